"""Parity with TRL's own losses, step by step, through real training.

Each test trains twice from the same seed -- once with TRL's ``trl.GRPOTrainer`` and a built-in
``loss_type``, once with stablerl's ``GRPOTrainer`` and the stablerl loss -- with
``num_iterations=2`` and ``gradient_accumulation_steps=2`` (so old log-probs exist and the ratio
is not 1) and a large learning rate (so clipping is active), and compares the logged loss and
every parameter after every optimizer step.

The model is float64. Adam divides each gradient by its running RMS, so a summation-order difference
in a near-zero gradient becomes a parameter difference of order ``lr``; in float32 such differences
depend on the CPU's vector kernels (AVX2 and AVX-512 reduce in different orders) and could cross a
hand-picked bound on one CPU and not another. In float64 they are ~1e-16 relative: the parameter
differences below are identical under ``ATEN_CPU_CAPABILITY=avx2`` and ``avx512``.

Convention differences, stated:
* ``vanilla`` == TRL ``dapo`` with ``clip_ratio_high = epsilon_high`` and no dual clip
  (``clip_ratio_c=None``; stablerl's default dual clip 3.0 has no TRL counterpart).
* ``gspo`` (GSPO-token form) == TRL ``grpo`` with ``importance_sampling_level="sequence"`` under
  ``stablerl_loss_agg_mode="seq-mean-token-mean"``; bounds 3e-4/4e-4 on both sides.
* ``cispo``: TRL's ``epsilon_high`` is an ABSOLUTE cap on the weight, stablerl's (verl's)
  ``clip_ratio_high`` is relative: TRL ``epsilon_high=c`` == stablerl ``clip_ratio_high=c-1`` with
  ``clip_ratio_low>=1`` (no lower bound). The name exists in both, so stablerl's is
  ``loss_type="stablerl_cispo"``.
* ``sapo``: same temperatures (1.0/1.05) and aggregation (per-sequence token mean), as
  ``stablerl_sapo``.
* The ``grpo`` estimator with ``epsilon=1e-4`` == TRL's default group-scaled advantages.
"""

import pytest
import torch

import trl_helpers as H  # noqa: I001  (conftest puts this folder on sys.path)

import trl
from stablerl.adapters.trl import GRPOConfig, GRPOTrainer

STEPS = 4
# float64 weights: the claim is "same formula", and a summation-order difference must not reach the
# tolerance through Adam on any CPU's vector kernels (AVX2 vs AVX-512 reduce in different orders)
DTYPE = torch.float64


def _compare(reference, candidate, *, rtol, atol, expect_clipping=None):
    (_, ref, init_ref), (_, cand, init_cand) = reference, candidate
    assert torch.equal(init_ref, init_cand)
    assert len(ref.params) == len(cand.params) == STEPS
    assert len(ref.logs) == len(cand.logs) == STEPS
    for step, (p_ref, p_cand, l_ref, l_cand) in enumerate(zip(ref.params, cand.params, ref.logs, cand.logs)):
        assert p_ref.dtype == p_cand.dtype == DTYPE
        assert not torch.equal(p_ref, init_ref), f"step {step}: parameters did not move"
        torch.testing.assert_close(p_cand, p_ref, rtol=rtol, atol=atol, msg=lambda m: f"step {step}: {m}")
        assert l_cand["loss"] == pytest.approx(l_ref["loss"], rel=1e-4, abs=1e-7), f"step {step}"
        assert l_cand.get("reward") == pytest.approx(l_ref.get("reward")), f"step {step}: sampling diverged"
    if expect_clipping is not None:  # the clip branch must have been exercised
        assert any(log.get(expect_clipping, 0) > 0 for log in ref.logs), f"no clipping seen in {expect_clipping}"


def _pair(tmp_path, trl_kwargs, stablerl_kwargs, common=None):
    common = dict(max_steps=STEPS, **(common or {}))
    ref = H.train(trl.GRPOTrainer, trl.GRPOConfig(**H.base_kwargs(tmp_path / "trl", **common, **trl_kwargs)),
                  dtype=DTYPE)
    cand = H.train(GRPOTrainer, GRPOConfig(**H.base_kwargs(tmp_path / "srl", **common, **stablerl_kwargs)),
                   dtype=DTYPE)
    return ref, cand


def test_vanilla_equals_trl_dapo(tmp_path):
    ref, cand = _pair(
        tmp_path,
        dict(loss_type="dapo", epsilon=0.2, epsilon_high=0.28),
        dict(loss_type="vanilla",
             stablerl_loss_params={"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": None}),
        common=dict(learning_rate=2e-2),
    )
    _compare(ref, cand, rtol=1e-6, atol=1e-7, expect_clipping="clip_ratio/region_mean")
    # stablerl's own clip metrics are logged
    assert all("stablerl/pg_clipfrac" in log for log in cand[1].logs)


