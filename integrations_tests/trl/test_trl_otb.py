"""``optimal_token_baseline`` / ``tir_optimal_token_baseline`` in real TRL 1.16 training on CPU: ``old_log_prob``
and ``sum_pi_squared`` come from one forward of the policy through TRL's fused LM head (its ``log_sum_sq_probs``
output, at TRL's temperature): TRL's old-log-prob pass where TRL runs one (num_iterations=2, GA=2), else one
extra no-grad forward of the generating policy (num_iterations=1, GA=1). Reference: ``stablerl.compute_advantage``
on log-probs and ``sum_v softmax(z / T)^2`` computed here, in float64, from a plain forward of a snapshot of the
policy taken when the batch was generated."""

import pytest
import torch

import trl_helpers as H  # noqa: I001

import stablerl
import stablerl.api as core_api
from stablerl.adapters.trl import GRPOConfig, GRPOTrainer

TEMPERATURE = 0.8


def _reference(model, out):
    """Old log-probs of the completion tokens and ``sum_pi_squared`` at their positions (float64, ``[n, T]``)."""
    logp = H.completion_log_softmax(model, out, TEMPERATURE)
    return logp.gather(-1, out["completion_ids"].unsqueeze(-1)).squeeze(-1), logp.exp().pow(2).sum(-1)


def _count_no_grad_passes(monkeypatch):
    """Every call of TRL's ``_get_per_token_logps_and_entropies``: whether grad was on."""
    import trl.trainer.grpo_trainer as trl_grpo

    passes = []
    real = trl_grpo.GRPOTrainer._get_per_token_logps_and_entropies

    def counting(self, model, *a, **kw):
        passes.append(torch.is_grad_enabled())
        return real(self, model, *a, **kw)

    monkeypatch.setattr(trl_grpo.GRPOTrainer, "_get_per_token_logps_and_entropies", counting)
    return passes


def _run(tmp_path, monkeypatch, name, **overrides):
    real = core_api.compute_advantage
    args = GRPOConfig(**H.base_kwargs(tmp_path, advantage_estimator=name, temperature=TEMPERATURE, **overrides))
    trainer, batches, calls = H.train_recording_estimator(monkeypatch, GRPOTrainer, args)
    for (snapshot, out), kw in zip(batches, calls):
        mask = out["completion_mask"].bool()
        ref_logp, ref_spp = _reference(snapshot, out)
        torch.testing.assert_close(kw["old_log_prob"].double()[mask], ref_logp[mask], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(kw["sum_pi_squared"].double()[mask], ref_spp[mask], rtol=1e-4, atol=1e-7)
        assert torch.all(kw["sum_pi_squared"][~mask] == 0) and torch.all(kw["old_log_prob"][~mask] == 0)
        # the advantages TRL trains on equal the estimator's on the independently computed inputs
        inputs = {k: kw[k] for k in ("token_level_rewards", "response_mask", "index")}
        expected, _ = real(name, old_log_prob=ref_logp * mask, sum_pi_squared=ref_spp * mask, **inputs)
        torch.testing.assert_close(out["advantages"].double() * mask, expected.double() * mask, rtol=1e-4, atol=1e-5)
    return trainer, batches, calls


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_otb_from_trls_old_log_prob_pass(tmp_path, monkeypatch, name):
    """num_iterations=2, GA=2: TRL runs its old-log-prob pass; the adapter records log sum pi^2 there."""
    passes = _count_no_grad_passes(monkeypatch)
    trainer, batches, calls = _run(tmp_path, monkeypatch, name, max_steps=4)
    assert passes.count(False) == len(batches)  # TRL's old pass only: no extra forward
    for (_, out), kw in zip(batches, calls):
        torch.testing.assert_close(kw["old_log_prob"], out["old_per_token_logps"] * out["completion_mask"])
    # a per-token baseline: the advantages vary along a response (GRPO's are constant per row)
    adv = batches[0][1]["advantages"]
    assert adv.dim() == 2 and (adv.max(-1).values - adv.min(-1).values).max() > 1e-3


def test_otb_without_trls_old_pass_runs_one_extra_forward(tmp_path, monkeypatch):
    """num_iterations=1, GA=1: TRL computes no old log-probs; one extra no-grad forward per generation batch."""
    passes = _count_no_grad_passes(monkeypatch)
    trainer, batches, _ = _run(tmp_path, monkeypatch, "optimal_token_baseline", num_iterations=1,
                               gradient_accumulation_steps=1)
    assert all(out.get("old_per_token_logps") is None for _, out in batches)
    assert passes.count(False) == len(batches)


def test_other_estimators_leave_trls_lm_head_alone(tmp_path):
    """Only an estimator declaring sum_pi_squared adds the log_sum_sq_probs output to TRL's fused head."""
    args = GRPOConfig(**H.base_kwargs(tmp_path, advantage_estimator="grpo"))
    trainer = GRPOTrainer(model=H.tiny_model(), reward_funcs=H.copy_reward, args=args,
                          train_dataset=H.build_dataset(8, seed=0), processing_class=H.TOKENIZER)
    ids = torch.randint(3, trainer.model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    out = trainer.model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, fused_lm_head=True)
    assert out.log_sum_sq_probs is None
    args = GRPOConfig(**H.base_kwargs(tmp_path, advantage_estimator="optimal_token_baseline"))
    trainer = GRPOTrainer(model=H.tiny_model(), reward_funcs=H.copy_reward, args=args,
                          train_dataset=H.build_dataset(8, seed=0), processing_class=H.TOKENIZER)
    out = trainer.model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, fused_lm_head=True)
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.double()[:, :-1]
    torch.testing.assert_close(out.log_sum_sq_probs.double().exp(),
                               (logits / trainer.temperature).softmax(-1).pow(2).sum(-1), rtol=1e-5, atol=1e-7)
    assert stablerl.get_spec("advantage_estimator", "optimal_token_baseline").requires == ("old_log_prob",
                                                                                           "sum_pi_squared")
