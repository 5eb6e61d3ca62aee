"""``stablerl bench``: the relative-to-vanilla path (torch only), its JSON schema and the memory counter."""

from __future__ import annotations

import argparse
import json
import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stablerl import cli
from stablerl.tools import bench

TINY = [("B4xT32", 4, 32)]


def test_relative_to_vanilla_schema():
    result = bench.run(shapes=TINY, repeats=2, dtypes=("fp32", "bf16"), use_verl=False, losses=["vanilla", "gspo", "m2po"])
    assert set(result) >= {"machine", "config", "losses"}
    assert result["config"]["native"] is None
    assert set(result["losses"]) == {"vanilla", "gspo", "m2po"}
    for name, entry in result["losses"].items():
        assert entry["baseline"] == "stablerl:vanilla"
        assert set(entry["cases"]) == {"B4xT32/fp32", "B4xT32/bf16"}
        for case in entry["cases"].values():
            assert "error" not in case, (name, case)
            for key in ("time_ratio", "time_ratio_min", "time_ratio_best", "mem_ratio", "ours_ms_min", "base_mem_mb"):
                assert math.isfinite(case[key]) and case[key] > 0, (name, key)
        # the headline is the worst case over shapes and dtypes
        assert entry["time_ratio"] == max(c["time_ratio"] for c in entry["cases"].values())
        assert entry["mem_ratio"] == max(c["mem_ratio"] for c in entry["cases"].values())
    # vanilla against itself keeps exactly the same tensors for backward
    assert result["losses"]["vanilla"]["mem_ratio"] == 1.0
    md = bench.markdown(result)
    assert "| m2po | stablerl:vanilla | B4xT32/fp32 |" in md


def test_every_loss_runs_with_the_bench_inputs():
    # every registered (available) loss finds its declared extra inputs in make_inputs
    result = bench.run(shapes=[("B8xT16", 8, 16)], repeats=1, dtypes=("fp32",), use_verl=False)
    errors = {n: c["error"] for n, e in result["losses"].items() for c in e["cases"].values() if "error" in c}
    assert not errors
    assert len(result["losses"]) >= 20


def test_saved_bytes_counts_graph_tensors_not_inputs():
    inputs = bench.make_inputs(4, 32, torch.float32)

    def exp_loss(lp):  # exp saves its output (4*32 floats); the sum saves nothing
        return torch.exp(lp).sum(), {}

    def mul_input(lp):  # lp * old saves both operands, which are inputs: nothing new
        return (lp * inputs["old_log_prob"]).sum(), {}

    assert bench.saved_bytes(exp_loss, inputs) == 4 * 32 * 4 + 4
    assert bench.saved_bytes(mul_input, inputs) == 4


def test_cli_bench_without_verl(tmp_path, capsys):
    out = tmp_path / "bench.md"
    rc = cli.main(["bench", "--no-verl", "--no-routing", "--json", "--out", str(out), "--losses", "vanilla,cispo",
                   "--shape", "4x16", "--repeats", "1", "--dtypes", "fp32"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["losses"]) == {"vanilla", "cispo"}
    assert data["losses"]["cispo"]["baseline"] == "stablerl:vanilla"
    assert "| cispo |" in out.read_text()


def test_trl_section_says_why_it_is_skipped():
    result = bench.run(shapes=[("B4xT16", 4, 16)], repeats=1, dtypes=("fp32",), use_verl=False, use_trl=False,
                       losses=["vanilla"])
    assert result["trl"] == {"skipped": "--no-trl"}
    assert "TRL comparison not run: --no-trl." in bench.markdown(result)
    if bench.bench_trl.trl_version() is None:  # the unit environment has no TRL
        result = bench.run(shapes=[("B4xT16", 4, 16)], repeats=1, dtypes=("fp32",), use_verl=False, losses=["vanilla"])
        assert result["trl"]["skipped"].startswith("TRL is not installed")


def test_cli_bench_writes_no_file_without_out_and_no_paths(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["bench", "--no-verl", "--no-routing", "--no-trl", "--json", "--losses", "vanilla",
                   "--shape", "4x16", "--repeats", "1", "--dtypes", "fp32"])
    assert rc == 0
    assert list(tmp_path.iterdir()) == []  # stablerl-bench.md is no longer written by default
    out = capsys.readouterr().out
    data = json.loads(out)
    assert "markdown" not in data and str(tmp_path) not in out
    assert data["config"]["clock"] == "thread"  # CPU, one torch thread (the bench default)
    if bench._verl_core_algos() is None:
        assert data["estimators"]["skipped"].startswith("verl is not installed")


def test_pick_clock():
    assert bench.pick_clock("wall", "cpu")[0] == "wall"
    assert bench.pick_clock("auto", "cuda")[0] == "wall"
    name, clock = bench.pick_clock("thread", "cpu")
    assert name == "thread" and clock is time.thread_time


@pytest.mark.parametrize("argv, names", [
    (["--shape", "abc"], "--shape"), (["--shape", "0x4"], "--shape"), (["--shape", "4x"], "--shape"),
    (["--dtypes", "fp8"], "--dtypes"), (["--dtypes", ""], "--dtypes"), (["--device", "bogus"], "--device"),
    (["--repeats", "-1"], "--repeats"), (["--repeats", "0"], "--repeats"), (["--threads", "-2"], "--threads"),
])
def test_bench_refuses_bad_arguments_before_running(argv, names, capsys):
    from stablerl.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert e.value.code == 2
    assert names in capsys.readouterr().err


@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet="0123456789xX -.ab", max_size=8))
def test_bench_shape_argument_accepts_only_positive_bxt(text):
    from stablerl.tools.bench import _shape_arg

    parts = text.lower().split("x")
    ok = len(parts) == 2 and all(p.strip().isdigit() and int(p) > 0 for p in parts)  # spaces around a number are fine
    if ok:
        assert _shape_arg(text)[1:] == (int(parts[0]), int(parts[1]))
    else:
        with pytest.raises(argparse.ArgumentTypeError, match="BxT"):
            _shape_arg(text)


def test_bench_unknown_loss_and_unwritable_out_fail_before_measuring(tmp_path, capsys):
    from stablerl.tools import bench

    assert bench.main(["--losses", "bogus_loss", "--no-verl", "--no-trl", "--no-routing", "--no-estimators"]) == 2
    assert "bogus_loss" in capsys.readouterr().err
    assert bench.main(["--losses", "vanilla", "--out", str(tmp_path / "missing" / "x.md"), "--no-verl"]) == 2
    assert "does not exist" in capsys.readouterr().err
