"""The framework contract (stablerl.frameworks): one name rule, one precedence rule for hyper-parameters,
the framework declarations, and a fourth framework added through the register_frameworks hook. Torch only:
no framework is imported."""

from __future__ import annotations

import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stablerl
from stablerl import frameworks as F
from stablerl.contracts import ADVANTAGE_ESTIMATOR, POLICY_LOSS


def test_the_builtin_frameworks_are_declared_through_the_hook():
    assert [fw.name for fw in F.list_frameworks()] == ["verl", "trl", "openrlhf", "skyrl"]
    assert F.get_framework("verl").adapter == "stablerl.adapters.verl"
    with pytest.raises(stablerl.UnknownNameError, match="unknown framework 'verll' .*did you mean 'verl'"):
        F.get_framework("verll")
    # core imports no adapter to know them: the declarations plugin is framework-free (verl's declaration lives in
    # its package, stablerl.adapters.verl._spec, whose import neither imports verl nor instruments it)
    assert "verl" not in sys.modules
    verl_adapter = sys.modules.get("stablerl.adapters.verl")
    assert verl_adapter is None or not verl_adapter.ADAPTER.is_instrumented


def test_one_name_rule_in_every_framework():
    gspo = stablerl.get_spec(POLICY_LOSS, "gspo")
    m2po = stablerl.get_spec(POLICY_LOSS, "m2po")
    for name in ("verl", "trl", "openrlhf"):
        fw = F.get_framework(name)
        assert F.resolve(fw, POLICY_LOSS, "m2po") == F.resolve(fw, POLICY_LOSS, "stablerl_m2po") == "m2po"
        assert F.framework_names(fw, m2po) == ["m2po", "stablerl_m2po"]
        assert F.resolve(fw, POLICY_LOSS, None) is None
    # a framework's own name keeps the framework's code; ours is prefixed there
    assert F.resolve("verl", POLICY_LOSS, "gspo") is None and F.framework_names(F.get_framework("verl"), gspo) == ["stablerl_gspo"]
    assert F.resolve("openrlhf", POLICY_LOSS, "gspo") is None
    assert F.resolve("trl", POLICY_LOSS, "gspo") == "gspo"  # TRL has no 'gspo' loss_type
    with pytest.raises(stablerl.UnknownNameError, match=r"'m2p0' \(did you mean 'm2po'\?\).*trl's own: .*dapo"):
        F.resolve("trl", POLICY_LOSS, "m2p0")


def test_refusals_say_why_in_the_frameworks_words():
    with pytest.raises(stablerl.MissingInputError, match=r"hidden_states: OpenRLHF's Actor.forward returns log-probs"):
        F.resolve("openrlhf", POLICY_LOSS, "capo")
    status, why = F.reach(F.get_framework("trl"), stablerl.get_spec(POLICY_LOSS, "capo"))
    assert status == "refused" and "hidden_states: TRL's forward in _compute_loss returns log-probs" in why
    # TRL: policy versions as generation rounds (its synchronous GRPOTrainer: alpha 0); the behaviour log-probs
    # under a setting
    a3po = stablerl.get_spec(POLICY_LOSS, "a3po")
    assert F.reach(F.get_framework("trl"), a3po) == ("partial", "a3po")
    conditions = F.reach_conditions(F.get_framework("trl"), a3po)
    assert [n.split(":")[0] for n in conditions] == ["rollout_log_prob", "versions", "policy_version"]
    assert "versions == policy_version and A-3PO's alpha = 0" in conditions[1]
    assert {"versions", "policy_version"} <= F.get_framework("trl").feedable[POLICY_LOSS]
    # verl and OpenRLHF: one weight version per batch in their synchronous trainers (A-3PO's alpha = 0), under
    # that setting
    assert F.reach(F.get_framework("verl"), stablerl.get_spec(POLICY_LOSS, "a3po")) == ("partial", "a3po")
    assert any(n.startswith("versions: the legacy trainer (trainer.use_v1=false)")
               for n in F.reach_conditions(F.get_framework("verl"), stablerl.get_spec(POLICY_LOSS, "a3po")))
    assert F.reach(F.get_framework("openrlhf"), stablerl.get_spec(POLICY_LOSS, "a3po")) == ("partial", "a3po")
    assert any(n.startswith("versions: the synchronous trainer (no --train.async_enable)")
               for n in F.reach_conditions(F.get_framework("openrlhf"), stablerl.get_spec(POLICY_LOSS, "a3po")))
    # the old-log-prob pass's entropy at verl's advantage step: kept by the adapter in the legacy trainer only
    assert F.reach(F.get_framework("verl"), stablerl.get_spec("batch_filter", "d3s")) == ("partial", "d3s")
    assert F.reach_conditions(F.get_framework("verl"), stablerl.get_spec("batch_filter", "d3s"))[0].startswith(
        "entropy: the legacy trainer (trainer.use_v1=false) without bypass mode")
    # the old-log-prob pass's entropy: every framework feeds it to erc (verl: under a setting; SkyRL since issue 27)
    assert F.selectable_in(stablerl.get_spec(POLICY_LOSS, "erc")) == ["verl", "trl", "openrlhf", "skyrl"]
    assert F.selectable_in(stablerl.get_spec(POLICY_LOSS, "m2po")) == ["verl", "trl", "openrlhf", "skyrl"]
    assert F.selectable_in(stablerl.get_spec("batch_filter", "gtpo_entropy_filter")) == ["verl", "trl", "openrlhf",
                                                                                         "skyrl"]
    assert F.reach(F.get_framework("skyrl"), stablerl.get_spec("batch_filter", "d3s")) == ("selectable", "d3s")


