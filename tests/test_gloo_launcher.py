"""stablerl.testing.launch_gloo: the one launcher of the multi-process tests (results, targets, failures)."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from stablerl.testing import GlooLaunchError, launch_gloo


def _sum_ranks(rank, world, scale):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)  # inside a gloo group set up by the launcher
    return {"rank": rank, "world": world, "sum": float(t) * scale, "env_rank": os.environ["RANK"]}


def _fails_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("rank one refuses")
    return rank


def _no_group(rank, world):
    return {"initialized": dist.is_initialized(), "master": os.environ["MASTER_ADDR"], "extra": os.environ["EXTRA"]}


def test_results_in_rank_order_through_one_gloo_group():
    out = launch_gloo(_sum_ranks, 3, args=(10.0,))
    assert [r["rank"] for r in out] == [0, 1, 2] and {r["world"] for r in out} == {3}
    assert [r["sum"] for r in out] == [60.0, 60.0, 60.0]  # (1 + 2 + 3) * 10 on every rank
    assert [r["env_rank"] for r in out] == ["0", "1", "2"]


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(GlooLaunchError, match=r"(?s)rank 1 exited 1.*ValueError: rank one refuses"):
        launch_gloo(_fails_on_rank_one, 2)


def test_file_target_without_a_group(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text("import os\nimport torch.distributed as dist\n\n" + _source(_no_group))
    out = launch_gloo(f"{worker}:_no_group", 2, init_process_group=False, env={"EXTRA": "x"})
    assert out == [{"initialized": False, "master": "127.0.0.1", "extra": "x"}] * 2


def _sleeps(rank, world, seconds):
    time.sleep(seconds)


def test_a_rank_that_hangs_is_killed_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(GlooLaunchError, match="did not finish within 5"):
        launch_gloo(_sleeps, 2, args=(120,), timeout=5)
    assert time.monotonic() - start < 60


def _source(fn):
    import inspect

    return inspect.getsource(fn)
