"""`stablerl demo --scenario moe`: the quantized-router rollout engine and a two-step run through TRL's vLLM path.

Evidence: the engine's sampler differs from the policy in the router weights only; a fair share of response tokens
get another expert; the routes it returns are the ones its forward uses and, replayed in the fp32 forward, leave no
log-prob difference (top-1, normalised gate weight 1). Through TRL, the R3 arm's trainer log-probs equal the
engine's (TRL's own ``sampling_logp_difference`` metric ~0), the TRL arm's differ by about a nat.
"""

import json
from pathlib import Path

import pytest
import torch

import trl_helpers as H  # noqa: F401,I001  (offline environment, skips without TRL)

import stablerl
from stablerl import routing_replay as rr
from stablerl.tools import demo
from stablerl.tools.demo import moe, task


def test_moe_arms_are_valid():
    for arm in moe.ARMS:
        moe.make_config("/tmp/stablerl-trl-moe-test", arm, steps=1, seed=0, lr=1e-3)
    with pytest.raises(stablerl.UnknownNameError, match="r3_tis"):
        moe.make_config("/tmp/stablerl-trl-moe-test", "r3_tiss", steps=1, seed=0, lr=1e-3)
    assert set(moe.DEMO["arms"]) <= set(moe.ARMS) and set(moe.ARM_HELP) == set(moe.ARMS)


def _engine(precision, seed=0):
    tok = task.build_tokenizer()
    model = moe.build_model(tok, seed=seed)
    engine = moe.QuantizedRouterRollout(model, tok, precision=precision, max_completion_length=8)
    prompts = [tok(f"copy {d} :", add_special_tokens=False)["input_ids"] for d in "0123456789"] * 2
    torch.manual_seed(seed)
    engine.sync_weights()
    _, completions, logprobs, _ = engine.generate(prompts)
    return model, engine, prompts, completions, logprobs


def test_engine_rounds_only_the_routers_and_returns_the_routes_it_used():
    model, engine, prompts, completions, logprobs = _engine("int2")
    routers = {info.name for info in rr.require_routers(model)}
    assert len(routers) == moe.MODEL["num_layers"]
    trained, sampled = dict(model.named_parameters()), dict(engine.sampler.named_parameters())
    for name, p in trained.items():
        same = torch.equal(p, sampled[name])
        assert same != (name.rsplit(".", 1)[0] in routers), name  # routers rounded, every other weight exact
    h = engine.history[-1]
    # the measured mismatch (seed 0, int2 routers, top-1): most tokens change expert somewhere, ~1.5 nats apart;
    # with the rollout's routes replayed the fp32 forward gives the rollout's log-probs
    assert h["flipped"] > 0.5 and h["abs"] > 0.5 and h["ratio_out_of_2x"] > 0.2
    assert abs(h["kl_replay"]) < 1e-5 and h["abs_replay"] < 1e-5
    for p, c, lps, arr in zip(prompts, completions, logprobs, engine.last_routes):
        assert arr.shape == (len(p) + len(c) - 1, moe.MODEL["num_layers"], moe.MODEL["top_k"])
        assert arr.dtype.name == "uint8"
        ids = torch.tensor([p + c])
        with torch.no_grad(), rr.capture(engine.sampler) as cap:
            logits = engine.sampler(input_ids=ids).logits[0, len(p) - 1:-1]
        used = cap.routes().to_token_layer_slot(moe.MODEL["num_layers"])[: len(p) + len(c) - 1]
        assert torch.equal(used, torch.from_numpy(arr).long())
        got = logits.log_softmax(-1).gather(1, torch.tensor(c).unsqueeze(1)).squeeze(1)
        assert torch.allclose(got, torch.tensor([x[0] for x in lps]), atol=1e-5)


def test_fp32_engine_has_no_mismatch():
    engine = _engine("fp32")[1]
    h = engine.history[-1]
    assert h["flipped"] == 0.0 and h["abs"] < 1e-5


def test_demo_moe_smoke(tmp_path, capsys):
    rc = demo.main(["--scenario", "moe", "--steps", "2", "--arms", "trl_tok_trunc,r3_tok_trunc", "--out", str(tmp_path),
                    "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "scenario moe" in out and "int2 router weights" in out and "on seed 0" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["arms"]) == ["trl_tok_trunc", "r3_tok_trunc"]
    assert results["config"]["recorded_with"] == moe.RECORDED_WITH
    diff = {a: [v for v in r["metrics"]["sampling/sampling_logp_difference/mean"] if v is not None]
            for a, r in results["arms"].items()}
    assert len(diff["r3_tok_trunc"]) == 2 and max(diff["r3_tok_trunc"]) < 1e-4  # R3: the rollout's log-probs
    assert min(diff["trl_tok_trunc"]) > 0.3  # TRL: its recompute routes differently
    for r in results["arms"].values():
        assert len(r["rollout_mismatch"]) == 2 and r["rollout_mismatch"][0]["flipped"] > 0.5
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_demo_record_is_the_recorded_json():
    """The moe scenario's "other seeds" lines read DEMO_RECORD: the benchmark's torch 2.13.0 runs of DEMO's setting
    (docs/stability/moe_routing.json), every recorded arm and seed, finals and bests to 3 decimals."""
    path = Path(__file__).resolve().parents[2] / "docs" / "stability" / "moe_routing.json"
    d = moe.DEMO
    record: dict = {}
    for r in json.loads(path.read_text())["runs"]:
        if ((r["precision"], r["lr"], r["steps"], r["completion_length"], r["model"]) ==
                (d["precision"], d["lr"], d["steps"], d["completion_length"], moe.MODEL)
                and r["environment"]["torch"].startswith("2.13.0")):
            record.setdefault(r["arm"], {})[r["seed"]] = (round(r["final_reward"], 3), round(r["best_reward"], 3))
    assert record == moe.DEMO_RECORD
    assert all(len(record[a]) == 3 for a in d["arms"])