def test_partial_reach_says_what_the_user_must_set():
    """An input fed only under a setting makes the algorithm 'partial': still selectable (config lines, name
    resolution), with the setting named in the reach table and the config lines."""
    pacs = stablerl.get_spec(POLICY_LOSS, "pacs")
    orlhf = F.get_framework("openrlhf")
    assert F.reach(orlhf, pacs) == ("partial", "pacs")
    assert F.reach_conditions(orlhf, pacs) == [f"index: {orlhf.conditions[POLICY_LOSS]['index']}"]
    assert F.resolve("openrlhf", POLICY_LOSS, "pacs") == "pacs" and "openrlhf" in F.selectable_in(pacs)
    assert any("--rollout.n_samples_per_prompt" in line for line in F.config_lines(pacs)["openrlhf"])
    # verl: whole prompt groups only in the legacy trainer with a micro-batch that is a multiple of rollout.n
    verl = F.get_framework("verl")
    assert F.reach(verl, pacs) == ("partial", "pacs")
    assert F.reach_conditions(verl, pacs) == [f"index: {verl.conditions[POLICY_LOSS]['index']}"]
    assert "trainer.use_v1=false" in verl.conditions[POLICY_LOSS]["index"]
    row = next(r for r in F.reach_table([pacs]))
    assert row["reach"]["openrlhf"]["status"] == "partial" and "needs" in row["reach"]["openrlhf"]
    assert row["reach"]["verl"]["status"] == "partial" and "needs" in row["reach"]["verl"]
    erc = next(r for r in F.reach_table([stablerl.get_spec(POLICY_LOSS, "erc")]))
    assert erc["reach"]["verl"]["status"] == "partial" and any("old_entropy" in n for n in erc["reach"]["verl"]["needs"])
    assert erc["reach"]["trl"] == erc["reach"]["openrlhf"] == {"status": "selectable", "name": "erc"}
    counts = F.reach_counts(F.reach_table([pacs]))
    assert counts["openrlhf"] == {"selectable": 0, "partial": 1, "refused": 0}


def _values(settings):
    return {s.name: (s.value, s.source) for s in settings}


