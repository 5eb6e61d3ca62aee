"""stablerl losses against OpenRLHF 0.11.2's real PolicyLoss (value, gradient, 5-tuple, IS correction)."""

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (nox -s openrlhf installs it)")

import torch

import stablerl
from orlhf_helpers import loss_batch

from openrlhf.models.loss import PolicyLoss, aggregate_loss  # the real OpenRLHF code
from stablerl.adapters.openrlhf import StablePolicyLoss


def _run(loss_fn, b, adv, normalisers, rollout=False):
    x = b.new.clone().requires_grad_(True)
    out = loss_fn(x, b.old, adv, action_mask=b.mask, rollout_log_probs=b.rollout if rollout else None, **normalisers)
    (grad,) = torch.autograd.grad(out[0], x)
    return out, grad


NORMALISERS = [
    {},  # OpenRLHF's local masked means
    {"dp_size": 2, "batch_num_tokens": torch.tensor(61.0, dtype=torch.float64), "global_batch_size": torch.tensor(11.0, dtype=torch.float64)},
]


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("eps,dual", [((0.2, 0.2), None), ((0.2, 0.28), None), ((0.1, 0.3), 3.0), ((0.2, 0.28), 1.5)])
@pytest.mark.parametrize("norm", range(len(NORMALISERS)))
def test_vanilla_equals_openrlhf_ppo(token_level, eps, dual, norm):
    b = loss_batch(spread=0.4, seed=norm)
    kw = dict(clip_eps_low=eps[0], clip_eps_high=eps[1], dual_clip=dual, token_level_loss=token_level)
    ref, g_ref = _run(PolicyLoss(policy_loss_type="ppo", **kw), b, b.adv_tok, NORMALISERS[norm])
    ours, g_ours = _run(StablePolicyLoss(policy_loss_type="vanilla", **kw), b, b.adv_tok, NORMALISERS[norm])
    assert len(ours) == 5 and ours[3] is None and ours[4] is None  # IS off: OpenRLHF's None, None
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours[1].double(), ref[1].double(), rtol=1e-9, atol=1e-12)  # clip_ratio
    torch.testing.assert_close(ours[2], ref[2], rtol=1e-10, atol=1e-12)  # ppo_kl
    assert float(ref[1]) > 0  # the clip is exercised
    assert float(g_ref.abs().sum()) > 0 and torch.all(g_ours[~b.mask] == 0)


@pytest.mark.parametrize("norm", range(len(NORMALISERS)))
def test_stablerl_gspo_equals_openrlhf_gspo(norm):
    """Sequence-level advantages (OpenRLHF's group estimators give one per response): equal value and
    gradient; OpenRLHF forces seq-mean-token-mean for gspo, so the stablerl loss gets that mode."""
    b = loss_batch(spread=0.05, seed=3 + norm)
    b.adv[::2], b.adv[1::2] = b.adv[::2].abs(), -b.adv[1::2].abs()  # both clip sides are reached
    eps = dict(clip_eps_low=3e-3, clip_eps_high=4e-3)
    ref, g_ref = _run(PolicyLoss(policy_loss_type="gspo", **eps), b, b.adv, NORMALISERS[norm])
    ours, g_ours = _run(
        StablePolicyLoss(policy_loss_type="stablerl_gspo", token_level_loss=False, **eps), b, b.adv, NORMALISERS[norm]
    )
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ours[2], ref[2], rtol=1e-10, atol=1e-12)
    assert 0 < float(ref[1]) < 1  # some sequences clipped, some not
    torch.testing.assert_close(ours[1].double(), ref[1].double())


def test_builtin_names_run_openrlhf_code():
    b = loss_batch()
    for name in ("ppo", "gspo"):
        ref, g_ref = _run(PolicyLoss(policy_loss_type=name), b, b.adv, NORMALISERS[1])
        ours, g_ours = _run(StablePolicyLoss(policy_loss_type=name), b, b.adv, NORMALISERS[1])
        assert StablePolicyLoss(policy_loss_type=name).stablerl_name is None
        for r, o in zip(ref, ours):
            assert (r is None and o is None) or torch.equal(r, o)
        assert torch.equal(g_ref, g_ours)


IS_SETTINGS = [
    ("token", "clip", "ratio", (0.5, 2.0)),  # TIS
    ("token", "mask", "ratio", (0.5, 2.0)),  # ICEPOP
    ("seq", "mask", "ratio", (0.7, 1.5)),  # seq-mask-tis
    ("seq", "mask", "binary_kl", (0.0, 0.05)),  # FlashREINFORCE gate
    ("token", "mask", "tv", (0.0, 0.1)),
]


@pytest.mark.parametrize("level,mode,gating,threshold", IS_SETTINGS)
@pytest.mark.parametrize("token_level", [True, False])
def test_is_correction_is_openrlhfs(level, mode, gating, threshold, token_level):
    """stablerl vanilla with OpenRLHF's IS correction == OpenRLHF ppo with it (loss, grad, vllm_kl,
    is_filter_ratio): the coefficient comes from OpenRLHF's own code."""
    b = loss_batch(seed=7, spread=0.3)
    kw = dict(clip_eps_low=0.2, clip_eps_high=0.28, token_level_loss=token_level, is_correction_level=level,
              is_correction_mode=mode, is_correction_gating=gating, is_correction_threshold=threshold)
    ref, g_ref = _run(PolicyLoss(policy_loss_type="ppo", **kw), b, b.adv_tok, NORMALISERS[1], rollout=True)
    b.rollout[~b.mask] = float("nan")  # garbage on padding must not leak into ours (OpenRLHF's would be NaN)
    ours, g_ours = _run(StablePolicyLoss(policy_loss_type="vanilla", **kw), b, b.adv_tok, NORMALISERS[1], rollout=True)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-9, atol=1e-12, equal_nan=False)
    torch.testing.assert_close(ours[3], ref[3])  # vllm_kl
    torch.testing.assert_close(ours[4], ref[4])  # is_filter_ratio
    assert 0 < float(ref[4]) < 1, "the gate must filter some units and keep others"


