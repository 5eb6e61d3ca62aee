"""The training-inference mismatch scenario: the low-precision rollout engine on TRL's vLLM path,
``stablerl_rollout_correction`` through the TRL adapter, and ``stablerl demo`` (scenario mismatch) in a few steps."""

import json

import pytest
import torch

import trl_helpers as H  # noqa: F401,I001  (offline environment, skips without TRL)

import stablerl
from stablerl.tools import demo
from stablerl.adapters.trl import GRPOConfig
from stablerl.tools.demo import mismatch

CPU = dict(output_dir="/tmp/stablerl-trl-mismatch-test", use_cpu=True, bf16=False, report_to="none")


def test_rollout_correction_config_errors():
    with pytest.raises(stablerl.UnknownNameError, match="did you mean 'tis'"):
        GRPOConfig(loss_type="vanilla", stablerl_rollout_correction="tiss", **CPU)
    with pytest.raises(stablerl.StableRLError, match="corrects a stablerl loss.*stablerl_grpo"):
        GRPOConfig(loss_type="grpo", stablerl_rollout_correction="tis", **CPU)
    with pytest.raises(stablerl.StableRLError, match="twice"):
        GRPOConfig(loss_type="vanilla", stablerl_rollout_correction="tis", use_vllm=True,
                   vllm_importance_sampling_correction=True, **CPU)
    with pytest.raises(stablerl.StableRLError, match="threshold"):
        GRPOConfig(loss_type="vanilla", stablerl_rollout_correction="tis", stablerl_rollout_correction_params={
            "threshold": -1.0}, **CPU)
    with pytest.raises(stablerl.StableRLError, match="stablerl_rollout_correction is not"):
        GRPOConfig(loss_type="vanilla", stablerl_rollout_correction_params={"threshold": 2.0}, **CPU)


def test_rollout_correction_needs_the_engines_logprobs():
    args = demo.make_config("/tmp/stablerl-trl-mismatch-test", "vanilla", steps=1, seed=0,
                            stablerl_rollout_correction="tis")
    with pytest.raises(stablerl.StableRLError, match="use_vllm=True or a rollout_func"):
        demo.make_trainer(args)


def test_round_weight_grids():
    w = torch.randn(6, 40)
    q = mismatch.round_weight(w, "int4")
    assert max(len(row.unique()) for row in q) <= 15  # symmetric 4-bit: -7..7 levels of the row's scale
    assert torch.allclose(q.abs().amax(dim=1), w.abs().amax(dim=1))  # the row's absmax is on the grid
    assert len(mismatch.round_weight(w, "int2-tensor").unique()) <= 3
    assert torch.equal(mismatch.round_weight(w, "fp8"), w.to(torch.float8_e4m3fn).float())
    # one scale per block of K rows: K = 1 is per row, K >= the rows is per tensor, in between a block's absmax
    assert torch.equal(mismatch.round_weight(w, "int2-rows1"), mismatch.round_weight(w, "int2"))
    assert torch.equal(mismatch.round_weight(w, "int2-rows8"), mismatch.round_weight(w, "int2-tensor"))
    q = mismatch.round_weight(w, "int3-rows4")
    assert torch.allclose(q[:4].abs().amax(), w[:4].abs().amax()) and torch.allclose(q[4:].abs().amax(), w[4:].abs().amax())
    for bad in ("int9", "int2-rows0", "int2-row4"):
        with pytest.raises(stablerl.StableRLError, match=bad):
            mismatch.check_precision(bad)


