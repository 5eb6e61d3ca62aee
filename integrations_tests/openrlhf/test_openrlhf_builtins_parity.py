"""Parity of stablerl's copies of OpenRLHF 0.11.2's estimators with OpenRLHF's own (issue 16).

``reinforce``, ``reinforce_baseline`` and ``flash_reinforce`` through the real
``RemoteExperienceMaker.compute_advantages_and_returns``: OpenRLHF's branch against stablerl's estimator
selected as ``stablerl_<name>`` (OpenRLHF owns the names). With ``kl_coef = 0``: OpenRLHF folds the KL reward
in before its whitening, while the adapter adds it to a stablerl estimator's advantages afterwards (the
KL-in-reward is the framework's, never normalised there), so with a KL penalty the whitened estimators
differ by design.
"""

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (nox -s openrlhf installs it)")

import torch
from orlhf_helpers import clone, make_experiences
from test_openrlhf_advantage import _openrlhf, _stable


def _compare(ours, ref):
    for o, r in zip(ours, ref):
        m = o.action_mask
        # OpenRLHF leaves (x - mean) * rstd on padding; stablerl gives 0 there (never read by the loss)
        torch.testing.assert_close(o.advantages * m, r.advantages * m, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(o.info["return"], r.info["return"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["reinforce", "reinforce_baseline", "flash_reinforce"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reinforce_family_equals_openrlhf(name, seed):
    exps = make_experiences(seed=seed, kl_scale=0.3)
    ref = _openrlhf(name, clone(exps), kl_coef=0.0)
    out = _stable("stablerl_" + name, clone(exps), None, kl_coef=0.0)
    _compare(out, ref)
    adv = torch.cat([(r.advantages * r.action_mask).flatten() for r in ref])
    assert float(adv.abs().max()) > 0.5


@pytest.mark.parametrize("name", ["reinforce", "reinforce_baseline"])
def test_no_std_norm_centres_only(name):
    exps = make_experiences(seed=3)
    ref_args = _openrlhf.__globals__["make_args"](estimator=name)
    ref_args.algo.advantage.no_std_norm = True
    from test_openrlhf_advantage import ORIGINAL
    from orlhf_helpers import make_maker

    ref = ORIGINAL(make_maker(ref_args, name, 0.0), clone(exps))
    out = _stable("stablerl_" + name, clone(exps), None, kl_coef=0.0, framework={"norm_adv_by_std_in_grpo": False})
    _compare(out, ref)


@pytest.mark.parametrize("gating", ["binary_kl", "tv"])
@pytest.mark.parametrize("level", ["token", "seq"])
def test_divergence_is_equals_openrlhf_gating(gating, level):
    """stablerl's divergence_is rollout correction (for verl and TRL) == OpenRLHF's PolicyLoss with
    is_correction_mode=mask and is_correction_gating=binary_kl|tv: loss and gradient, ppo loss, token-mean."""
    import stablerl
    from openrlhf.models.loss import PolicyLoss
    from orlhf_helpers import loss_batch

    b = loss_batch(seed=7, spread=0.3)
    threshold = 0.05 if gating == "binary_kl" else 0.12
    ref_fn = PolicyLoss(policy_loss_type="ppo", clip_eps_low=0.2, clip_eps_high=0.28, is_correction_level=level,
                        is_correction_mode="mask", is_correction_gating=gating, is_correction_threshold=[0.0, threshold])
    x = b.new.clone().requires_grad_(True)
    ref = ref_fn(x, b.old, b.adv_tok, action_mask=b.mask, rollout_log_probs=b.rollout)
    (g_ref,) = torch.autograd.grad(ref[0], x)
    y = b.new.clone().requires_grad_(True)
    ours, metrics = stablerl.compute_policy_loss(
        "vanilla", log_prob=y, old_log_prob=b.old, advantages=b.adv_tok, response_mask=b.mask,
        rollout_log_prob=b.rollout, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=None,
        rollout_correction="divergence_is",
        rollout_correction_params={"gating": gating, "level": "sequence" if level == "seq" else "token",
                                   "threshold": threshold})
    (g_ours,) = torch.autograd.grad(ours, y)
    torch.testing.assert_close(ours, ref[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-9, atol=1e-12)
    assert 0 < float(ref[4]) < 1, "the gate must filter some units and keep others"


def test_openrlhf_gamma_reaches_reinforce_and_is_refused_where_unused():
    import stablerl
    from orlhf_helpers import make_args, make_maker
    from stablerl.adapters.openrlhf.train_ppo_ray import explicit_advantage_flags
    from test_openrlhf_advantage import ORIGINAL

    args = make_args(estimator="reinforce")
    args.algo.advantage.gamma = 0.9
    framework, _ = explicit_advantage_flags(args, ["--algo.advantage.gamma", "0.9"])
    assert framework == {"gamma": 0.9}
    assert explicit_advantage_flags(args, [])[0] == {}  # not given: OpenRLHF's value is not read
    exps = make_experiences(seed=4)
    ref = ORIGINAL(make_maker(args, "reinforce", 0.0), clone(exps))
    out = _stable("stablerl_reinforce", clone(exps), None, kl_coef=0.0, framework=framework)
    # advantages only: the adapter logs info["return"] as the (discounted) return at the first token, OpenRLHF
    # as the undiscounted reward sum; equal at gamma = 1 (test above), a logging difference below it
    for o, r in zip(out, ref):
        m = o.action_mask
        torch.testing.assert_close(o.advantages * m, r.advantages * m, rtol=1e-5, atol=1e-6)
    undiscounted = _stable("stablerl_reinforce", clone(exps), None, kl_coef=0.0)
    assert any(not torch.allclose(u.advantages, o.advantages) for u, o in zip(undiscounted, out))
    with pytest.raises(stablerl.StableRLError, match="--algo.advantage.gamma=0.9 has no effect"):
        _stable("stablerl_dr_grpo", clone(exps), None, kl_coef=0.0, framework=framework)
