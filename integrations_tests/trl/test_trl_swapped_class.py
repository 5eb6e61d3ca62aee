"""A script may swap ``trl.GRPOTrainer`` for stablerl's subclass (so that code building ``trl.GRPOTrainer`` by name
gets ours). The adapter binds TRL's own class once at import and calls it, never ``trl.GRPOTrainer`` at call time:
the R3 + vLLM refusal still reads TRL's ``__init__`` signature, and the extra forward still calls TRL's method."""

import pytest
import torch

import trl_helpers as H  # noqa: I001

from stablerl import StableRLError
from stablerl.adapters.trl import GRPOConfig, GRPOTrainer
from stablerl.adapters.trl._config import TRL_GRPOTrainer


def test_a_swapped_trl_grpotrainer_still_reaches_trls_own_class(tmp_path, monkeypatch):
    import trl
    import trl.trainer.grpo_trainer as trl_grpo

    assert TRL_GRPOTrainer is trl_grpo.GRPOTrainer and issubclass(GRPOTrainer, TRL_GRPOTrainer)
    monkeypatch.setattr(trl, "GRPOTrainer", GRPOTrainer)  # the script's swap

    vargs = GRPOConfig(**H.base_kwargs(tmp_path, routing_replay="R3", use_vllm=True))
    with pytest.raises(StableRLError, match="routed_experts"):  # refused before TRL builds anything
        GRPOTrainer(model=H.tiny_model(), reward_funcs=H.binary_digit_reward, args=vargs,
                    train_dataset=H.build_dataset(8), processing_class=H.TOKENIZER)

    args = GRPOConfig(**H.base_kwargs(tmp_path / "empg", advantage_estimator="empg"))
    trainer = GRPOTrainer(model=H.tiny_model(), reward_funcs=H.binary_digit_reward, args=args,
                          train_dataset=H.build_dataset(8), processing_class=H.TOKENIZER)
    calls = []
    trls = TRL_GRPOTrainer._get_per_token_logps_and_entropies

    def recording(self, *a, **k):
        calls.append(type(self).__name__)
        return trls(self, *a, **k)

    def ours(self, *a, **k):
        raise AssertionError("the extra forward went through trl.GRPOTrainer (the swapped-in subclass)")

    monkeypatch.setattr(TRL_GRPOTrainer, "_get_per_token_logps_and_entropies", recording)
    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", ours)
    out = {"prompt_ids": torch.tensor([[5, 6, 7]]), "prompt_mask": torch.ones(1, 3, dtype=torch.long),
           "completion_ids": torch.tensor([[8, 9]]), "completion_mask": torch.ones(1, 2, dtype=torch.long)}
    logps, entropies, _ = trainer._stablerl_passes.rollout_forward(out, "train", "empg", compute_entropy=True)
    assert calls == ["GRPOTrainer"] and logps.shape == entropies.shape == (1, 2)
