"""`stablerl demo` end to end with a few steps: table, results.json, curves.png."""

import json

import trl_helpers as H  # noqa: F401,I001  (offline environment, skips without TRL)

from stablerl.tools import demo


def test_demo_smoke(tmp_path, capsys):
    rc = demo.main(["--scenario", "basic", "--steps", "4", "--losses", "dapo,vanilla", "--out", str(tmp_path), "--seed", "1", "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "final reward" in out and "dapo" in out and "vanilla" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["losses"]) == ["dapo", "vanilla"]
    for name, r in results["losses"].items():
        assert len(r["steps"]) == 4 and len(r["entropy"]) == len(r["reward"]) == 4
        rewards = [v for v in r["reward"] if v is not None]  # logged once per generated batch
        assert len(rewards) == 2 and all(0.0 <= v <= 1.0 for v in rewards)
        assert r["time_s"] > 0
    assert "stablerl/pg_clipfrac" in results["losses"]["vanilla"]["metrics"]
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_demo_rejects_unknown_loss(tmp_path, capsys):
    assert demo.main(["--scenario", "basic", "--steps", "2", "--losses", "dapo,m2p0", "--out", str(tmp_path)]) == 2
    assert "did you mean 'm2po'" in capsys.readouterr().err
