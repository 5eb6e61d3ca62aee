"""Shared fixtures for the unit tests (torch only)."""

import pytest
import torch

import stablerl


def make_batch(B=4, T=6, seed=0, dtype=torch.float32, spread=0.3, padded=True):
    """A random padded policy-loss batch: right padding, one row with a single valid token."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 0.05
    log_prob = (old + spread * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    advantages = torch.randn(B, generator=g, dtype=torch.float64).unsqueeze(-1).expand(B, T).clone()
    mask = torch.ones(B, T, dtype=torch.float64)
    if padded:
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        lengths[0] = T
        lengths[-1] = 1
        mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.float64)
    return {
        "log_prob": log_prob.to(dtype).requires_grad_(True),
        "old_log_prob": old.to(dtype),
        "advantages": advantages.to(dtype),
        "response_mask": mask.bool(),
    }


@pytest.fixture
def batch():
    return make_batch()


def adv(name, r, mask, index, **kw):
    """``stablerl.compute_advantage`` for an outcome estimator, checking returns == advantages."""
    a, ret = stablerl.compute_advantage(name, token_level_rewards=r, response_mask=mask, index=index, **kw)
    assert torch.equal(a, ret), "returns == advantages for outcome estimators"
    return a


def per_seq(a, mask):
    """The scalar advantage of each response (outcome estimators broadcast one value per response)."""
    lengths = mask.sum(-1).long()
    out = a[torch.arange(a.shape[0]), (lengths - 1).clamp(min=0)]
    assert torch.equal(a, out[:, None] * mask)
    return out
