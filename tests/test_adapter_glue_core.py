"""Core functions that adapters call instead of writing them (issue 14): selection checks, the dedicated-key /
alias rule of a call option, advantages from one score per response, declared and supplied inputs, the state
file and its legacy JSON, the controller driver and trainer-hook passes, routing-replay modes."""

import json

import pytest
import torch

import stablerl
from stablerl.contracts import ADVANTAGE_ESTIMATOR, POLICY_LOSS, ROLLOUT_CORRECTION, ParamsView
from stablerl.params import MissingInputError, StableRLError, UnknownNameError


def test_params_dict_reads_dicts_and_json_objects_only():
    from stablerl.params import params_dict

    assert params_dict(None, "k") == {} and params_dict("", "k") == {}
    assert params_dict('{"m2_threshold": 0.04}', "k") == {"m2_threshold": 0.04}
    given = {"a": 1}
    assert params_dict(given, "k") == given and params_dict(given, "k") is not given
    with pytest.raises(StableRLError, match="k must be a JSON object"):
        params_dict("{m2_threshold: 0.04}", "k")
    with pytest.raises(StableRLError, match="k must be a dict .* got list"):
        params_dict([1], "k")


def test_check_selection_names_params_and_params_without_a_name():
    from stablerl.frameworks import check_selection

    kw = dict(key="advantage_estimator", params_key="stablerl_advantage_params")
    assert check_selection("trl", ADVANTAGE_ESTIMATOR, None, {}, **kw) is None
    assert check_selection("trl", ADVANTAGE_ESTIMATOR, "none", {}, **kw) is None
    assert check_selection("trl", ADVANTAGE_ESTIMATOR, "stablerl_qae", {"quantile_k": 0.4}, **kw) == "qae"
    with pytest.raises(StableRLError, match="stablerl_advantage_params is set but advantage_estimator is not"):
        check_selection("trl", ADVANTAGE_ESTIMATOR, None, {"quantile_k": 0.4}, **kw)
    with pytest.raises(UnknownNameError, match="did you mean 'qae'"):
        check_selection("trl", ADVANTAGE_ESTIMATOR, "qaee", {}, **kw)
    with pytest.raises(UnknownNameError, match="quantile_k"):
        check_selection("trl", ADVANTAGE_ESTIMATOR, "qae", {"quantile": 0.4}, **kw)


def test_dedicated_call_option_or_its_alias_never_both():
    from stablerl.frameworks import dedicated_call_option

    def setting(name, params, loss_params):
        return dedicated_call_option("trl", ROLLOUT_CORRECTION, name, params, loss_params, "stablerl_loss_params")

    assert setting(None, {}, {"clip_ratio_high": 0.3}) == (None, {})
    assert setting("tis", {"threshold": 2.0}, {}) == ("tis", {"threshold": 2.0})
    alias = {"rollout_correction": "icepop", "rollout_correction_params": '{"low": 0.5}'}
    assert setting(None, {}, alias) == ("icepop", {"low": 0.5})
    with pytest.raises(StableRLError, match=r"set twice: stablerl_rollout_correction\(_params\) and "
                                            r"stablerl_loss_params' rollout_correction"):
        setting("tis", {}, {"rollout_correction": "tis"})


def test_check_signatures_names_the_missing_method_and_parameter():
    from stablerl.frameworks import UnsupportedVersionError, check_signatures

    class Trainer:
        def step(self, model, inputs):
            pass

    check_signatures("trl", Trainer, {"step": ("model", "inputs")}, "1.16.0")
    with pytest.raises(UnsupportedVersionError, match=r"trl 1.16.0: Trainer.step lacks parameter\(s\) \['batch'\]"):
        check_signatures("trl", Trainer, {"step": ("model", "batch")}, "1.16.0")
    with pytest.raises(UnsupportedVersionError, match="Trainer.load no longer exists; stablerl.adapters.trl supports"):
        check_signatures("trl", Trainer, {"load": ()}, "1.16.0")


