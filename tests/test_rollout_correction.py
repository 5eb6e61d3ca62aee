"""Rollout (training-inference mismatch) corrections applied with any loss."""

import math

import pytest
import torch
from conftest import make_batch

import stablerl
from stablerl import MissingInputError, StableRLError

OLD = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -9.0]], dtype=torch.float64)
ROLL = torch.tensor([[-1.0, -2.0, -0.2], [-2.1, -1.9, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
ADV = torch.tensor([[1.0] * 3, [-1.0] * 3], dtype=torch.float64)


def test_tis_token_truncates_upper_only():
    rho = torch.exp(OLD - ROLL)
    expected = rho.clamp(max=2.0) * MASK
    lp = OLD.clone().requires_grad_(True)
    b = dict(log_prob=lp, old_log_prob=OLD, advantages=-torch.ones_like(OLD), response_mask=MASK, rollout_log_prob=ROLL)
    base, _ = stablerl.compute_policy_loss("vanilla", loss_agg_mode="token-mean", **b)
    loss, metrics = stablerl.compute_policy_loss("vanilla", loss_agg_mode="token-mean", rollout_correction="tis", **b)
    assert loss.item() == pytest.approx(expected.sum().item() / MASK.sum().item())
    assert metrics["rollout_corr/weight_mean"] == pytest.approx(expected.sum().item() / 5)
    assert metrics["rollout_corr/kl"] == pytest.approx(((ROLL - OLD) * MASK).sum().item() / 5)
    assert base.item() == pytest.approx(1.0)


def test_tis_sequence_level():
    seq = torch.exp(((OLD - ROLL) * MASK).sum(-1)).clamp(max=2.0)
    lp = OLD.clone().requires_grad_(True)
    loss, _ = stablerl.compute_policy_loss(
        "vanilla", log_prob=lp, old_log_prob=OLD, advantages=-torch.ones_like(OLD), response_mask=MASK,
        rollout_log_prob=ROLL, loss_agg_mode="seq-mean-token-sum", rollout_correction="tis",
        rollout_correction_params={"level": "sequence"},
    )
    assert loss.item() == pytest.approx(((seq[0] * 3 + seq[1] * 2) / 2).item())


def test_icepop_zeroes_outside_band_and_keeps_rho_inside():
    rho = torch.exp(OLD - ROLL)
    inside = (rho >= 0.5) & (rho <= 5.0)
    expected = torch.where(inside, rho, torch.zeros_like(rho)) * MASK
    lp = OLD.clone().requires_grad_(True)
    loss, metrics = stablerl.compute_policy_loss(
        "vanilla", log_prob=lp, old_log_prob=OLD, advantages=-torch.ones_like(OLD), response_mask=MASK,
        rollout_log_prob=ROLL, rollout_correction="icepop",
    )
    assert loss.item() == pytest.approx(expected.sum().item() / 5)
    assert metrics["rollout_corr/masked_fraction"] == pytest.approx(((~inside) & MASK).sum().item() / 5)
    assert 0 < metrics["rollout_corr/masked_fraction"] < 1


def test_seq_mis_and_geo_rs_by_hand():
    log_seq = ((OLD - ROLL) * MASK).sum(-1)  # row0: 0 + 1 - 0.8 = 0.2 ; row1: 0.1 - 0.1 = 0.0
    rho_seq = torch.exp(log_seq)
    lp = OLD.clone().requires_grad_(True)
    common = dict(log_prob=lp, old_log_prob=OLD, advantages=-torch.ones_like(OLD), response_mask=MASK, rollout_log_prob=ROLL)
    loss, _ = stablerl.compute_policy_loss("vanilla", rollout_correction="seq_mis", **common)
    assert loss.item() == pytest.approx((rho_seq[0] * 3 + rho_seq[1] * 2).item() / 5)
    loss, _ = stablerl.compute_policy_loss("vanilla", rollout_correction="seq_mis", rollout_correction_params={"high": 1.1}, **common)
    assert loss.item() == pytest.approx((rho_seq[1] * 2).item() / 5)  # row 0 (1.22) rejected
    # geo mean: row0 exp(0.2/3) = 1.069 (rejected by the default 0.999..1.001 band), row1 exp(0) = 1 (kept)
    loss, metrics = stablerl.compute_policy_loss("vanilla", rollout_correction="geo_rs", **common)
    assert loss.item() == pytest.approx(2 / 5)
    assert metrics["rollout_corr/masked_fraction"] == pytest.approx(3 / 5)


def test_opsm_masks_only_negative_advantage_sequences_past_delta():
    lp = OLD.clone()
    lp[0] -= 0.5
    lp.requires_grad_(True)
    adv = torch.tensor([[-1.0] * 3, [1.0] * 3], dtype=torch.float64)
    # divergence mean(lp_roll - lp): row0 (0.5 - 0.5 + 1.3)/3 = 0.433, row1 (-0.1 + 0.1)/2 = 0
    common = dict(log_prob=lp, old_log_prob=OLD, advantages=adv, response_mask=MASK, rollout_log_prob=ROLL)
    base, _ = stablerl.compute_policy_loss("vanilla", **common)
    assert base.item() == pytest.approx((0.8 * 3 - 2) / 5)  # row 0 clipped at 1 - 0.2, row 1 at ratio 1
    kept, _ = stablerl.compute_policy_loss("vanilla", rollout_correction="opsm", rollout_correction_params={"threshold": 1.0}, **common)
    assert kept.item() == pytest.approx(base.item())
    dropped, _ = stablerl.compute_policy_loss("vanilla", rollout_correction="opsm", rollout_correction_params={"threshold": 0.2}, **common)
    # row 0 (A < 0, divergence 0.433 > 0.2) is dropped; row 1 has A > 0 and stays
    assert dropped.item() == pytest.approx(-2 / 5)
    with pytest.raises(StableRLError, match="opsm needs threshold"):
        stablerl.compute_policy_loss("vanilla", rollout_correction="opsm", **common)


def test_weights_are_detached_and_gradient_scales():
    b = make_batch(B=4, T=5, seed=7, dtype=torch.float64)
    roll = b["old_log_prob"] + 0.3
    loss, _ = stablerl.compute_policy_loss("vanilla", rollout_log_prob=roll, rollout_correction="tis", **b)
    (g,) = torch.autograd.grad(loss, b["log_prob"])
    b2 = {**b, "log_prob": b["log_prob"].detach().clone().requires_grad_(True)}
    w = torch.exp(torch.full_like(roll, -0.3)).clamp(max=2.0)
    ref, _ = stablerl.compute_policy_loss("vanilla", is_weights=w, **b2)
    (g_ref,) = torch.autograd.grad(ref, b2["log_prob"])
    torch.testing.assert_close(g, g_ref)
    assert math.isclose(loss.item(), ref.item(), rel_tol=1e-12)


def test_never_applied_twice_and_needs_rollout_log_prob():
    b = make_batch()
    with pytest.raises(StableRLError, match="applied on top of the framework's own"):
        stablerl.compute_policy_loss(
            "vanilla", rollout_log_prob=b["old_log_prob"], is_weights=torch.ones(4, 6), rollout_correction="tis", **b
        )
    with pytest.raises(MissingInputError, match="needs rollout_log_prob"):
        stablerl.compute_policy_loss("vanilla", rollout_correction="icepop", **b)
    with pytest.raises(stablerl.UnknownNameError, match="did you mean 'tis'"):
        stablerl.compute_policy_loss("vanilla", rollout_log_prob=b["old_log_prob"], rollout_correction="tiss", **b)
    with pytest.raises(stablerl.UnknownNameError, match="valid: level, threshold"):
        stablerl.compute_policy_loss(
            "vanilla", rollout_log_prob=b["old_log_prob"], rollout_correction="tis", rollout_correction_params={"C": 2}, **b
        )
