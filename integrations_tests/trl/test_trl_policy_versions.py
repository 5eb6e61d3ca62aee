"""A-3PO (arXiv 2512.06547) in TRL 1.16's off-policy path, by config key only: ``GRPOConfig(loss_type="a3po")`` with
``steps_per_generation = 3 * gradient_accumulation_steps`` (each generation batch trained over 3 optimizer steps), real
training on CPU without vLLM. The adapter's providers feed ``versions`` (the generation round that generated each
row: AReaL's weight versions, one per weight sync to the rollout engine), ``policy_version`` (the round of the batch
being trained) and the behaviour log-probs (TRL's old-log-prob pass at generation). TRL's GRPOTrainer is synchronous,
so versions == policy_version over the optimizer steps that reuse one generation batch: alpha = 0 (AReaL keeps the
version constant over the ppo_n_minibatches steps of one rollout batch). A hand-made stamp gives one batch mixed
versions, to check the formula at the loss call where alpha > 0."""

import pytest
import torch

import trl_helpers as H  # noqa: I001

import stablerl
from stablerl.adapters.trl import GRPOConfig, GRPOTrainer
from stablerl.adapters.trl._adapter import VERSION_KEY

K = 2  # steps_per_generation = K + 1 optimizer steps per generation batch
STEPS = 9  # three generation rounds
MIXED_ROUND = 2  # the round whose batch gets a hand-made mixed-version stamp


def _a3po_by_hand(kw):
    """A-3PO's loglinear proximal policy and decoupled PPO (defaults: eps 0.2, behaviour weight cap 5, mask), token
    mean over the context's token count, written from the formula."""
    lp, roll, v, pv = kw["log_prob"].double(), kw["rollout_log_prob"].double(), kw["versions"].double(), kw["policy_version"]
    m = kw["response_mask"].double()
    A = kw["advantages"].double()
    diff = pv - v
    alpha = torch.where((diff > 0) & (v >= 0), (pv - 1 - v) / diff.clamp(min=1), torch.zeros_like(v)).clamp(0, 1)
    prox = roll + alpha * (lp - roll)
    w = torch.exp(prox - roll)
    r = torch.exp(lp - prox)
    per_token = torch.maximum(-A * r, -A * r.clamp(0.8, 1.2)) * w * (w <= 5.0)
    return (per_token * m).sum() / kw["ctx"].token_count.double(), alpha