def test_advantages_from_scores_last_token_unscorable_rows_and_empty_masks():
    from stablerl.frameworks import advantages_from_scores

    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]], dtype=torch.int32)
    scores = torch.tensor([1.0, 0.0, 7.0, 1.0, 0.0])
    group = torch.tensor([0, 0, 0, 1, 1])
    unscorable = torch.tensor([False, False, True, False, False])
    adv, metrics = advantages_from_scores("grpo", scores, mask, group, unscorable=unscorable)
    assert adv.dtype == torch.float32 and adv.shape == (5, 3)
    # group 0 without its unscorable row: scores (1, 0) -> +-1/sqrt(2) (unbiased std), on every valid token
    ref, _ = stablerl.compute_advantage("grpo", token_level_rewards=torch.tensor([[0.0, 1.0], [0.0, 0.0]]),
                                        response_mask=torch.ones(2, 2), index=torch.tensor([0, 0]))
    torch.testing.assert_close(adv[0, :2], ref[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(adv[1, 1], ref[1, 1], rtol=1e-6, atol=1e-7)
    assert float(adv[0, 0]) == pytest.approx(2 ** -0.5, rel=1e-5)
    assert torch.all(adv[2] == 0)  # unscorable: advantage 0
    # the empty row keeps its score (on position 0) in its group's statistics: (1, 0) again
    assert float(adv[3, 0]) == pytest.approx(float(adv[0, 0]), rel=1e-6) and float(adv[4, 0]) < 0
    per_response = torch.tensor([adv[0, 1], adv[1, 2], 0.0, adv[3, 0], adv[4, 1]])
    assert metrics["advantages/mean"] == pytest.approx(float(per_response.mean()), abs=1e-6)
    assert metrics["advantages/frac_zero"] == pytest.approx(0.2)


def test_declared_inputs_and_supplied_inputs():
    from stablerl.frameworks import check_supplied_inputs, declared_inputs

    spec = stablerl.get_spec("reward_shaper", "grpo_lambda")
    assert "correct" in spec.requires
    given = {"correct": [1, 0], "lengths": torch.tensor([3.0, 2.0])}
    got = declared_inputs(spec, given.get, lambda n: f"give {n}", skip=("index", "scores"))
    assert set(got) == set(spec.requires) - {"index", "scores"} and got["correct"] == [1, 0]
    with pytest.raises(MissingInputError, match=r"reward shaper 'grpo_lambda' needs input 'correct' \(.*\): give correct"):
        declared_inputs(spec, {}.get, lambda n: f"give {n}", skip=("index", "scores", "lengths"))

    loss = stablerl.get_spec(POLICY_LOSS, "a3po")
    kw = dict(declared_in="stablerl_extra_loss_inputs", supplied_by="stablerl_loss_inputs")
    declared = ["rollout_log_prob", "versions", "policy_version"]
    full = {"rollout_log_prob": 0, "versions": 0, "policy_version": 3}
    assert check_supplied_inputs(loss, declared, full, **kw) is full
    with pytest.raises(StableRLError, match=r"stablerl_loss_inputs returned \['entropy'\], which "
                                            r"stablerl_extra_loss_inputs does not list"):
        check_supplied_inputs(loss, declared, {**full, "entropy": 0}, **kw)
    with pytest.raises(MissingInputError, match=r"'a3po' needs \['versions'\], declared in stablerl_extra_loss_inputs, "
                                                r"but stablerl_loss_inputs did not return them"):
        check_supplied_inputs(loss, declared, {"rollout_log_prob": 0, "policy_version": 3}, **kw)


def test_state_file_round_trip_and_the_legacy_json(tmp_path):
    from stablerl.state import LEGACY_FORMAT, StateStore, from_legacy_json, read_state

    store = StateStore(holds="trainer")
    store.slot(POLICY_LOSS, "capo")["m"] = torch.arange(6.0).reshape(2, 3)
    gen = store.generator("shaper", 7)
    torch.rand(3, generator=gen)
    path = str(tmp_path / "sub" / "state.pt")
    assert store.save(path) == path and not (tmp_path / "sub" / "state.pt.tmp").exists()
    fresh = StateStore(holds="trainer")
    assert fresh.load(path) and not fresh.load(str(tmp_path / "missing.pt"))
    assert torch.equal(fresh.slot(POLICY_LOSS, "capo")["m"], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(torch.rand(2, generator=fresh.generator("shaper", 7)), torch.rand(2, generator=gen))
    assert read_state(str(tmp_path / "missing.pt")) is None

    legacy = {"format": LEGACY_FORMAT, "rng": gen.get_state().tolist(),
              "ctx_state": {"entropic": {"integral": 0.5}, "shaper:redit": {"n": 2},
                            "adv:grpo": {"t": {"__tensor__": [1, 2], "dtype": "int64", "shape": [2]}}},
              "controller": {"name": "aepo", "state": {"steps": 3}, "decision": {"temperature": 1.2}}}
    (tmp_path / "old.json").write_text(json.dumps(legacy))
    state = from_legacy_json(read_state(str(tmp_path / "old.json")), "trainer", ("shaper", 7))
    old = StateStore(holds="trainer")
    old.load_state_dict(state)
    assert old.slot(POLICY_LOSS, "entropic") == {"integral": 0.5} and old.slot("reward_shaper", "redit") == {"n": 2}
    assert torch.equal(old.slot(ADVANTAGE_ESTIMATOR, "grpo")["t"], torch.tensor([1, 2]))
    assert torch.equal(old.generator("shaper", 7).get_state(), gen.get_state())
    assert state["objects"]["controller"] == {"aepo": {"state": {"steps": 3}, "decision": {"temperature": 1.2}}}


def test_controller_driver_steps_applies_saves_and_restores():
    from stablerl.trainer_loop import ControllerDriver

    applied = []
    driver = ControllerDriver("aepo", {"entropy_base": 0.5}, provides=("entropy", "turn_entropy"), framework="TRL",
                              gives="the mean entropy", apply=applied.append)
    assert driver.penalty is None and not driver.per_turn
    metrics = driver.step(entropy=0.3, turn_entropy=[0.3])  # turn_entropy: not a parameter of aepo's step
    p = driver.controller.params
    assert driver.decision["temperature"] == p.temperature_high and applied[-1] == driver.decision
    assert metrics == {"temperature": p.temperature_high, "num_samples": float(p.reinforce_sample_num),
                       "below_target": 1.0, "active": 1.0}
    again = ControllerDriver("aepo", {"entropy_base": 0.5}, provides=("entropy",), framework="TRL", gives="",
                             apply=applied.append)
    again.load_state_dict(driver.state_dict())
    assert again.controller.steps == 1 and applied[-1] == driver.decision  # the decision is re-applied

    epo = ControllerDriver("epo", {}, provides=("entropy", "turn_entropy"), framework="TRL", gives="",
                           apply=lambda d: None)
    assert epo.per_turn
    epo.step(turn_entropy=[0.4])
    h, mask = torch.rand(3, 4, dtype=torch.float64), torch.ones(3, 4, dtype=torch.int32)
    term, _ = epo.loss_term(h, mask, stablerl.Context())
    ref, _ = epo.controller.penalty(h, torch.zeros(3, dtype=torch.long), mask.to(h.dtype), loss_agg_mode="token-mean",
                                    ctx=stablerl.Context())
    assert float(term) == float(ref)


def test_controller_driver_refuses_a_statistic_the_framework_lacks(monkeypatch):
    import stablerl.trainer_loop as loop

    class NeedsKL(stablerl.Controller):
        def step(self, entropy, kl):
            return {}

    monkeypatch.setattr(loop, "make_controller", lambda name, **params: NeedsKL(None))
    with pytest.raises(MissingInputError, match=r"needs statistic\(s\) \['kl'\] that TRL does not provide \(it gives"):
        loop.ControllerDriver("x", {}, provides=("entropy",), framework="TRL", gives="it gives entropy",
                              apply=lambda d: None)


def test_hook_passes_count_the_passes_of_each_batch():
    from stablerl.trainer_loop import HookPasses

    weight = torch.nn.Parameter(torch.zeros(2))
    view = ParamsView(parameters=lambda: [weight])
    passes = HookPasses("sfpo", {"inner_steps": 2, "alpha": 0.5})
    assert passes.hook.passes_per_batch() == 3 and passes.pass_index is None
    assert passes.after_pass(view, entropy=1.0) == {}  # between batches: nothing
    assert passes.before_pass(view) and not passes.before_pass(view)  # only the batch's first pass starts it
    seen = []
    for k in range(3):
        with torch.no_grad():
            weight += 1.0  # the optimizer step of pass k
        seen.append((passes.pass_index, passes.after_pass(view, entropy=1.0)))
    assert [k for k, _ in seen] == [0, 1, 2] and passes.pass_index is None
    assert seen[1][1]["repositioned"] == 1.0 and torch.allclose(weight, torch.full((2,), 2.0))  # 0 + 0.5 * (2 - 0) + 1
    assert seen[2][1]["active"] == 1.0 and seen[0][1] == {}
    assert passes.before_pass(view, passes=1) and passes.after_pass(view) == {}  # sfpo's pass 0 of its 3
    assert passes.pass_index is None  # the framework's count (1) ended the batch


def test_routing_replay_modes_and_dense_models():
    from stablerl import routing_replay as rr

    assert rr.parse_mode("r2", "k") == "R2" and rr.parse_mode(" R3 ", "k") == "R3"
    assert all(rr.parse_mode(v, "k") is None for v in (None, "", "none", "Off", "false"))
    with pytest.raises(UnknownNameError, match="routing_replay value 'R4'|'R4'"):
        rr.parse_mode("R4", "routing_replay")
    with pytest.raises(StableRLError, match="routing_replay='R2' needs a Mixture-of-Experts model .* no MoE router"):
        rr.require_routers(torch.nn.Linear(2, 2), needed_by="routing_replay='R2'")
