"""GDPO (arXiv 2601.05242): per-component group normalisation, weighted sum, batch normalisation; both forms.

The framework parity tests are integrations_tests/verl/test_builtins_parity.py::test_gdpo* (verl's
compute_gdpo_outcome_advantage) and integrations_tests/trl/test_trl_builtins_parity.py::test_gdpo* (TRL's
normalize_then_sum through training); here: hand-computed values, invariances and the errors.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stablerl
from stablerl.params import StableRLError

def _t(values):
    return torch.tensor(values, dtype=torch.float64)


IDS = np.array([0, 0, 0, 1, 1, 1])


def _mask(lengths, T=4):
    return (torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).double()


def _gdpo(comps, mask=None, ids=IDS, **kw):
    mask = _mask([4] * len(ids)) if mask is None else mask
    extras = {"reward_components": comps}
    if "reward_weights" in kw:
        extras["reward_weights"] = kw.pop("reward_weights")
    adv, ret = stablerl.compute_advantage("gdpo", token_level_rewards=torch.zeros(mask.shape, dtype=torch.float64),
                                          response_mask=mask, index=ids, extras=extras, **kw)
    assert torch.equal(adv, ret)
    return adv


def test_trl_form_hand_computed():
    acc = _t([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    length = _t([2.0, 4.0, 9.0, 1.0, 1.0, 1.0])  # group 1: no spread -> 0
    adv = _gdpo(torch.stack([acc, length], -1), form="trl", reward_weights=[1.0, 0.5])[:, 0]

    def z(x):
        return (x - x.mean()) / (x.std() + 1e-4)
    s = torch.cat([z(acc[:3]) + 0.5 * z(length[:3]), z(acc[3:]) + 0.5 * torch.zeros(3)])
    expected = (s - s.mean()) / (s.std() + 1e-4)
    torch.testing.assert_close(adv, expected.double(), rtol=1e-12, atol=1e-12)


def test_verl_form_whitens_over_tokens():
    """form='verl': the token-weighted mean of the advantages is 0 and their token variance 1 (up to 1e-8)."""
    g = torch.Generator().manual_seed(0)
    comps = torch.rand(6, 3, generator=g, dtype=torch.float64)
    mask = _mask([1, 4, 2, 3, 4, 1])
    adv = _gdpo(comps, mask)
    vals = adv[mask.bool()]
    assert abs(float(vals.mean())) < 1e-8  # verl divides by (n + 1e-8)
    assert float(vals.var()) == pytest.approx(1.0, rel=1e-6)
    # a response weighs by its length: the per-response mean is not 0
    assert abs(float(adv[:, 0].mean())) > 1e-3


def test_decoupling_differs_from_normalising_the_sum():
    """The point of GDPO: a wide-spread component does not drown a binary one (GRPO on the sum does)."""
    acc = _t([1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    big = _t([0.0, 100.0, 50.0, 10.0, 0.0, 5.0])
    adv = _gdpo(torch.stack([acc, big], -1), form="trl")[:, 0]
    grpo = stablerl.compute_advantage("grpo", token_level_rewards=torch.stack([acc + big] * 4, -1) / 4,
                                      response_mask=_mask([4] * 6), index=IDS)[0][:, 0]
    # in group 0 the correct response (index 0) is the worst under GRPO on the sum, not under GDPO
    assert grpo[0] < grpo[1] and grpo[0] < grpo[2]
    assert adv[0] > adv[2]


@settings(max_examples=40, deadline=None)
@given(scale=st.floats(0.01, 100.0), shift=st.floats(-50.0, 50.0), seed=st.integers(0, 2**16))
def test_each_component_is_affine_invariant(scale, shift, seed):
    """Normalised per component: a positive affine map of one component changes nothing (epsilon 0)."""
    g = torch.Generator().manual_seed(seed)
    comps = torch.rand(6, 2, generator=g, dtype=torch.float64) + 0.1 * torch.arange(6, dtype=torch.float64)[:, None]
    moved = comps.clone()
    moved[:, 1] = comps[:, 1] * scale + shift
    for form in ("verl", "trl"):
        torch.testing.assert_close(_gdpo(moved, form=form, epsilon=0.0), _gdpo(comps, form=form, epsilon=0.0),
                                   rtol=1e-7, atol=1e-7)


def test_trl_form_nan_is_a_declined_reward():
    """TRL: a NaN component is left out of its group's statistics and counts 0; a response no reward function
    scored gets 0 and stays out of the batch statistics."""
    acc = _t([1.0, 0.0, float("nan"), 1.0, 0.0, float("nan")])
    fmt = _t([0.5, 0.2, 0.9, 0.1, 0.3, float("nan")])
    adv = _gdpo(torch.stack([acc, fmt], -1), form="trl")[:, 0]
    assert adv[5] == 0
    z_acc = _t([1.0, 0.0]) - 0.5
    z_acc = z_acc / (z_acc.std() + 1e-4)
    f0, f1 = fmt[:3], fmt[3:5]
    zf0, zf1 = (f0 - f0.mean()) / (f0.std() + 1e-4), (f1 - f1.mean()) / (f1.std() + 1e-4)
    s = torch.stack([z_acc[0] + zf0[0], z_acc[1] + zf0[1], zf0[2], z_acc[0] + zf1[0], z_acc[1] + zf1[1]])
    expected = (s - s.mean()) / (s.std() + 1e-4)
    torch.testing.assert_close(adv[:5], expected.double(), rtol=1e-9, atol=1e-9)
    with pytest.raises(StableRLError, match="non-finite"):
        _gdpo(torch.stack([acc, fmt], -1))  # verl's form has no declined rewards


def test_without_components_the_score_is_the_one_component():
    mask = _mask([4] * 6)
    scores = _t([1.0, 0.0, 0.5, 2.0, 1.0, 0.0])
    rewards = torch.zeros(6, 4, dtype=torch.float64)
    rewards[:, -1] = scores
    adv = stablerl.compute_advantage("gdpo", token_level_rewards=rewards, response_mask=mask, index=IDS)[0]
    torch.testing.assert_close(adv, _gdpo(scores.unsqueeze(-1)), rtol=1e-12, atol=1e-12)


def test_dict_components_and_token_level_components():
    g = torch.Generator().manual_seed(3)
    a, b = torch.rand(6, generator=g, dtype=torch.float64), torch.rand(6, 4, generator=g, dtype=torch.float64)
    as_dict = _gdpo({"a": a, "b": b}, form="trl")
    as_matrix = _gdpo(torch.stack([a, b.sum(-1)], -1), form="trl")
    torch.testing.assert_close(as_dict, as_matrix, rtol=1e-12, atol=1e-12)


def test_weights_scale_the_components():
    g = torch.Generator().manual_seed(4)
    comps = torch.rand(6, 2, generator=g, dtype=torch.float64)
    zero_second = _gdpo(comps, form="trl", reward_weights=[1.0, 0.0])
    only_first = _gdpo(comps[:, :1], form="trl")
    torch.testing.assert_close(zero_second, only_first, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(_gdpo(comps, form="trl", reward_weights=[1.0, 3.0]), _gdpo(comps, form="trl"))


def test_errors_are_specific():
    comps = torch.rand(6, 2, dtype=torch.float64)
    with pytest.raises(StableRLError, match="reward_weights'\\] has 3 values for 2 reward components"):
        _gdpo(comps, reward_weights=[1.0, 1.0, 1.0])
    with pytest.raises(StableRLError, match="expected \\[6, K\\]"):
        _gdpo(torch.rand(5, 2))
    with pytest.raises(StableRLError, match="form must be one of verl, trl"):
        _gdpo(comps, form="paper")
    with pytest.raises(StableRLError, match="at least 2 response tokens"):
        _gdpo(torch.rand(1, 1), mask=_mask([1], T=1), ids=np.array([0]))

