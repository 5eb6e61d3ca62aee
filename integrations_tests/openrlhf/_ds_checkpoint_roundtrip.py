"""Run in a fresh process by test_openrlhf_checkpoint_state.py (a DeepSpeed engine initialises torch.distributed
and DeepSpeed's communication globals, which must not leak into the other tests): the stablerl policy loss's
state, and the entropy controller's, through OpenRLHF's real DeepspeedStrategy.save_ckpt / load_ckpt on a real
DeepSpeed engine (CPU, ZeRO 0, one process). Prints one JSON object."""

import json
import os
import sys
import tempfile
from types import SimpleNamespace

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

import deepspeed  # noqa: E402
import deepspeed.comm.torch as ds_comm_torch  # noqa: E402

import stablerl.adapters.openrlhf as adapter  # noqa: E402
from orlhf_helpers import make_args  # noqa: E402
from stablerl.adapters.openrlhf import Selection  # noqa: E402

ds_comm_torch.build_shm_op = lambda: None  # no JIT-compiled shared-memory op: gloo is enough for one process
adapter.instrument(now=True)
import openrlhf.trainer.ray.ppo_actor as ppo_actor  # noqa: E402
import openrlhf.utils.deepspeed.deepspeed as ds_strategy  # noqa: E402
from openrlhf.utils.deepspeed.deepspeed import DeepspeedStrategy  # noqa: E402

ds_strategy.torch_dist_barrier_and_cuda_sync = torch.distributed.barrier  # no CUDA to synchronise on this machine

ppo_actor.NaiveReplayBuffer = lambda *a, **k: SimpleNamespace()
ppo_actor.torch_dist_barrier_and_cuda_sync = lambda: None

net = torch.nn.Linear(4, 2)
engine, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                                  config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}})
strategy = DeepspeedStrategy.__new__(DeepspeedStrategy)  # save_ckpt / load_ckpt read nothing set by __init__
args = make_args(policy_loss_type="entropic", stablerl=None)


def actor_loss():
    """The loss OpenRLHF's real ActorPPOTrainer.__init__ builds (the adapter swaps in StablePolicyLoss)."""
    return ppo_actor.ActorPPOTrainer(SimpleNamespace(args=args), None, None, None, None).actor_loss_fn


g = torch.Generator().manual_seed(0)
calls = [(-torch.rand(3, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g, dtype=torch.float64),
          torch.rand(3, 5, generator=g, dtype=torch.float64) * 2) for _ in range(3)]
mask = torch.ones(3, 5, dtype=torch.bool)


def step(loss, i):
    lp, adv, entropy = calls[i]
    loss.feed({"entropy": entropy})
    out = loss(lp, lp.detach() - 0.01, adv, action_mask=mask)
    return float(out[0]), dict(loss.last_metrics)


out = {}
with tempfile.TemporaryDirectory() as ckpt:
    loss = actor_loss()
    out["loss_class"] = type(loss).__name__
    step(loss, 0), step(loss, 1)
    # PolicyModelActor.save_checkpoint's call: positional, with the driver's client_states
    strategy.save_ckpt(engine, ckpt, "global_step2", 3, 1000, {"global_step": 2})
    out["saved_state"] = dict(loss.stablerl_state.slot("policy_loss", "entropic")["entropic"])
    reference = step(loss, 2)  # the uninterrupted third step

    # a fresh actor process: no loss yet when PolicyModelActor loads the checkpoint
    adapter.OpenRLHFAdapter().loss_state.live = None
    load_path, states = strategy.load_ckpt(engine, ckpt)
    out["states_keys"] = sorted(k for k in states if k in ("global_step", adapter.OpenRLHFAdapter().loss_state.key))
    resumed = actor_loss()
    out["restored_state"] = dict(resumed.stablerl_state.slot("policy_loss", "entropic")["entropic"])
    out["same_third_step"] = step(resumed, 2) == reference
    out["third_integral"] = reference[1]["entropic/integral"]

    # a checkpoint written without a stablerl loss in the process (e.g. before stablerl) loads as before
    adapter.OpenRLHFAdapter().loss_state.live = None
    strategy.save_ckpt(engine, ckpt, "global_step3", 3, 1000, {"global_step": 3})
    _, states = strategy.load_ckpt(engine, ckpt)
    fresh = actor_loss()
    out["plain_states_keys"] = sorted(k for k in states
                                      if k in ("global_step", adapter.OpenRLHFAdapter().loss_state.key))
    out["fresh_state"] = fresh.stablerl_state.state_dict()["slots"]

    # the entropy controller's state (the actor worker's second store) through the same save_ckpt / load_ckpt
    args.stablerl = Selection(policy_loss="entropic", entropy_controller="adaptive_entropy",
                              entropy_controller_params={"entropy_target": 10.0, "entropy_coef_delta": 0.01})
    trainer = ppo_actor.ActorPPOTrainer(SimpleNamespace(args=args), None, None, None, None)
    driver = adapter.OpenRLHFAdapter().worker(trainer).controller
    driver.step(entropy=3.0), driver.step(entropy=2.5)
    out["saved_controller"] = driver.controller.state_dict()
    strategy.save_ckpt(engine, ckpt, "global_step4", 3, 1000, {"global_step": 4})
    adapter.OpenRLHFAdapter().loss_state.live = adapter.OpenRLHFAdapter().controller_state.live = None
    args.actor.entropy_coef = None  # a fresh process's args
    _, states = strategy.load_ckpt(engine, ckpt)
    out["controller_states_keys"] = sorted(k for k in states if k in ("global_step",
                                                                      adapter.OpenRLHFAdapter().loss_state.key,
                                                                      adapter.OpenRLHFAdapter().controller_state.key))
    resumed = ppo_actor.ActorPPOTrainer(SimpleNamespace(args=args), None, None, None, None)
    out["restored_controller"] = adapter.OpenRLHFAdapter().worker(resumed).controller.controller.state_dict()
    out["restored_entropy_coef"] = args.actor.entropy_coef
print(json.dumps(out))
