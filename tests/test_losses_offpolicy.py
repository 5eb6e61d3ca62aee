"""Decoupled PPO and A-3PO against hand computations."""

import pytest
import torch
from conftest import make_batch

import stablerl
from stablerl import MissingInputError
from stablerl.plugins.decoupled import a3po_alpha


def ppo_tokens(lp, prox, adv, low=0.2, high=0.2):
    r = torch.exp(lp - prox)
    return torch.maximum(-adv * r, -adv * torch.clamp(r, 1 - low, 1 + high))


def test_decoupled_value_and_gradient_by_hand():
    b = make_batch(B=4, T=5, seed=11, dtype=torch.float64, spread=0.4)
    m = b["response_mask"].double()
    roll = b["old_log_prob"] + torch.linspace(-2.0, 2.0, 20, dtype=torch.float64).reshape(4, 5)
    loss, metrics = stablerl.compute_policy_loss("decoupled_ppo", rollout_log_prob=roll, **b)
    lp = b["log_prob"].detach().clone().requires_grad_(True)
    w = torch.exp(b["old_log_prob"] - roll)
    keep = (w <= 5.0).double()
    ref = (ppo_tokens(lp, b["old_log_prob"], b["advantages"]) * w * keep * m).sum() / m.sum()
    torch.testing.assert_close(loss, ref)
    (g,) = torch.autograd.grad(loss, b["log_prob"])
    (g_ref,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(g, g_ref)
    # rejected tokens (w > 5) stay in the denominator and get no gradient
    assert 0 < metrics["rs_filtered_fraction"] < 1
    assert torch.all(g[(keep == 0) | (m == 0)] == 0)


def test_decoupled_clamp_mode_and_sequence_level():
    b = make_batch(B=3, T=4, seed=12, dtype=torch.float64)
    roll = b["old_log_prob"] - 3.0  # w = e^3 = 20 everywhere
    clamped, metrics = stablerl.compute_policy_loss(
        "decoupled_ppo", rollout_log_prob=roll, behave_imp_weight_mode="clamp", **b
    )
    plain, _ = stablerl.compute_policy_loss("vanilla", clip_ratio_high=0.2, clip_ratio_c=None, **b)
    torch.testing.assert_close(clamped, plain * 5.0)
    assert metrics["rs_filtered_fraction"] == 0.0
    masked, _ = stablerl.compute_policy_loss("decoupled_ppo", rollout_log_prob=roll, behave_imp_weight_level="sequence", **b)
    assert masked.item() == 0.0  # every sequence's geometric-mean weight is 20 > 5: all rejected


def test_a3po_alpha_worked_example():
    versions = torch.tensor([[8, 7, 3, 9, 10, -1]])
    assert a3po_alpha(versions, 10).tolist()[0] == pytest.approx([0.5, 2 / 3, 6 / 7, 0.0, 0.0, 0.0])


def test_a3po_loglinear_value_and_gradient():
    b = make_batch(B=2, T=3, seed=13, dtype=torch.float64, padded=False)
    roll = b["old_log_prob"] - 0.1
    versions = torch.tensor([[8, 8, 9], [7, 10, 3]])
    loss, metrics = stablerl.compute_policy_loss(
        "a3po", rollout_log_prob=roll, versions=versions, policy_version=10, **b
    )
    lp = b["log_prob"].detach().clone().requires_grad_(True)
    alpha = a3po_alpha(versions, 10).double()
    prox = roll + alpha * (lp.detach() - roll)
    w = torch.exp(prox - roll)
    ref = (ppo_tokens(lp, prox, b["advantages"]) * w * (w <= 5)).mean()
    torch.testing.assert_close(loss, ref)
    (g,) = torch.autograd.grad(loss, b["log_prob"])
    (g_ref,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(g, g_ref)
    assert metrics["a3po/alpha_mean"] == pytest.approx(alpha.mean().item())
    # tokens from the previous version have lp_prox == lp_behav exactly: the behaviour weight is 1
    torch.testing.assert_close(prox[0, 2], roll[0, 2])


def test_a3po_recompute_equals_decoupled_and_inputs_are_required():
    b = make_batch(B=3, T=4, seed=14, dtype=torch.float64)
    roll = b["old_log_prob"] + 0.2
    versions = torch.zeros(3, 4, dtype=torch.long)
    a, _ = stablerl.compute_policy_loss("a3po", rollout_log_prob=roll, versions=versions, policy_version=2, prox_logp_method="recompute", **b)
    d, _ = stablerl.compute_policy_loss("decoupled_ppo", rollout_log_prob=roll, **b)
    torch.testing.assert_close(a, d)
    with pytest.raises(MissingInputError, match="needs input 'versions'"):
        stablerl.compute_policy_loss("a3po", rollout_log_prob=roll, policy_version=2, **b)
    with pytest.raises(MissingInputError, match="needs input 'rollout_log_prob'"):
        stablerl.compute_policy_loss("decoupled_ppo", **b)


def test_degenerate_and_bf16():
    b = make_batch(B=3, T=4, seed=15)
    roll = b["old_log_prob"]
    zero = {**b, "response_mask": torch.zeros_like(b["response_mask"])}
    loss, metrics = stablerl.compute_policy_loss("decoupled_ppo", rollout_log_prob=roll, **zero)
    assert loss.item() == 0.0 and all(v == v for v in metrics.values())
    b16 = {k: (v.detach().bfloat16() if v.dtype.is_floating_point else v) for k, v in b.items()}
    b16["log_prob"].requires_grad_(True)
    l16, _ = stablerl.compute_policy_loss("a3po", rollout_log_prob=roll.bfloat16(), versions=torch.ones(3, 4, dtype=torch.long),
                                          policy_version=3, **b16)
    l32, _ = stablerl.compute_policy_loss("a3po", rollout_log_prob=roll, versions=torch.ones(3, 4, dtype=torch.long),
                                          policy_version=3, **b)
    assert torch.isfinite(l16) and abs(l16.item() - l32.item()) < 0.05


def test_framework_is_weights_are_refused_not_applied_twice():
    b = make_batch(B=2, T=3, seed=16, dtype=torch.float64)
    with pytest.raises(stablerl.StableRLError, match="apply their own behaviour-policy IS weight"):
        stablerl.compute_policy_loss("decoupled_ppo", rollout_log_prob=b["old_log_prob"], is_weights=torch.ones(2, 3), **b)
