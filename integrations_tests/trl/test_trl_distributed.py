"""Two data-parallel CPU processes (torchrun, gloo) through TRL: stablerl advantages are computed on
the rewards gathered over both processes and sliced per process exactly as TRL slices its own, and
a group-aware stablerl loss trains."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import trl_helpers as H  # noqa: F401,I001  (offline environment, skips without TRL)

import stablerl


def test_two_processes_advantages_sliced_like_trl(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found")
    loss = "gvpo" if "gvpo" in stablerl.get_registry().names("policy_loss") else "vanilla"
    out = tmp_path / "result"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [torchrun, "--nproc_per_node", "2", "--master_port", "29533", str(Path(__file__).parent / "dist_worker.py"),
         str(out), loss],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    for r in results:
        assert r["world"] == 2
        assert r["compared"] >= 2, "stablerl grpo advantages were not compared with TRL's on every generation"
        assert r["finite"] and r["moved"]
    assert results[0]["losses"] == results[1]["losses"]  # logged losses are reduced over processes
