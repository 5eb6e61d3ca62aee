"""Every patch the OpenRLHF adapter makes, by module (each applied when its module is imported, OpenRLHF's only at
a supported version; every rebinding through the adapter's ledger, undone by ``uninstrument()``):

* ``ActorPPOTrainer.__init__``: a stablerl ``--actor.policy_loss_type`` replaces the ``PolicyLoss`` OpenRLHF built
  by a ``StablePolicyLoss`` built from the same flags (``_loss``); routing replay, the old-pass statistics and an
  entropy controller arm the policy ``Actor`` (one ``PolicyWorker``); ``training_step`` / ``Actor.forward``: the
  loss step's record, routing replay R2/R3 and the controller (``_routing_replay``, ``_inputs``, ``_controller``);
  ``ppo_actor.DataLoader``: whole prompt groups (``_groups``); the loss normalisers of an all-filtered step;
* ``RemoteExperienceMaker.compute_advantages_and_returns``: the advantage step (``_advantage``); ``make_experience``:
  routes and old-pass statistics into the experiences (``_routing_replay``);
* R3's rollout side: ``BaseModelActor.execute_batch``, ``SamplesGenerator``, the agent executors, vLLM's
  ``AsyncEngineArgs``; checkpoints: the algorithms' state in DeepSpeed's ``client_state`` (``_state``);
* policy versions under ``--train.async_enable``: ``SamplesGenerator._generate_vllm``, ``BasePPOTrainer.train_step``
  / ``broadcast_to_vllm`` (``_versions``).
"""

from __future__ import annotations

import functools

from . import _controller, _routing_replay, _state, _teacher, _versions
from ._flags import check_openrlhf, check_policy_loss_api
from ._selection import selection_from_args


def _patch_actor_module(module, ledger, adapter) -> None:
    """``ActorPPOTrainer.__init__`` (see the module docstring), ``training_step`` / ``Actor.forward``, the DataLoader
    and the loss normalisers."""
    check_policy_loss_api(module.PolicyLoss)

    @ledger.around(module.ActorPPOTrainer, "__init__")
    def __init__(original, self, *args, **kwargs):
        original(self, *args, **kwargs)
        sel = selection_from_args(self.args)
        if sel.policy_loss is not None:
            from ._loss import build_policy_loss

            self.actor_loss_fn = build_policy_loss(self.args, sel, strategy=self.strategy)
            adapter.loss_state.adopt(self.actor_loss_fn.stablerl_state)  # saved with this actor's checkpoints
        stats = sel.old_pass_stats()
        if stats:  # its old-log-prob pass also returns entropy / sum_pi_squared / log M (._inputs)
            worker = adapter.worker(self.actor, create=True)
            worker.old_pass_stats = stats
            if "log_kept_mass" in stats:  # sampling-mask replay (._sampling_mask)
                worker.sampling_rule = sel.sampling_replay.rule
        if sel.routing_replay is not None:
            _routing_replay.arm(self, sel.routing_replay, adapter)
        _controller.arm(self, adapter)  # an entropy controller steering --actor.entropy_coef, if one is selected

    _routing_replay.patch_actor_module(module, ledger, adapter)
    from ._groups import group_dataloader

    ledger.set_attr("ppo_actor.DataLoader", module, "DataLoader", group_dataloader(module.DataLoader))
    _patch_loss_normalisers(module, ledger, adapter, "ppo_actor")


def _nonzero_normalisers(info: dict) -> dict:
    """A step whose rows a batch filter all dropped has 0 tokens and 0 sequences: OpenRLHF's
    ``sum(loss * mask) / 0`` would make the loss and every gradient NaN; with 1 they are exactly 0."""
    import torch

    out = dict(info)
    for key in ("batch_num_tokens", "global_batch_size"):
        if out.get(key) is not None:
            value = torch.as_tensor(out[key])
            out[key] = torch.where(value == 0, torch.ones_like(value), value)
    return out


def _patch_loss_normalisers(module, ledger, adapter, owner: str) -> None:
    """With a batch filter selected, OpenRLHF's loss normalisers (``get_loss_batch_info``,
    ``iter_grad_accum_global_norm``, as bound in ``module``) never divide by an all-masked step's 0."""

    def filtering(strategy) -> bool:
        return selection_from_args(strategy.args).batch_filter is not None

    if "get_loss_batch_info" in module.__dict__:
        @ledger.around(module, "get_loss_batch_info", key=f"{owner}.get_loss_batch_info")
        def get_loss_batch_info(get_info, strategy, *args, **kwargs):
            info = get_info(strategy, *args, **kwargs)
            return _nonzero_normalisers(info) if filtering(strategy) else info

    if "iter_grad_accum_global_norm" in module.__dict__:
        @ledger.around(module, "iter_grad_accum_global_norm", key=f"{owner}.iter_grad_accum_global_norm")
        def iter_grad_accum_global_norm(iter_norm, data_iter, strategy, *args, **kwargs):
            items = iter_norm(data_iter, strategy, *args, **kwargs)
            return ((item, _nonzero_normalisers(info)) for item, info in items) if filtering(strategy) else items


