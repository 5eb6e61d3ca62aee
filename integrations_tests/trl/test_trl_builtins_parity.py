"""Parity with TRL 1.16's built-ins that stablerl now also offers elsewhere (issue 16): ``vespo``, ``luspo``
and ``delta`` (INTELLECT-2's two-sided clip), each trained twice from the same seed as in
test_trl_parity.py (float64 model, num_iterations=2, GA=2, parameters compared after every step).

* ``vespo``: TRL owns the name, stablerl's is ``stablerl_vespo``; same k/lambda defaults, token-mean.
* ``luspo``: TRL's with ``importance_sampling_level="sequence"`` and GSPO's bounds 3e-4/4e-4 (stablerl's
  defaults) == ``stablerl_luspo``.
* ``delta``: TRL ``dapo`` with ``delta=d`` == stablerl ``vanilla`` with TRL's own ``delta=d`` (read as
  clip_ratio_c: for ``d >= 1 + epsilon_high`` the two-sided clip is the dual clip, value and gradient).
"""

import pytest
import torch

import stablerl
import trl
import trl_helpers as H
from test_trl_parity import DTYPE, STEPS, _compare, _pair


def test_vespo_equals_trl_vespo(tmp_path):
    ref, cand = _pair(tmp_path, dict(loss_type="vespo"), dict(loss_type="stablerl_vespo"),
                      common=dict(learning_rate=2e-2))
    _compare(ref, cand, rtol=1e-6, atol=1e-7)
    # TRL's vespo/phi_seq_mean is stablerl's (token-weighted mean of phi); phi moved away from 1
    for r, c in zip(ref[1].logs, cand[1].logs):
        assert c["stablerl/vespo/phi_seq_mean"] == pytest.approx(r["vespo/phi_seq_mean"], rel=1e-6)
    assert any(abs(r["vespo/phi_seq_mean"] - 1.0) > 1e-4 for r in ref[1].logs)


