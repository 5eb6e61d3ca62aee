"""The last classes of the fuzz of every built-in algorithm (issue 30, item 2), as hypothesis properties over
every algorithm: each bad input is refused naming what is wrong, or has a defined result.

* aggregation modes x every policy loss: a mode whose own setting is missing (``seq-mean-token-sum-norm``
  without ``loss_scale_factor``) is refused by every loss, also by those that aggregate themselves;
* negative values x every hyper-parameter whose default is >= 0: refused, unless the value is meaningful
  (:data:`NEGATIVE_MEANINGFUL`, each with its reason);
* empty dimensions x every estimator: no response token (T = 0) gives empty ``[B, 0]`` advantages;
* off-by-one shapes x every declared per-token input of every estimator: refused naming the input and both shapes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stablerl
from stablerl.api import _PER_TOKEN_INPUTS
from stablerl.params import StableRLError, build_params

# every algorithm is a parametrized case; hypothesis draws the values and shapes for each
SETTINGS = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: (algorithm, hyper-parameter) whose negative values mean something, and what
NEGATIVE_MEANINGFUL = {
    ("bnpo", "min_value"): "the lower end of the reward range (rewards in [-1, 1] have min_value=-1)",
    ("aepo", "adv_threshold"): "a threshold on advantages, which are negative for below-mean samples",
    ("clip_cov", "clip_cov_lb"): "a bound on a covariance, which can be negative (verl's own key, same semantics)",
    ("entropic", "target_entropy"): "negative switches the controller off (the authors' run_entropic.sh convention)",
    ("reinforce_ada_sampler", "positive_threshold"): "a threshold on rewards, which may be negative",
    ("sfpo", "zscore_threshold"): "a z-score threshold: negative stops the fast passes at a below-mean z (a stricter "
    "stop, not a meaningless one)",
}


def _non_negative_fields():
    out = []
    for spec in stablerl.list_algorithms():
        if spec.status == stablerl.UNAVAILABLE or spec.params is None:
            continue
        for field in dataclasses.fields(spec.params):
            default = field.default
            if isinstance(default, bool) or not isinstance(default, (int, float)) or default < 0:
                continue
            out.append((spec.kind, spec.name, field.name, type(default)))
    return out


NON_NEGATIVE = _non_negative_fields()


def test_the_allow_list_names_real_hyper_parameters():
    names = {(name, field) for _, name, field, _ in NON_NEGATIVE}
    assert set(NEGATIVE_MEANINGFUL) <= names


@pytest.mark.parametrize("case", NON_NEGATIVE, ids=lambda c: f"{c[1]}.{c[2]}" if isinstance(c, tuple) else None)
@SETTINGS
@given(magnitude=st.floats(min_value=1e-6, max_value=1e6))
def test_negative_values_of_non_negative_hyper_parameters_are_refused(case, magnitude):
    kind, name, field, typ = case
    value = -magnitude if typ is float else -max(1, int(magnitude))
    spec = stablerl.get_spec(kind, name)
    if (name, field) in NEGATIVE_MEANINGFUL:
        build_params(spec, {field: value})  # meaningful: accepted
        return
    with pytest.raises(StableRLError, match=field):
        build_params(spec, {field: value})


def _losses():
    return [s for s in stablerl.list_algorithms(stablerl.POLICY_LOSS) if s.status != stablerl.UNAVAILABLE]


@pytest.mark.parametrize("spec", _losses(), ids=lambda s: s.name)
@SETTINGS
@given(B=st.integers(1, 4), T=st.integers(1, 5))
def test_an_aggregation_mode_missing_its_setting_is_refused_by_every_loss(spec, B, T):
    kwargs = dict(log_prob=torch.zeros(B, T), old_log_prob=torch.zeros(B, T), advantages=torch.ones(B, T),
                  response_mask=torch.ones(B, T))
    # whichever is checked first (a missing input or the mode), the call is refused, never silently run
    with pytest.raises(StableRLError) as err:
        stablerl.compute_policy_loss(spec.name, loss_agg_mode="seq-mean-token-sum-norm", **kwargs)
    if not spec.requires:
        assert "loss_scale_factor" in str(err.value)


@pytest.mark.parametrize("name", ["gmpo", "sapo", "luspo"])
def test_losses_with_their_own_aggregation_refuse_the_incomplete_mode_and_accept_it_complete(name):
    kwargs = dict(log_prob=torch.zeros(2, 3), old_log_prob=torch.zeros(2, 3), advantages=torch.ones(2, 3),
                  response_mask=torch.ones(2, 3))
    with pytest.raises(StableRLError, match="loss_scale_factor"):
        stablerl.compute_policy_loss(name, loss_agg_mode="seq-mean-token-sum-norm", **kwargs)
    with pytest.warns(UserWarning, match="is ignored"):
        stablerl.compute_policy_loss(name, loss_agg_mode="seq-mean-token-sum-norm",
                                     ctx=stablerl.Context(loss_scale_factor=3.0), **kwargs)


def _estimators():
    return [s for s in stablerl.list_algorithms(stablerl.ADVANTAGE_ESTIMATOR) if s.status != stablerl.UNAVAILABLE]


def _inputs(spec, B, T, short=None):
    out: dict = {}
    for name in spec.requires:
        if name == "index":
            continue
        if name in _PER_TOKEN_INPUTS:
            out[name] = torch.full((B, T - 1 if name == short else T), -0.5)
        elif name == "reward_components":
            out.setdefault("extras", {})["reward_components"] = torch.zeros(B, 2)
        elif name == "reward_weights":
            out.setdefault("extras", {})["reward_weights"] = [1.0, 1.0]
        else:
            out[name] = torch.zeros(B)
    return out


@pytest.mark.parametrize("spec", _estimators(), ids=lambda s: s.name)
@SETTINGS
@given(B=st.integers(1, 5))
def test_no_response_token_gives_empty_advantages_for_every_estimator(spec, B):
    index = torch.arange(B) // 2
    adv, ret = stablerl.compute_advantage(spec.name, token_level_rewards=torch.zeros(B, 0),
                                          response_mask=torch.zeros(B, 0), index=index, **_inputs(spec, B, 0))
    assert adv.shape == (B, 0) and ret.shape == (B, 0)


PER_TOKEN_CASES = [(s, name) for s in _estimators() for name in s.requires if name in _PER_TOKEN_INPUTS]


def test_there_are_estimators_with_per_token_inputs():
    assert {s.name for s, _ in PER_TOKEN_CASES} >= {"optimal_token_baseline", "tir_optimal_token_baseline", "empg"}


@pytest.mark.parametrize("case", PER_TOKEN_CASES, ids=lambda c: f"{c[0].name}.{c[1]}" if isinstance(c, tuple) else None)
@SETTINGS
@given(B=st.integers(1, 4), T=st.integers(2, 6))
def test_a_per_token_input_one_column_short_is_refused_naming_it_and_both_shapes(case, B, T):
    spec, name = case
    with pytest.raises(StableRLError) as err:
        stablerl.compute_advantage(spec.name, token_level_rewards=torch.zeros(B, T), response_mask=torch.ones(B, T),
                                   index=torch.arange(B) // 2, **_inputs(spec, B, T, short=name))
    message = str(err.value)
    assert repr(name) in message and str((B, T - 1)) in message and str((B, T)) in message
