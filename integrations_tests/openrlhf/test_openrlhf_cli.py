"""The wrapper CLI runs OpenRLHF's real openrlhf.cli.train_ppo_ray parser and validation (dry run: Ray is faked)."""

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (nox -s openrlhf installs it)")

import json


import stablerl
import stablerl.adapters.openrlhf as adapter
from orlhf_helpers import dry_run
from stablerl.adapters.openrlhf import train_ppo_ray as wrapper

BASE = ["--actor.model_name_or_path", "Qwen/Qwen3-0.6B", "--rollout.n_samples_per_prompt", "4"]


def test_dry_run_attaches_selection_and_setup_hook(monkeypatch):
    args, init = dry_run(monkeypatch, BASE + [
        "--actor.policy_loss_type", "m2po", "--actor.stablerl_params", "m2_threshold=0.05", "variant=mask",
        "--algo.advantage.estimator", "qae", "--algo.advantage.stablerl_params", '{"quantile_k": 0.3}',
        "--actor.eps_clip_low_high", "0.2", "0.28",
    ])
    sel = args.stablerl
    assert sel.policy_loss == "m2po" and sel.policy_loss_params == {"m2_threshold": 0.05, "variant": "mask"}
    assert sel.advantage_estimator == "qae" and sel.advantage_params == {"quantile_k": 0.3}
    assert sel.openrlhf_clip == {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}
    assert args.critic.model_name_or_path is None  # OpenRLHF's own driver logic saw a non-gae estimator
    assert init["runtime_env"]["worker_process_setup_hook"] == "stablerl.adapters.openrlhf.instrument"
    assert "NCCL_DEBUG" in init["runtime_env"]["env_vars"]  # OpenRLHF's own runtime_env is kept
    import argparse

    assert "<locals>" not in argparse.ArgumentParser.add_argument.__qualname__  # restored


def test_advantage_knobs_given_on_the_command_line(monkeypatch, capsys):
    """--algo.advantage.no_std_norm and --reward.clip_range count only when given (one precedence rule);
    the effective settings are printed with their sources."""
    args, _ = dry_run(monkeypatch, BASE + ["--algo.advantage.estimator", "qae"])
    assert args.stablerl.openrlhf_advantage == {} and args.stablerl.reward_clip_range is None
    args, _ = dry_run(monkeypatch, BASE + ["--algo.advantage.estimator", "qae", "--algo.advantage.no_std_norm",
                                            "--reward.clip_range", "-5", "5"])
    assert args.stablerl.openrlhf_advantage == {"norm_adv_by_std_in_grpo": False}
    assert args.stablerl.reward_clip_range == (-5.0, 5.0)
    settings = {s.name: (s.value, s.source) for s in adapter.advantage_settings(args.stablerl)}
    assert settings["norm_adv_by_std_in_grpo"] == (False, "framework key")
    with pytest.raises(SystemExit):  # an estimator without the switch: refused, not ignored
        dry_run(monkeypatch, BASE + ["--algo.advantage.estimator", "stablerl_rloo", "--algo.advantage.no_std_norm"])
    assert "--algo.advantage.no_std_norm=(given) has no effect" in capsys.readouterr().err


def test_builtin_names_select_nothing(monkeypatch):
    args, _ = dry_run(monkeypatch, BASE + ["--actor.policy_loss_type", "gspo", "--algo.advantage.estimator", "group_norm"])
    assert args.stablerl.policy_loss is None and args.stablerl.advantage_estimator is None
    args, _ = dry_run(monkeypatch, BASE + ["--actor.policy_loss_type", "stablerl_gspo",
                                            "--algo.advantage.estimator", "stablerl_rloo"])
    assert args.stablerl.policy_loss == "gspo" and args.stablerl.advantage_estimator == "rloo"


def test_help_lists_stablerl_names(capsys):
    with pytest.raises(SystemExit) as e:
        wrapper.main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for name in ("m2po", "cispo", "vanilla", "stablerl_gspo", "qae", "grpo", "stablerl_rloo", "group_norm", "gae"):
        assert name in out, name
    assert "--actor.stablerl_params" in out and "--algo.advantage.stablerl_params" in out


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--actor.policy_loss_type", "m3po"], ["argument --actor.policy_loss_type: invalid choice: 'm3po'", "'m2po'", "'ppo'"]),
        (["--algo.advantage.estimator", "qea"], ["argument --algo.advantage.estimator: invalid choice: 'qea'", "'qae'", "'group_norm'"]),
        (["--actor.policy_loss_type", "haepo"], ["invalid choice: 'haepo'"]),  # listed by stablerl, not implemented
        (["--actor.policy_loss_type", "m2po", "--actor.stablerl_params", "m2_treshold=0.1"], ["m2_threshold"]),
        (["--algo.advantage.estimator", "qae", "--algo.advantage.stablerl_params", "quantile_k"], ["KEY=VALUE"]),
        (["--actor.policy_loss_type", "decoupled_ppo"], ["is_correction_level"]),
    ],
)
def test_bad_names_get_argparse_errors(capsys, argv, expected):
    with pytest.raises(SystemExit) as e:
        wrapper.main(BASE + argv)
    assert e.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "error:" in err
    for piece in expected:
        assert piece in err, (piece, err[-800:])


def test_choices_cover_the_registry():
    names = adapter.openrlhf_choices(stablerl.POLICY_LOSS)
    assert names[:2] == ["ppo", "gspo"] and "stablerl_gspo" in names and "gspo" not in names[2:]
    assert "capo" not in names and "haepo" not in names  # needs hidden states / unavailable
    assert "a3po" in names  # one weight version per batch (synchronous trainer)
    est = adapter.openrlhf_choices(stablerl.ADVANTAGE_ESTIMATOR)
    assert {"stablerl_rloo", "stablerl_dr_grpo", "grpo", "qae"} <= set(est) and "gigpo" not in est
    assert "empg" in est  # the old-pass entropy at the advantage step; steps: the loss mask's runs
    assert json.dumps(names)  # plain strings


def test_routing_replay_turns_off_zero_copy_tensors(monkeypatch, capsys):
    """OpenRLHF's train() sets RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1 unless set; its serializer drops the routes
    carried on the log-prob tensors: under routing replay the workers get 0 (said on stderr), otherwise untouched."""
    openrlhf_env = {"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1", "NCCL_DEBUG": "WARN"}}
    monkeypatch.delenv("STABLERL_ROUTING_REPLAY", raising=False)
    assert adapter.add_setup_hook(openrlhf_env)["env_vars"]["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] == "1"
    monkeypatch.setenv("STABLERL_ROUTING_REPLAY", "R3")
    env = adapter.add_setup_hook(openrlhf_env)["env_vars"]
    assert env["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] == "0" and env["NCCL_DEBUG"] == "WARN"
    assert "routing replay sets RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=0 for the Ray workers (was '1')" in capsys.readouterr().err
