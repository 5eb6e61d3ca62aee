"""The OpenRLHF adapter's patches: one ledger, a post-import hook per patched module, and the
``instrument()`` / ``uninstrument()`` pair the package exports (see the package docstring for what is
patched and why)."""

from __future__ import annotations

import functools
import importlib
import os
import threading
from typing import Any

from stablerl.adapters._patching import PatchLedger

from ._selection import _load_callable, selection_from_args
from ._spec import (
    _ACTOR_MODULE,
    _AGENT_MODULE,
    _CRITIC_MODULE,
    _LAUNCHER_MODULE,
    _MAKER_MODULE,
    _SAMPLES_MODULE,
    _STRATEGY_MODULE,
    _TRAINER_MODULE,
    _VLLM_ARGS_MODULE,
    ENV_CHAINED_SETUP_HOOK,
    LEGACY_SETUP_HOOK,
    SETUP_HOOK,
    _check_policy_loss_api,
    check_openrlhf,
    openrlhf_version,
)

_LOCK = threading.RLock()
#: every change to OpenRLHF (and vLLM's AsyncEngineArgs) and the post-import hook; uninstrument() undoes them
LEDGER = PatchLedger("__stablerl_openrlhf_patch__")


def _set_patch(key: str, owner: Any, attr: str, new: Any) -> None:
    LEDGER.set_attr(key, owner, attr, new)  # once per process; uninstrument() undoes it


def _patch_actor_module(module) -> None:
    """Wrap ``ActorPPOTrainer.__init__``: a stablerl policy_loss_type replaces the loss it built."""
    check_openrlhf()
    _check_policy_loss_api(module.PolicyLoss)
    cls = module.ActorPPOTrainer
    original = cls.__dict__["__init__"]

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        sel = selection_from_args(self.args)
        if sel.policy_loss is not None:
            from ._loss import build_policy_loss
            from ._state import adopt_loss

            self.actor_loss_fn = build_policy_loss(self.args, sel, strategy=self.strategy)
            adopt_loss(self.actor_loss_fn)  # its state goes into this actor's checkpoints, and comes back on resume
        if sel.routing_replay is not None:
            from ._routing_replay import arm

            arm(self, sel.routing_replay)
        from . import _inputs

        if _inputs.needs_old_pass_entropy(sel):  # its old-log-prob pass also returns entropy (._inputs)
            setattr(self.actor, _inputs.WANTS_OLD_ENTROPY, True)

    __init__.__wrapped__ = original
    __init__.__doc__ = original.__doc__
    _set_patch("ActorPPOTrainer.__init__", cls, "__init__", __init__)
    from ._routing_replay import patch_actor_module

    patch_actor_module(module, _set_patch)  # training_step, Actor.forward (R2)
    from ._groups import group_dataloader

    # ppo_train's DataLoader keeps prompt groups whole when the buffer's rows carry them (._groups)
    _set_patch("ppo_actor.DataLoader", module, "DataLoader", group_dataloader(module.DataLoader))
    _patch_loss_normalisers(module, "ppo_actor")


def _nonzero_normalisers(info: dict) -> dict:
    """A step whose rows a batch filter all dropped has 0 tokens and 0 sequences: OpenRLHF's
    ``sum(loss * mask) / 0`` would make the loss and every gradient NaN; with 1 they are exactly 0."""
    import torch

    out = dict(info)
    for key in ("batch_num_tokens", "global_batch_size"):
        value = out.get(key)
        if value is not None:
            value = torch.as_tensor(value)
            out[key] = torch.where(value == 0, torch.ones_like(value), value)
    return out


def _patch_loss_normalisers(module, owner: str) -> None:
    """With a batch filter selected, OpenRLHF's loss normalisers (``get_loss_batch_info``,
    ``iter_grad_accum_global_norm``, as bound in ``module``) never divide by an all-masked step's 0."""
    get_info = module.__dict__.get("get_loss_batch_info")
    iter_norm = module.__dict__.get("iter_grad_accum_global_norm")

    def filtering(strategy) -> bool:
        return selection_from_args(strategy.args).batch_filter is not None

    if get_info is not None:
        def get_loss_batch_info(strategy, *args, **kwargs):
            info = get_info(strategy, *args, **kwargs)
            return _nonzero_normalisers(info) if filtering(strategy) else info

        get_loss_batch_info.__wrapped__ = get_info
        _set_patch(f"{owner}.get_loss_batch_info", module, "get_loss_batch_info", get_loss_batch_info)
    if iter_norm is not None:
        def iter_grad_accum_global_norm(data_iter, strategy, *args, **kwargs):
            items = iter_norm(data_iter, strategy, *args, **kwargs)
            if not filtering(strategy):
                return items
            return ((item, _nonzero_normalisers(info)) for item, info in items)

        iter_grad_accum_global_norm.__wrapped__ = iter_norm
        _set_patch(f"{owner}.iter_grad_accum_global_norm", module, "iter_grad_accum_global_norm",
                   iter_grad_accum_global_norm)


