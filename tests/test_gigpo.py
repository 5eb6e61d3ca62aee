"""GiGPO (arXiv 2505.10978) against a hand computation of the reference's three steps, and its errors."""

import numpy as np
import pytest
import torch

import stablerl
from stablerl import MissingInputError, StableRLError

F64 = torch.float64


def _steps():
    """Two episode groups. Group 0: trajectories A (3 steps) and B (2 steps), outcome 1 and 0; A's first step
    and B's first step see the same start state (anchor 0); A's second step and B's second step share state 5.
    Group 1: one trajectory C of 2 steps, outcome 0.5, its states distinct."""
    index = np.array([0, 0, 0, 0, 0, 1, 1])
    outcome = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.5, 0.5], dtype=F64)
    anchors = torch.tensor([0, 5, 7, 0, 5, 0, 3])
    step_returns = torch.tensor([0.9025, 0.95, 1.0, 0.0, 0.0, 0.475, 0.5], dtype=F64)
    mask = torch.ones(7, 3, dtype=F64)
    mask[3, 2] = 0
    rewards = torch.zeros(7, 3, dtype=F64)
    rewards[torch.arange(7), mask.sum(-1).long() - 1] = outcome
    return rewards, mask, index, anchors, step_returns, outcome


def _adv(**kw):
    rewards, mask, index, anchors, step_returns, _ = _steps()
    inputs = dict(anchor_ids=anchors, step_returns=step_returns)
    inputs.update(kw.pop("inputs", {}))
    return stablerl.compute_advantage("gigpo", token_level_rewards=rewards, response_mask=mask, index=index,
                                      extras=inputs, **kw)


def test_mean_norm_by_hand():
    adv, ret = _adv()
    assert torch.equal(adv, ret)
    # episode: group 0 mean over its 5 step rows = 3/5; group 1 (one trajectory, 2 rows) mean 0.5
    episode = torch.tensor([0.4, 0.4, 0.4, -0.6, -0.6, 0.0, 0.0], dtype=F64)
    # step: anchor 0 of group 0 {0.9025, 0.0} mean 0.45125; anchor 5 {0.95, 0.0} mean 0.475; the rest alone (0);
    # anchor 0 of group 1 is another group than anchor 0 of group 0
    step = torch.tensor([0.45125, 0.475, 0.0, -0.45125, -0.475, 0.0, 0.0], dtype=F64)
    torch.testing.assert_close(adv[:, 0], episode + step, rtol=0, atol=1e-15)
    torch.testing.assert_close(adv[3], (episode + step)[3] * torch.tensor([1.0, 1.0, 0.0], dtype=F64))
    half, _ = _adv(step_advantage_w=0.5)
    torch.testing.assert_close(half[:, 0], episode + 0.5 * step, rtol=0, atol=1e-15)


def test_mean_std_norm_by_hand():
    adv, _ = _adv(mode="mean_std_norm")
    _, _, _, _, G, S = _steps()
    s0 = S[:5]
    e0 = (s0 - s0.mean()) / (s0.std() + 1e-6)
    # group 1: two rows with equal outcome: std 0 -> 0 / (0 + eps) = 0
    episode = torch.cat([e0, torch.zeros(2, dtype=F64)])
    pair0 = torch.tensor([0.9025, 0.0], dtype=F64)
    pair5 = torch.tensor([0.95, 0.0], dtype=F64)
    z0 = (pair0 - pair0.mean()) / (pair0.std() + 1e-6)
    z5 = (pair5 - pair5.mean()) / (pair5.std() + 1e-6)
    step = torch.tensor([z0[0], z5[0], 0.0, z0[1], z5[1], 0.0, 0.0], dtype=F64)
    torch.testing.assert_close(adv[:, 0], episode + step, rtol=1e-12, atol=1e-12)


def test_single_row_episode_group_keeps_its_score():
    """The reference's episode convention: a group of one row has mean 0 and std 1."""
    rewards = torch.tensor([[0.0, 2.0]], dtype=F64)
    adv, _ = stablerl.compute_advantage("gigpo", token_level_rewards=rewards, response_mask=torch.ones(1, 2),
                                        index=[0], extras=dict(anchor_ids=[4], step_returns=[2.0]))
    torch.testing.assert_close(adv, torch.full((1, 2), 2.0, dtype=F64))


def test_inputs_are_required_and_checked():
    rewards, mask, index, anchors, step_returns, _ = _steps()
    with pytest.raises(MissingInputError, match="anchor_ids"):
        stablerl.compute_advantage("gigpo", token_level_rewards=rewards, response_mask=mask, index=index,
                                   extras=dict(step_returns=step_returns))
    with pytest.raises(StableRLError, match=r"step_returns has shape \(6,\), expected \[7\]"):
        _adv(inputs=dict(step_returns=step_returns[:6]))
    with pytest.raises(StableRLError, match="anchor_ids must be integers"):
        _adv(inputs=dict(anchor_ids=anchors.double() + 0.5))
    with pytest.raises(StableRLError, match="mode must be one of mean_norm, mean_std_norm"):
        _adv(mode="std")
