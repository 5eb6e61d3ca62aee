"""Sampling-mask replay in TRL (``sampling_mask_replay``): the issue's ratio table rebuilt on a tiny model, through
TRL's real GRPOTrainer and its vLLM code path, with a stand-in engine that samples with top_p = 0.8 from a bf16 copy
of the policy and returns processed (kept-set) log-probs.

Before (replay off): TRL's IS ratio carries the trainer's kept mass (mean ~ M, most tokens outside [0.9, 1.1]);
after: the ratio is the real (bf16) mismatch only (mean ~ 1, few tokens outside)."""

import pytest
import torch

import trl_helpers as H  # noqa: F401,I001  (offline environment, skips without TRL)

import stablerl
from stablerl.adapters.trl import GRPOConfig
from stablerl.adapters.trl._sampling_mask import batch_mask, rollout_rule
from stablerl.sampling_mask import SamplingMask, SamplingRule, kept_mask, processed_log_probs
from stablerl.tools import demo
from stablerl.tools.demo import mismatch, truncated

CPU = dict(output_dir="/tmp/stablerl-trl-smask-test", use_cpu=True, bf16=False, report_to="none")


def _generation(replay: str, *, precision="bf16", arm="trl_tok_trunc", top_p=0.8, **overrides):
    """One generation batch of 8 prompts x 8 completions (<= 16 tokens) through TRL's
    ``_generate_and_score_completions`` on the stand-in engine; returns (trainer, TRL's output dict)."""
    args = truncated.make_config("/tmp/stablerl-trl-smask-test", arm, steps=1, seed=0, lr=1e-3, top_p=top_p,
                                 max_completion_length=16, sampling_mask_replay=replay,
                                 **{"vllm_importance_sampling_clip_max": 1e9, **overrides})
    trainer = truncated.make_trainer(args, precision)
    trainer.model.train()
    rows = [{"prompt": f"copy {d} :", "target": str(d)} for d in range(8) for _ in range(8)]
    torch.manual_seed(0)
    return trainer, trainer._generate_and_score_completions(rows)


def _full_log_probs(trainer, out):
    """The trainer's log-probs of the completion tokens over the full vocabulary (a plain forward)."""
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    with torch.no_grad():
        logits = trainer.model(input_ids=ids).logits[:, out["prompt_ids"].size(1) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, out["completion_ids"].unsqueeze(-1)).squeeze(-1)


def _ratio_stats(ratio, mask):
    r = ratio[mask.bool()]
    return float(r.mean()), float(((r < 0.9) | (r > 1.1)).float().mean())


def test_ratio_table_before_and_after_replay():
    """The issue's table (TRL PR #7269: top_p 0.8, mean ratio 0.896 / 51.8% outside [0.9, 1.1] before, 1.001 / 4.3%
    after) on the tiny model: TRL's own token-level IS ratio (token_truncate, no cap) with and without replay."""
    table = {}
    for replay in ("false", "true"):
        trainer, out = _generation(replay)
        mask = out["completion_mask"]
        table[replay] = _ratio_stats(out["importance_sampling_ratio"], mask)
        if replay == "true":
            kept = trainer._metrics["train"]["sampling_mask/kept_mass"][-1]
            # TRL's old log-probs are its own (the PPO ratio's anchor): full vocabulary, not the kept set
            full = _full_log_probs(trainer, out)
            assert torch.allclose(out["old_per_token_logps"][mask.bool()], full[mask.bool()], atol=1e-4)
            # the rollout's log-probs were replaced by their full-vocabulary form: the ratio to them is ~1
            ratio = (out["old_per_token_logps"] - out["sampling_per_token_logps"]).exp()
            assert abs(_ratio_stats(ratio, mask)[0] - 1) < 0.02
    before, after = table["false"], table["true"]
    print(f"\nmean IS ratio / tokens outside [0.9, 1.1]: before {before[0]:.3f} / {before[1]:.1%}, "
          f"after {after[0]:.3f} / {after[1]:.1%}; kept mass {kept:.3f}")
    assert 0.6 < kept < 0.95
    assert abs(before[0] - kept) < 0.05  # before: the ratio is the kept mass (the bf16 mismatch is ~1%)
    assert before[1] > 0.4
    assert abs(after[0] - 1) < 0.02 and after[1] < 0.1  # after: 1 within the bf16 noise


def test_replay_without_trls_old_pass_uses_one_extra_forward():
    """stablerl's tis (TRL's IS off, one update per generation: TRL runs no old-log-prob pass): the replay measures
    log M in one extra forward and the rollout log-probs every stablerl correction reads are over the vocabulary."""
    trainer, out = _generation("true", precision="fp32", arm="replay_tis", vllm_importance_sampling_clip_max=3.0)
    assert "old_per_token_logps" not in out and "importance_sampling_ratio" not in out
    mask = out["completion_mask"].bool()
    full = _full_log_probs(trainer, out)
    # fp32 engine = the trainer's weights: over the full vocabulary the rollout's log-probs are the trainer's
    assert torch.allclose(out["sampling_per_token_logps"][mask], full[mask], atol=1e-4)
    # and without replay they are the kept-set ones, higher by -log M
    _, raw = _generation("false", precision="fp32", arm="replay_tis", vllm_importance_sampling_clip_max=3.0)
    assert float((raw["sampling_per_token_logps"] - full)[mask].mean()) > 0.05


