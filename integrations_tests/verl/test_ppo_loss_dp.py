"""Batch statistics inside a stablerl loss are global over verl's data-parallel ranks: verl hands its
``ppo_loss`` the DP group and the adapter reduces the loss's statistics over it, so 2 ranks with half the
rows each equal 1 rank with all rows (verl runs the same number of micro-batches on every DP rank)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from stablerl.testing import launch_gloo

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _two_rank_ppo_loss as W  # noqa: E402


def _two_ranks(loss_mode, use_group):
    return launch_gloo(W.rank_main, 2, args=(loss_mode, use_group), timeout=300)


@pytest.mark.parametrize("loss_mode", ["m2po", "stablerl_vanilla"])
def test_two_ranks_equal_one_rank(adapter, loss_mode):
    loss1, grads1 = W.run(list(range(6)), 1, None, loss_mode)
    ranks = _two_ranks(loss_mode, use_group=True)
    # DDP averages the ranks' gradients; verl's token-mean multiplies each rank's loss by dp_size
    torch.testing.assert_close((ranks[0]["loss"] + ranks[1]["loss"]) / 2, loss1, rtol=1e-6, atol=1e-7)
    grads2 = [g / 2 for r in ranks for g in r["grads"]]
    torch.testing.assert_close(torch.cat(grads2), torch.cat(grads1), rtol=1e-6, atol=1e-7)


def test_without_the_group_m2po_masks_per_rank(adapter):
    """The check above can fail: per-rank statistics (no group) give another M2PO mask and loss."""
    loss1, _ = W.run(list(range(6)), 1, None, "m2po")
    ranks = _two_ranks("m2po", use_group=False)
    assert abs(float((ranks[0]["loss"] + ranks[1]["loss"]) / 2 - loss1)) > 1e-4