def _patch_critic_module(module) -> None:
    check_openrlhf()
    _patch_loss_normalisers(module, "ppo_critic")  # gae + a batch filter: the critic loss sees the same masks


def _patch_maker_module(module) -> None:
    """Wrap ``RemoteExperienceMaker.compute_advantages_and_returns`` (OpenRLHF names delegate)."""
    check_openrlhf()
    cls = module.RemoteExperienceMaker
    original = cls.__dict__["compute_advantages_and_returns"]

    def compute_advantages_and_returns(self, experiences):
        sel = selection_from_args(self.strategy.args)
        if sel.advantage_estimator is None:
            estimate = functools.partial(original, self)
        else:
            from ._advantage import stable_advantages_and_returns

            estimate = functools.partial(stable_advantages_and_returns, self, selection=sel)
        if sel.has_extensions:
            from ._shape_filter import advantages_with_extensions

            experiences = advantages_with_extensions(self, experiences, sel, estimate)
        else:
            experiences = estimate(experiences)
        from . import _inputs
        from ._groups import tag_groups, wants_groups

        if not _inputs.loss_needs_old_entropy(sel):  # used by the advantage step only: not sent to the actors
            _inputs.drop_old_entropy(experiences)

        if wants_groups(sel.policy_loss):  # the loss's prompt groups, through the replay buffer (._groups)
            tag_groups(experiences, int(self.strategy.args.rollout.n_samples_per_prompt))
        return experiences

    compute_advantages_and_returns.__wrapped__ = original
    compute_advantages_and_returns.__doc__ = original.__doc__
    _set_patch("RemoteExperienceMaker.compute_advantages_and_returns", cls, "compute_advantages_and_returns",
               compute_advantages_and_returns)
    from ._routing_replay import patch_maker_module

    patch_maker_module(module, _set_patch, selection_from_args)  # make_experience (R2)


def _patch_launcher_module(module) -> None:
    from ._routing_replay import patch_launcher_module

    check_openrlhf()
    patch_launcher_module(module, _set_patch)  # BaseModelActor.execute_batch (R3)


def _patch_samples_module(module) -> None:
    from ._routing_replay import patch_samples_module

    check_openrlhf()
    patch_samples_module(module, _set_patch, selection_from_args)  # _process_response_into_experience (R3)


def _patch_agent_module(module) -> None:
    from ._routing_replay import patch_agent_module

    check_openrlhf()
    patch_agent_module(module, _set_patch)  # agent executors' execute (R3)


def _patch_vllm_args_module(module) -> None:
    from ._routing_replay import patch_vllm_arg_utils

    patch_vllm_arg_utils(module, _set_patch)  # AsyncEngineArgs.__init__ (R3)


def _patch_strategy_module(module) -> None:
    from ._state import patch_strategy_module

    check_openrlhf()
    patch_strategy_module(module, _set_patch)  # DeepspeedStrategy.save_ckpt / load_ckpt (the loss's state)


def _patch_trainer_module(module) -> None:
    from ._state import patch_trainer_module

    check_openrlhf()
    patch_trainer_module(module, _set_patch)  # BasePPOTrainer checkpoints (the shapers' / filters' state)


_PATCHERS = {_ACTOR_MODULE: _patch_actor_module, _CRITIC_MODULE: _patch_critic_module,
             _MAKER_MODULE: _patch_maker_module,
             _LAUNCHER_MODULE: _patch_launcher_module, _SAMPLES_MODULE: _patch_samples_module,
             _AGENT_MODULE: _patch_agent_module, _VLLM_ARGS_MODULE: _patch_vllm_args_module,
             _STRATEGY_MODULE: _patch_strategy_module, _TRAINER_MODULE: _patch_trainer_module}


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
        LEDGER.on_import(_HOOK_TAG, _PATCHERS)
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
    return {key: True for key in LEDGER.keys() if key != _HOOK_TAG} | {
        k: False for k in ("ActorPPOTrainer.__init__", "RemoteExperienceMaker.compute_advantages_and_returns",
                           "ActorPPOTrainer.training_step", "Actor.forward",
                           "RemoteExperienceMaker.make_experience", "BaseModelActor.execute_batch",
                           "SamplesGenerator._process_response_into_experience", "SingleTurnAgentExecutor.execute",
                           "MultiTurnAgentExecutor.execute", "AsyncEngineArgs.__init__",
                           "ppo_actor.get_loss_batch_info", "ppo_actor.iter_grad_accum_global_norm",
                           "ppo_critic.get_loss_batch_info", "ppo_critic.iter_grad_accum_global_norm",
                           "DeepspeedStrategy.save_ckpt", "DeepspeedStrategy.load_ckpt",
                           "BasePPOTrainer.save_logs_and_checkpoints", "BasePPOTrainer.save_best_checkpoint",
                           "BasePPOTrainer.init_checkpoint_states")
        if k not in LEDGER
    }