def test_replay_auto_and_errors():
    # auto: on with top_p < 1 and a ratio against the rollout; off with top_p = 1; off without such a ratio
    trainer, _ = _generation("auto")
    assert trainer._stablerl_replay.on
    trainer, _ = _generation("auto", top_p=1.0)
    assert not trainer._stablerl_replay.on and "do not truncate" in trainer._stablerl_replay.decision.reason
    trainer, _ = _generation("auto", arm="trl_none")
    assert not trainer._stablerl_replay.on and "no rollout log-probs" in trainer._stablerl_replay.decision.reason
    with pytest.raises(stablerl.StableRLError, match="sampling_mask_replay=true.*nothing to replay"):
        _generation("true", arm="trl_none")
    with pytest.raises(stablerl.StableRLError, match="sampling_mask_replay must be auto, true or false"):
        GRPOConfig(loss_type="grpo", sampling_mask_replay="sometimes", **CPU)
    # the rule: TRL's keys, generation_kwargs overriding them; top_k = 0 is off
    args = GRPOConfig(loss_type="grpo", top_p=0.9, top_k=0, min_p=0.05, temperature=0.7,
                      generation_kwargs={"top_k": 5}, **CPU)
    assert rollout_rule(args) == SamplingRule(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05)


def test_batch_mask_from_engine_masks():
    """A rollout_func's per-completion kept sets -> one CSR over TRL's padded [B, C]; padding positions are empty."""
    logits = torch.randn(3, 15)
    rule = SamplingRule(top_p=0.7)
    dense = kept_mask(logits, rule)
    rows = [SamplingMask.from_dense(dense[:2]), [dense[2].nonzero().squeeze(-1).tolist()]]
    mask = batch_mask(rows, 3)
    assert mask.shape == (2, 3)
    got = mask.dense_rows(0, 6, 15)
    assert torch.equal(got[:2], dense[:2]) and torch.equal(got[3], dense[2])
    assert not got[2].any() and not got[4:].any()
    with pytest.raises(stablerl.StableRLError, match="more than the batch's 1"):
        batch_mask(rows, 1)


def test_demo_truncated_arms_are_valid():
    for arm in truncated.ARMS:
        truncated.make_config("/tmp/stablerl-trl-smask-test", arm, steps=1, seed=0, lr=1e-3)
    with pytest.raises(stablerl.UnknownNameError, match="replay_tis"):
        truncated.make_config("/tmp/stablerl-trl-smask-test", "replay_tiss", steps=1, seed=0, lr=1e-3)
    assert demo and mismatch  # the modules the scenario builds on


def test_stand_in_engine_samples_from_the_kept_set_and_returns_processed_log_probs():
    """The engine's top-p: every sampled token is in vLLM's kept set of its sampler's logits, and its log-prob is the
    kept-set-normalised one (processed_logprobs), higher than the full-vocabulary log-prob wherever tokens were cut."""
    model = H.tiny_model(seed=0)
    engine = mismatch.LowPrecisionRollout(model, H.TOKENIZER, precision="int4", max_completion_length=6, top_p=0.7)
    assert engine.rule == SamplingRule(top_p=0.7)
    torch.manual_seed(0)
    prompts = [H.TOKENIZER("copy 3 :")["input_ids"]] * 8
    _, completions, logprobs, _ = engine.generate(prompts, None, 8)
    cut = 0
    for completion, lps in zip(completions, logprobs):
        ids = torch.tensor([prompts[0] + completion])
        with torch.no_grad():
            logits = engine.sampler(input_ids=ids).logits[0, len(prompts[0]) - 1:-1].float()
        processed = processed_log_probs(logits, engine.rule)
        token = torch.tensor(completion).unsqueeze(1)
        got = torch.tensor([lp[0] for lp in lps])
        assert torch.isfinite(processed.gather(1, token)).all()  # sampled inside the kept set
        assert torch.allclose(got, processed.gather(1, token).squeeze(1), atol=1e-5)
        full = logits.log_softmax(-1).gather(1, token).squeeze(1)
        assert (got >= full - 1e-6).all()
        cut += int((got > full + 1e-3).sum())
    assert cut > 0