def test_paper_default_wins_over_a_framework_default_and_says_so():
    gspo = stablerl.get_spec(POLICY_LOSS, "gspo")
    verl = F.get_framework("verl")
    at_verl_defaults = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}
    s = F.effective_hyperparameters(verl, gspo, {}, at_verl_defaults)
    assert _values(s) == {"clip_ratio_low": (3e-4, F.FROM_PAPER_DEFAULT), "clip_ratio_high": (4e-4, F.FROM_PAPER_DEFAULT)}
    note = {x.name: x.note for x in s}["clip_ratio_low"]
    assert note == ("actor_rollout_ref.actor.clip_ratio_low=0.2 is verl's default, not applied; to run with it set "
                    "+actor_rollout_ref.actor.policy_loss.clip_ratio_low=0.2")
    assert F.as_params(s) == {}
    # a framework key the user set applies; a stablerl key beats it
    s = F.effective_hyperparameters(verl, gspo, {"clip_ratio_high": 5e-4}, {"clip_ratio_low": 1e-4, "clip_ratio_high": 0.2})
    assert _values(s) == {"clip_ratio_low": (1e-4, F.FROM_FRAMEWORK_KEY), "clip_ratio_high": (5e-4, F.FROM_STABLERL_KEY)}
    # where the framework can tell what was given (OpenRLHF's argv), a given default value counts as set
    s = F.effective_hyperparameters("openrlhf", gspo, {}, {"clip_ratio_low": 0.2}, user_set={"clip_ratio_low"})
    assert _values(s)["clip_ratio_low"] == (0.2, F.FROM_FRAMEWORK_KEY)
    with pytest.raises(stablerl.UnknownNameError, match="'clip_ratio_hihg'.*did you mean 'clip_ratio_high'"):
        F.effective_hyperparameters(verl, gspo, {"clip_ratio_hihg": 0.3}, {})


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from([s.name for s in stablerl.list_algorithms(POLICY_LOSS) if s.defaults()]),
    framework=st.sampled_from(["verl", "trl", "openrlhf"]),
    data=st.data(),
)
def test_precedence_holds_for_every_loss_and_framework(name, framework, data):
    """For any loss, any subset of stablerl keys and of framework keys (at or off the framework default):
    the value comes from the stablerl key if given, else from a framework key set off its default, else
    is the paper default -- and the recorded source says which."""
    spec = stablerl.get_spec(POLICY_LOSS, name)
    fw = F.get_framework(framework)
    defaults = spec.defaults()
    keys = fw.hyperparameter_keys.get(POLICY_LOSS, {})
    mine = {k: 0.123 for k in data.draw(st.sets(st.sampled_from(sorted(defaults))), label="stablerl keys")}
    theirs = {}
    for k in data.draw(st.sets(st.sampled_from(sorted(keys))), label="framework keys"):
        theirs[k] = data.draw(st.sampled_from([keys[k].default, 0.456]), label=k)
    for s in F.effective_hyperparameters(fw, spec, mine, theirs):
        if s.name in mine:
            assert (s.value, s.source) == (0.123, F.FROM_STABLERL_KEY)
        elif s.name in theirs and theirs[s.name] == 0.456 and s.name in keys:
            assert (s.value, s.source) == (0.456, F.FROM_FRAMEWORK_KEY)
        else:
            assert (s.value, s.source) == (defaults[s.name], F.FROM_PAPER_DEFAULT)
            assert bool(s.note) == (s.name in theirs and theirs[s.name] is not None and theirs[s.name] != defaults[s.name])


def test_an_advantage_knob_the_estimator_cannot_honour_is_refused():
    rloo = stablerl.get_spec(ADVANTAGE_ESTIMATOR, "rloo")
    grpo = stablerl.get_spec(ADVANTAGE_ESTIMATOR, "grpo")
    F.check_framework_keys_used("trl", rloo, {"norm_adv_by_std_in_grpo": True})  # TRL's default: nothing to refuse
    with pytest.raises(stablerl.StableRLError, match="scale_rewards='none' has no effect.*'rloo'"):
        F.check_framework_keys_used("trl", rloo, {"norm_adv_by_std_in_grpo": False})
    F.check_framework_keys_used("trl", grpo, {"norm_adv_by_std_in_grpo": False})  # grpo honours it
    s = F.effective_hyperparameters("trl", grpo, {}, {"norm_adv_by_std_in_grpo": False})
    assert _values(s)["norm_adv_by_std_in_grpo"] == (False, F.FROM_FRAMEWORK_KEY)
    assert {x.name: x.key for x in s}["norm_adv_by_std_in_grpo"] == "scale_rewards='none'"


