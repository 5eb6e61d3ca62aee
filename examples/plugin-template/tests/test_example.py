"""Tests of the example plugin: the stablerl conformance suite plus a hand computation."""

import pytest
import torch

import stablerl
from stablerl.testing import conformance_cases


# the stablerl conformance suite, for every algorithm this package registers
@pytest.mark.parametrize("case", conformance_cases(plugin="example"))
def test_conformance(case):
    case.run()


def test_registered_through_the_entry_point():
    names = {s.name: s for s in stablerl.list_algorithms()}
    assert names["example_reinforce"].plugin.startswith("example (")
    assert names["example_mean_baseline"].kind == "advantage_estimator"
    assert not [f for f in stablerl.get_registry().failures if f.plugin.startswith("example")]


def test_reinforce_value_and_gradient_by_hand():
    lp = torch.tensor([[-1.0, -0.5, -2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0, -1.5, -1.0]], dtype=torch.float64)
    adv = torch.tensor([[2.0, 2.0, 2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    loss, metrics = stablerl.compute_policy_loss(
        "example_reinforce", log_prob=lp, old_log_prob=old, advantages=adv, response_mask=mask, is_cap=2.0
    )
    loss.backward()
    # token 1: r = 1; token 2: r = e^1 = 2.718 -> capped at 2; token 3 masked
    w = torch.tensor([1.0, 2.0, 0.0], dtype=torch.float64)
    expected = (-(w * 2.0 * lp.detach()[0])).sum() / 2
    assert torch.allclose(loss, expected)
    assert torch.allclose(lp.grad[0], -w * 2.0 / 2)
    assert metrics["example/is_capped_frac"] == pytest.approx(0.5)


def test_mean_baseline_by_hand():
    rewards = torch.zeros(4, 3)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 3.0, 5.0])
    mask = torch.ones(4, 3, dtype=torch.bool)
    adv, ret = stablerl.compute_advantage(
        "example_mean_baseline", token_level_rewards=rewards, response_mask=mask, index=["a", "a", "b", "b"],
        baseline_weight=0.5,
    )
    expected = torch.tensor([1 - 0.25, 0 - 0.25, 3 - 2.0, 5 - 2.0])
    assert torch.allclose(adv, expected.unsqueeze(-1).expand(4, 3))
    assert torch.equal(adv, ret)


def test_bad_hyper_parameter_is_named():
    with pytest.raises(stablerl.StableRLError, match="is_cap"):
        stablerl.compute_policy_loss(
            "example_reinforce", log_prob=torch.zeros(1, 2), old_log_prob=torch.zeros(1, 2),
            advantages=torch.zeros(1, 2), response_mask=torch.ones(1, 2), is_cap=-1.0,
        )
