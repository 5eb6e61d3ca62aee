"""REBEL (arXiv 2404.16767) against the authors' pair loss, written out independently, and its invariances."""

import itertools

import pytest
import torch
from conftest import make_batch
from hypothesis import given, settings
from hypothesis import strategies as st

import stablerl
from stablerl import StableRLError


def _authors_pair_loss(lp, old, m, r, pairs, eta):
    """The authors' form: s = masked sum of lp - lp_old; mean over pairs of (s_a - s_b - eta (r_a - r_b))^2."""
    s = ((lp - old) * m).sum(-1)
    return torch.stack([(s[a] - s[b] - eta * (r[a] - r[b])) ** 2 for a, b in pairs]).mean()


@pytest.mark.parametrize("eta", [1.0, 0.3])
def test_pairs_equal_the_authors_loss_value_and_gradient(eta):
    b = make_batch(B=6, T=5, seed=31, dtype=torch.float64, spread=0.4)
    m = b["response_mask"].double()
    r = torch.tensor([1.0, 0.0, 0.2, 0.9, -1.0, 3.0], dtype=torch.float64)
    gid = torch.tensor([0, 1, 2, 0, 2, 1])  # groups of two, interleaved
    loss, metrics = stablerl.compute_policy_loss("rebel", scores=r, index=gid, eta=eta, **b)
    lp = b["log_prob"].detach().clone().requires_grad_(True)
    ref = _authors_pair_loss(lp, b["old_log_prob"], m, r, [(0, 3), (1, 5), (2, 4)], eta)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    (g,) = torch.autograd.grad(loss, b["log_prob"])
    (g_ref,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)
    assert ref > 0.1 and metrics["rebel/unpaired_fraction"] == 0


def test_larger_groups_average_all_pairs():
    """Groups of 3 and 3 (equal sizes): the mean over all 6 unordered pairs; sizes 4 and 2: each group's pair mean
    weighted by its size."""
    b = make_batch(B=6, T=4, seed=32, dtype=torch.float64, spread=0.4)
    m = b["response_mask"].double()
    r = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0], dtype=torch.float64)
    loss, _ = stablerl.compute_policy_loss("rebel", scores=r, index=[0, 0, 0, 1, 1, 1], **b)
    pairs = list(itertools.combinations([0, 1, 2], 2)) + list(itertools.combinations([3, 4, 5], 2))
    torch.testing.assert_close(loss, _authors_pair_loss(b["log_prob"], b["old_log_prob"], m, r, pairs, 1.0))
    loss, _ = stablerl.compute_policy_loss("rebel", scores=r, index=[0, 0, 0, 0, 1, 1], **b)
    g0 = _authors_pair_loss(b["log_prob"], b["old_log_prob"], m, r, list(itertools.combinations(range(4), 2)), 1.0)
    g1 = _authors_pair_loss(b["log_prob"], b["old_log_prob"], m, r, [(4, 5)], 1.0)
    torch.testing.assert_close(loss, (4 * g0 + 2 * g1) / 6)


def test_a_group_of_one_has_no_pair():
    b = make_batch(B=3, T=4, seed=33, dtype=torch.float64, spread=0.4)
    m = b["response_mask"].double()
    r = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    loss, metrics = stablerl.compute_policy_loss("rebel", scores=r, index=[0, 0, 1], **b)
    torch.testing.assert_close(loss, _authors_pair_loss(b["log_prob"], b["old_log_prob"], m, r, [(0, 1)], 1.0) * 2 / 3)
    assert metrics["rebel/unpaired_fraction"] == pytest.approx(1 / 3)


@settings(max_examples=30, deadline=None)
@given(shift=st.floats(-5, 5), seed=st.integers(0, 2**16))
def test_shifting_a_groups_rewards_or_log_ratios_changes_nothing(shift, seed):
    """Only differences within a group enter: a per-group constant on r (or on s) leaves the loss unchanged."""
    b = make_batch(B=4, T=4, seed=seed % 97, dtype=torch.float64, spread=0.4)
    r = torch.rand(4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    gid = torch.tensor([0, 0, 1, 1])
    base, _ = stablerl.compute_policy_loss("rebel", scores=r, index=gid, **b)
    moved, _ = stablerl.compute_policy_loss("rebel", scores=r + shift * (gid == 1), index=gid, **b)
    torch.testing.assert_close(moved, base, rtol=1e-9, atol=1e-9)


def test_errors():
    b = make_batch(B=2, T=3, seed=34, dtype=torch.float64)
    with pytest.raises(StableRLError, match="eta must be > 0"):
        stablerl.compute_policy_loss("rebel", scores=torch.zeros(2), index=[0, 0], eta=0.0, **b)
    with pytest.raises(stablerl.MissingInputError, match="scores"):
        stablerl.compute_policy_loss("rebel", index=[0, 0], **b)
    with pytest.raises(StableRLError, match="does not take token-level IS weights"):
        stablerl.compute_policy_loss("rebel", scores=torch.zeros(2), index=[0, 0],
                                     is_weights=torch.ones(2, 3, dtype=torch.float64), **b)
