"""Two data-parallel ranks (gloo, CPU) equal one rank with the whole batch: EMPG and ΔL.

EMPG takes min/max of the step entropies, the mean of exp(-k H^) and the mean of the modulated
advantages over every step of the batch; ΔL normalises its length weights over every sequence.
Both reduce through ``ctx.all_reduce``, so prompts split over ranks must give the same numbers.
"""


import numpy as np
import pytest
import torch
import torch.distributed as dist
from stablerl.testing import launch_gloo

WORLD = 2


def whole_batch(seed=0, n_prompts=7, T=9):
    """Multi-turn batch: mixed group sizes (one of size 1), interleaved uids, padding, 1-3 steps per response."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 6, (n_prompts,), generator=g).tolist()
    sizes[2] = 1
    uids = np.array([f"prompt-{k}" for k, n in enumerate(sizes) for _ in range(n)], dtype=object)
    uids = uids[torch.randperm(len(uids), generator=g).numpy()]
    B = len(uids)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    rewards = torch.zeros(B, T, dtype=torch.float64)
    rewards[torch.arange(B), lengths - 1] = torch.randint(0, 2, (B,), generator=g).double()
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    turn = torch.randint(0, 3, (B, T), generator=g).sort(-1).values
    turn[~mask.bool()] = -1
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) - 0.1
    log_prob = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    return dict(rewards=rewards, mask=mask, uids=uids, entropy=entropy, turn=turn, old=old, log_prob=log_prob,
                advantages=advantages)


def rank_rows(uids, rank):
    """Whole prompts per rank: prompt k goes to rank k % WORLD (rows stay interleaved)."""
    prompt = np.array([int(u.split("-")[1]) for u in uids])
    return torch.from_numpy(np.nonzero(prompt % WORLD == rank)[0])


def _empg(d, rows=None, ctx=None, entropy=None):
    import stablerl

    rows = torch.arange(len(d["uids"])) if rows is None else rows
    adv, _ = stablerl.compute_advantage(
        "empg", token_level_rewards=d["rewards"][rows], response_mask=d["mask"][rows], index=d["uids"][rows.numpy()],
        entropy=(d["entropy"] if entropy is None else entropy)[rows], turn_ids=d["turn"][rows], ctx=ctx)
    return adv


def _delta_l(d, rows=None, ctx=None, alpha=1.0):
    import stablerl

    rows = torch.arange(len(d["uids"])) if rows is None else rows
    lp = d["log_prob"][rows].clone().requires_grad_(True)
    loss, _ = stablerl.compute_policy_loss(
        "vanilla", log_prob=lp, old_log_prob=d["old"][rows], advantages=d["advantages"][rows],
        response_mask=d["mask"][rows], loss_agg_mode="delta_l", loss_agg_params={"alpha": alpha}, ctx=ctx)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad


def _rank(rank, world):
    from stablerl import StableRLError, torch_distributed_context

    d = whole_batch()
    rows = rank_rows(d["uids"], rank)
    results = {"rows": rows, "empg": _empg(d, rows, ctx=torch_distributed_context())}
    ctx = torch_distributed_context(token_count=float(d["mask"].sum()))
    for alpha in (1.0, 0.75):
        results[f"delta_l_loss_{alpha}"], results[f"delta_l_grad_{alpha}"] = _delta_l(d, rows, ctx, alpha)
    # a non-finite entropy on rank 1 only raises on both ranks (no rank is left waiting)
    bad = d["entropy"].clone()
    if rank == 1:
        bad[rows[0], 0] = float("nan")
    try:
        _empg(d, rows, ctx=torch_distributed_context(), entropy=bad)
        results["raised"] = torch.tensor(0)
    except StableRLError as e:
        results["raised"] = torch.tensor(1 if ("another rank" in str(e)) == (rank == 0) else 2)
    return results


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_gloo_ranks_equal_one_rank_whole_batch():
    d = whole_batch()
    expected_empg = _empg(d)
    expected_dl = {alpha: _delta_l(d, alpha=alpha) for alpha in (1.0, 0.75)}
    # the split matters: a rank alone normalises differently
    rows0 = rank_rows(d["uids"], 0)
    assert not torch.allclose(_empg(d, rows0), expected_empg[rows0])
    alone_loss, alone_grad = _delta_l(d, rows0)
    assert not torch.allclose(alone_grad, expected_dl[1.0][1][rows0])

    parts = launch_gloo(_rank, WORLD)

    covered = torch.cat([p["rows"] for p in parts]).sort().values
    assert torch.equal(covered, torch.arange(len(d["uids"])))
    got = torch.zeros_like(expected_empg)
    for p in parts:
        got[p["rows"]] = p["empg"]
    torch.testing.assert_close(got, expected_empg, rtol=1e-12, atol=1e-12)
    for alpha, (loss, grad) in expected_dl.items():
        # DP averages the ranks' losses and gradients (each rank's loss carries the dp_size factor)
        mean_loss = sum(p[f"delta_l_loss_{alpha}"] for p in parts) / WORLD
        torch.testing.assert_close(mean_loss, loss, rtol=1e-12, atol=1e-14)
        g = torch.zeros_like(grad)
        for p in parts:
            g[p["rows"]] = p[f"delta_l_grad_{alpha}"] / WORLD
        torch.testing.assert_close(g, grad, rtol=1e-12, atol=1e-14)
    assert [int(p["raised"]) for p in parts] == [1] * WORLD