def test_format_and_log_once(capsys, caplog):
    gspo = stablerl.get_spec(POLICY_LOSS, "gspo")
    s = F.effective_hyperparameters("verl", gspo, {}, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2})
    F._LOGGED.clear()
    with caplog.at_level("WARNING"):
        F.log_effective_settings("verl", gspo, s)
        F.log_effective_settings("verl", gspo, s)
    err = capsys.readouterr().err
    assert err.count("stablerl/verl: policy loss 'gspo' runs with:") == 1
    assert "clip_ratio_high = 0.0004  (paper default: +actor_rollout_ref.actor.policy_loss.clip_ratio_high=<value>)" in err
    assert caplog.text.count("is verl's default, not applied") == 2  # one warning per note, once


def test_describe_framework_prints_the_effective_settings(capsys):
    from stablerl.cli import main

    assert main(["describe", "gspo", "--framework", "verl"]) == 0
    out = capsys.readouterr().out
    assert "verl: select with actor_rollout_ref.actor.policy_loss.loss_mode=stablerl_gspo" in out
    assert "clip_ratio_low  = 0.0003" in out and "One precedence rule in every framework" in out
    assert main(["describe", "capo", "--framework", "trl"]) == 0
    assert "trl: 'capo' cannot be selected: needs" in capsys.readouterr().out
    assert main(["describe", "gspo", "--framework", "jax"]) == 2
    assert "unknown framework 'jax'" in capsys.readouterr().err


def test_a_fourth_framework_through_the_hook(tmp_path, monkeypatch):
    """A third party declares a framework without touching core: it resolves names, refuses what it
    cannot feed, and applies the precedence rule, like the built-in three."""
    pkg = tmp_path / "sr_jaxrl"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent('''
        from stablerl import hookimpl
        from stablerl.frameworks import FrameworkKey, FrameworkSpec

        @hookimpl
        def register_frameworks(register):
            register(FrameworkSpec(
                name="jaxrl", distribution="jaxrl", supported=">=1.0", adapter="sr_jaxrl.adapter",
                builtin_names={"policy_loss": frozenset({"ppo"})},
                feedable={"policy_loss": frozenset({"entropy"})},
                why_not={"*": {"index": "jaxrl shuffles rows"}},
                selection_keys={"policy_loss": "loss.name"},
                hyperparameter_keys={"policy_loss": {"clip_ratio_low": FrameworkKey("loss.eps", 0.1)}},
                params_keys={"policy_loss": "loss.stablerl.{name}={value}"},
                config_lines=lambda spec: [f"loss.name={spec.name}"],
            ))
    '''))
    (pkg / "adapter.py").write_text("LOADED = True\n")
    info = tmp_path / "sr_jaxrl-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sr-jaxrl\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[stablerl]\njaxrl = sr_jaxrl\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("STABLERL_PLUGINS", raising=False)
    try:
        stablerl.reload_registry()
        assert [fw.name for fw in F.list_frameworks()] == ["verl", "trl", "openrlhf", "skyrl", "jaxrl"]
        assert F.resolve("jaxrl", POLICY_LOSS, "ppo") is None and F.resolve("jaxrl", POLICY_LOSS, "m2po") == "m2po"
        with pytest.raises(stablerl.MissingInputError, match="index: jaxrl shuffles rows"):
            F.resolve("jaxrl", POLICY_LOSS, "pacs")
        s = F.effective_hyperparameters("jaxrl", stablerl.get_spec(POLICY_LOSS, "vanilla"), {}, {"clip_ratio_low": 0.1})
        assert {x.name: x.note for x in s}["clip_ratio_low"] == (
            "loss.eps=0.1 is jaxrl's default, not applied; to run with it set loss.stablerl.clip_ratio_low=0.1")
        assert F.config_lines(stablerl.get_spec(POLICY_LOSS, "m2po"))["jaxrl"] == ["loss.name=m2po"]
        assert F.load_adapter("jaxrl").LOADED is True
    finally:
        monkeypatch.undo()
        sys.modules.pop("sr_jaxrl", None)
        sys.modules.pop("sr_jaxrl.adapter", None)
        stablerl.reload_registry()


