"""Two data-parallel CPU processes (gloo, launched by stablerl.testing.launch_gloo) through TRL: stablerl
advantages are computed on the rewards gathered over both processes and sliced per process exactly as
TRL slices its own, and a group-aware stablerl loss trains."""

from pathlib import Path

import trl_helpers as H  # noqa: F401,I001  (offline environment, skips without TRL)

import stablerl
from stablerl.testing import launch_gloo


def test_two_processes_advantages_sliced_like_trl(tmp_path):
    loss = "gvpo" if "gvpo" in stablerl.get_registry().names("policy_loss") else "vanilla"
    worker = f"{Path(__file__).parent / 'dist_worker.py'}:rank_main"
    results = launch_gloo(worker, 2, args=(str(tmp_path), loss), init_process_group=False, timeout=300,
                          env={"PYTHONWARNINGS": "ignore"})
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["world"] == 2
        assert r["compared"] >= 2, "stablerl grpo advantages were not compared with TRL's on every generation"
        assert r["finite"] and r["moved"]
    assert results[0]["losses"] == results[1]["losses"]  # logged losses are reduced over processes
