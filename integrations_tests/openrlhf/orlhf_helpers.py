"""Shared builders for the OpenRLHF tests: hierarchized args, experiences, padded batches."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import torch

HERE_PATH = str(Path(__file__).parent)
STUBS_PATH = str(Path(__file__).parent / "stubs")


def make_args(
    *,
    policy_loss_type="ppo",
    estimator="group_norm",
    eps=(0.2, 0.2),
    dual_clip=None,
    loss_agg_mode="token-mean",
    is_level="off",
    is_mode="mask",
    is_gating="ratio",
    is_threshold=(0.5, 5.0),
    n_samples=4,
    clip_range=(-10.0, 10.0),
    stablerl=None,
):
    """The slice of OpenRLHF 0.11.2's hierarchized args that the patched code reads."""
    args = SimpleNamespace(
        actor=SimpleNamespace(
            eps_clip=eps[0], eps_clip_low_high=tuple(eps), dual_clip=dual_clip, loss_agg_mode=loss_agg_mode,
            policy_loss_type=policy_loss_type, aux_loss_coef=0.0, entropy_coef=None,
        ),
        algo=SimpleNamespace(
            advantage=SimpleNamespace(
                estimator=estimator, is_correction_level=is_level, is_correction_mode=is_mode,
                is_correction_gating=is_gating, is_correction_threshold=list(is_threshold), gamma=1.0, lambd=1.0,
                no_std_norm=False,
            ),
            kl=SimpleNamespace(use_loss=False, init_coef=0.01, estimator="k1"),
        ),
        rollout=SimpleNamespace(n_samples_per_prompt=n_samples, max_new_tokens=64),
        reward=SimpleNamespace(clip_range=clip_range, overlong_buffer_len=None, stop_properly_penalty_coef=None),
        train=SimpleNamespace(max_epochs=1, dynamic_batch_enable=False, colocate_all=False, async_enable=False),
        ds=SimpleNamespace(packing_samples=False),
        vllm=SimpleNamespace(sync_backend="gloo"),
        data=SimpleNamespace(max_len=64),
    )
    if stablerl is not None:
        args.stablerl = stablerl
    return args