def test_gspo_equals_trl_grpo_sequence_level(tmp_path):
    ref, cand = _pair(
        tmp_path,
        dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
        dict(loss_type="gspo", stablerl_loss_agg_mode="seq-mean-token-mean"),
    )
    _compare(ref, cand, rtol=1e-5, atol=1e-6, expect_clipping="clip_ratio/region_mean")


def test_cispo_equals_trl_cispo_with_absolute_cap(tmp_path):
    cap = 1.2
    ref, cand = _pair(
        tmp_path,
        dict(loss_type="cispo", epsilon_high=cap),
        dict(loss_type="stablerl_cispo", stablerl_loss_params={"clip_ratio_high": cap - 1.0, "clip_ratio_low": 10.0}),
        common=dict(learning_rate=2e-2),
    )
    _compare(ref, cand, rtol=1e-6, atol=1e-7, expect_clipping="cispo_clip_ratio")
    # TRL's cispo_clip_ratio is stablerl's clip_high (same definition)
    for r, c in zip(ref[1].logs, cand[1].logs):
        assert c["stablerl/clip_high"] == pytest.approx(r["cispo_clip_ratio"], abs=1e-6)


def test_sapo_equals_trl_sapo(tmp_path):
    import stablerl

    if "sapo" not in stablerl.get_registry().names("policy_loss"):
        pytest.skip("stablerl has no 'sapo' policy loss registered")
    ref, cand = _pair(
        tmp_path,
        dict(loss_type="sapo"),
        dict(loss_type="stablerl_sapo", stablerl_loss_agg_mode="seq-mean-token-mean"),
        common=dict(learning_rate=2e-2),
    )
    # same formula, different summation order (TRL: mean over sequences then /GA; stablerl: sum/(B*GA)).
    # In float64 the largest parameter difference after 4 Adam steps is 7.9e-7, the same to the last
    # digit under ATEN_CPU_CAPABILITY=avx2 and avx512 (in float32 it was 1.4e-5 on AVX-512: over the bound)
    _compare(ref, cand, rtol=1e-4, atol=1e-5)


def test_grpo_estimator_equals_trl_advantages(tmp_path):
    ref, cand = _pair(
        tmp_path,
        dict(loss_type="dapo"),
        dict(loss_type="dapo", advantage_estimator="grpo", stablerl_advantage_params={"epsilon": 1e-4}),
    )
    _compare(ref, cand, rtol=1e-5, atol=1e-6)


def test_builtin_loss_type_keeps_trl_behaviour(tmp_path):
    """stablerl's trainer with a TRL name is TRL, bit for bit."""
    ref, cand = _pair(tmp_path, dict(loss_type="dapo"), dict(loss_type="dapo"))
    _compare(ref, cand, rtol=0, atol=0)


def test_vanilla_equals_trl_dapo_with_trl_extras(tmp_path):
    """Everything TRL does around the loss, all at once: KL to a reference model (bias-corrected),
    the off-policy sequence mask, the top-entropy token mask and the entropy bonus."""

    def model_with_ref(sub):
        model = H.tiny_model(0, DTYPE)
        path = tmp_path / sub / "ref"
        model.save_pretrained(path)  # TRL reloads the reference model from _name_or_path
        model.config._name_or_path = str(path)
        return model

    extras = dict(max_steps=STEPS, learning_rate=2e-2, beta=0.05, off_policy_mask_threshold=1e-3,
                  top_entropy_quantile=0.5, entropy_coef=0.01)
    ref = H.train(trl.GRPOTrainer, trl.GRPOConfig(**H.base_kwargs(tmp_path / "trl", loss_type="dapo",
                                                                  epsilon_high=0.28, **extras)),
                  model=model_with_ref("trl"))
    cand = H.train(GRPOTrainer, GRPOConfig(**H.base_kwargs(
        tmp_path / "srl", loss_type="vanilla", **extras,
        stablerl_loss_params={"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": None})),
        model=model_with_ref("srl"))
    # KL is now summed separately from the policy term: rounding-level differences (Adam step 2e-2)
    _compare(ref, cand, rtol=1e-4, atol=1e-5)
    for r, c in zip(ref[1].logs, cand[1].logs):
        assert c["kl"] == pytest.approx(r["kl"], rel=1e-4, abs=1e-9)
        assert c["policy_loss"] == pytest.approx(r["policy_loss"], rel=1e-4, abs=1e-7)
        assert c["entropy"] == pytest.approx(r["entropy"], rel=1e-6)
    assert ref[1].logs[-1]["kl"] > 0
