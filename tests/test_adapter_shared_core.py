"""Core pieces every adapter shares instead of writing its own (issue 26: no logic duplicated between adapters):
stablerl.config_recipe (config lines as data), AlgorithmSelection's validate / from_values / from_env /
from_config / effective params (the one selection object), ray_setup.without_zero_copy, name_registration
(algorithms into a framework's name registry) and call_options.option_inputs. Their use in verl, TRL and OpenRLHF
is tested against the real frameworks in integrations_tests/."""

from __future__ import annotations

import dataclasses

import pytest

import stablerl
from stablerl.algorithm_selection import AlgorithmSelection
from stablerl.call_options import TOP_ENTROPY_INPUT, option_inputs
from stablerl.config_recipe import KindLines, Note, Params, recipe_lines
from stablerl.contracts import ADVANTAGE_ESTIMATOR, BATCH_FILTER, POLICY_LOSS, REWARD_SHAPER
from stablerl.frameworks import FrameworkSpec, get_framework
from stablerl.name_registration import register_algorithms
from stablerl.params import StableRLError, UnknownNameError
from stablerl.patching import PatchLedger
from stablerl.ray_setup import ZERO_COPY_ENV, without_zero_copy

TOY = FrameworkSpec(name="toy", distribution="toy", supported=">=1", adapter="toy",
                    builtin_names={POLICY_LOSS: frozenset({"m2po"})},
                    selection_keys={POLICY_LOSS: "--loss", REWARD_SHAPER: "--shaper"})


def _lines(kind: str, name: str, recipes: dict) -> list:
    return recipe_lines(TOY, recipes)(stablerl.get_spec(kind, name))


def test_config_recipe_renders_selection_params_and_notes():
    fields = list(stablerl.get_spec(POLICY_LOSS, "m2po").defaults())
    recipe = {POLICY_LOSS: KindLines(
        head=("run toy",), select="  {key} {name}", params_head=("(params follow)",),
        params=(Params(("  --p {items}",), item="{field}:<v>", sep=","),),
        notes=(Note("named", name="m2po"), Note("never", name="other"), Note("threshold", fields_any=frozenset(fields[:1])),
               Note(lambda spec, f: f"{spec.name} has {len(f)}"), Note("reads index", requires=("index",))))}
    # the framework's built-in name m2po: stablerl's is selected as stablerl_m2po
    assert _lines(POLICY_LOSS, "m2po", recipe) == [
        "run toy", "  --loss stablerl_m2po", "(params follow)", "  --p " + ",".join(f"{f}:<v>" for f in fields),
        "named", "threshold", f"m2po has {len(fields)}"]


def test_config_recipe_per_field_lines_filters_and_fallback():
    shaper = stablerl.get_spec(REWARD_SHAPER, "redit")
    fields = list(shaper.defaults())
    recipe = {"*": KindLines(select="pick {name}", params=(
        Params(per_field="{key}.{field}=<v>", exclude=frozenset(fields[1:])),
        Params(per_field=lambda f: f"+{f}", only=frozenset(fields[1:]))))}
    assert _lines(REWARD_SHAPER, "redit", recipe) == ["pick redit", f"--shaper.{fields[0]}=<v>",
                                                      *(f"+{f}" for f in fields[1:])]
    with pytest.raises(KeyError):  # {key} for a kind the framework has no selection key for
        _lines(BATCH_FILTER, "dynamic_sampling", {"*": KindLines()})


@dataclasses.dataclass
class _Sel(AlgorithmSelection):
    framework, label = "openrlhf", "OpenRLHF"
    components_key, weights_key = "--components", "--weights"


def test_selection_validate_names_the_frameworks_keys():
    keys = get_framework("openrlhf").selection_keys
    with pytest.raises(StableRLError, match=f"{keys[POLICY_LOSS]} is an OpenRLHF built-in"):
        _Sel(policy_loss_params={"m2_threshold": 0.1}).validate()
    with pytest.raises(StableRLError, match="--components given, but"):
        _Sel(reward_components=("a",)).validate()
    with pytest.raises(StableRLError, match="m2_treshold"):
        _Sel(policy_loss="m2po", policy_loss_params={"m2_treshold": 0.1}).validate()
    with pytest.raises(StableRLError, match="loss_agg_mode"):  # call options are checked too
        _Sel(policy_loss="m2po", policy_loss_params={"loss_agg_mode": "token-meen"}).validate()
    with pytest.raises(StableRLError, match="--weights has 1 values for 2 --components"):
        _Sel(advantage_estimator="gdpo", reward_components=("a", "b"), reward_weights=(1.0,)).validate()
    sel = _Sel(policy_loss="m2po", policy_loss_params={"m2_threshold": 0.07, "loss_agg_mode": "seq-mean-token-mean"})
    assert sel.validate() is sel
    hyper, options = sel.effective_loss_params()
    assert hyper["m2_threshold"] == 0.07 and options == {"loss_agg_mode": "seq-mean-token-mean"}