def test_a3po_selected_by_loss_type_gets_trl_versions_and_the_formula(tmp_path, monkeypatch):
    calls, seen, snapshots = [], [], {}
    real = stablerl.compute_policy_loss

    def spy(name, **kw):
        loss, metrics = real(name, **kw)
        calls.append(({key: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for key, v in kw.items()},
                      loss.detach().clone(), dict(metrics)))
        return loss, metrics

    monkeypatch.setattr(stablerl, "compute_policy_loss", spy)

    class Recording(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            snapshots[int(self.state.global_step)] = H.weights_snapshot(self.model)  # the behaviour policy
            out = super()._generate_and_score_completions(inputs)
            if self._stablerl_policy_version == MIXED_ROUND:
                # TRL's synchronous loop never trains a batch of an older round; stamp every other row of this
                # round's batch as generated in round 0 (what an asynchronous rollout would hand over), to check the
                # formula on a mixed-version batch at the loss call
                out[VERSION_KEY][::2] = 0
            return out

        def _stablerl_policy_loss(self, inputs, logps, *args, **kwargs):
            seen.append((int(self.state.global_step), dict(inputs)))
            return super()._stablerl_policy_loss(inputs, logps, *args, **kwargs)

    args = GRPOConfig(**H.base_kwargs(tmp_path, loss_type="a3po", num_iterations=1, gradient_accumulation_steps=1,
                                      steps_per_generation=K + 1, max_steps=STEPS))
    _, rec, _ = H.train(Recording, args)
    assert sorted(snapshots) == [0, 3, 6]  # three generation rounds: weight versions 0, 1, 2
    assert [s for s, _ in seen] == list(range(STEPS)) and len(calls) == STEPS
    alphas = []
    for (step, inp), (kw, loss, metrics) in zip(seen, calls):
        generated_at, round_ = step - step % (K + 1), step // (K + 1)
        mask = kw["response_mask"].bool()
        # the round of the batch being trained, constant over the K + 1 optimizer steps that reuse it
        assert kw["policy_version"] == round_
        if round_ != MIXED_ROUND:
            assert kw["versions"][mask].unique().tolist() == [round_]  # versions == policy_version: alpha 0
        else:  # the rows of one optimizer step may all be of one stamp (TRL shuffles and splits the batch)
            assert set(kw["versions"][mask].unique().tolist()) <= {0, round_}
        assert (kw["versions"][~mask] == -1).all()
        assert kw["is_weights"] is None
        # the behaviour log-probs are the generating weights' (TRL's old-log-prob pass at generation)
        behaviour = H.completion_logps(snapshots[generated_at], inp)
        torch.testing.assert_close(kw["rollout_log_prob"][mask], behaviour[mask], rtol=0, atol=2e-5)
        ref, alpha = _a3po_by_hand(kw)
        torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-7)
        alphas.append(alpha[mask].unique().tolist())
        if step > generated_at:  # reused: the current weights moved away from the generating ones
            assert (kw["rollout_log_prob"] - kw["log_prob"])[mask].abs().max() > 1e-3
        if round_ == MIXED_ROUND:  # alpha = (v - 1 - v_b) / (v - v_b) = (2 - 1 - 0) / (2 - 0) on the round-0 rows
            assert (alpha[mask & (kw["versions"] == 0)] == 0.5).all()
            assert (alpha[mask & (kw["versions"] == round_)] == 0).all()
    # AReaL's convention in a synchronous trainer: alpha 0 at every optimizer step of a reused generation batch
    assert alphas[:6] == [[0.0]] * 6
    assert sorted({a for step in alphas[6:] for a in step}) == [0.0, 0.5]  # the mixed batch: both stamps trained
    logged = [log["stablerl/a3po/alpha_mean"] for log in rec.logs]
    assert logged[:6] == [0.0] * 6 and 0.0 < sum(logged[6:]) / 3 < 0.5, logged


def test_a3po_on_policy_in_trl_has_alpha_zero_and_trains_like_decoupled_ppo(tmp_path):
    """steps_per_generation = gradient_accumulation_steps: every batch is on-policy (alpha = 0, behaviour = proximal),
    so a3po and decoupled_ppo (selected by loss_type too, now fed by the same behaviour log-probs) train alike."""
    kw = dict(num_iterations=1, gradient_accumulation_steps=1, steps_per_generation=1, max_steps=3)
    _, rec_a, _ = H.train(GRPOTrainer, GRPOConfig(**H.base_kwargs(tmp_path / "a", loss_type="a3po", **kw)),
                          dtype=torch.float64)
    _, rec_d, _ = H.train(GRPOTrainer, GRPOConfig(**H.base_kwargs(tmp_path / "d", loss_type="decoupled_ppo", **kw)),
                          dtype=torch.float64)
    assert [log["stablerl/a3po/alpha_mean"] for log in rec_a.logs] == [0.0, 0.0, 0.0]
    assert torch.allclose(rec_a.params[-1], rec_d.params[-1], rtol=0, atol=1e-9)


def test_a3po_with_vllm_needs_the_samplers_log_probs(tmp_path):
    with pytest.raises(stablerl.MissingInputError, match="rollout_log_prob: with use_vllm=True it needs "
                                                         "vllm_importance_sampling_correction=True"):
        GRPOConfig(**H.base_kwargs(tmp_path, loss_type="a3po", use_vllm=True, vllm_importance_sampling_correction=False))