def loss_batch(B=6, T=9, seed=0, dtype=torch.float64, spread=0.3):
    """Padded random [B, T] log-probs, advantages (one per sequence) and a right-padded mask."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 2 - 0.05
    new = (old + spread * torch.randn(B, T, generator=g, dtype=dtype)).clamp(max=-1e-3)
    rollout = (old + 0.4 * torch.randn(B, T, generator=g, dtype=dtype)).clamp(max=-1e-3)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    if B > 2:
        lengths[2] = 0  # an empty row
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    adv_seq = torch.randn(B, 1, generator=g, dtype=dtype)
    adv = adv_seq.expand(B, T).clone()
    adv_tok = torch.randn(B, T, generator=g, dtype=dtype)
    return SimpleNamespace(old=old, new=new, rollout=rollout, mask=mask, adv=adv, adv_tok=adv_tok)


def make_experiences(n_prompts=3, n=4, seed=0, lengths=(7, 5), kl_scale=0.05):
    """Experiences as OpenRLHF's trainer hands them to compute_advantages_and_returns: rollout order
    shuffled across experiences of different padded lengths, index = position in prompt order."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    g = torch.Generator().manual_seed(seed)
    total = n_prompts * n
    order = torch.randperm(total, generator=g).tolist()
    rewards = torch.randint(0, 2, (total,), generator=g).float() + 0.25 * torch.randn(total, generator=g)
    rewards[:n] = 1.0  # one group with equal rewards
    chunks = [order[: total // 2], order[total // 2:]]
    out = []
    for chunk, T in zip(chunks, lengths):
        B = len(chunk)
        lens = torch.randint(1, T + 1, (B,), generator=g)
        mask = torch.arange(T).unsqueeze(0) < lens.unsqueeze(1)
        kl = kl_scale * torch.randn(B, T, generator=g) * mask
        out.append(
            Experience(
                action_mask=mask,
                rewards=rewards[chunk].clone(),
                kl=kl,
                index=list(chunk),
                response_length=lens.float(),
                info={},
            )
        )
    return out


def make_maker(args, estimator, kl_coef=0.01):
    """RemoteExperienceMaker without Ray actors (as upstream tests/test_reward_shaping.py does)."""
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    maker = RemoteExperienceMaker.__new__(RemoteExperienceMaker)
    maker.strategy = SimpleNamespace(args=args)
    maker.args = args
    maker.advantage_estimator = estimator
    maker.kl_ctl = SimpleNamespace(value=kl_coef)
    return maker


def clone(experiences):
    return copy.deepcopy(experiences)


def training_strategy(args, optimizer_step):
    """A stand-in for OpenRLHF's DeepspeedStrategy in ``ActorPPOTrainer.training_step``: plain backward,
    ``optimizer_step`` supplied by the test, no ring attention, rank 0."""
    return SimpleNamespace(args=args, ring_attn_group=None, is_rank_0=lambda: True,
                           backward=lambda loss, *a: loss.backward(), optimizer_step=optimizer_step,
                           get_grad_norm=lambda *a: 0.0)


def step_and_zero_grad(optimizer, *a, **k):
    """The stand-in strategy's optimizer_step: step, then clear the gradients (as DeepSpeed's engine.step() does)."""
    optimizer.step()
    optimizer.zero_grad()


def ppo_trainer(ppo_actor, args, actor, optim, optimizer_step=step_and_zero_grad):
    """OpenRLHF's real ``ActorPPOTrainer`` on :func:`training_strategy`, constant learning rate (``trainer.strategy``:
    the strategy)."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1)
    return ppo_actor.ActorPPOTrainer(training_strategy(args, optimizer_step), actor, None, optim, scheduler)


def init_ray_with_setup_hook(adapter):
    """A local Ray (2 CPUs) whose workers run stablerl's setup hook and import the CPU stubs."""
    import os

    import ray

    if ray.is_initialized():
        ray.shutdown()
    path = os.pathsep.join([HERE_PATH, STUBS_PATH, os.environ.get("PYTHONPATH", "")])
    runtime_env = adapter.add_setup_hook({"env_vars": {"PYTHONPATH": path, "DS_ACCELERATOR": "cpu"}})
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env)


def run_without_ray_or_gpu(monkeypatch, ppo_actor):
    """OpenRLHF's actor code in one CPU process: ``ray.get``/``ray.put`` are identities, no CUDA device,
    no replay-buffer or barrier machinery (what the routing-replay tests drive by hand)."""
    import ray

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    monkeypatch.setattr(ray, "get", lambda refs: refs)
    monkeypatch.setattr(ray, "put", lambda value: value)
    monkeypatch.setattr(ppo_actor, "NaiveReplayBuffer", lambda *a, **k: SimpleNamespace())
    monkeypatch.setattr(ppo_actor, "torch_dist_barrier_and_cuda_sync", lambda: None)


class _Stop(Exception):
    pass


def dry_run(monkeypatch, argv):
    """Run the wrapper until OpenRLHF's train() calls ray.init; return (args, ray.init kwargs)."""
    import argparse

    import openrlhf.utils.config as config
    import pytest
    import ray

    from stablerl.adapters.openrlhf import train_ppo_ray as wrapper

    seen = {}
    original = config.hierarchize

    def recording_hierarchize(a):
        seen["args"] = original(a)
        return seen["args"]

    import builtins

    before, real_import = argparse.ArgumentParser.add_argument, builtins.__import__

    def fake_init(*a, **kw):
        seen["ray_init"] = kw
        # while OpenRLHF's script runs, nothing global is patched (the wrapper extends its namespace only)
        seen["globals_untouched"] = (argparse.ArgumentParser.add_argument is before and builtins.__import__ is
                                     real_import and config.hierarchize is recording_hierarchize)
        raise _Stop

    monkeypatch.setattr(config, "hierarchize", recording_hierarchize)
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(_Stop):
        wrapper.main(argv)
    assert seen["globals_untouched"]
    assert argparse.ArgumentParser.add_argument is before
    assert config.hierarchize is recording_hierarchize and ray.init is fake_init  # the wrapper restored them
    return seen["args"], seen["ray_init"]


def through_replay_buffer(experiences, order, packing: bool):
    """What OpenRLHF's NaiveReplayBuffer and its collate_fn do to experiences: split into rows (with
    seeded random advantages), unpad, then re-batch the rows in ``order`` (a shuffle)."""
    from openrlhf.trainer.ppo_utils.experience import (make_experience_batch, remove_padding_in_sequences,
                                                       split_experience_batch)

    g = torch.Generator().manual_seed(2)
    items = []
    for e in experiences:
        e.advantages = torch.randn(len(e.sequences), 1, generator=g) * e.action_mask
        items += split_experience_batch(e)
    items = remove_padding_in_sequences(items)
    return make_experience_batch([items[i] for i in order], packing)


class PickleGroup:
    """RayActorGroup stand-in: calls the actor's execute_batch; results cross a pickle round trip (Ray)."""

    def __init__(self, worker):
        self.worker = worker

    def async_run_method_batch(self, method_name, **kwargs):
        import pickle

        n = len(next(iter(kwargs.values())))
        return [pickle.loads(pickle.dumps(self.worker.execute_batch(method_name, kwargs, 0, n)))]


def actor_pipeline(monkeypatch, args, model, packing: bool, temperature: float):
    """OpenRLHF's policy Actor around ``model``, the real ``ActorPPOTrainer`` (plain SGD at lr 0), the by-value
    ``PolicyModelActor`` and a ``RemoteExperienceMaker`` whose actor group is a :class:`PickleGroup`, in one CPU
    process (the adapter instrumented; ``--ds.packing_samples`` as ``packing``)."""
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from openrlhf.models import Actor
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    import stablerl.adapters.openrlhf as adapter

    adapter.instrument(now=True)
    if packing:
        from test_openrlhf_routing_replay import _torch_bert_padding

        _torch_bert_padding(monkeypatch)
    run_without_ray_or_gpu(monkeypatch, ppo_actor)
    args.ds = SimpleNamespace(packing_samples=packing, ring_attn_size=1, tensor_parallel_size=1)
    args.train.colocate_actor_ref = False
    actor = Actor(model)
    actor.packing_samples, actor.temperature = packing, temperature
    trainer = ppo_trainer(ppo_actor, args, actor, torch.optim.SGD(actor.parameters(), lr=0.0))
    strategy = trainer.strategy
    worker = object.__new__(ppo_actor.PolicyModelActor.__ray_metadata__.modified_class)
    worker.actor, worker.strategy = actor, strategy
    maker = RemoteExperienceMaker.__new__(RemoteExperienceMaker)
    maker.strategy, maker.args, maker.kl_ctl = strategy, args, SimpleNamespace(value=0.0)
    maker.advantage_estimator = args.algo.advantage.estimator
    maker.actor_model_group, maker.critic_model_group = PickleGroup(worker), None
    maker.reward_model_group = maker.initial_model_group = None
    return SimpleNamespace(trainer=trainer, maker=maker, model=model, actor=actor, args=args)
