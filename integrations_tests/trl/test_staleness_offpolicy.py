"""The staleness experiment's off-policy trainer (benchmarks/stability/_offpolicy_trainer.py) hands
decoupled_ppo (arXiv 2110.00641 / 2505.24298) and a3po (arXiv 2512.06547) the right tensors, in real
TRL 1.16 training on CPU with stale rollouts made by ``steps_per_generation = k + 1``:
behaviour log-probs = the generating weights' log-probs, proximal = the detached current log-probs,
versions = the optimizer step of generation, policy_version = the current optimizer step."""

import sys
from pathlib import Path

import pytest
import torch

import trl_helpers as H  # noqa: I001

import stablerl
from stablerl.adapters.trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "stability"))
import _offpolicy_trainer as OP  # noqa: E402

# one clip for everyone: decoupled_ppo's defaults are 0.2/0.2 without the dual clip
VANILLA_PARAMS = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": None}


def _args(tmp_path, loss_type, k, steps, params=None):
    kw = H.base_kwargs(tmp_path, loss_type=loss_type, num_iterations=1, gradient_accumulation_steps=1,
                       steps_per_generation=k + 1, max_steps=steps, stablerl_loss_params=params,
                       stablerl_extra_loss_inputs=OP.off_policy_inputs_of(loss_type) or None)
    return GRPOConfig(**kw)


def _final_params(trainer_cls, args, dtype=torch.float32):
    _, rec, _ = H.train(trainer_cls, args, dtype=dtype)
    return rec.params[-1]


def test_the_adapter_refuses_the_off_policy_losses_where_trl_has_no_behaviour_log_probs(tmp_path):
    # without vLLM TRL feeds them itself (its old-log-prob pass at generation, policy versions as generation rounds:
    # test_trl_policy_versions.py); with vLLM only with the sampler's log-probs, unless a subclass declares them
    vllm = dict(use_vllm=True, vllm_importance_sampling_correction=False)
    with pytest.raises(stablerl.MissingInputError, match="rollout_log_prob: with use_vllm=True it needs "
                                                         "vllm_importance_sampling_correction=True"):
        GRPOConfig(**H.base_kwargs(tmp_path, loss_type="decoupled_ppo", **vllm))
    GRPOConfig(**H.base_kwargs(tmp_path, loss_type="a3po", stablerl_extra_loss_inputs=["rollout_log_prob"], **vllm))
    with pytest.raises(stablerl.UnknownNameError, match="'rollout_logprob'.*'rollout_log_prob'"):
        GRPOConfig(**H.base_kwargs(tmp_path, loss_type="a3po", stablerl_extra_loss_inputs=["rollout_logprob"]))
    assert _args(tmp_path, "a3po", k=0, steps=1).stablerl_extra_loss_inputs == [
        "old_log_prob", "rollout_log_prob", "versions", "policy_version"]


def test_a_declared_input_the_subclass_does_not_return_is_an_error(tmp_path):
    class Forgetful(OP.trainer_class()):
        def stablerl_loss_inputs(self, inputs, log_prob):
            return {"old_log_prob": log_prob.detach()}

    with pytest.raises(stablerl.MissingInputError, match="did not return them"):
        H.train(Forgetful, _args(tmp_path, "decoupled_ppo", k=1, steps=1))

    class Undeclared(OP.trainer_class()):
        def stablerl_loss_inputs(self, inputs, log_prob):
            return {**super().stablerl_loss_inputs(inputs, log_prob), "entropy": log_prob.detach()}

    with pytest.raises(stablerl.StableRLError, match=r"returned \['entropy'\]"):
        H.train(Undeclared, _args(tmp_path / "u", "decoupled_ppo", k=1, steps=1))


