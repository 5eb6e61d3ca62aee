"""Tiny MoE models of every built-in router family, built in code from transformers configs (no Hub).

Imported by the tests of this folder (conftest.py puts the folder on sys.path)."""

import os

for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1"}.items():
    os.environ.setdefault(_k, _v)

import pytest
import torch

transformers = pytest.importorskip("transformers")

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3")
VOCAB = 64


def moe_config(family: str, **overrides):
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=1,
                  tie_word_embeddings=False)
    if family == "qwen3_moe":
        kw = dict(common, head_dim=8, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
        cfg = transformers.Qwen3MoeConfig
    elif family == "qwen2_moe":  # norm_topk_prob=False (the default) and a shared expert
        kw = dict(common, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
                  num_experts_per_tok=2)
        cfg = transformers.Qwen2MoeConfig
    elif family == "mixtral":
        kw = dict(common, head_dim=8, num_local_experts=8, num_experts_per_tok=2)
        cfg = transformers.MixtralConfig
    elif family == "olmoe":
        kw = dict(common, num_experts=8, num_experts_per_tok=2)
        cfg = transformers.OlmoeConfig
    elif family == "deepseek_v3":  # layer 0 dense, layers 1-2 MoE, group-limited routing, scaling factor
        kw = dict(common, num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=4, moe_intermediate_size=16,
                  n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                  routed_scaling_factor=2.5, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4,
                  qk_nope_head_dim=8, v_head_dim=8)
        cfg = transformers.DeepseekV3Config
    else:
        raise KeyError(family)
    kw.update(overrides)
    return cfg(**kw)


def build_moe(family: str, seed: int = 0, **overrides):
    cfg = moe_config(family, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    if family == "deepseek_v3":  # a non-zero selection bias, so that selection differs from the weights' ranking
        g = torch.Generator().manual_seed(seed + 1)
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(torch.randn(gate.num_experts, generator=g) * 0.05)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # fixed-length generation
    return model.eval()


def left_padded_batch(B=3, T=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    for i in range(B):
        mask[i, : i * 2 % T] = 0
    return ids * mask, mask
