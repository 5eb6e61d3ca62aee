"""Two data-parallel ranks (gloo, CPU) give the advantages one rank computes on the whole batch.

BNPO fits its Beta over the per-prompt success rates of the whole batch, so with prompts split
over ranks the moments must be summed with ``ctx.all_reduce``. The group-baseline estimators
only use their own group, so they are split-invariant by construction; checked too.
"""


import numpy as np
import pytest
import torch
import torch.distributed as dist
from stablerl.testing import launch_gloo

WORLD = 2
NAMES = ("grpo", "dr_grpo", "rloo", "opo", "qae", "bnpo")


def whole_batch(seed=0, n_prompts=9, T=6):
    """Binary-reward batch with mixed group sizes (one of size 1), interleaved uids, padding."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 7, (n_prompts,), generator=g).tolist()
    sizes[3] = 1
    uids = np.array([f"prompt-{k}" for k, n in enumerate(sizes) for _ in range(n)], dtype=object)
    order = torch.randperm(len(uids), generator=g).numpy()
    uids = uids[order]
    B = len(uids)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    acc = torch.randint(0, 2, (B,), generator=g).double()
    fmt = torch.randint(0, 2, (B,), generator=g).double()
    rewards = torch.zeros(B, T, dtype=torch.float64)
    rewards[torch.arange(B), lengths - 1] = acc
    return rewards, mask, uids, torch.stack([acc, fmt], -1)


def rank_rows(uids, rank):
    """Whole prompts per rank: prompt k goes to rank k % WORLD (rows stay interleaved)."""
    prompt = np.array([int(u.split("-")[1]) for u in uids])
    return torch.from_numpy(np.nonzero(prompt % WORLD == rank)[0])


def _run(name, rewards, mask, uids, ctx=None, **kw):
    import stablerl

    adv, _ = stablerl.compute_advantage(name, token_level_rewards=rewards, response_mask=mask, index=uids, ctx=ctx, **kw)
    return adv


def _rank(rank, world):
    from stablerl import StableRLError, torch_distributed_context

    ctx = torch_distributed_context()
    rewards, mask, uids, comps = whole_batch()
    rows = rank_rows(uids, rank)
    sub = (rewards[rows], mask[rows], uids[rows.numpy()])
    results = {}
    for name in NAMES:
        results[name] = _run(name, *sub, ctx=ctx)
    results["bnpo_decomposition"] = _run(
        "bnpo", *sub, ctx=ctx, decomposition=True, extras={"reward_components": comps[rows]}
    )
    # an input error on one rank raises on every rank (no rank is left waiting in a collective)
    bad = sub[0].clone()
    if rank == 1:
        bad = bad * 3.0  # p > 1 on rank 1 only
    try:
        _run("bnpo", bad, sub[1], sub[2], ctx=ctx)
        results["raised"] = torch.tensor(0)
    except StableRLError as e:
        results["raised"] = torch.tensor(1 if ("another rank" in str(e)) == (rank == 0) else 2)
    results["rows"] = rows
    return results


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_gloo_ranks_equal_one_rank_whole_batch():
    rewards, mask, uids, comps = whole_batch()
    expected = {name: _run(name, rewards, mask, uids) for name in NAMES}
    expected["bnpo_decomposition"] = _run(
        "bnpo", rewards, mask, uids, decomposition=True, extras={"reward_components": comps}
    )
    # the split matters for BNPO: a rank alone fits a different Beta
    rows0 = rank_rows(uids, 0)
    alone = _run("bnpo", rewards[rows0], mask[rows0], uids[rows0.numpy()])
    assert not torch.allclose(alone, expected["bnpo"][rows0])

    parts = launch_gloo(_rank, WORLD)

    covered = torch.cat([p["rows"] for p in parts]).sort().values
    assert torch.equal(covered, torch.arange(len(uids)))
    for key, want in expected.items():
        got = torch.zeros_like(want)
        for p in parts:
            got[p["rows"]] = p[key]
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-9, msg=lambda m: f"{key}: {m}")
    assert [int(p["raised"]) for p in parts] == [1] * WORLD
