"""In a real local Ray worker, the setup hook alone makes OpenRLHF's classes use stablerl (one short actor call)."""

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (nox -s openrlhf installs it)")

import os

import torch

ray = pytest.importorskip("ray")

import stablerl.adapters.openrlhf as adapter  # noqa: E402
from orlhf_helpers import init_ray_with_setup_hook  # noqa: E402


def _work(check_patch_mark: bool):
    """Runs in the worker (and, for the expected values, in this process with the patches applied)."""
    from types import SimpleNamespace

    import openrlhf.trainer.ppo_utils.experience_maker as em
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from orlhf_helpers import loss_batch, make_args, make_experiences, make_maker
    from stablerl.adapters.openrlhf import Selection

    patched = {
        "maker": getattr(em.RemoteExperienceMaker.compute_advantages_and_returns, "__stablerl_openrlhf_patch__", False),
        "trainer": getattr(ppo_actor.ActorPPOTrainer.__init__, "__stablerl_openrlhf_patch__", False),
    }
    sel = Selection(policy_loss="m2po", advantage_estimator="qae", advantage_params={"quantile_k": 0.4})
    args = make_args(policy_loss_type="m2po", estimator="qae", stablerl=sel)
    exps = em.RemoteExperienceMaker.compute_advantages_and_returns(make_maker(args, "qae", 0.01), make_experiences(seed=9))
    # the real ActorPPOTrainer.__init__, its CPU-hostile helpers replaced in this worker only
    ppo_actor.NaiveReplayBuffer = lambda *a, **k: SimpleNamespace()
    ppo_actor.torch_dist_barrier_and_cuda_sync = lambda: None
    trainer = ppo_actor.ActorPPOTrainer(SimpleNamespace(args=args), None, None, None, None)
    b = loss_batch(dtype=torch.float32, seed=9)
    loss = trainer.actor_loss_fn(b.new, b.old, b.adv, action_mask=b.mask, rollout_log_probs=None, dp_size=1,
                                 batch_num_tokens=torch.tensor(30.0), global_batch_size=torch.tensor(6.0))
    return {
        "patched": patched,
        "pid": os.getpid(),
        "loss_cls": type(trainer.actor_loss_fn).__name__,
        "loss_name": getattr(trainer.actor_loss_fn, "stablerl_name", None),
        "loss": float(loss[0]),
        "advantages": [e.advantages for e in exps],
    }


def test_setup_hook_patches_ray_worker():
    init_ray_with_setup_hook(adapter)
    try:

        @ray.remote(num_cpus=1)
        class Worker:
            def run(self):
                return _work(True)

        got = ray.get(Worker.remote().run.remote(), timeout=540)
    finally:
        ray.shutdown()
    assert got["pid"] != os.getpid()
    assert got["patched"] == {"maker": True, "trainer": True}  # by the setup hook, in the worker
    assert got["loss_cls"] == "StablePolicyLoss" and got["loss_name"] == "m2po"
    # the same computation here, patched explicitly: the worker computed stablerl's numbers
    assert not any(adapter.is_applied().values())  # the driver was never patched
    adapter.instrument(now=True)
    want = _work(False)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    for g, w in zip(got["advantages"], want["advantages"]):
        torch.testing.assert_close(g, w)
