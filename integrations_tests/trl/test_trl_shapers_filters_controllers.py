"""Reward shapers, batch filters and entropy controllers through TRL 1.16 (tiny model, CPU, 1-3 steps each).

Checks: config-time refusals; redit shapes the rewards reproducibly with the seed and training runs;
dynamic_sampling zeroes the advantages and loss mask of the all-equal groups (what the loss receives);
gtpo_entropy_filter / d3s run on the rollout's entropies, resampling samplers are refused with the reason;
aepo sets the generation temperature from TRL's entropy; controller and entropic (ctx.state) state are
written to the checkpoint folder and restored exactly on resume.
"""

import json
import math
import os

import pytest
import torch

import trl_helpers as H  # noqa: I001

import stablerl
from stablerl.adapters.trl import GRPOConfig, GRPOTrainer


def cfg(tmp_path, **kw):
    base = dict(num_iterations=1, gradient_accumulation_steps=1, max_steps=1)
    base.update(kw)
    return GRPOConfig(**H.base_kwargs(tmp_path, **base))


def group_reward(prompts, completions, **kwargs):
    """Prompts with an odd digit: every completion gets 1.0 (an all-equal group); even digit: 1 if the first
    generated word is a digit (mixed groups)."""
    out = []
    for p, c in zip(prompts, completions):
        if int(p.split()[1]) % 2:
            out.append(1.0)
        else:
            out.append(float(bool(c.split()) and c.split()[0].isdigit()))
    return out


class Spy(GRPOTrainer):
    """Records what each generation batch hands to the loss, and the sampling temperature of each generation."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.batches, self.raw_rewards, self.temperatures, self.loss_inputs = [], [], [], []

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        r = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self.raw_rewards.append(r.clone())
        return r

    def _generate_single_turn(self, *a, **k):
        self.temperatures.append(float(self.generation_config.temperature))
        return super()._generate_single_turn(*a, **k)

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.batches.append({k: (v.clone() if torch.is_tensor(v) else v) for k, v in out.items()})
        return out

    def _compute_loss(self, model, inputs):
        self.loss_inputs.append({k: inputs[k].clone() for k in ("advantages", "completion_mask", "tool_mask")
                                 if k in inputs})
        return super()._compute_loss(model, inputs)


def run(tmp_path, trainer_cls=Spy, reward=H.binary_digit_reward, **kw):
    return H.train(trainer_cls, cfg(tmp_path, **kw), reward=reward)


# ----------------------------------------------------------------------------- config


def test_config_refusals(tmp_path):
    with pytest.raises(stablerl.StableRLError, match="needs a stablerl advantage_estimator"):
        cfg(tmp_path, reward_shaper="redit")
    with pytest.raises(stablerl.UnknownNameError, match="dynamic_sampling"):
        cfg(tmp_path, batch_filter="dynamic_samplin")
    with pytest.raises(stablerl.StableRLError, match="scale"):
        cfg(tmp_path, advantage_estimator="grpo", reward_shaper="redit", stablerl_reward_shaper_params={"scal": 0.1})
    with pytest.raises(stablerl.StableRLError, match="stablerl_batch_filter_params is set but batch_filter is not"):
        cfg(tmp_path, stablerl_batch_filter_params='{"keep_singletons": false}')
    with pytest.raises(stablerl.UnknownNameError):
        cfg(tmp_path, entropy_controller="aepoo")
    c = cfg(tmp_path, advantage_estimator="grpo", reward_shaper="redit",
            stablerl_reward_shaper_params='{"scale": 0.1}')  # JSON string from the CLI
    assert c.stablerl_reward_shaper_params == {"scale": 0.1}


def test_missing_user_input_names_how_to_provide(tmp_path):
    with pytest.raises(stablerl.MissingInputError, match=r"needs input 'correct'.*log_extra\('correct'"):
        run(tmp_path, advantage_estimator="grpo", reward_shaper="grpo_lambda")


def test_user_inputs_from_log_extra(tmp_path):
    """grpo_lambda gets `correct` from a reward function's log_extra and `lengths` from the loss mask."""

    def reward(prompts, completions, log_extra=None, **kw):
        r = H.binary_digit_reward(prompts, completions)
        log_extra("correct", [v > 0 for v in r])
        return r

    trainer, rec, _ = run(tmp_path, reward=reward, advantage_estimator="grpo", reward_shaper="grpo_lambda",
                          stablerl_reward_shaper_params={"lambda_ratio": 1.0})
    assert math.isfinite(rec.logs[-1]["loss"])
    assert rec.logs[-1]["stablerl/grpo_lambda/selected_group_frac"] == 1.0


