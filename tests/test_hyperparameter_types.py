"""Hyper-parameters of every registered algorithm are checked against their annotations, and a bad one is
refused by name (issue 15's first class): a string for a number, +-inf, a fractional integer, the string
"False" for a bool, None where None is not allowed. Property-based: hypothesis picks the algorithm, the
field and the bad value."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stablerl
from stablerl.params import build_params

FIELDS = [
    (spec, f.name, typing.get_type_hints(spec.params)[f.name])
    for spec in stablerl.list_algorithms() if spec.status != stablerl.UNAVAILABLE
    for f in dataclasses.fields(spec.params)
]


def _base(hint):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return (args[0], True) if typing.get_origin(hint) is typing.Union and len(args) == 1 else (hint, False)


def _bad_values(hint) -> list:
    base, optional = _base(hint)
    common = [] if optional else [None]
    if base is bool:
        return common + ["False", "true", 0, 1.0]
    if base is float:
        return common + ["0.2", math.inf, -math.inf, True, [0.2]]
    if base is int:
        return common + ["3", 0.5, math.inf, True]
    if base is str:
        return common + [3, 0.5, True]
    return []


BAD = [(spec, name, bad) for spec, name, hint in FIELDS for bad in _bad_values(hint)]


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(BAD))
def test_a_bad_hyperparameter_is_refused_by_name(case):
    spec, name, bad = case
    with pytest.raises(stablerl.StableRLError, match=rf"\b{name}\b"):
        build_params(spec, {name: bad})


def test_every_default_passes_and_integral_floats_become_ints():
    for spec in stablerl.list_algorithms():
        if spec.status == stablerl.UNAVAILABLE:
            continue
        try:
            build_params(spec, {})
        except stablerl.StableRLError as e:  # a value the paper leaves to the user (opsm's threshold)
            assert " must be " not in str(e), e
    capo = stablerl.get_spec("policy_loss", "capo")
    ints = [n for n, h in typing.get_type_hints(capo.params).items() if _base(h)[0] is int]
    assert ints, "capo has integer hyper-parameters"
    params = build_params(capo, {ints[0]: 2.0})
    assert getattr(params, ints[0]) == 2 and isinstance(getattr(params, ints[0]), int)


def test_the_message_says_what_is_expected():
    vanilla = stablerl.get_spec("policy_loss", "vanilla")
    with pytest.raises(stablerl.StableRLError, match=r"vanilla: hyper-parameter clip_ratio_low must be a finite "
                                                     r"number, got '0.2' \(str\)"):
        build_params(vanilla, {"clip_ratio_low": "0.2"})
    grpo = stablerl.get_spec("advantage_estimator", "grpo")
    with pytest.raises(stablerl.StableRLError, match=r"norm_adv_by_std_in_grpo must be true or false, got 'False'"):
        build_params(grpo, {"norm_adv_by_std_in_grpo": "False"})