def test_m2po_is_stablerls_and_aggregates_like_openrlhf():
    b = loss_batch(seed=11)
    norm = NORMALISERS[1]
    fn = StablePolicyLoss(policy_loss_type="m2po", stablerl_params={"m2_threshold": 0.04}, **{"clip_eps_low": 0.2})
    out, grad = _run(fn, b, b.adv_tok, norm)
    ref, _ = stablerl.compute_policy_loss(
        "m2po", log_prob=b.new, old_log_prob=b.old, advantages=b.adv_tok, response_mask=b.mask, m2_threshold=0.04,
        ctx=stablerl.Context(token_count=61.0, seq_count=11.0, dp_size=2),
    )
    torch.testing.assert_close(out[0], ref, rtol=1e-12, atol=1e-12)
    assert "m2po/m2_before" in fn.last_metrics and torch.all(grad[~b.mask] == 0)
    # a per-token loss of ones reproduces OpenRLHF's normaliser exactly
    ones = aggregate_loss(torch.ones_like(b.old), b.mask, True, **norm)
    assert float(ones) == pytest.approx(float(b.mask.sum()) / 61.0 * 2)


def test_decoupled_ppo_gets_the_vllm_log_probs_and_not_openrlhfs_weights_on_top():
    """A loss that corrects for the sampler itself (decoupled_ppo) runs under OpenRLHF's IS correction: it
    gets the rollout log-probs, OpenRLHF's IS weights are not applied on top (they would apply the
    behaviour weight twice), and OpenRLHF's vllm_kl is still reported."""
    b = loss_batch(seed=12)
    norm = NORMALISERS[1]
    fn = StablePolicyLoss(policy_loss_type="decoupled_ppo", is_correction_level="token", clip_eps_low=0.2)
    out, grad = _run(fn, b, b.adv_tok, norm, rollout=True)
    ref, _ = stablerl.compute_policy_loss(
        "decoupled_ppo", log_prob=b.new, old_log_prob=b.old, rollout_log_prob=b.rollout, advantages=b.adv_tok,
        response_mask=b.mask, ctx=stablerl.Context(token_count=61.0, seq_count=11.0, dp_size=2),
    )
    torch.testing.assert_close(out[0], ref, rtol=1e-12, atol=1e-12)
    assert out[3] is not None and torch.all(grad[~b.mask] == 0)  # vllm_kl reported


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(stablerl.UnknownNameError, match="m2po"):
        StablePolicyLoss(policy_loss_type="m2p0")
    with pytest.raises(stablerl.UnknownNameError, match="m2_threshold"):
        StablePolicyLoss(policy_loss_type="m2po", stablerl_params={"m2_treshold": 1.0})
    with pytest.raises(stablerl.MissingInputError, match="is_correction_level"):
        StablePolicyLoss(policy_loss_type="decoupled_ppo")
    with pytest.raises(stablerl.StableRLError, match="unavailable|not implemented"):
        StablePolicyLoss(policy_loss_type="haepo")
    b = loss_batch()
    b.new[0, 0] = float("nan")
    with pytest.raises(stablerl.StableRLError, match="non-finite"):
        StablePolicyLoss(policy_loss_type="vanilla")(b.new, b.old, b.adv, action_mask=b.mask)


def test_bf16_inputs_close_to_fp32():
    b = loss_batch(dtype=torch.float32, seed=5)
    fn = StablePolicyLoss(policy_loss_type="m2po")
    full = fn(b.new, b.old, b.adv, action_mask=b.mask)[0]
    half = fn(b.new.bfloat16(), b.old.bfloat16(), b.adv.bfloat16(), action_mask=b.mask)[0]
    assert torch.isfinite(half) and abs(float(half) - float(full)) < 5e-2


def test_the_actor_prints_the_effective_settings_when_it_builds_the_loss(capsys):
    """One precedence rule, printed at start-up: a clip flag given on the command line applies, the
    stablerl key wins over it, the rest are the paper's defaults."""
    from orlhf_helpers import make_args
    from stablerl import frameworks
    from stablerl.adapters.openrlhf import Selection
    from stablerl.adapters.openrlhf._loss import build_policy_loss

    frameworks._LOGGED.clear()
    sel = Selection(policy_loss="vanilla", policy_loss_params={"clip_ratio_c": 5.0},
                    openrlhf_clip={"clip_ratio_low": 0.1, "clip_ratio_high": 0.1})
    fn = build_policy_loss(make_args(policy_loss_type="vanilla", eps=(0.1, 0.1)), sel)
    assert fn.stablerl_params == {"clip_ratio_low": 0.1, "clip_ratio_high": 0.1, "clip_ratio_c": 5.0}
    err = capsys.readouterr().err
    assert "stablerl/openrlhf: policy loss 'vanilla' runs with:" in err
    assert "clip_ratio_low  = 0.1  (framework key: --actor.eps_clip_low_high[0] / --actor.eps_clip=0.1)" in err
    assert "clip_ratio_c    = 5.0  (stablerl key: --actor.stablerl_params clip_ratio_c=5.0)" in err
    # flags left at OpenRLHF's defaults leave the paper's: DAPO's clip-higher 0.28
    frameworks._LOGGED.clear()
    fn = build_policy_loss(make_args(policy_loss_type="vanilla"), Selection(policy_loss="vanilla"))
    assert fn.stablerl_params == {} and "clip_ratio_high = 0.28  (paper default" in capsys.readouterr().err
