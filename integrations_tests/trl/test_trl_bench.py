"""``stablerl bench``'s TRL section: TRL's real ``GRPOTrainer._compute_loss`` against ours."""

import json
import math

import pytest
import torch

import trl
from stablerl import cli
from stablerl.tools import bench
from stablerl.tools.bench import trl as bench_trl

TINY = [("B4xT32", 4, 32)]


def test_every_trl_pair_runs_agrees_and_has_the_json_keys():
    result = bench.run(shapes=TINY, repeats=2, dtypes=("fp32", "bf16"), use_verl=False, losses=list(bench_trl.TRL_TWINS))
    assert result["machine"]["trl"] == trl.__version__ == result["trl"]["version"]
    entries = result["trl"]["losses"]
    assert set(entries) == set(bench_trl.TRL_TWINS)
    for label, entry in entries.items():
        loss_type, _, name, params, agg = bench_trl.TRL_TWINS[label]
        assert entry["baseline"] == f"trl:{loss_type}" and entry["ours"] == f"stablerl:{name}"
        assert entry["ours_params"] == params and entry["loss_agg_mode"] == agg
        assert set(entry["cases"]) == {"B4xT32/fp32", "B4xT32/bf16"}
        for case in entry["cases"].values():
            assert "error" not in case, (label, case)
            for key in ("time_ratio", "time_ratio_min", "mem_ratio", "ours_ms_min", "base_ms_min", "base_mem_mb"):
                assert math.isfinite(case[key]) and case[key] > 0, (label, key)
            assert case["fp32_loss_abs_diff"] <= 1e-6 and case["fp32_grad_max_rel_diff"] <= bench_trl.GRAD_RTOL
        assert entry["time_ratio"] == max(c["time_ratio"] for c in entry["cases"].values())
    # vanilla vs dapo is the same arithmetic in fp32: no difference at all
    assert entries["dapo"]["cases"]["B4xT32/fp32"]["loss_abs_diff"] == 0.0
    assert "| trl:grpo (grpo_sequence) | stablerl:gspo seq-mean-token-mean | B4xT32/fp32 |" in bench.markdown(result)


def test_trl_side_is_trls_own_compute_loss():
    # the stand-in forward hands TRL the prepared log-probs; TRL's method computes the loss and logs its metrics
    inputs = bench.make_inputs(4, 32, torch.float32)
    batch = bench_trl.trl_inputs(inputs)
    lp = inputs["log_prob"].clone().requires_grad_(True)
    loss, metrics = bench_trl.trl_fn("dapo", inputs, batch)(lp)
    m = inputs["response_mask"].double()
    ratio = torch.exp(inputs["log_prob"].double() - inputs["old_log_prob"].double())
    adv = inputs["advantages"][:, :1].double()
    want = -torch.min(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
    assert float(loss.detach()) == pytest.approx(float((want * m).sum() / m.sum()), rel=1e-6)
    clipped = ((ratio < 0.8) & (adv < 0)) | ((ratio > 1.28) & (adv > 0))
    assert metrics["train"]["clip_ratio/region_mean"] == [pytest.approx(float((clipped * m).sum() / m.sum()), abs=1e-6)]
    loss.backward()
    assert lp.grad is not None and bool(lp.grad[~inputs["response_mask"]].eq(0).all())


def test_a_pair_that_disagrees_fails_loudly(monkeypatch, tmp_path, capsys):
    wrong = dict(bench_trl.TRL_TWINS)
    loss_type, settings, name, params, agg = wrong["dapo"]
    wrong["dapo"] = (loss_type, settings, name, {**params, "clip_ratio_high": 0.5}, agg)  # TRL clips at 1.28
    monkeypatch.setattr(bench_trl, "TRL_TWINS", wrong)
    with pytest.raises(AssertionError, match="TRL loss_type='dapo' .* and stablerl 'vanilla' disagree"):
        bench_trl.check_same_loss("dapo", bench.make_inputs(8, 64, torch.float32))
    rc = cli.main(["bench", "--no-verl", "--no-routing", "--json", "--out", str(tmp_path / "b.md"), "--losses", "dapo",
                   "--shape", "8x64", "--repeats", "1", "--dtypes", "fp32"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "TRL comparison failed for dapo B8xT64/fp32" in captured.err
    assert json.loads(captured.out)["trl"]["losses"]["dapo"]["cases"]["B8xT64/fp32"]["error"].startswith("AssertionError")


def test_cli_json_has_the_trl_section(tmp_path, capsys):
    out = tmp_path / "bench.md"
    rc = cli.main(["bench", "--no-verl", "--no-routing", "--json", "--out", str(out), "--losses", "dapo,sapo",
                   "--shape", "4x16", "--repeats", "1", "--dtypes", "fp32"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["trl"]["losses"]) == {"dapo", "sapo"}
    assert data["trl"]["losses"]["sapo"]["baseline"] == "trl:sapo"
    assert data["trl"]["losses"]["sapo"]["ours"] == "stablerl:sapo"
    assert data["losses"]["sapo"]["baseline"] == "stablerl:vanilla"  # the verl/relative tables are unchanged
    assert "| trl:dapo (dapo) | stablerl:vanilla token-mean | B4xT16/fp32 |" in out.read_text()
    rc = cli.main(["bench", "--no-verl", "--no-trl", "--no-routing", "--json", "--out", "-", "--losses", "sapo",
                   "--shape", "4x16", "--repeats", "1", "--dtypes", "fp32"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["trl"] == {"skipped": "--no-trl"}