def _patch_maker_module(module, ledger, adapter) -> None:
    """``RemoteExperienceMaker.compute_advantages_and_returns`` (``_advantage``) and ``make_experience``."""

    @ledger.around(module.RemoteExperienceMaker, "compute_advantages_and_returns")
    def compute_advantages_and_returns(original, self, experiences):
        from ._advantage import advantages_and_returns

        return advantages_and_returns(adapter, self, experiences, functools.partial(original, self))

    _routing_replay.patch_maker_module(module, ledger, adapter)


#: module -> its patcher ``(module, ledger, adapter)``
PATCHERS = {
    "openrlhf.trainer.ray.ppo_actor": _patch_actor_module,
    # gae + a batch filter: the critic loss sees the same masks
    "openrlhf.trainer.ray.ppo_critic": functools.partial(_patch_loss_normalisers, owner="ppo_critic"),
    "openrlhf.trainer.ppo_utils.experience_maker": _patch_maker_module,
    # routing replay R3: the model actors' base, the samples generator, the agent executors, vLLM's engine args
    # on-policy distillation: the reference group loads the teacher (_teacher)
    "openrlhf.trainer.ray.launcher": lambda module, ledger, adapter: (
        _routing_replay.patch_launcher_module(module, ledger, adapter),
        _teacher.patch_launcher_module(module, ledger, adapter)),
    # policy versions under --train.async_enable: the generator stamps its samples (_versions)
    "openrlhf.trainer.ppo_utils.samples_generator": lambda module, ledger, adapter: (
        _routing_replay.patch_samples_module(module, ledger, adapter),
        _versions.patch_samples_module(module, ledger, adapter)),
    "openrlhf.utils.agent": _routing_replay.patch_agent_module,
    "vllm.engine.arg_utils": _routing_replay.patch_vllm_arg_utils,
    # stablerl state in checkpoints: DeepSpeed's client_state (actors), the trainer's client_states (driver)
    "openrlhf.utils.deepspeed.deepspeed": _state.patch_strategy_module,
    # and the trainer counts its weight syncs and stamps the round's policy version (_versions)
    "openrlhf.trainer.ppo_trainer": lambda module, ledger, adapter: (
        _state.patch_trainer_module(module, ledger, adapter), _versions.patch_trainer_module(module, ledger, adapter)),
}
#: every ledger key the patchers set (is_applied reports each)
PATCH_KEYS = (
    "ActorPPOTrainer.__init__", "ActorPPOTrainer.training_step", "Actor.forward", "ppo_actor.DataLoader",
    "ppo_actor.get_loss_batch_info", "ppo_actor.iter_grad_accum_global_norm", "ppo_critic.get_loss_batch_info",
    "ppo_critic.iter_grad_accum_global_norm", "RemoteExperienceMaker.compute_advantages_and_returns",
    "RemoteExperienceMaker.make_experience", "BaseModelActor.execute_batch",
    "BaseModelActor.forward_with_rollout_routes",
    "SamplesGenerator._process_response_into_experience", "SingleTurnAgentExecutor.execute",
    "MultiTurnAgentExecutor.execute", "AsyncEngineArgs.__init__", "DeepspeedStrategy.save_ckpt",
    "DeepspeedStrategy.load_ckpt", "BasePPOTrainer.save_logs_and_checkpoints", "BasePPOTrainer.save_best_checkpoint",
    "BasePPOTrainer.init_checkpoint_states", "RayActorGroup.async_init_model_from_pretrained",
    "BasePPOTrainer.train_step", "BasePPOTrainer.broadcast_to_vllm", "SamplesGenerator._generate_vllm",
)


def patcher(name: str, patch, ledger, adapter):
    """The post-import hook's patcher of module ``name``."""

    def patch_module(module) -> None:
        if name.startswith("openrlhf."):  # OpenRLHF's modules are patched only at a supported version
            check_openrlhf()
        patch(module, ledger, adapter)

    return patch_module