def test_demo_truncated_smoke(tmp_path, capsys):
    import json

    rc = demo.main(["--scenario", "truncated", "--steps", "2", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "scenario truncated" in out and "top_p 0.8" in out and "on seed 0" in out and "versions: torch" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["top_p"] == truncated.DEMO["top_p"] and list(results["arms"]) == list(truncated.DEMO["arms"])
    baseline, fix = (results["arms"][a] for a in truncated.DEMO["arms"])
    assert not baseline["sampling_mask_replay"] and baseline["trl_importance_sampling"]
    assert fix["sampling_mask_replay"] and fix["stablerl_rollout_correction"] == "tis"
    kept = [v for v in fix["metrics"]["sampling_mask/kept_mass"] if v is not None]
    assert len(kept) == 2 and all(0.5 < v < 1 for v in kept)
    assert "sampling_mask/kept_mass" not in baseline["metrics"]
    assert results["config"]["recorded_with"] == truncated.RECORDED_WITH
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    assert demo.main(["--scenario", "mismatch", "--top-p", "0.9", "--out", str(tmp_path)]) == 2


def test_demo_record_is_the_recorded_json():
    """The truncated scenario's "other seeds" lines read DEMO_RECORD: the benchmark's torch 2.13.0 runs of DEMO's
    setting (docs/stability/truncated_sampling.json), every recorded arm and seed, finals and bests to 3 decimals."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "docs" / "stability" / "truncated_sampling.json"
    d = truncated.DEMO
    record: dict = {}
    for r in json.loads(path.read_text())["runs"]:
        if ((r["precision"], r["top_p"], r["lr"], r["steps"], r["completion_length"]) ==
                (d["precision"], d["top_p"], d["lr"], d["steps"], d["completion_length"])
                and r["environment"]["torch"].startswith("2.13.0") and r["arm"] in truncated.ARMS):
            record.setdefault(r["arm"], {})[r["seed"]] = (round(r["final_reward"], 3), round(r["best_reward"], 3))
    assert record == truncated.DEMO_RECORD
    assert all(len(record[a]) == 3 for a in d["arms"])


def _rollout_func_with_masks(engine, corrupt=False):
    """A rollout_func that samples with the stand-in engine and returns, like vLLM >= 0.28 with
    return_sampling_mask, each completion's kept sets (recomputed from the engine's own logits); ``corrupt``: the
    first token's kept set of the first completion loses the sampled token."""
    def rollout_func(prompts, trainer):
        prompt_ids = [H.TOKENIZER(p)["input_ids"] for p in prompts]
        _, completions, logprobs, _ = engine.generate(prompt_ids, None, 1)
        masks = []
        for p, c in zip(prompt_ids, completions):
            with torch.no_grad():
                logits = engine.sampler(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1:-1].float()
            dense = kept_mask(logits / engine.temperature, engine.rule)
            if corrupt and not masks:
                dense[0, c[0]] = False
            masks.append(SamplingMask.from_dense(dense))
        return {"prompt_ids": prompt_ids, "completion_ids": completions,
                "logprobs": [[lp[0] for lp in seq] for seq in logprobs], "sampling_mask": masks}

    return rollout_func


@pytest.mark.parametrize("corrupt", [False, True])
def test_engine_masks_from_a_rollout_func(corrupt):
    """The engine's kept sets (a rollout_func's ``sampling_mask`` field) are replayed instead of the recomputed rule:
    with an fp32 engine the rollout's log-probs become the trainer's full-vocabulary ones; a mask that excludes the
    sampled token is refused, naming the position."""
    args = truncated.make_config("/tmp/stablerl-trl-smask-test", "replay_tis", steps=1, seed=0, lr=1e-3,
                                 max_completion_length=16, use_vllm=False, vllm_importance_sampling_correction=False)
    model = H.build_model(H.TOKENIZER, seed=0)
    engine = mismatch.LowPrecisionRollout(model, H.TOKENIZER, precision="fp32", max_completion_length=16, top_p=0.8)
    from stablerl.adapters.trl import GRPOTrainer

    trainer = GRPOTrainer(model=model, reward_funcs=demo.copy_reward, args=args, train_dataset=demo.build_dataset(),
                          processing_class=H.TOKENIZER, rollout_func=_rollout_func_with_masks(engine, corrupt))
    trainer.model.train()
    rows = [{"prompt": f"copy {d} :", "target": str(d)} for d in range(8) for _ in range(8)]
    torch.manual_seed(0)
    if corrupt:
        with pytest.raises(stablerl.StableRLError, match=r"kept set at position \(0, 0\).*excludes the sampled token"):
            trainer._generate_and_score_completions(rows)
        return
    out = trainer._generate_and_score_completions(rows)
    assert trainer._stablerl_replay.on and "engine's kept sets" not in trainer._stablerl_replay.decision.reason
    mask = out["completion_mask"].bool()
    full = _full_log_probs(trainer, out)
    assert torch.allclose(out["sampling_per_token_logps"][mask], full[mask], atol=1e-4)
    kept = trainer._metrics["train"]["sampling_mask/kept_mass"][-1]
    assert 0.5 < kept < 0.95
