"""A local Ray actor, whose first verl import is core_algos, sees the stablerl registrations."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    env = {k: v for k, v in os.environ.items() if k.startswith("VERL_USE_EXTERNAL")}
    for k in env:  # the actor must get the names through the entry point alone
        os.environ.pop(k)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        os.environ.update(env)


@ray.remote(num_cpus=1)
class Probe:
    def registered(self):
        import sys

        from verl.trainer.ppo import core_algos

        return {
            "losses": sorted(n for n in core_algos.POLICY_LOSS_REGISTRY if n.startswith("stablerl_") or n == "m2po"),
            "estimators": sorted(n for n in core_algos.ADV_ESTIMATOR_REGISTRY if n.startswith("stablerl_") or n == "qae"),
            "adapter_loaded": "stablerl.adapters.verl" in sys.modules,
        }

    def loss(self, cfg):
        import torch
        from verl.trainer.ppo import core_algos

        lp = torch.tensor([[-1.0, -0.5, -2.0]], requires_grad=True)
        loss, metrics = core_algos.get_policy_loss_fn("stablerl_vanilla")(
            old_log_prob=torch.tensor([[-1.1, -0.4, -2.0]]), log_prob=lp, advantages=torch.ones(1, 3),
            response_mask=torch.tensor([[True, True, False]]), loss_agg_mode="token-mean", config=cfg,
        )
        return float(loss), sorted(metrics), type(cfg.policy_loss).__name__


def test_ray_actor_sees_registrations(local_ray, adapter, actor_config):
    import stablerl

    probe = Probe.remote()
    out = ray.get(probe.registered.remote(), timeout=300)
    assert out["adapter_loaded"]
    assert "stablerl_vanilla" in out["losses"] and "stablerl_grpo" in out["estimators"]
    if "m2po" in stablerl.get_registry().names("policy_loss"):
        assert "m2po" in out["losses"]
    if "qae" in stablerl.get_registry().names("advantage_estimator"):
        assert "qae" in out["estimators"]
    # a config holding StablePolicyLossConfig pickles into the actor (class found by import path)
    cfg = actor_config(policy_loss=adapter.StablePolicyLossConfig(loss_mode="stablerl_vanilla"))
    loss, metric_keys, cls_name = ray.get(probe.loss.remote(cfg), timeout=120)
    # hand value: ratios e^0.1, e^-0.1 (inside 0.8..1.2): -(1.10517 + 0.90484) / 2
    assert loss == pytest.approx(-(2.718281828 ** 0.1 + 2.718281828 ** -0.1) / 2, rel=1e-6)
    assert "actor/pg_clipfrac" in metric_keys and cls_name == "StablePolicyLossConfig"