def test_luspo_equals_trl_luspo(tmp_path):
    ref, cand = _pair(
        tmp_path,
        dict(loss_type="luspo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
        dict(loss_type="stablerl_luspo"),
    )
    # GSPO-token's gradient (sg(s_i) grad lp_t) vs TRL's sequence ratio's: equal up to summation order, which Adam
    # turns into parameter differences of ~2e-7 on near-zero gradients (the bound of test_gspo_equals_trl_grpo_...)
    _compare(ref, cand, rtol=1e-5, atol=1e-6, expect_clipping="clip_ratio/region_mean")


def test_trl_delta_is_the_dual_clip_of_stablerl_losses(tmp_path):
    ref, cand = _pair(
        tmp_path,
        dict(loss_type="dapo", epsilon=0.01, epsilon_high=0.01, delta=1.02),
        dict(loss_type="vanilla", epsilon=0.01, epsilon_high=0.01, delta=1.02),
        common=dict(learning_rate=2e-2),
    )
    _compare(ref, cand, rtol=1e-6, atol=1e-7)
    assert any(log["stablerl/pg_clipfrac_lower"] > 0 for log in cand[1].logs)  # the delta cap was exercised


def test_grpo_batch_std_equals_trl_scale_rewards_batch(tmp_path):
    ref, cand = _pair(tmp_path, dict(loss_type="dapo", scale_rewards="batch"),
                      dict(loss_type="dapo", advantage_estimator="grpo_batch_std"))
    _compare(ref, cand, rtol=1e-5, atol=1e-6)


def test_trl_delta_sets_clip_ratio_c_and_warns_only_where_a_loss_has_none():
    import warnings

    from stablerl.adapters.trl import GRPOConfig
    from stablerl.adapters.trl.trainer import loss_settings
    from stablerl.frameworks import as_params

    cpu = dict(output_dir="/tmp/stablerl-trl-builtins-test", use_cpu=True, bf16=False, report_to="none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = GRPOConfig(loss_type="vanilla", delta=2.5, **cpu)
    assert not [w for w in caught if "delta" in str(w.message)]  # vanilla takes delta: no warning about it
    assert as_params(loss_settings(args, "vanilla"))["clip_ratio_c"] == 2.5
    with pytest.warns(UserWarning, match="no counterpart in the stablerl loss 'gpg'"):
        GRPOConfig(loss_type="gpg", delta=2.5, **cpu)


def _length_reward(prompts, completions, **kwargs):
    """A second, continuous reward on another scale: the completion's length in words."""
    return [float(len(c.split())) for c in completions]


def _partial_reward(prompts, completions, **kwargs):
    """A reward function that declines (None) every third completion: TRL's NaN component."""
    return [None if i % 3 == 0 else float(bool(c.split()) and c.split()[0].isdigit()) for i, c in enumerate(completions)]


def _gdpo_pair(tmp_path, trl_kwargs, stablerl_kwargs):
    import trl
    import trl_helpers as H

    from stablerl.adapters.trl import GRPOConfig, GRPOTrainer

    from test_trl_parity import DTYPE, STEPS

    rewards = [H.copy_reward, _length_reward, _partial_reward]
    common = dict(max_steps=STEPS, reward_weights=[1.0, 0.5, 2.0], loss_type="dapo")
    ref = H.train(trl.GRPOTrainer, trl.GRPOConfig(**H.base_kwargs(tmp_path / "trl", **common, **trl_kwargs)),
                  reward=rewards, dtype=DTYPE)
    cand = H.train(GRPOTrainer, GRPOConfig(**H.base_kwargs(tmp_path / "srl", **common, **stablerl_kwargs)),
                   reward=rewards, dtype=DTYPE)
    return ref, cand


def test_gdpo_trl_form_equals_trl_normalize_then_sum(tmp_path):
    """TRL's GDPO (multi_objective_aggregation='normalize_then_sum': three reward functions, weights, one that
    declines some completions) == stablerl's gdpo, which TRL's own setting switches to form='trl'."""
    ref, cand = _gdpo_pair(tmp_path, dict(multi_objective_aggregation="normalize_then_sum"),
                           dict(multi_objective_aggregation="normalize_then_sum", advantage_estimator="gdpo"))
    _compare(ref, cand, rtol=1e-5, atol=1e-6)
    # and the other aggregation is a different run: the comparison can fail
    other, _ = _gdpo_pair(tmp_path / "sum", dict(multi_objective_aggregation="sum_then_normalize"), dict())
    assert not torch.allclose(other[1].params[-1], ref[1].params[-1], rtol=1e-5, atol=1e-6)


def test_gdpo_form_follows_trls_multi_objective_aggregation():
    from stablerl.adapters.trl import GRPOConfig
    from stablerl.adapters.trl.trainer import advantage_settings
    from stablerl.frameworks import as_params

    cpu = dict(output_dir="/tmp/stablerl-trl-builtins-test", use_cpu=True, bf16=False, report_to="none")
    args = GRPOConfig(advantage_estimator="gdpo", multi_objective_aggregation="normalize_then_sum", **cpu)
    assert as_params(advantage_settings(args, "gdpo"))["form"] == "trl"
    args = GRPOConfig(advantage_estimator="gdpo", **cpu)
    assert "form" not in as_params(advantage_settings(args, "gdpo"))  # the default, verl's form
    args = GRPOConfig(advantage_estimator="gdpo", multi_objective_aggregation="normalize_then_sum",
                      stablerl_advantage_params={"form": "verl"}, **cpu)
    assert as_params(advantage_settings(args, "gdpo"))["form"] == "verl"  # an explicit stablerl key wins


def test_gdpo_with_a_reward_shaper_is_refused():
    """TRL's adapter always hands gdpo every reward function's reward; a shaper's change to the summed reward would
    be lost, so the combination is refused at config time."""
    from stablerl.adapters.trl import GRPOConfig

    cpu = dict(output_dir="/tmp/stablerl-trl-builtins-test", use_cpu=True, bf16=False, report_to="none")
    with pytest.raises(stablerl.StableRLError, match="shaping would be lost"):
        GRPOConfig(advantage_estimator="gdpo", reward_shaper="redit", **cpu)
    GRPOConfig(advantage_estimator="grpo", reward_shaper="redit", **cpu)  # estimators on the summed reward: fine


# ----------------------------------------------------------------------------- top_entropy_quantile (issue 16)


def test_top_entropy_quantile_equals_trl_dapo(tmp_path):
    """stablerl's top_entropy_quantile (core, through stablerl_loss_params, TRL's own option left at 1.0) trains
    exactly as TRL dapo with TRL's top_entropy_quantile: the same mask, and the token-mean denominator unchanged."""
    ref, cand = _pair(
        tmp_path,
        dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28, top_entropy_quantile=0.2),
        dict(loss_type="vanilla", stablerl_loss_params={"clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
                                                        "clip_ratio_c": None, "top_entropy_quantile": 0.2}),
        common=dict(learning_rate=2e-2),
    )
    _compare(ref, cand, rtol=1e-6, atol=1e-7)
    # the mask changed training: TRL dapo without it ends elsewhere after the first step
    off = H.train(trl.GRPOTrainer, trl.GRPOConfig(**H.base_kwargs(tmp_path / "off", max_steps=STEPS, learning_rate=2e-2,
                                                                  loss_type="dapo", epsilon=0.2, epsilon_high=0.28)),
                  dtype=DTYPE)
    assert float((off[1].params[0] - ref[1].params[0]).abs().max()) > 1e-6


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("quantile", [0.2, 0.5, 0.9, 1e-3])
def test_high_entropy_mask_equals_trls_get_high_entropy_mask(ties, quantile):
    from types import SimpleNamespace

    from trl.trainer.grpo_trainer import GRPOTrainer as TRLGRPOTrainer

    from stablerl.ops import high_entropy_mask

    class _OneProcess:  # what get_high_entropy_mask reads of its accelerator, for one process
        @staticmethod
        def pad_across_processes(t, dim=0, pad_index=0):
            return t

        @staticmethod
        def gather(t):
            return t

    host = SimpleNamespace(accelerator=_OneProcess())
    g = torch.Generator().manual_seed(int(quantile * 1000) + ties)
    for _ in range(20):
        entropy = torch.rand(6, 9, generator=g, dtype=torch.float32) * 3
        if ties:  # few distinct values: many tokens sit exactly at the threshold
            entropy = (entropy * 2).floor() / 2
        mask = (torch.rand(6, 9, generator=g) > 0.3).to(torch.float32)
        trl = TRLGRPOTrainer.get_high_entropy_mask(host, entropy, mask, 1 - quantile)
        ours = high_entropy_mask(entropy, mask.bool(), quantile)
        assert torch.equal(ours, trl)
    empty = torch.zeros(3, 4)
    assert torch.equal(high_entropy_mask(torch.rand(3, 4), empty.bool(), quantile),
                       TRLGRPOTrainer.get_high_entropy_mask(host, torch.rand(3, 4), empty, 1 - quantile))


def test_top_entropy_quantile_set_twice_is_refused():
    from stablerl.adapters.trl import GRPOConfig

    cpu = dict(output_dir="/tmp/stablerl-trl-builtins-test", use_cpu=True, bf16=False, report_to="none")
    with pytest.raises(stablerl.StableRLError, match="top_entropy_quantile is set twice"):
        GRPOConfig(loss_type="vanilla", top_entropy_quantile=0.5, stablerl_loss_params={"top_entropy_quantile": 0.2},
                   **cpu)
    with pytest.raises(stablerl.StableRLError, match=r"top_entropy_quantile must be in \(0, 1\]"):
        GRPOConfig(loss_type="vanilla", stablerl_loss_params={"top_entropy_quantile": 2}, **cpu)
    with pytest.raises(stablerl.StableRLError, match="'gmpo' returns a scalar"):
        GRPOConfig(loss_type="gmpo", stablerl_loss_params={"top_entropy_quantile": 0.2}, **cpu)
