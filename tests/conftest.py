"""Shared fixtures for the unit tests (torch only)."""

import os
import tempfile
import time

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


def _gloo_rank(rank, world, init_method, out_dir, fn):
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world), os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # no rank leaves while another is still in a collective
    finally:
        dist.destroy_process_group()


def run_gloo_ranks(fn, world: int = 2, timeout: float = 120.0) -> list:
    """``fn(rank, world)`` on ``world`` gloo ranks (CPU processes); returns each rank's result (anything
    ``torch.save`` takes). Forked where the platform allows (``fn`` may be any function), else spawned
    (``fn`` must then be importable from its module)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory(prefix="stablerl-gloo-") as tmp:
        procs = mp.start_processes(_gloo_rank, args=(world, f"file://{tmp}/init", tmp, fn), nprocs=world,
                                   join=False, start_method=method)
        deadline = time.monotonic() + timeout
        while not procs.join(timeout=1):
            if time.monotonic() > deadline:
                for proc in procs.processes:
                    proc.terminate()
                pytest.fail(f"the {world}-process gloo run did not finish within {timeout:.0f} s")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