def test_a_framework_difference_by_design_is_shown_with_the_config_lines():
    """M2PO's 'old' policy is a different thing in each framework: each declaration says which."""
    lines = F.config_lines(stablerl.get_spec(POLICY_LOSS, "m2po"))
    assert lines["verl"][-1].startswith("(in verl: old_log_prob is the actor's recomputed log-prob")
    assert "detached current policy" in lines["trl"][-1]
    assert "no way to give the behaviour (vLLM) policy" in lines["openrlhf"][-1]


def test_aggregations_and_rollout_corrections_by_the_loss_params_key():
    """delta_l and stablerl's rollout corrections are set through each framework's stablerl loss-params key
    (CALL_OPTIONS), or a dedicated key where the framework declares one (TRL's stablerl_rollout_correction):
    partial everywhere (they act on a stablerl loss), checked up front, shown as settings."""
    tis = stablerl.get_spec("rollout_correction", "tis")
    delta_l = stablerl.get_spec("aggregation", "delta_l")
    vanilla = stablerl.get_spec(POLICY_LOSS, "vanilla")
    for fw in F.list_frameworks():
        assert F.reach(fw, delta_l)[0] == "partial" and F.reach(fw, tis)[0] == "partial"
    assert F.reach(F.get_framework("openrlhf"), delta_l)[1] == "--actor.stablerl_params loss_agg_mode=delta_l"
    assert F.reach(F.get_framework("verl"), tis)[1] == \
        "+actor_rollout_ref.actor.policy_loss.stablerl_params={rollout_correction:tis}"
    # TRL: a dedicated key (stablerl_loss_params' rollout_correction is its alias), with TRL's own correction off
    trl = F.get_framework("trl")
    assert F.reach(trl, tis)[1] == 'stablerl_rollout_correction="tis"'
    assert ("rollout_log_prob: use_vllm=True (or a rollout_func returning logprobs) and "
            "vllm_importance_sampling_correction=False") in F.reach_conditions(trl, tis)
    assert F.config_lines(tis)["trl"][:2] == ['stablerl_rollout_correction="tis"',
                                             'stablerl_rollout_correction_params={"threshold": <value>, "level": <value>}']
    assert [s.key for s in F.effective_hyperparameters("trl", tis, {}, {})][0] == \
        'stablerl_rollout_correction_params={"threshold": <value>}'
    settings = F.effective_hyperparameters("openrlhf", vanilla, {"loss_agg_mode": "delta_l", "clip_ratio_c": 3.0})
    hyper, options = F.split_call_options(F.as_params(settings))
    assert options == {"loss_agg_mode": "delta_l"} and hyper == {"clip_ratio_c": 3.0}
    F.check_call_options("verl", vanilla, {"loss_agg_mode": "delta_l", "loss_agg_params": {"alpha": 0.5}})
    with pytest.raises(stablerl.StableRLError, match=r"alpha"):
        F.check_call_options("verl", vanilla, {"loss_agg_mode": "delta_l", "loss_agg_params": {"alpha": "x"}})
    with pytest.raises(stablerl.StableRLError, match="rollout_correction_params given without rollout_correction"):
        F.check_call_options("verl", vanilla, {"rollout_correction_params": {"threshold": 2.0}})
    with pytest.raises(stablerl.MissingInputError, match=r"rollout_correction='tis' needs .*rollout_log_prob"):
        F.check_call_options("trl", vanilla, {"rollout_correction": "tis"}, feedable={"entropy"})
    with pytest.raises(stablerl.UnknownNameError, match=r"'loss_agg_mod'.*loss_agg_mode"):
        F.effective_hyperparameters("trl", vanilla, {"loss_agg_mod": "delta_l"})


