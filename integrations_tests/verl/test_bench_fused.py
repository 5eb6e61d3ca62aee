"""``stablerl bench``'s verl-twin table reports the fused and the eager path of the ratio losses."""

import pytest

from stablerl.tools import bench


@pytest.mark.filterwarnings("ignore")
def test_twin_cases_report_the_fused_path_and_the_eager_path(monkeypatch):
    monkeypatch.delenv("STABLERL_FUSED", raising=False)
    result = bench.run(shapes=[("B4xT64", 4, 64)], dtypes=("fp32", "bf16"), repeats=3,
                       losses=["vanilla", "gmpo", "clip_cov"], use_trl=False, estimators=False)
    assert result["config"]["fused"] is True
    for name in ("vanilla", "gmpo"):
        for case, row in result["losses"][name]["cases"].items():
            assert "error" not in row, (name, case, row)
            assert row["path"] == "fused"
            assert row["eager"]["time_ratio"] > 0 and row["eager"]["mem_ratio"] > 0
            # the same computation as verl's in fp32 (gmpo: about 1e-7 relative, see docs/benchmarks.md)
            if case.endswith("fp32"):
                assert row["loss_abs_diff"] <= 1e-6 and row["grad_max_rel_diff"] <= 1e-5
            # fewer bytes kept for backward than the eager path
            assert row["mem_ratio"] < row["eager"]["mem_ratio"] or row["mem_ratio"] <= 0.5
    clip_cov = result["losses"]["clip_cov"]["cases"]["B4xT64/fp32"]
    assert clip_cov["path"] == "eager" and "eager" not in clip_cov  # no fused form
    table = bench.markdown(result)
    assert "| vanilla | verl:vanilla | B4xT64/bf16 |" in table and " fused | " in table


def test_fused_path_off_in_the_environment(monkeypatch):
    monkeypatch.setenv("STABLERL_FUSED", "0")
    result = bench.run(shapes=[("B4xT64", 4, 64)], dtypes=("fp32",), repeats=3, losses=["vanilla"],
                       use_trl=False, estimators=False)
    row = result["losses"]["vanilla"]["cases"]["B4xT64/fp32"]
    assert result["config"]["fused"] is False and row["path"] == "eager" and "eager" not in row


def test_relative_table_reports_both_paths_for_a_fused_loss_without_a_twin(monkeypatch):
    monkeypatch.delenv("STABLERL_FUSED", raising=False)
    result = bench.run(shapes=[("B4xT64", 4, 64)], dtypes=("fp32",), repeats=3, losses=["a3po", "gpg"],
                       use_trl=False, estimators=False)
    a3po = result["losses"]["a3po"]["cases"]["B4xT64/fp32"]
    assert result["losses"]["a3po"]["baseline"] == "stablerl:vanilla"
    assert a3po["path"] == "fused" and a3po["eager"]["time_ratio"] > 0
    assert result["losses"]["gpg"]["cases"]["B4xT64/fp32"]["path"] == "eager"