# ----------------------------------------------------------------------------- reward shaper


def test_redit_shapes_rewards_reproducibly(tmp_path):
    kw = dict(advantage_estimator="grpo", reward_shaper="redit", stablerl_reward_shaper_params={"scale": 0.05},
              max_steps=2)
    runs = []
    for i in range(2):
        trainer, rec, initial = run(tmp_path / str(i), **kw)
        assert len(rec.logs) == 2 and all(math.isfinite(log["loss"]) for log in rec.logs)
        assert not torch.equal(rec.params[-1], initial)
        runs.append((trainer, rec))
    (t1, r1), (t2, r2) = runs
    for log1, log2 in zip(r1.logs, r2.logs):  # same seed: same noise, same training
        assert log1["stablerl/redit/noise_std"] == log2["stablerl/redit/noise_std"] > 0
        assert log1["stablerl/shaped_reward/mean"] == log2["stablerl/shaped_reward/mean"]
        assert log1["stablerl/shaped_reward/mean"] != log1["reward"]  # TRL logs the raw reward
        assert abs(log1["stablerl/shaped_reward/mean"] - log1["reward"]) <= 0.05
        assert log1["stablerl/redit/noise_abs_max"] <= 0.05
    # the shaped rewards reach the estimator: a group with equal raw rewards gets non-zero (noise) advantages
    raw = t1.raw_rewards[0].sum(1).view(-1, 4)
    adv = t1.batches[0]["advantages"].sum(-1).view(-1, 4)  # one value per row (on the last token), 1 process
    flat = (raw.max(1).values == raw.min(1).values)
    if bool(flat.any()):
        assert bool((adv[flat].abs() > 0).any())
    # a different seed draws different noise
    t3, r3, _ = run(tmp_path / "s1", seed=1, **kw)
    assert r3.logs[0]["stablerl/redit/noise_std"] != r1.logs[0]["stablerl/redit/noise_std"]


# ----------------------------------------------------------------------------- batch filters


@pytest.mark.parametrize("estimator", [None, "grpo"])
def test_dynamic_sampling_zeroes_flat_groups(tmp_path, estimator):
    trainer, rec, initial = run(tmp_path, reward=group_reward, advantage_estimator=estimator,
                                batch_filter="dynamic_sampling", max_steps=2, per_device_train_batch_size=16)
    assert all(math.isfinite(log["loss"]) for log in rec.logs)
    n_flat = n_varied = 0
    for raw, out in zip(trainer.raw_rewards, trainer.batches):
        r = raw.sum(1).view(-1, 4)
        flat = (r.max(1).values == r.min(1).values).repeat_interleave(4)
        n_flat += int(flat.sum())
        keep = out["tool_mask"] * out["completion_mask"]
        adv = out["advantages"] if out["advantages"].dim() == 2 else out["advantages"].unsqueeze(-1)
        assert torch.all(keep[flat] == 0) and torch.all(adv[flat] == 0)
        assert torch.all(keep[~flat] == out["completion_mask"][~flat])  # kept rows keep their loss mask
        n_varied += int((~flat).sum())
        if bool((~flat).any()):
            assert bool((adv[~flat].abs().sum(-1) > 0).any())
        assert int(out["num_items_in_batch"]) == int(keep.sum().clamp(min=1))  # normaliser: kept tokens
    assert n_flat > 0 and n_varied > 0, "the reward makes odd-digit groups flat, even-digit ones mostly mixed"
    # what the loss received (shuffled rows): masked rows carry advantage 0
    for inp in trainer.loss_inputs:
        adv = inp["advantages"] if inp["advantages"].dim() == 2 else inp["advantages"].unsqueeze(-1).expand_as(
            inp["completion_mask"])
        masked = (inp["tool_mask"] * inp["completion_mask"]).sum(-1) == 0
        assert torch.all(adv[masked] == 0)
    assert "stablerl/dynamic_sampling/kept_group_frac" in rec.logs[-1]
    assert rec.logs[-1]["stablerl/filter/kept_row_frac"] < 1.0


