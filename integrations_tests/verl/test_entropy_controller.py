"""adaptive_entropy in verl 0.9.1: the adapter's update_actor wrapper sets verl's actor.entropy_coeff to the
controller's coefficient before each update and steps the controller with verl's actor/entropy_loss after it.

Each update here runs verl's real ``ppo_loss`` (through the worker's ``partial(ppo_loss, config=...)``, as
``ActorRolloutRefWorker`` builds it) on a fixed batch; the coefficients must be TRL's (the sequences that
``integrations_tests/trl/test_trl_trainer_hooks.py::test_adaptive_entropy_controller_equals_trl`` checks TRL
1.16's own ``use_adaptive_entropy`` against), and verl's loss must carry exactly ``-c * actor/entropy_loss``.
"""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

import stablerl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_declared_inputs import _batch, _config  # noqa: E402  (the jagged batch verl's engine hands ppo_loss)

TRL_PARAMS = dict(entropy_coef=0.2, entropy_coef_delta=0.05, entropy_coef_min=0.0, entropy_coef_max=0.3)


class _Worker:
    """The parts of verl's ActorRolloutRefWorker the wrapper touches: config and loss_fn."""

    def __init__(self, adapter, params, **actor):
        from omegaconf import OmegaConf
        from verl.workers.utils.losses import ppo_loss

        self.config = OmegaConf.create({"actor": {"calculate_entropy": True, "entropy_coeff": 0.0, **actor,
                                                  "policy_loss": {"stablerl_entropy_controller": "adaptive_entropy",
                                                                  "stablerl_entropy_controller_params": params}}})
        self.loss_fn = functools.partial(ppo_loss, config=_config(adapter, "vanilla"))
        self.losses = []


def _update_actor(worker, data):
    """One verl update: the worker's loss function on the batch; verl's Metric objects in the output."""
    from verl.utils import tensordict_utils as tu

    batch, model_output, _, _ = _batch(seed=len(worker.losses))
    loss, metrics = worker.loss_fn(model_output=model_output, data=batch)
    worker.losses.append((float(loss.detach()), {k: float(v.aggregate()) if hasattr(v, "aggregate") else float(v)
                                         for k, v in metrics.items()}))
    return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics})


@pytest.fixture
def controllers(adapter):
    adapter.entropy_controller._CONTROLLERS.clear()
    yield adapter.entropy_controller
    adapter.entropy_controller._CONTROLLERS.clear()


@pytest.mark.parametrize("target", [100.0, 0.3])  # always below target (c rises) / always above (c falls to 0)
def test_adaptive_entropy_steers_verls_entropy_coeff_as_trl(adapter, controllers, target):
    params = {**TRL_PARAMS, "entropy_target": target}
    worker = _Worker(adapter, params)
    wrapped = adapter.trainer_hook._wrap_update_actor(_update_actor)
    coefs, applied = [], []
    for _ in range(3):
        out = wrapped(worker, None)
        from verl.utils import tensordict_utils as tu

        metrics = tu.get(out, "metrics")
        coefs.append(metrics["stablerl/adaptive_entropy/entropy_coef"][0])
        applied.append(metrics["stablerl/adaptive_entropy/applied_coef"][0])
    # TRL 1.16's own use_adaptive_entropy gives these coefficients (its parity test)
    expected = [0.25, 0.3, 0.3] if target == 100.0 else [0.15, 0.1, 0.05]
    assert coefs == pytest.approx(expected, abs=1e-12)
    # the coefficient in force at each update: the previous step's end while H <= target, 0 before any step
    assert applied == pytest.approx([0.0, 0.25, 0.3] if target == 100.0 else [0.0, 0.0, 0.0], abs=1e-12)
    for (loss, m), c in zip(worker.losses, applied):
        assert m["actor/entropy_loss"] > 0.3  # this batch's entropies are above 0.3: target 0.3 is never met
        assert loss == pytest.approx(m["actor/pg_loss"] - c * m["actor/entropy_loss"], rel=1e-12, abs=1e-12)
    # the same controller fed the same entropies outside verl
    ref = stablerl.make_controller("adaptive_entropy", **params)
    for (_, m), coef in zip(worker.losses, coefs):
        assert ref.step(entropy=m["actor/entropy_loss"])["entropy_coef"] == pytest.approx(coef, abs=1e-12)
    from stablerl.adapters.verl import _inputs

    assert _inputs.verl_adapter().state.loss.state_dict()["objects"]["controller"]["adaptive_entropy"] == ref.state_dict()


def test_the_selection_is_checked_where_verl_builds_the_config(adapter):
    with pytest.raises(stablerl.StableRLError, match="entropy_coef_min"):
        adapter.StablePolicyLossConfig(loss_mode="vanilla", stablerl_entropy_controller="adaptive_entropy",
                                       stablerl_entropy_controller_params={"entropy_coef_min": 2.0})
    with pytest.raises(stablerl.StableRLError, match=r"rollout_temperature: verl's rollout temperature is one"):
        adapter.StablePolicyLossConfig(loss_mode="vanilla", stablerl_entropy_controller="aepo")
    with pytest.raises(stablerl.StableRLError, match=r"loss_term"):
        adapter.StablePolicyLossConfig(loss_mode="vanilla", stablerl_entropy_controller="epo")
    with pytest.raises(stablerl.StableRLError, match="stablerl_entropy_controller is not"):
        adapter.StablePolicyLossConfig(loss_mode="vanilla", stablerl_entropy_controller_params={"entropy_target": 1})
    cfg = adapter.StablePolicyLossConfig(loss_mode="vanilla", stablerl_entropy_controller="adaptive_entropy")
    assert adapter.entropy_controller.selection(cfg) == ("adaptive_entropy", {})


def test_refuses_verls_own_coefficient_and_a_run_without_entropy(adapter, controllers):
    wrapped = adapter.trainer_hook._wrap_update_actor(_update_actor)
    with pytest.raises(stablerl.StableRLError, match=r"entropy_coeff at 0"):
        wrapped(_Worker(adapter, {}, entropy_coeff=0.01), None)
    with pytest.raises(stablerl.StableRLError, match=r"calculate_entropy=True"):
        wrapped(_Worker(adapter, {}, calculate_entropy=False), None)