@pytest.mark.parametrize("precision,low,high", [("fp32", 0.0, 1e-5), ("int2", 1e-2, 10.0)])
def test_engine_logprobs_are_the_samplers(precision, low, high):
    """fp32: the engine's log-probs are the trainer's (no mismatch); int2: they differ, and the engine's own
    measure (rollout minus train log-prob of the sampled tokens) is what a direct recompute gives."""
    model = H.tiny_model(seed=0)
    engine = mismatch.LowPrecisionRollout(model, H.TOKENIZER, precision=precision, max_completion_length=4)
    torch.manual_seed(0)
    prompts = [H.TOKENIZER("copy 3 :")["input_ids"]] * 8
    prompt_ids, completions, logprobs, _ = engine.generate(prompts, None, 8)
    assert prompt_ids == prompts and all(1 <= len(c) <= 4 for c in completions)
    stats = engine.history[-1]
    assert low <= stats["abs"] <= high
    # recompute row 0 with the sampler (its log-probs) and the trainer (the measure)
    ids = torch.tensor([prompts[0] + completions[0]])
    with torch.no_grad():
        roll = torch.log_softmax(engine.sampler(input_ids=ids).logits[0, len(prompts[0]) - 1:-1], -1)
    expected = roll.gather(1, torch.tensor(completions[0]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor([lp[0] for lp in logprobs[0]]), expected, atol=1e-5)


@pytest.mark.parametrize("spelling", ["key", "alias"])
def test_stablerl_correction_gets_the_engines_logprobs_in_trl(spelling):
    """Through the real TRL trainer (use_vllm=True, engine replaced): the correction's logged k1 KL equals the
    engine's own measure of the same generation (one micro-batch = the whole generation), whether it is set by
    stablerl_rollout_correction or by its alias in stablerl_loss_params."""
    record = {"step": [], "metrics": {}}
    overrides = {} if spelling == "key" else {"stablerl_rollout_correction": None,
                                               "stablerl_loss_params": {"rollout_correction": "tis"}}
    args = mismatch.make_config("/tmp/stablerl-trl-mismatch-test", "tis", steps=2, seed=0, lr=1e-3, **overrides)
    trainer = mismatch.make_trainer(args, "int2", callbacks=[demo._recorder_callback(record, None)])
    trainer.train()
    engine = mismatch.rollout_of(trainer)
    assert engine is not None and engine.syncs == 2 and len(engine.history) == 2
    logged = record["metrics"]["stablerl/rollout_corr/kl"]
    assert [round(v, 4) for v in logged] == [round(h["kl"], 4) for h in engine.history]
    assert all(abs(v) > 1e-3 for v in logged)


def test_demo_mismatch_smoke(tmp_path, capsys):
    rc = demo.main(["--scenario", "mismatch", "--steps", "2", "--arms", "none,tis,trl_is", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "scenario mismatch" in out and "on seed 0" in out and "other seeds" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["scenario"] == "mismatch" and list(results["arms"]) == ["none", "tis", "trl_is"]
    assert results["config"]["max_completion_length"] == mismatch.DEMO["completion_length"]
    # the versions this run used, and the recorded runs', in the record and on the console (issue 30)
    import torch

    env = results["config"]["environment"]
    assert env["torch"] == torch.__version__ and env["trl"] == "1.16.0" and env["cpu_kernels"]
    assert results["config"]["recorded_with"]["torch"] == "2.13.0"
    assert f"versions: torch {torch.__version__}" in out
    assert ("same versions as the recorded runs" in out) != ("numbers will differ from the recorded ones" in out)
    arms = results["arms"]
    assert arms["tis"]["stablerl_rollout_correction"] == "tis" and not arms["tis"]["trl_importance_sampling"]
    assert arms["trl_is"]["trl_importance_sampling"] and arms["none"]["stablerl_rollout_correction"] is None
    assert "sampling/importance_sampling_ratio/mean" in arms["trl_is"]["metrics"]
    assert "sampling/importance_sampling_ratio/mean" not in arms["none"]["metrics"]
    for r in arms.values():
        assert len(r["rollout_mismatch"]) == 2 and r["rollout_mismatch"][0]["abs"] > 0
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_demo_scenarios_list_and_misuse(capsys):
    assert demo.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "moe (default)" in out and "mismatch:" in out and "basic:" in out and "arm tis" in out
    assert demo.main(["--losses", "dapo"]) == 2
    assert "--scenario basic" in capsys.readouterr().err
    assert demo.main(["--scenario", "basic", "--arms", "tis"]) == 2
    assert demo.main(["--scenario", "mismatch", "--arms", "tis,nope", "--steps", "1", "--out", "/tmp/stablerl-trl-mismatch-test"]) == 2
    assert "did you mean" in capsys.readouterr().err


def test_benchmark_script_smoke(tmp_path):
    """benchmarks/stability/rollout_mismatch.py end to end in 2 steps: JSON (every run), table, plot."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "stability" / "rollout_mismatch.py"
    cmd = [sys.executable, str(script), "--precisions", "int2", "--seeds", "0", "--arms", "none,tis", "--steps", "2",
           "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    data = json.loads((tmp_path / "rollout_mismatch.json").read_text())
    assert [(r["arm"], r["precision"], r["seed"]) for r in data["runs"]] == [("none", "int2", 0), ("tis", "int2", 0)]
    assert all(len(r["rollout_mismatch"]) == 2 and r["mismatch_kl"] != 0 for r in data["runs"])
    table = (tmp_path / "rollout_mismatch.md").read_text()
    assert "rollout int2, lr 0.001, 2 steps" in table and "| tis | 0 |" in table
    assert (tmp_path / "rollout_mismatch.png").stat().st_size > 10_000


def test_engine_refuses_sampling_settings_it_does_not_implement():
    # top_p / top_k / min_p are implemented (vLLM's rule, processed log-probs: test_trl_sampling_mask.py)
    args = mismatch.make_config("/tmp/stablerl-trl-mismatch-test", "none", steps=1, seed=0, lr=1e-3,
                                repetition_penalty=1.2)
    with pytest.raises(stablerl.StableRLError, match="repetition_penalty"):
        mismatch.make_trainer(args, "int4")


def test_demo_record_is_the_recorded_json():
    """The demo's "other seeds" line reads DEMO_RECORD: it must be the benchmark's record of DEMO's setting
    (docs/stability/rollout_mismatch.json), every recorded arm and seed, finals and bests to 3 decimals."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "docs" / "stability" / "rollout_mismatch.json"
    d = mismatch.DEMO
    runs = [r for r in json.loads(path.read_text())["runs"]
            if (r["precision"], r["lr"], r["steps"], r.get("completion_length", 4), r.get("source")) ==
            (d["precision"], d["lr"], d["steps"], d["completion_length"], None)]
    record: dict = {}
    for r in runs:
        record.setdefault(r["arm"], {})[r["seed"]] = (round(r["final_reward"], 3), round(r["best_reward"], 3))
    assert record == mismatch.DEMO_RECORD
    assert set(d["arms"]) <= set(record) and all(len(record[a]) >= 3 for a in d["arms"])


def test_verdict_counts_the_other_seeds_that_agree():
    fail, hold = {"reward": [0.5] * 10 + [0.1] * 10, "final_reward": 0.1}, {"reward": [0.95] * 20, "final_reward": 0.95}
    d = mismatch.DEMO
    setting = dict(precision=d["precision"], lr=d["lr"], steps=d["steps"], completion_length=d["completion_length"])
    lines = mismatch.verdict({"trl_is": fail, "tis": hold}, seed=0, **setting)
    assert "  trl_is   FAILED  final 0.10" in lines[1] and "  tis      held    final 0.95" in lines[2]
    others = sorted(set(mismatch.DEMO_RECORD["trl_is"]) & set(mismatch.DEMO_RECORD["tis"]) - {0})
    agree = [s for s in others if mismatch.recorded_failed(*mismatch.DEMO_RECORD["trl_is"][s])
             and not mismatch.recorded_failed(*mismatch.DEMO_RECORD["tis"][s])]
    assert f"other seeds: {len(agree)} of {len(others)} recorded" in "\n".join(lines)
    lines = mismatch.verdict({"trl_is": fail, "tis": hold}, seed=0, **{**setting, "steps": 3})
    assert "not the recorded setting" in lines[-1]
