"""The FrameworkAdapter base class, providers and the advantage step (stablerl.adapter / providers / steps)."""

from __future__ import annotations

import pytest
import torch

import stablerl
from stablerl.adapter import FrameworkAdapter
from stablerl.frameworks import UnsupportedVersionError
from stablerl.params import MissingInputError, StableRLError
from stablerl.providers import provides
from stablerl.steps import AdvantageSelection, AdvantageStep, BatchRecord

ADV, FILTER, SHAPER = stablerl.ADVANTAGE_ESTIMATOR, stablerl.BATCH_FILTER, stablerl.REWARD_SHAPER


class _Host:
    def __init__(self):
        self.patched = False


HOST = _Host()


def _make(version="1.0", fail=False, name="verl"):
    calls = {"provided": 0, "uninstrument": 0}

    class Toy(FrameworkAdapter):
        def installed_version(self):
            return version

        def _instrument(self, ledger, **options):
            ledger.set_attr("host.patched", HOST, "patched", True)
            if fail:
                raise RuntimeError("boom")

        def _uninstrument(self):
            calls["uninstrument"] += 1

        @provides("old_entropy", to=(ADV, FILTER), extra_pass=True)
        def old_entropy(self, record):
            calls["provided"] += 1
            return record.host["entropy"]

        @provides("rollout_log_prob", to=(stablerl.POLICY_LOSS,), condition="engine.logprobs=True")
        def rollout_log_prob(self, record):
            return None

    Toy.name = name
    return Toy, calls


def test_feedable_and_conditions_are_derived_from_providers():
    Toy, _ = _make()
    assert Toy.feedable() == {ADV: frozenset({"old_entropy"}), FILTER: frozenset({"old_entropy"}),
                              stablerl.POLICY_LOSS: frozenset({"rollout_log_prob"})}
    assert Toy.conditions() == {stablerl.POLICY_LOSS: {"rollout_log_prob": "engine.logprobs=True"}}
    assert Toy.providers[ADV, "old_entropy"].extra_pass is True


def test_provides_refuses_unknown_inputs_and_kinds():
    with pytest.raises(StableRLError, match="not an optional input"):
        provides("old_entropie", to=(ADV,))
    with pytest.raises(StableRLError, match="kinds must be"):
        provides("old_entropy", to=("advantage",))


def test_instrument_is_idempotent_and_uninstrument_restores():
    Toy, calls = _make(version="0.9.1")
    adapter = Toy()
    assert Toy() is adapter  # one instance per class
    assert adapter.instrument() is True and HOST.patched is True
    assert adapter.instrument() is False  # idempotent
    assert adapter.is_instrumented and adapter.version == "0.9.1"
    assert adapter.uninstrument() is True and HOST.patched is False and calls["uninstrument"] == 1
    assert adapter.uninstrument() is False


def test_failed_instrument_restores_what_it_patched():
    Toy, calls = _make(version="0.9.1", fail=True)
    with pytest.raises(RuntimeError, match="boom"):
        Toy().instrument()
    assert HOST.patched is False and not Toy().is_instrumented and calls["uninstrument"] == 1


def test_version_outside_the_declared_range_is_refused_naming_both(monkeypatch):
    monkeypatch.delenv("STABLERL_ALLOW_UNSUPPORTED", raising=False)
    Toy, _ = _make(version="0.8.0")
    with pytest.raises(UnsupportedVersionError, match=r"0\.8\.0.*install a supported version"):
        Toy().instrument()
    assert HOST.patched is False
    assert Toy().dependencies() == (f"verl{stablerl.frameworks.get_framework('verl').supported}",)
    with pytest.warns(RuntimeWarning, match="STABLERL_ALLOW_UNSUPPORTED"):
        assert Toy().instrument(allow_unsupported=True)
    Toy().uninstrument()


def test_record_calls_a_provider_once_and_only_when_read():
    Toy, calls = _make()
    record = BatchRecord(Toy(), host={"entropy": torch.ones(2, 3)})
    assert calls["provided"] == 0
    assert torch.equal(record.input(ADV, "old_entropy"), torch.ones(2, 3))
    record.input(ADV, "old_entropy")
    assert calls["provided"] == 1
    record.produced["old_entropy"] = torch.zeros(2, 3)  # what the batch produced wins over the provider
    assert torch.equal(record.input(FILTER, "old_entropy"), torch.zeros(2, 3))


def test_missing_required_input_names_the_condition():
    Toy, _ = _make()
    record = BatchRecord(Toy())
    spec = stablerl.get_spec(stablerl.POLICY_LOSS, "decoupled_ppo")  # requires rollout_log_prob
    assert "rollout_log_prob" in spec.requires
    with pytest.raises(MissingInputError, match=r"rollout_log_prob.*feeds it only with engine\.logprobs=True"):
        record.declared(spec)


def _batch():
    torch.manual_seed(0)
    mask = torch.ones(4, 3)
    mask[1, 2] = 0
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    return mask, scores, torch.tensor([0, 0, 1, 1])


def test_advantage_step_equals_the_core_calls_in_order():
    mask, scores, index = _batch()
    sel = AdvantageSelection(estimator="grpo", reward_shaper="fapo", batch_filter="dynamic_sampling")
    flawed = torch.tensor([False, False, True, False])
    record = BatchRecord(None, response_mask=mask, index=index, scores=scores.clone(),
                         produced={"flawed": flawed, "correct": scores > 0})
    ctx = lambda kind, name: stablerl.Context()  # noqa: E731
    result = AdvantageStep(sel, ctx=ctx, filter_key="k").run(record)
    shaped, _ = stablerl.shape_rewards("fapo", scores=scores, index=index, flawed=flawed, correct=scores > 0)
    assert torch.equal(result.scores, shaped)
    from stablerl.framework_batch import advantages_from_scores

    adv, _ = advantages_from_scores("grpo", shaped, mask, index)
    filtered = stablerl.filter_batch("dynamic_sampling", advantages=adv, response_mask=mask, index=index, scores=shaped)
    expect_mask = torch.zeros_like(mask)
    expect_mask[filtered.rows] = filtered.response_mask
    assert torch.equal(result.response_mask, expect_mask * mask)
    assert torch.allclose(result.advantages, adv * result.response_mask)
    assert "filter/kept_row_frac" in result.metrics


def test_advantage_step_shapes_token_level_rewards_on_the_last_token_and_runs_the_frameworks_estimator():
    mask, scores, index = _batch()
    from stablerl.ops import scores_on_last_token

    rewards = scores_on_last_token(scores, mask)
    seen = {}

    def own_estimator(record):
        seen["rewards"] = record.token_level_rewards.clone()
        return record.token_level_rewards * 2, record.token_level_rewards

    sel = AdvantageSelection(reward_shaper="fapo")
    record = BatchRecord(None, response_mask=mask, index=index, token_level_rewards=rewards,
                         produced={"flawed": torch.tensor([True, False, False, False]), "correct": scores > 0})
    result = AdvantageStep(sel, ctx=lambda k, n: stablerl.Context()).run(record, estimate=own_estimator)
    shaped, _ = stablerl.shape_rewards("fapo", scores=scores, index=index, flawed=record.produced["flawed"],
                                       correct=scores > 0)
    assert torch.allclose(seen["rewards"].sum(-1), shaped)
    assert torch.equal(result.advantages, seen["rewards"] * 2) and result.dropped is None


def test_advantage_step_without_any_estimator_is_refused():
    with pytest.raises(StableRLError, match="neither"):
        AdvantageStep(AdvantageSelection(), ctx=lambda k, n: None).run(BatchRecord())
