"""Fixtures for the verl integration tests (venv with verl 0.9.1, torch CPU, ray).

Run: ``python -m pytest integrations_tests/verl -q -p no:cacheprovider --import-mode=importlib``.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tiny_moe, _two_rank_ppo_loss

if importlib.util.find_spec("verl") is None:  # not the verl environment: nothing to run here
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def adapter():
    """The adapter module, imported the way verl does it (``import verl`` loads the entry point)."""
    import verl  # noqa: F401

    import stablerl.adapters.verl as adapter

    return adapter


@pytest.fixture(scope="session")
def core_algos(adapter):
    from verl.trainer.ppo import core_algos

    return core_algos


def _padded_batch(B=6, T=9, seed=0, dtype=torch.float64, empty_row=True, noise=0.35, token_adv=False):
    """verl-style padded batch: right-padded bool mask, sequence-level advantages broadcast over
    tokens (token-level if ``token_adv``), log-probs whose ratios cross the PPO clip bounds."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    if empty_row:
        lengths[-1] = 0
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3 - 0.05
    log_prob = (old + noise * torch.randn(B, T, generator=g, dtype=dtype)).requires_grad_(True)
    if token_adv:
        adv = torch.randn(B, T, generator=g, dtype=dtype)
    else:
        adv = torch.randn(B, 1, generator=g, dtype=dtype).expand(B, T).clone()
    adv = adv * mask
    is_w = (0.5 + torch.rand(B, T, generator=g, dtype=dtype)) * mask
    return {"old_log_prob": old, "log_prob": log_prob, "advantages": adv, "response_mask": mask, "is_weights": is_w}


@pytest.fixture
def padded_batch():
    return _padded_batch


def _actor_config(loss_mode="vanilla", policy_loss=None, **kw):
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    kw.setdefault("strategy", "fsdp")
    kw.setdefault("rollout_n", 1)
    kw.setdefault("ppo_micro_batch_size_per_gpu", 2)
    return FSDPActorConfig(policy_loss=policy_loss or PolicyLossConfig(loss_mode=loss_mode), **kw)


@pytest.fixture
def actor_config():
    return _actor_config


def _rewards_batch(seed=0, T=5, dtype=torch.float64):
    """Outcome rewards on the last valid token; groups of 4, 3, 1 (singleton) and 4 equal rewards."""
    g = torch.Generator().manual_seed(seed)
    uids = ["a"] * 4 + ["b"] * 3 + ["c"] + ["d"] * 4
    B = len(uids)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).to(dtype)
    scores = torch.randn(B, generator=g, dtype=dtype)
    scores[-4:] = 0.7
    rewards = torch.zeros(B, T, dtype=dtype)
    rewards[torch.arange(B), lengths - 1] = scores
    order = torch.randperm(B, generator=g)  # groups interleaved, as after a shuffle
    index = np.array(uids, dtype=object)[order.numpy()]
    return rewards[order], mask[order], index


@pytest.fixture
def rewards_batch():
    return _rewards_batch


@pytest.fixture(scope="session")
def process_group():
    """A one-rank gloo group (verl's engine all-reduces the token count over its DP group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny Qwen3-MoE and a word-level tokenizer saved in code (no Hub), for verl's HFModelConfig."""
    from tiny_moe import VOCAB, tiny_moe
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("tiny_qwen3_moe")
    tiny_moe().save_pretrained(d)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0", eos_token="w1", unk_token="w2").save_pretrained(d)
    return str(d)


@pytest.fixture
def make_engine(adapter, process_group, model_dir, monkeypatch):
    """``make_engine(mode, model, use_remove_padding=True)`` -> verl's registry engine around ``model``."""
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl as ti

    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")  # verl registers its FSDP engines for cuda/npu only
    for name in ("get_device_id", "get_device_name"):
        monkeypatch.setattr(ti, name, lambda: "cpu")
    monkeypatch.setattr(ti, "create_device_mesh", lambda **kw: None)

    def make(mode, model, use_remove_padding=True, engine_cls=None, **engine_kw):
        cls = EngineRegistry.get_engine_cls("language_model", "fsdp2") if engine_cls is None else ti.FSDPEngineWithLMHead
        ec = FSDPEngineConfig(strategy="fsdp2", model_dtype="fp32", use_torch_compile=False, **engine_kw)
        if mode is not None:
            object.__setattr__(ec, "router_replay", {"mode": mode})  # what Hydra leaves for `+...router_replay.mode`
        mc = HFModelConfig(path=model_dir, use_remove_padding=use_remove_padding)
        eng = cls(model_config=mc, engine_config=ec, optimizer_config=FSDPOptimizerConfig(lr=1e-3),
                  checkpoint_config=CheckpointConfig())
        eng.module = model
        eng._autocast_dtype = torch.float32
        return eng

    return make
