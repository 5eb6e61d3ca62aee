"""The parity session's comparison (torch only): it must catch what it exists to catch."""

import copy
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import parity_report as R  # noqa: E402


def _cell(status="identical", values=None, reason="", to_fix=False):
    values = values if values is not None else {"loss": 0.5, "grad": [[0.1, -0.2], [0.0, 0.3]]}
    return {"kind": "policy_loss", "name": "vanilla", "setting": "explicit", "status": status, "reason": reason,
            "to_fix": to_fix,
            "hyperparameters": {"clip_ratio_low": 0.2}, "values": values,
            "core": {"loss": 0.5, "grad": [[0.1, -0.2], [0.0, 0.3]]} if values else {}, "rel_diff": {}}


def _results(**cells):
    return {fw: {"format": 1, "framework": fw, "version": "1", "torch": "2", "rtol": 1e-6, "overrides": {},
                 "loss_agg_modes": ["token-mean"], "settings": ["explicit"],
                 "algorithms": {"explicit/policy_loss/vanilla": cells.get(fw, _cell())}}
            for fw in R.FRAMEWORKS}


def test_agreeing_results_pass_and_render():
    results = _results()
    assert R.compare(results) == []
    text = R.render(results)
    assert "| `vanilla` | identical | identical | identical | identical |" in text


def test_unlisted_difference_between_frameworks_fails():
    off = _cell(values={"loss": 0.5, "grad": [[0.1, -0.2], [0.0, 0.3001]]})
    problems = R.compare(_results(trl=off))
    assert len(problems) == len(R.FRAMEWORKS) - 1 and all("no reason is listed" in p and "grad" in p for p in problems)
    # within rel 1e-6 of the largest entry: the same
    close = _cell(values={"loss": 0.5, "grad": [[0.1, -0.2], [0.0, 0.3 + 1e-8]]})
    assert R.compare(_results(trl=close)) == []


def test_listed_difference_passes_and_is_shown_with_its_reason():
    listed = _cell("differs", {"loss": 0.7, "grad": [[0.1, -0.2], [0.0, 0.3]]}, "it clamps", to_fix=True)
    results = _results(openrlhf=listed)
    assert R.compare(results) == []
    assert "differs because it clamps **(to fix)**" in R.render(results)
    unlisted = _cell("differs", {"loss": 0.7, "grad": [[0.1, -0.2], [0.0, 0.3]]}, "UNLISTED: loss rel diff 0.4")
    assert any("without a listed reason" in p for p in R.compare(_results(openrlhf=unlisted)))


def test_missing_algorithm_and_missing_file_name_the_session(tmp_path, monkeypatch):
    results = _results()
    partial = copy.deepcopy(results)
    partial["verl"]["algorithms"] = {}
    assert any("rerun `nox -s verl`" in p for p in R.compare(partial))
    for fw in ("verl", "openrlhf"):
        (tmp_path / f"{fw}.json").write_text(json.dumps(results[fw]))
    monkeypatch.setenv("STABLERL_PARITY_DIR", str(tmp_path))
    with pytest.raises(R.ParityError, match=r"trl\.json \(run `nox -s trl` first\)"):
        R.load(R.results_dir())
    assert R.main(["--check"]) == 1
