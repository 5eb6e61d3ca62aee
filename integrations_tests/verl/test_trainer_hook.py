"""Trainer hooks (SFPO) around verl 0.9.1's ``ActorRolloutRefWorker.update_actor``.

The wrapper is verl's own class attribute after ``import verl`` (dispatch attributes kept); the selection
keys live on ``StablePolicyLossConfig`` and are checked where verl builds it; ``run_passes`` drives verl's
``update_actor`` contract (a TensorDict whose options ``train_mini_batch`` pops, metrics in the output) on a
toy actor, where under SGD the result is the paper's unified form. The whole trainer runs it in
``test_main_ppo_e2e.py::test_sfpo_*``.
"""

from __future__ import annotations

import pytest
import torch

import stablerl


def _fields(**kw):
    import stablerl.adapters.verl as adapter

    return adapter.StablePolicyLossConfig(loss_mode="vanilla", **kw)


def test_update_actor_is_wrapped_and_keeps_verls_dispatch(adapter):
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.workers import engine_workers

    fn = engine_workers.ActorRolloutRefWorker.update_actor
    assert adapter.trainer_hook.status() == "patched"
    assert getattr(fn, "__stablerl_verl_patch__", False)
    assert getattr(fn, MAGIC_ATTR)["dispatch_mode"] is not None  # verl's register() attributes survive
    assert adapter.registration_report()["trainer_hook"] == "patched"


def test_selection_keys_are_checked_where_verl_builds_the_config(adapter):
    cfg = _fields(stablerl_trainer_hook="sfpo", stablerl_trainer_hook_params={"inner_steps": 2, "alpha": 0.5})
    assert adapter.trainer_hook.selection(cfg) == ("sfpo", {"inner_steps": 2, "alpha": 0.5})
    with pytest.raises(stablerl.StableRLError, match="alpha"):
        _fields(stablerl_trainer_hook="sfpo", stablerl_trainer_hook_params={"alpha": 1.5})
    with pytest.raises(stablerl.StableRLError, match="sampling_rounds"):
        _fields(stablerl_trainer_hook="reinforce_ada_sampler")
    with pytest.raises(stablerl.UnknownNameError, match="sfpo"):
        _fields(stablerl_trainer_hook="sfp")
    with pytest.raises(stablerl.StableRLError, match="stablerl_trainer_hook is not"):
        _fields(stablerl_trainer_hook_params={"alpha": 0.5})


class _Engine:
    def __init__(self, module):
        self.module = module
        self.optimizer = torch.optim.SGD(module.parameters(), lr=0.1)


class _Worker:
    """The parts of verl's ActorRolloutRefWorker the wrapper touches: config and actor.engine."""

    def __init__(self, hook_params):
        from omegaconf import OmegaConf

        torch.manual_seed(0)
        self.module = torch.nn.Linear(3, 2).double()
        self.actor = type("Actor", (), {"engine": _Engine(self.module)})()
        self.config = OmegaConf.create({"actor": {"policy_loss": {
            "stablerl_trainer_hook": "sfpo", "stablerl_trainer_hook_params": hook_params}}})
        self.calls = 0


X = torch.tensor([[1.0, -2.0, 0.5], [0.3, 0.1, -1.0]], dtype=torch.float64)


def _loss(module):
    return (module(X) ** 2).sum()


def _fake_update_actor(worker, data):
    """verl's update_actor contract: train_mini_batch pops its options from the batch; one SGD step per call;
    metrics (verl Metric objects) in the output TensorDict."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric.utils import Metric

    assert tu.pop(data, key="epochs", default=None) == 1  # popped on every pass: each pass gets a copy
    worker.calls += 1
    opt = worker.actor.engine.optimizer
    opt.zero_grad()
    _loss(worker.module).backward()
    opt.step()
    metrics = {"actor/entropy_loss": Metric(value=1.0 + 0.1 * worker.calls, aggregation="mean"), "actor/pg_loss": [0.0]}
    return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics})


def _grad(params, module):
    with torch.no_grad():
        for p, v in zip(module.parameters(), params):
            p.copy_(v)
    module.zero_grad()
    _loss(module).backward()
    return [p.grad.clone() for p in module.parameters()]


def test_run_passes_is_sfpo_on_verls_update_contract(adapter):
    from verl.utils import tensordict_utils as tu

    K, alpha, lr = 2, 0.6, 0.1
    adapter.trainer_hook._HOOKS.clear()
    worker = _Worker({"inner_steps": K, "alpha": alpha, "zscore_window": 0})
    theta0 = [p.detach().clone() for p in worker.module.parameters()]
    # the unified form under SGD: theta0 - lr [alpha sum_k g(theta_k) + g(theta~)]
    probe = torch.nn.Linear(3, 2).double()
    theta, grads = [t.clone() for t in theta0], []
    for _ in range(K):
        grads.append(_grad(theta, probe))
        theta = [t - lr * g for t, g in zip(theta, grads[-1])]
    tilde = [t0 + alpha * (t - t0) for t0, t in zip(theta0, theta)]
    g_tilde = _grad(tilde, probe)
    expected = [t0 - lr * (alpha * sum(gs) + gt) for t0, gs, gt in zip(theta0, zip(*grads), g_tilde)]

    data = tu.get_tensordict(tensor_dict={"x": torch.zeros(2, 1)}, non_tensor_dict={"epochs": 1})
    wrapped = adapter.trainer_hook._wrap_update_actor(_fake_update_actor)
    out = wrapped(worker, data)
    assert worker.calls == K + 1
    for p, e in zip(worker.module.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-12, atol=1e-12)
    metrics = tu.get(out, "metrics")
    assert metrics["stablerl/sfpo/repositioned"] == [1.0] and metrics["stablerl/sfpo/passes"] == [3.0]
    assert metrics["stablerl/sfpo/fast_drift"][0] > 0
    hook = adapter.trainer_hook._HOOKS["sfpo"]
    assert hook.entropy_history == [pytest.approx(1.3)]  # the slow pass's actor/entropy_loss
    from stablerl.adapters.verl import _inputs

    assert _inputs.verl_adapter().state.loss.state_dict()["objects"]["trainer_hook"]["sfpo"] == hook.state_dict()
    adapter.trainer_hook._HOOKS.clear()


def test_no_hook_is_verls_update_actor(adapter):
    from omegaconf import OmegaConf

    calls = []
    wrapped = adapter.trainer_hook._wrap_update_actor(lambda self, data: calls.append(data) or "out")
    worker = type("W", (), {"config": OmegaConf.create({"actor": {"policy_loss": {"loss_mode": "vanilla"}}})})()
    assert wrapped(worker, "batch") == "out" and calls == ["batch"]


def test_a_batch_that_is_not_a_tensordict_is_refused(adapter):
    adapter.trainer_hook._HOOKS.clear()
    worker = _Worker({"inner_steps": 1})
    wrapped = adapter.trainer_hook._wrap_update_actor(_fake_update_actor)
    with pytest.raises(stablerl.StableRLError, match="use_v1=false"):
        wrapped(worker, {"not": "a TensorDict"})
    adapter.trainer_hook._HOOKS.clear()