def test_router_families_are_reached_through_routing_replay():
    """No key names a router family: each framework's routing-replay switch uses the detected one."""
    qwen3 = stablerl.get_spec("router_family", "qwen3_moe")
    replaying = [fw for fw in F.list_frameworks() if "routing_replay" in fw.switches]
    assert [fw.name for fw in replaying] == ["verl", "trl", "openrlhf", "skyrl"]
    for fw in replaying:
        status, how = F.reach(fw, qwen3)
        assert status == "selectable" and how == fw.switches["routing_replay"] and "R2" in how
    assert F.config_lines(qwen3)["skyrl"][0].startswith("trainer.algorithm.stablerl_routing_replay=R2")
    assert F.config_lines(qwen3)["openrlhf"][0].startswith("--actor.stablerl_routing_replay R2")


def test_controllers_reach_trl_and_the_others_say_why():
    aepo = stablerl.get_spec("controller", "aepo")
    assert F.reach(F.get_framework("trl"), aepo) == ("selectable", "aepo")
    assert 'GRPOConfig(entropy_controller="aepo", ...)' in F.config_lines(aepo)["trl"]
    status, why = F.reach(F.get_framework("verl"), aepo)
    assert status == "refused" and "rollout_temperature: verl's rollout temperature is one config value" in why
    # verl runs the controller that acts through its own entropy bonus (actor.entropy_coeff)
    adaptive = stablerl.get_spec("controller", "adaptive_entropy")
    assert F.reach(F.get_framework("verl"), adaptive) == ("partial", "adaptive_entropy")
    assert F.reach(F.get_framework("trl"), adaptive) == ("selectable", "adaptive_entropy")
    assert "+actor_rollout_ref.actor.policy_loss.stablerl_entropy_controller=adaptive_entropy" in F.config_lines(
        adaptive)["verl"]
    # OpenRLHF too (its --actor.entropy_coef); a rollout temperature / a per-turn term of its own it cannot feed
    assert F.reach(F.get_framework("openrlhf"), adaptive) == ("selectable", "adaptive_entropy")
    assert "  --actor.stablerl_entropy_controller adaptive_entropy" in F.config_lines(adaptive)["openrlhf"]
    status, why = F.reach(F.get_framework("openrlhf"), aepo)
    assert status == "refused" and "rollout_temperature: OpenRLHF samples every rollout at one --rollout.temperature" in why
    status, why = F.reach(F.get_framework("openrlhf"), stablerl.get_spec("controller", "epo"))
    assert status == "refused" and "loss_term: a controller's own term is defined per agent turn" in why
    capo = stablerl.get_spec(POLICY_LOSS, "capo")
    for fw in F.list_frameworks():  # every refusal in the framework's own words, not the input's description
        status, why = F.reach(fw, capo)
        assert status == "refused" and "hidden_states: " + fw.why_not["*"]["hidden_states"] in why


def test_parse_params_reads_key_value_items_and_json_objects():
    from stablerl.params import StableRLError, parse_params

    assert parse_params(["m2_threshold=0.04", "flag=true", "name=tis", "none=null"], "--p") == {
        "m2_threshold": 0.04, "flag": True, "name": "tis", "none": None}
    assert parse_params('{"loss_agg_params": {"alpha": 0.5}}', "--p") == {"loss_agg_params": {"alpha": 0.5}}
    assert parse_params("k=1", "--p") == {"k": 1} and parse_params({"k": 2}, "--p") == {"k": 2}
    assert parse_params(None, "--p") == parse_params("", "--p") == parse_params([], "--p") == {}
    with pytest.raises(StableRLError, match=r"--p: expected KEY=VALUE items \(e.g. m2_threshold=0.04\), got 'k'"):
        parse_params(["k"], "--p")
    with pytest.raises(StableRLError, match=r"--p: not a JSON object \(Expecting property name .*\): '\{1\}'"):
        parse_params("{1}", "--p")


def test_installed_version():
    from stablerl.frameworks import installed_version

    import torch

    assert installed_version("torch").split("+")[0] == torch.__version__.split("+")[0]
    assert installed_version("no-such-distribution-stablerl") is None
