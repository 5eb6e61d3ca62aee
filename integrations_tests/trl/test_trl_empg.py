"""``empg`` (an estimator reading per-token entropy) in real TRL 1.16 training on CPU: the entropy is the generating
policy's, from one extra no-grad forward over the rollout (TRL computes entropies only in ``_compute_loss``), shared
with a batch filter that reads entropy too. Reference: ``stablerl.compute_advantage('empg', ...)`` on entropies of
``softmax(z / T)`` computed here, in float64, from a plain forward of a snapshot of the policy taken when the batch
was generated."""

import pytest
import torch

import trl_helpers as H  # noqa: I001

from stablerl.api import compute_advantage as core_advantage  # bound before the tests' spy
from stablerl.adapters.trl import GRPOConfig, GRPOTrainer
from stablerl.adapters.trl._passes import ForwardPasses
from stablerl.adapters.trl._records import GenerationBatch

TEMPERATURE = 0.8
PARAMS = {"k": 2.0, "zeta": 0.5}


def _reference_entropy(model, out):
    logp = H.completion_log_softmax(model, out, TEMPERATURE)
    return -(logp.exp() * logp).sum(-1)


def _run(tmp_path, monkeypatch, **overrides):
    forwards = []

    real = ForwardPasses.rollout_forward

    def counting(self, out, mode, needed_by, compute_entropy=False):
        forwards.append(needed_by)
        return real(self, out, mode, needed_by, compute_entropy=compute_entropy)

    monkeypatch.setattr(ForwardPasses, "rollout_forward", counting)

    args = GRPOConfig(**H.base_kwargs(tmp_path, advantage_estimator="empg", temperature=TEMPERATURE,
                                      stablerl_advantage_params=PARAMS, num_iterations=1,
                                      gradient_accumulation_steps=1, **overrides))
    _, batches, calls = H.train_recording_estimator(monkeypatch, GRPOTrainer, args)
    return batches, calls, forwards


def test_empg_gets_the_generating_policys_entropy(tmp_path, monkeypatch):
    batches, calls, forwards = _run(tmp_path, monkeypatch)
    assert len(forwards) == len(batches) and all("advantage_estimator='empg'" in f for f in forwards)
    real = core_advantage
    for (snapshot, out), kw in zip(batches, calls):
        mask = out["completion_mask"].bool()
        ref = _reference_entropy(snapshot, out)
        torch.testing.assert_close(kw["entropy"].double()[mask], ref[mask], rtol=1e-4, atol=1e-5)
        assert torch.all(kw["entropy"][~mask] == 0)
        inputs = {k: kw[k] for k in ("token_level_rewards", "response_mask", "index")}
        expected, _ = real("empg", entropy=ref * mask, **inputs, **PARAMS)
        torch.testing.assert_close(out["advantages"].double() * mask, expected.double() * mask, rtol=1e-4, atol=1e-5)
        # the entropy matters: a flat entropy gives other advantages wherever a group has a signal
        flat, _ = real("empg", entropy=torch.full_like(ref, float(ref[mask].mean())) * mask, **inputs, **PARAMS)
        if expected.abs().max() > 0:
            assert (flat - expected).abs().max() > 1e-4


def test_empg_and_an_entropy_filter_share_one_extra_forward(tmp_path, monkeypatch):
    batches, calls, forwards = _run(tmp_path, monkeypatch, batch_filter="gtpo_entropy_filter",
                                    stablerl_batch_filter_params={"ent_threshold": 100.0})
    assert len(forwards) == len(batches)  # one per generation batch, not one per reader
    assert "advantage_estimator='empg' and batch_filter='gtpo_entropy_filter'" in forwards[0]


def test_empg_refuses_a_multimodal_batch_with_the_reason(tmp_path):
    args = GRPOConfig(**H.base_kwargs(tmp_path, advantage_estimator="empg"))
    trainer = GRPOTrainer(model=H.tiny_model(), reward_funcs=H.copy_reward, args=args,
                          train_dataset=H.build_dataset(8, seed=0), processing_class=H.TOKENIZER)
    with pytest.raises(Exception, match=r"advantage_estimator='empg' \(the rollout's entropies\) needs an extra "
                                        r"forward pass .* text-only batches; this batch has \['pixel_values'\]"):
        trainer._stablerl_rollout.rollout_entropy(GenerationBatch(host={"pixel_values": torch.zeros(1)}, mode="train"))