def test_on_policy_decoupled_ppo_and_a3po_train_exactly_like_the_clipped_loss(tmp_path):
    """k=0: behaviour = proximal = current policy, so w = 1, r = 1 (a3po: alpha = 0): vanilla's update.

    float64, so that Adam cannot amplify a rounding difference of two equal formulas past the bound on
    any CPU's vector kernels (see test_trl_parity.py)."""
    f64 = torch.float64
    vanilla = _final_params(GRPOTrainer, _args(tmp_path / "v", "vanilla", k=0, steps=3, params=VANILLA_PARAMS), f64)
    decoupled = _final_params(OP.trainer_class(), _args(tmp_path / "d", "decoupled_ppo", k=0, steps=3), f64)
    a3po = _final_params(OP.trainer_class(), _args(tmp_path / "a", "a3po", k=0, steps=3), f64)
    assert torch.allclose(decoupled, vanilla, rtol=0, atol=1e-9), (decoupled - vanilla).abs().max()
    assert torch.allclose(a3po, vanilla, rtol=0, atol=1e-9), (a3po - vanilla).abs().max()
    # with stale rollouts they differ: the behaviour weight w != 1 from the second step of a generation on
    vanilla2 = _final_params(GRPOTrainer, _args(tmp_path / "v2", "vanilla", k=2, steps=3, params=VANILLA_PARAMS))
    decoupled2 = _final_params(OP.trainer_class(), _args(tmp_path / "d2", "decoupled_ppo", k=2, steps=3))
    assert (decoupled2 - vanilla2).abs().max() > 1e-4


def test_losses_without_off_policy_inputs_pass_through(tmp_path):
    plain = _final_params(GRPOTrainer, _args(tmp_path / "p", "m2po", k=2, steps=3))
    sub = _final_params(OP.trainer_class(), _args(tmp_path / "s", "m2po", k=2, steps=3))
    assert torch.equal(plain, sub)


def test_a3po_gets_behaviour_logps_proximal_versions_and_policy_version(tmp_path, monkeypatch):
    k, steps = 2, 6
    calls, seen, snapshots = [], [], {}
    real = stablerl.compute_policy_loss

    def spy(name, **kw):
        calls.append({key: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for key, v in kw.items()})
        return real(name, **kw)

    monkeypatch.setattr(stablerl, "compute_policy_loss", spy)

    class Recording(OP.trainer_class()):
        def _generate_and_score_completions(self, inputs):
            snapshots[int(self.state.global_step)] = H.weights_snapshot(self.model)  # the behaviour policy
            return super()._generate_and_score_completions(inputs)

        def _stablerl_policy_loss(self, inputs, logps, *args, **kwargs):
            seen.append((int(self.state.global_step), {key: v for key, v in inputs.items()}, logps.detach().clone()))
            return super()._stablerl_policy_loss(inputs, logps, *args, **kwargs)

    trainer, rec, _ = H.train(Recording, _args(tmp_path, "a3po", k=k, steps=steps))
    assert sorted(snapshots) == [0, 3]  # one generation per k + 1 = 3 optimizer steps
    assert [s for s, _, _ in seen] == list(range(steps)) and len(calls) == steps
    for (step, inp, logps), kw in zip(seen, calls):
        generated_at = step - step % (k + 1)
        mask = inp["completion_mask"].bool()
        assert kw["policy_version"] == step
        assert kw["versions"][mask].unique().tolist() == [generated_at]
        assert (kw["versions"][~mask] == -1).all()
        assert kw["is_weights"] is None  # no TRL IS ratio on top of the loss's own weight
        assert torch.equal(kw["old_log_prob"], logps)  # proximal: the detached current policy
        behaviour = H.completion_logps(snapshots[generated_at], inp)
        torch.testing.assert_close(kw["rollout_log_prob"][mask], behaviour[mask], rtol=0, atol=2e-5)
        gap = (kw["rollout_log_prob"] - logps)[mask].abs().max().item()
        if step == generated_at:  # the rollout is on-policy for the first step of its generation
            assert gap < 2e-5
        else:
            assert gap > 1e-3, (step, gap)
    # alpha = (v - 1 - v_b) / (v - v_b): 0 for 0 or 1 update stale, 1/2 for 2 updates stale
    assert [log["stablerl/a3po/alpha_mean"] for log in rec.logs] == pytest.approx([0, 0, 0.5, 0, 0, 0.5], abs=1e-7)
