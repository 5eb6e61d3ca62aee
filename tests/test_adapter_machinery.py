"""Framework-neutral adapter machinery in core (moved out of the OpenRLHF adapter, usable by any adapter):
stablerl.script_wrapper, stablerl.checkpoint_slot, stablerl.ray_setup, stablerl.algorithm_selection,
stablerl.entropy_meter. Their OpenRLHF use is tested against the real framework in integrations_tests/openrlhf."""

from __future__ import annotations

import argparse
import sys

import pytest
import torch

import stablerl
from stablerl.algorithm_selection import AlgorithmSelection
from stablerl.checkpoint_slot import CheckpointSlot, with_state
from stablerl.entropy_meter import EntropyMeter
from stablerl.frameworks import get_framework
from stablerl.params import StableRLError, UnknownNameError
from stablerl.ray_setup import with_setup_hook
from stablerl.script_wrapper import NameChoices, argparse_view, flag_given, name_flag_help, run_script
from stablerl.state import StateStore

SCRIPT = """
import argparse, os
parser = argparse.ArgumentParser()
parser.add_argument("--loss", choices=["ppo"])
args = parser.parse_args()
os.environ["STABLERL_TEST_SEEN"] = args.loss
"""


def test_run_script_sees_views_and_restores_argv_and_env(tmp_path, monkeypatch):
    (tmp_path / "toy_cli.py").write_text(SCRIPT)
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = list(sys.argv)

    def extend(parser, add_argument, args, kwargs):
        if "--loss" not in args:
            return None
        return add_argument(*args, **{**kwargs, "choices": ["ppo", "m2po"]})

    seen = []
    real_parse = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", lambda self, *a: seen.append(1) or real_parse(self, *a))
    run_script("toy_cli", {"argparse": lambda module: argparse_view(module, extend)}, ["--loss", "m2po"],
               restore_env=("STABLERL_TEST_SEEN",))
    assert seen and sys.argv == argv and "STABLERL_TEST_SEEN" not in __import__("os").environ
    assert argparse.ArgumentParser.add_argument.__qualname__.startswith("_ActionsContainer")  # never patched
    with pytest.raises(SystemExit):  # the real choices still refuse unknown names
        run_script("toy_cli", {"argparse": lambda module: argparse_view(module, extend)}, ["--loss", "m3po"])


def test_name_choices_and_help_list_what_the_framework_can_run():
    fw = get_framework("openrlhf")
    choices = NameChoices(fw, stablerl.POLICY_LOSS)
    assert list(choices)[:2] == ["ppo", "gspo"] and "m2po" in choices and "stablerl_m2po" in choices
    assert "stablerl_vanilla" in choices and "nope" not in choices and "stablerl_nope" not in choices
    text = name_flag_help(fw, stablerl.POLICY_LOSS, "the loss", "OpenRLHF")
    assert text.startswith("the loss. OpenRLHF: ppo, gspo. stablerl: ") and "stablerl_<name>" in text
    assert flag_given(["--a", "1", "--b=2"], "--b") and not flag_given(["--bb"], "--b")


def test_checkpoint_slot_waits_for_its_owner():
    slot = CheckpointSlot("k", "loss", "policy loss's")
    saved = StateStore(holds="loss")
    saved.slot(stablerl.POLICY_LOSS, "entropic")["entropic"] = {"integral": 1.5}
    states = with_state({"global_step": 2}, "k", saved)
    slot.take(states, "ckpt")
    assert states == {"global_step": 2} and slot.pending is not None  # taken out, waiting
    owner = StateStore(holds="loss")
    slot.adopt(owner)
    assert owner.slot(stablerl.POLICY_LOSS, "entropic")["entropic"] == {"integral": 1.5} and slot.pending is None
    assert slot.saved_into(None)["k"]["holds"] == "loss"
    with pytest.raises(RuntimeError, match="not a stablerl controller state"):
        CheckpointSlot("k", "controller", "controller's").take({"k": saved.state_dict()}, "ckpt")


def test_with_setup_hook_chains_what_was_there(monkeypatch):
    monkeypatch.setenv("STABLERL_FWD", "1")
    env = with_setup_hook({"worker_process_setup_hook": "user.hook", "env_vars": {"A": "x"}}, "pkg.instrument",
                          ours=("pkg.setup",), chained_env="CHAINED", forward=("STABLERL_FWD", "UNSET_VAR"))
    assert env == {"worker_process_setup_hook": "pkg.instrument",
                   "env_vars": {"A": "x", "CHAINED": "user.hook", "STABLERL_FWD": "1"}}
    assert "CHAINED" not in with_setup_hook({"worker_process_setup_hook": "pkg.setup"}, "pkg.instrument",
                                            ours=("pkg.setup",), chained_env="CHAINED").get("env_vars", {})
    with pytest.raises(ValueError, match="callable worker_process_setup_hook"):
        with_setup_hook({"worker_process_setup_hook": print}, "pkg.instrument", chained_env="CHAINED")


def test_algorithm_selection_answers_what_each_adapter_asks():
    sel = AlgorithmSelection(policy_loss="erc", advantage_estimator="optimal_token_baseline",
                             batch_filter="gtpo_entropy_filter")
    assert sel.requires(stablerl.POLICY_LOSS, "old_entropy") and not sel.requires(stablerl.REWARD_SHAPER, "entropy")
    assert sel.old_pass_stats() == {"entropy", "sum_pi_squared"} and sel.has_extensions
    adv = sel.advantage_selection({"epsilon": 1e-6})
    assert (adv.estimator, adv.estimator_params, adv.batch_filter) == ("optimal_token_baseline", {"epsilon": 1e-6},
                                                                       "gtpo_entropy_filter")
    keys = {stablerl.REWARD_SHAPER: "--shaper", stablerl.BATCH_FILTER: "--filter", stablerl.CONTROLLER: "--ctl"}
    check = dict(key=keys.get, params_key=lambda kind: keys[kind] + "_params", components_key="--c", weights_key="--w")
    AlgorithmSelection(reward_shaper="redit", reward_shaper_params={"scale": 0.1}).check_extensions(**check)
    with pytest.raises(UnknownNameError, match="scale"):
        AlgorithmSelection(reward_shaper="redit", reward_shaper_params={"scal": 0.1}).check_extensions(**check)
    with pytest.raises(StableRLError, match="--filter_params given, but no --filter"):
        AlgorithmSelection(batch_filter_params={"x": 1}).check_extensions(**check)
    with pytest.raises(StableRLError, match="--w has 1 values for 2 --c names"):
        AlgorithmSelection(reward_components=("a", "b"), reward_weights=(1.0,)).check_extensions(**check)


def test_entropy_meter_is_the_token_mean_of_the_step():
    meter = EntropyMeter()
    assert meter.take() is None  # no tokens: no entropy
    meter.add(torch.tensor([[9.0, 1.0, 2.0]]), torch.tensor([[1, 0]]))  # the last 2 positions: [1, 2] masked to [1]
    meter.add(torch.tensor([[3.0, 5.0]]), torch.tensor([[1, 1]]))
    assert meter.take() == pytest.approx((1.0 + 3.0 + 5.0) / 3) and (meter.total, meter.count) == (0.0, 0.0)
