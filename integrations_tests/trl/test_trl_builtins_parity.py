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
from test_trl_parity import _compare, _pair


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
