"""A tiny Qwen3-MoE built in code from a transformers config (no Hub): 2 decoder layers, 8 experts, top-2."""

import torch
import transformers

H, K, E = 2, 2, 8  # decoder layers, top-k, experts
VOCAB = 48


def tiny_moe_config():
    return transformers.Qwen3MoeConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=H, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, moe_intermediate_size=32, num_experts=E, num_experts_per_tok=K, norm_topk_prob=True,
        vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=False)


def tiny_moe(seed=0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(tiny_moe_config()).float()
