"""Policy versions (stablerl.policy_versions): a token newer than the weights being trained is refused with an error
naming the input, for every loss that reads versions (A-3PO), and a batch mixing two versions gets A-3PO's alpha per
token (numbers against the formula)."""

import numpy as np
import pytest
import torch
from conftest import make_batch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stablerl
from stablerl import StableRLError
from stablerl.plugins.decoupled import a3po_alpha
from stablerl.policy_versions import as_policy_version, check_policy_versions


@st.composite
def version_batches(draw):
    B, T = draw(st.integers(1, 4)), draw(st.integers(1, 5))
    current = draw(st.integers(0, 6))
    versions = draw(st.lists(st.integers(-2, 9), min_size=B * T, max_size=B * T))
    mask = draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))
    return torch.tensor(versions).reshape(B, T), current, torch.tensor(mask).reshape(B, T)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(version_batches())
def test_a_trained_token_newer_than_the_policy_is_refused(case):
    versions, current, mask = case
    B, T = versions.shape
    b = make_batch(B=B, T=T, seed=3, dtype=torch.float64, padded=False)
    b["response_mask"] = mask
    roll = b["old_log_prob"] - 0.1
    newest = int(versions[mask].max()) if bool(mask.any()) else None
    if newest is not None and newest > current:
        with pytest.raises(StableRLError, match=rf"versions has a trained token of policy version {newest}, newer "
                                                rf"than policy_version={current}"):
            stablerl.compute_policy_loss("a3po", rollout_log_prob=roll, versions=versions, policy_version=current, **b)
        return
    loss, metrics = stablerl.compute_policy_loss("a3po", rollout_log_prob=roll, versions=versions,
                                                 policy_version=current, **b)
    assert torch.isfinite(loss)
    alpha = a3po_alpha(versions, current)
    assert bool(((alpha >= 0) & (alpha <= 1)).all())
    if bool(mask.any()):
        assert metrics["a3po/alpha_mean"] == pytest.approx(alpha[mask].mean().item(), abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.one_of(st.floats(allow_nan=True), st.booleans(), st.text(max_size=3), st.integers(max_value=-1),
                 st.lists(st.integers(0, 3), min_size=2, max_size=3)))
def test_a_policy_version_that_is_not_a_nonnegative_integer_is_refused(bad):
    b = make_batch(B=2, T=3, seed=4, dtype=torch.float64)
    with pytest.raises(StableRLError, match="policy_version must be"):
        stablerl.compute_policy_loss("a3po", rollout_log_prob=b["old_log_prob"], versions=torch.zeros(2, 3, dtype=torch.long),
                                     policy_version=bad, **b)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.5, 2.25]))
def test_versions_that_are_not_whole_numbers_are_refused(bad):
    versions = torch.zeros(2, 3, dtype=torch.float64)
    versions[1, 1] = bad
    with pytest.raises(StableRLError, match=r"versions has (non-finite|fractional) values"):
        check_policy_versions(versions, 3)


def test_integer_forms_of_the_policy_version_are_accepted():
    assert as_policy_version(torch.tensor(4)) == 4 and as_policy_version(np.int64(2)) == 2 and as_policy_version(0) == 0
    with pytest.raises(StableRLError, match="policy_version must be an integer .* got a torch.float32 tensor"):
        as_policy_version(torch.tensor(1.0))
    with pytest.raises(StableRLError, match="versions must hold integer policy versions, got dtype torch.bool"):
        check_policy_versions(torch.ones(2, 2, dtype=torch.bool), 1)
    # padding may carry any version: only trained tokens are checked
    assert check_policy_versions(torch.tensor([[1, 9]]), 1, torch.tensor([[True, False]])) == 1


def test_a_batch_of_two_versions_gets_the_formula_per_token():
    """Rows generated 2 and 1 updates ago (policy_version 5: versions 3 and 4): alpha = 1/2 and 0 (AReaL's
    convention), lp_prox = lp_b + alpha (sg(lp) - lp_b), and decoupled PPO on it."""
    b = make_batch(B=4, T=5, seed=21, dtype=torch.float64)
    mask = b["response_mask"]
    versions = torch.tensor([3, 4, 3, 4]).unsqueeze(1).expand(4, 5).clone()
    versions[~mask] = -1
    roll = b["old_log_prob"] - 0.3 * torch.linspace(-1, 1, 20, dtype=torch.float64).reshape(4, 5)
    loss, metrics = stablerl.compute_policy_loss("a3po", rollout_log_prob=roll, versions=versions, policy_version=5, **b)
    lp = b["log_prob"].detach()
    alpha = torch.tensor([0.5, 0.0, 0.5, 0.0], dtype=torch.float64).unsqueeze(1) * mask
    prox = roll + alpha * (lp - roll)
    w = torch.exp(prox - roll)
    r = torch.exp(lp - prox)
    A = b["advantages"]
    per_token = torch.maximum(-A * r, -A * r.clamp(0.8, 1.2)) * w * (w <= 5.0)
    ref = (per_token * mask).sum() / mask.sum()
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-12, atol=1e-12)
    assert metrics["a3po/alpha_mean"] == pytest.approx(alpha[mask].mean().item(), abs=1e-6)  # metrics: float32