def test_gtpo_entropy_filter_uses_rollout_entropy(tmp_path):
    # random tiny model: token entropy ~ log(15) > 0.7, so the default threshold drops every row
    trainer, rec, _ = run(tmp_path, advantage_estimator="grpo", batch_filter="gtpo_entropy_filter")
    out = trainer.batches[0]
    assert rec.logs[0]["stablerl/gtpo_filter/entropy_mean"] > 0.7
    assert rec.logs[0]["stablerl/gtpo_filter/dropped_frac"] == 1.0
    assert torch.all(out["advantages"] == 0)
    # a high threshold keeps rows and shifts A by -0.1 * H_seq (per row constant over its tokens)
    trainer, rec, _ = run(tmp_path / "b", advantage_estimator="grpo", batch_filter="gtpo_entropy_filter",
                          stablerl_batch_filter_params={"ent_threshold": 100.0})
    out = trainer.batches[0]
    mask = out["completion_mask"].float()
    h = rec.logs[0]["stablerl/gtpo_filter/entropy_mean"]
    assert rec.logs[0]["stablerl/gtpo_filter/dropped_frac"] == 0.0 and math.isfinite(rec.logs[0]["loss"])
    per_row = (out["advantages"] * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    assert float(per_row.mean()) == pytest.approx(-0.1 * h, rel=0.2)  # grpo advantages have mean ~0 per group


def test_d3s_runs_and_masks_tokens(tmp_path):
    trainer, rec, _ = run(tmp_path, advantage_estimator="grpo", batch_filter="d3s", reward=H.binary_digit_reward,
                          max_steps=2)
    assert all(math.isfinite(log["loss"]) for log in rec.logs)
    out = trainer.batches[0]
    kept = (out["tool_mask"] * out["completion_mask"]).sum()
    assert 0 < int(kept) < int(out["completion_mask"].sum())
    assert rec.logs[0]["stablerl/d3s/kept_token_frac"] < 1.0


def test_resampling_filter_refused(tmp_path):
    with pytest.raises(stablerl.StableRLError, match="repeated rows.*fixed size"):
        run(tmp_path, advantage_estimator="grpo", batch_filter="shuffle_r1")
    # its pairwise sampling alone returns each row once: runs
    trainer, rec, _ = run(tmp_path / "b", advantage_estimator="grpo", batch_filter="shuffle_r1",
                          stablerl_batch_filter_params={"shuffle": False})
    assert math.isfinite(rec.logs[0]["loss"])


# ----------------------------------------------------------------------------- controllers


@pytest.mark.parametrize("entropy_base,expected", [(0.5, 0.8), (100.0, 1.2)])
def test_aepo_sets_generation_temperature(tmp_path, entropy_base, expected):
    trainer, rec, _ = run(tmp_path, entropy_controller="aepo", max_steps=3,
                          stablerl_entropy_controller_params={"entropy_base": entropy_base})
    # first generation at the configured temperature; after each step T follows TRL's entropy (~2.7 here)
    assert trainer.temperatures == [1.0, expected, expected]
    assert trainer.temperature == 1.0  # log-probs stay at the training temperature (AEPO's convention)
    assert rec.logs[0]["stablerl/aepo/temperature"] == expected
    assert trainer._stablerl_loop.controller.last_entropy == pytest.approx(rec.logs[-1]["entropy"], rel=1e-6)


def test_epo_penalty_is_added(tmp_path):
    with pytest.warns(UserWarning, match="turn 0"):
        trainer, rec, _ = run(tmp_path, entropy_controller="epo", max_steps=2,
                              stablerl_entropy_controller_params={"max_steps": 1})
    assert rec.logs[-1]["stablerl/epo/phase_weight"] > 0
    assert "stablerl/epo/smooth_penalty" in rec.logs[-1]
    assert trainer._stablerl_loop.controller.counts[0] == 2  # one history entry per optimizer step


def test_controller_and_loss_state_checkpointed(tmp_path):
    kw = dict(loss_type="entropic", entropy_controller="aepo", advantage_estimator="grpo", reward_shaper="redit",
              max_steps=2, save_strategy="steps", save_steps=1)
    trainer, rec, _ = run(tmp_path / "a", **kw)
    ckpt1, ckpt2 = (os.path.join(tmp_path / "a", f"checkpoint-{i}") for i in (1, 2))

    def updates(state):  # EntroPIC's PI state, kept across steps
        return state["slots"]["policy_loss"]["entropic"]["entropic"]["updates"]

    saved = H.plain(torch.load(os.path.join(ckpt2, "stablerl_state.pt"), weights_only=False))
    assert saved == H.plain(trainer.stablerl_state_dict())
    assert list(saved["objects"]["controller"]) == ["aepo"]
    assert saved["objects"]["controller"]["aepo"]["state"]["steps"] == 2
    assert updates(saved) > 0
    saved1 = H.plain(torch.load(os.path.join(ckpt1, "stablerl_state.pt"), weights_only=False))
    assert saved1["objects"]["controller"]["aepo"]["state"]["steps"] == 1
    assert updates(saved1) < updates(saved)

    # restore into a fresh trainer: exactly the saved state, and the decision re-applied
    fresh = Spy(model=H.tiny_model(), reward_funcs=H.binary_digit_reward, args=cfg(tmp_path / "b", **kw),
                train_dataset=H.build_dataset(64, seed=0), processing_class=H.TOKENIZER)
    assert fresh.load_stablerl_state(ckpt2)
    assert H.plain(fresh.stablerl_state_dict()) == saved
    assert fresh.generation_config.temperature == saved["objects"]["controller"]["aepo"]["decision"]["temperature"]
    assert not fresh.load_stablerl_state(str(tmp_path))  # no file: nothing loaded

    # resume: TRL's checkpoint loading restores it before the first step
    class Resumed(Spy):
        restored = None

        def load_stablerl_state_dict(self, state):
            super().load_stablerl_state_dict(state)
            Resumed.restored = H.plain(self.stablerl_state_dict())

    resumed = Resumed(model=H.tiny_model(), reward_funcs=H.binary_digit_reward, args=cfg(tmp_path / "c", **kw),
                      train_dataset=H.build_dataset(64, seed=0), processing_class=H.TOKENIZER)
    resumed.train(resume_from_checkpoint=ckpt1)
    assert Resumed.restored == saved1
    assert resumed._stablerl_loop.controller.steps == 2  # continued from 1, not restarted
    assert updates(H.plain(resumed.stablerl_state_dict())) > updates(saved1)

    # a checkpoint of earlier development versions (stablerl_controller.json, {"format": 1}) still loads
    legacy_dir = tmp_path / "legacy"
    legacy_dir.mkdir()
    aepo = saved["objects"]["controller"]["aepo"]
    legacy = {"format": 1, "controller": {"name": "aepo", "state": aepo["state"], "decision": aepo["decision"]},
              "ctx_state": {"entropic": saved["slots"]["policy_loss"]["entropic"],
                            "shaper:redit": saved["slots"]["reward_shaper"]["redit"],
                            "adv:grpo": saved["slots"]["advantage_estimator"]["grpo"]},
              "rng": next(iter(saved["generators"]["reward_shaper+batch_filter"].values()))}
    (legacy_dir / "stablerl_controller.json").write_text(json.dumps(legacy))
    old = Spy(model=H.tiny_model(), reward_funcs=H.binary_digit_reward, args=cfg(tmp_path / "d", **kw),
              train_dataset=H.build_dataset(64, seed=0), processing_class=H.TOKENIZER)
    assert old.load_stablerl_state(str(legacy_dir))
    assert H.plain(old.stablerl_state_dict()) == saved
    assert torch.equal(old._stablerl_loop.rng.get_state(), fresh._stablerl_loop.rng.get_state())


# ----------------------------------------------------------------------------- two processes

_WORKER = r'''
import math, os
for _k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ[_k] = "1"
import torch
torch.set_num_threads(1)
from transformers import TrainerCallback
from stablerl.adapters.trl import GRPOConfig, GRPOTrainer
from stablerl.tools.demo import build_dataset, build_model, build_tokenizer

VOID = []

def reward(prompts, completions, log_extra=None, **kwargs):
    void = [not (c.split() and c.split()[0].isdigit()) for c in completions]
    VOID.append(void)
    log_extra("void_turn", void)
    return [float(not v) for v in void]

class T(GRPOTrainer):
    checks = 0
    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        void = torch.tensor(VOID[-1])
        keep = (out["tool_mask"] * out["completion_mask"]).sum(-1) > 0
        assert torch.equal(keep, ~void & (out["completion_mask"].sum(-1) > 0)), (keep, void)
        T.checks += 1
        return out

logs = []
class Rec(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            records.append(dict(logs))
records = logs

def rank_main(rank, world, work):
    args = GRPOConfig(output_dir=os.path.join(work, "run"), advantage_estimator="grpo",
                      reward_shaper="redit", batch_filter="simpletir", entropy_controller="aepo",
                      per_device_train_batch_size=8, num_generations=4, max_completion_length=4, num_iterations=1,
                      gradient_accumulation_steps=1, learning_rate=5e-3, max_steps=3, logging_steps=1, use_cpu=True,
                      bf16=False, gradient_checkpointing=False, report_to="none", save_strategy="no",
                      disable_tqdm=True, seed=0)
    tok = build_tokenizer()
    trainer = T(model=build_model(tok, hidden_size=32), reward_funcs=reward, args=args,
                train_dataset=build_dataset(64), processing_class=tok, callbacks=[Rec()])
    trainer.train()
    state = trainer.stablerl_state_dict()
    return {"rank": trainer.accelerator.process_index, "world": trainer.accelerator.num_processes,
            "checks": T.checks, "state": state, "temperature": trainer.generation_config.temperature,
            "finite": all(math.isfinite(l["loss"]) for l in logs),
            "stablerl_logs": [{k: v for k, v in l.items() if k.startswith("stablerl/")} for l in logs]}
'''


def test_two_processes_identical_state(tmp_path):
    """redit + simpletir (void_turn from log_extra, gathered over processes) + aepo on 2 processes: each
    process masks exactly its own void rows, and the controller, generator and ctx state stay identical."""
    import tempfile
    from pathlib import Path

    from stablerl.testing import launch_gloo

    with tempfile.TemporaryDirectory(prefix="stablerl_trl_ext_") as work:  # not tmp_path: concurrent pytest
        worker = Path(work) / "worker.py"                                  # runs may prune its base folder
        worker.write_text(_WORKER)
        r0, r1 = launch_gloo(f"{worker}:rank_main", 2, args=(work,), init_process_group=False, timeout=300,
                             env={"PYTHONWARNINGS": "ignore"})
    assert r0["rank"] == 0 and r1["rank"] == 1
    assert r0["world"] == 2 and r0["checks"] == 3 and r1["checks"] == 3
    assert r0["finite"] and r1["finite"]
    state0, state1 = H.plain(r0["state"]), H.plain(r1["state"])  # as each process would checkpoint it
    assert state0 == state1 and state0["objects"]["controller"]["aepo"]["state"]["steps"] == 3
    assert r0["temperature"] == r1["temperature"] == 0.8
    assert r0["stablerl_logs"] == r1["stablerl_logs"]
    assert any(log["stablerl/simpletir/void_frac"] > 0 for log in r0["stablerl_logs"])
    for log in r0["stablerl_logs"]:  # void rows count as dropped
        assert log["stablerl/filter/kept_row_frac"] == pytest.approx(1 - log["stablerl/simpletir/void_frac"], abs=1e-6)