def test_selection_from_values_and_env():
    sel = _Sel.from_values({POLICY_LOSS: ("m2po", "m2_threshold=0.05", "--p"), REWARD_SHAPER: (None, None, "--s")},
                           reward_components=("x",))
    assert (sel.policy_loss, sel.policy_loss_params, sel.reward_shaper, sel.reward_components) == (
        "m2po", {"m2_threshold": 0.05}, None, ("x",))
    with pytest.raises(UnknownNameError, match="m2poo"):
        _Sel.from_values({POLICY_LOSS: ("m2poo", None, "--p")})
    variables = {POLICY_LOSS: ("L", "LP"), REWARD_SHAPER: ("S", "SP")}
    # the framework's own name (given) without a name in the environment: the environment's params are not its
    sel = _Sel.from_env({"LP": "m2_threshold=0.05"}, variables, {POLICY_LOSS: "m2po"})
    assert sel.policy_loss == "m2po" and sel.policy_loss_params == {}
    sel = _Sel.from_env({"L": "m2po", "LP": "m2_threshold=0.05", "SP": "scale=0.2"}, variables, {POLICY_LOSS: "ppo"})
    assert sel.policy_loss_params == {"m2_threshold": 0.05} and sel.reward_shaper_params == {"scale": 0.2}
    with pytest.raises(StableRLError, match="shaper_params given, but no"):  # shaper params without a shaper
        sel.validate()


def test_selection_from_config_reads_and_checks_keys():
    config = {"shaper": "redit", "shaper_params": {"scale": 0.3}}
    sel = _Sel.from_config(config, {REWARD_SHAPER: ("shaper", "shaper_params")}, prefix="algo.", batch_filter=None)
    assert (sel.reward_shaper, sel.reward_shaper_params) == ("redit", {"scale": 0.3})
    with pytest.raises(UnknownNameError, match="algo.shaper"):
        _Sel.from_config({"shaper": "redti"}, {REWARD_SHAPER: ("shaper", "shaper_params")}, prefix="algo.")
    with pytest.raises(StableRLError, match="algo.shaper_params is set but algo.shaper is not"):
        _Sel.from_config({"shaper_params": {"scale": 1}}, {REWARD_SHAPER: ("shaper", "shaper_params")}, prefix="algo.")


def test_without_zero_copy_turns_it_off_and_says_so(capsys):
    env = without_zero_copy({"env_vars": {ZERO_COPY_ENV: "1", "A": "b"}}, why="replay", what="routes",
                            carrier="log-prob tensors", label="toy")
    assert env["env_vars"] == {ZERO_COPY_ENV: "0", "A": "b"}
    assert f"toy: replay sets {ZERO_COPY_ENV}=0 for the Ray workers (was '1')" in capsys.readouterr().err
    assert without_zero_copy({}, why="x", what="y", carrier="z", label="toy") == {"env_vars": {ZERO_COPY_ENV: "0"}}
    assert capsys.readouterr().err == ""


def test_register_algorithms_names_skips_and_undo():
    ledger, decisions = PatchLedger("__toy_patch__"), {"record": [], "skip": []}
    foreign = lambda: None  # noqa: E731 - the framework's own entry

    def make(name):
        fn = lambda: name  # noqa: E731
        fn._toy = (POLICY_LOSS, name)
        return fn

    registry = {"m2po": foreign}
    register_algorithms(ledger, POLICY_LOSS, registry, make, feeds=(), prefix="s_", mark="_toy", label="toy",
                        record=lambda *a: decisions["record"].append(a), skip=lambda *a: decisions["skip"].append(a),
                        why_unfed=lambda missing: f"needs {missing}", reserved={"gmpo"})
    assert registry["m2po"] is foreign and registry["s_m2po"]() == "m2po"  # never replaced; prefixed name taken
    skipped = {name: why for _, name, why in decisions["skip"]}
    assert skipped["m2po"].startswith("toy already has 'm2po'") and skipped["gmpo"] == (
        "'gmpo' is hard-coded in toy; use s_gmpo")
    needing = [s for s in stablerl.list_algorithms(POLICY_LOSS) if s.requires and s.status != stablerl.UNAVAILABLE]
    assert needing and all(skipped[s.name] == f"needs {list(s.requires)}" for s in needing)
    assert all(f"s_{s.name}" not in registry for s in needing)
    recorded = len(decisions["record"])
    register_algorithms(ledger, POLICY_LOSS, registry, make, feeds=(), prefix="s_", mark="_toy", label="toy",
                        record=lambda *a: decisions["record"].append(a), skip=lambda *a: None,
                        why_unfed=str, only={(POLICY_LOSS, "m2po")})
    assert decisions["record"][recorded:] == [(POLICY_LOSS, "s_m2po", "m2po")]  # kept: this adapter's own entry
    ledger.restore()
    assert registry == {"m2po": foreign}


def test_option_inputs():
    assert option_inputs({}) == () and option_inputs({"top_entropy_quantile": 1.0}) == ()
    assert option_inputs({"rollout_correction": "tis", "top_entropy_quantile": 0.2}) == ("rollout_log_prob",
                                                                                        TOP_ENTROPY_INPUT)
    assert option_inputs({"rollout_correction": None, "top_entropy_quantile": True}) == ()
