"""The OpenRLHF adapter's patches: one ledger, a post-import hook per patched module, and the
``instrument()`` / ``uninstrument()`` pair the package exports (see the package docstring for what is
patched and why)."""

from __future__ import annotations

import functools
import importlib
import os
import threading

from stablerl.patching import PatchLedger

from . import _controller, _routing_replay, _state
from ._selection import _load_callable, selection_from_args
from ._spec import (ENV_CHAINED_SETUP_HOOK, LEGACY_SETUP_HOOK, SETUP_HOOK, check_openrlhf, check_policy_loss_api,
                    openrlhf_version)

_LOCK = threading.RLock()
#: every change to OpenRLHF (and vLLM's AsyncEngineArgs) and the post-import hook; uninstrument() undoes them
LEDGER = PatchLedger("__stablerl_openrlhf_patch__")


def _patch_actor_module(module, ledger) -> None:
    """``ActorPPOTrainer.__init__``: a stablerl policy_loss_type replaces the loss OpenRLHF built; routing replay,
    the old-pass entropy and an entropy controller (``._controller``) arm the policy actor. Also ``training_step`` /
    ``Actor.forward`` (``_routing_replay``), ``ppo_train``'s DataLoader (whole prompt groups, ``._groups``) and the
    loss normalisers."""
    check_policy_loss_api(module.PolicyLoss)

    @ledger.around(module.ActorPPOTrainer, "__init__")
    def __init__(original, self, *args, **kwargs):
        original(self, *args, **kwargs)
        sel = selection_from_args(self.args)
        if sel.policy_loss is not None:
            from ._loss import build_policy_loss

            self.actor_loss_fn = build_policy_loss(self.args, sel, strategy=self.strategy)
            _state.adopt_loss(self.actor_loss_fn)  # its state goes into this actor's checkpoints, and back
        if sel.routing_replay is not None:
            _routing_replay.arm(self, sel.routing_replay)
        stats = sel.old_pass_stats()
        if stats:  # its old-log-prob pass also returns entropy / sum_pi_squared (._inputs)
            from ._inputs import arm_old_pass

            arm_old_pass(self.actor, stats)
        _controller.arm(self)  # an entropy controller steering --actor.entropy_coef, if one is selected

    _routing_replay.patch_actor_module(module, ledger)
    from ._groups import group_dataloader

    ledger.set_attr("ppo_actor.DataLoader", module, "DataLoader", group_dataloader(module.DataLoader))
    _patch_loss_normalisers(module, ledger, "ppo_actor")


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


def _patch_loss_normalisers(module, ledger, owner: str) -> None:
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


def _patch_maker_module(module, ledger) -> None:
    """``RemoteExperienceMaker.compute_advantages_and_returns`` (``_advantage``) and ``make_experience``
    (``_routing_replay``)."""

    @ledger.around(module.RemoteExperienceMaker, "compute_advantages_and_returns")
    def compute_advantages_and_returns(original, self, experiences):
        from ._advantage import advantages_and_returns

        return advantages_and_returns(self, experiences, functools.partial(original, self))

    _routing_replay.patch_maker_module(module, ledger)


#: module -> its patcher (each applied when the module is imported; OpenRLHF's only at a supported version)
_PATCHERS = {
    "openrlhf.trainer.ray.ppo_actor": _patch_actor_module,
    # gae + a batch filter: the critic loss sees the same masks
    "openrlhf.trainer.ray.ppo_critic": functools.partial(_patch_loss_normalisers, owner="ppo_critic"),
    "openrlhf.trainer.ppo_utils.experience_maker": _patch_maker_module,
    # routing replay R3: the model actors' base, the samples generator, the agent executors, vLLM's engine args
    "openrlhf.trainer.ray.launcher": _routing_replay.patch_launcher_module,
    "openrlhf.trainer.ppo_utils.samples_generator": _routing_replay.patch_samples_module,
    "openrlhf.utils.agent": _routing_replay.patch_agent_module,
    "vllm.engine.arg_utils": _routing_replay.patch_vllm_arg_utils,
    # stablerl state in checkpoints: DeepSpeed's client_state (actors), the trainer's client_states (driver)
    "openrlhf.utils.deepspeed.deepspeed": _state.patch_strategy_module,
    "openrlhf.trainer.ppo_trainer": _state.patch_trainer_module,
}
#: every ledger key the patchers set (is_applied reports each)
PATCH_KEYS = (
    "ActorPPOTrainer.__init__", "ActorPPOTrainer.training_step", "Actor.forward", "ppo_actor.DataLoader",
    "ppo_actor.get_loss_batch_info", "ppo_actor.iter_grad_accum_global_norm", "ppo_critic.get_loss_batch_info",
    "ppo_critic.iter_grad_accum_global_norm", "RemoteExperienceMaker.compute_advantages_and_returns",
    "RemoteExperienceMaker.make_experience", "BaseModelActor.execute_batch",
    "SamplesGenerator._process_response_into_experience", "SingleTurnAgentExecutor.execute",
    "MultiTurnAgentExecutor.execute", "AsyncEngineArgs.__init__", "DeepspeedStrategy.save_ckpt",
    "DeepspeedStrategy.load_ckpt", "BasePPOTrainer.save_logs_and_checkpoints", "BasePPOTrainer.save_best_checkpoint",
    "BasePPOTrainer.init_checkpoint_states",
)


def _patcher(name: str, patch):
    def patcher(module) -> None:
        if name.startswith("openrlhf."):  # OpenRLHF's modules are patched only at a supported version
            check_openrlhf()
        patch(module, LEDGER)

    return patcher


_HOOK_TAG = "stablerl.openrlhf"
_CHAINED = {"done": False}


def instrument(now: bool = False) -> None:
    """Arm the patches in this process: modules already imported are patched now, the others when (and if)
    they are imported (a post-import hook; imports no OpenRLHF module). Idempotent. With ``now=True`` also
    import OpenRLHF's patched modules (and ``vllm.engine.arg_utils``) at once (heavy: ``openrlhf.models``).

    Also Ray's ``worker_process_setup_hook`` (see :data:`SETUP_HOOK`); it then runs
    ``$STABLERL_CHAINED_SETUP_HOOK`` (a user's own setup hook) once."""
    found = openrlhf_version()
    if found is not None or now:
        check_openrlhf(found)
    with _LOCK:
        LEDGER.on_import(_HOOK_TAG, {name: _patcher(name, patch) for name, patch in _PATCHERS.items()})
    if now:
        for name in _PATCHERS:
            importlib.import_module(name)  # the post-import hook (or the call above) patches it
    chained = os.environ.get(ENV_CHAINED_SETUP_HOOK)
    if chained and chained not in (SETUP_HOOK, LEGACY_SETUP_HOOK) and not _CHAINED["done"]:
        _CHAINED["done"] = True
        _load_callable(chained)()


def uninstrument() -> None:
    """Undo every patch and disarm the import hook (the exact original attributes come back). Idempotent."""
    with _LOCK:
        LEDGER.restore()


def is_applied() -> dict[str, bool]:
    """Which patches are in place in this process."""
    return {key: key in LEDGER for key in PATCH_KEYS}
