"""Trainer hooks (``stablerl.TrainerHook``, e.g. SFPO) around verl 0.9.1's actor update (and the entropy
controller's step, :mod:`stablerl.adapters.verl._controller`).

verl's actor config rejects unknown keys, so a hook is selected on the stablerl policy-loss config, which
the workers see too::

    actor_rollout_ref.actor.policy_loss._target_=stablerl.adapters.verl.StablePolicyLossConfig
    +actor_rollout_ref.actor.policy_loss.stablerl_trainer_hook=sfpo
    +actor_rollout_ref.actor.policy_loss.stablerl_trainer_hook_params={inner_steps:3,alpha:0.8}

The adapter wraps ``ActorRolloutRefWorker.update_actor`` (engine workers; the legacy trainer,
``trainer.use_v1=false``: under v1 the batch arrives as TransferQueue metadata and is refused): one
call of verl's own ``update_actor`` is one pass over the batch (``ppo_epochs`` epochs of its mini-batches,
each an optimizer step, then one LR-scheduler step). The wrapper runs ``hook.passes_per_batch()`` such
passes on copies of the same batch and calls the hook between them with the actor's trainable parameters
(this rank's FSDP shards: the optimizer steps them directly, so an in-place change is what the next pass
starts from). The statistic fed to ``after_pass`` is verl's ``actor/entropy_loss`` of the pass (needs
``actor.calculate_entropy=True`` or ``entropy_coeff != 0``), the same on every rank. The hook's state is
saved with the per-rank loss state (``stablerl_loss_state_rank<r>.pt``).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import torch

from stablerl.adapters.verl._ledger import LEDGER

logger = logging.getLogger("stablerl.adapters.verl")

WORKERS_MODULE = "verl.workers.engine_workers"
HOOK_KEY, HOOK_PARAMS_KEY = "stablerl_trainer_hook", "stablerl_trainer_hook_params"
ENTROPY_METRIC = "actor/entropy_loss"
_KEY = "trainer_hook"
_HOOKS: dict[str, Any] = {}  # name -> the hook of this process (one actor per worker process)
_WARNED: set = set()


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    getter = getattr(cfg, "get", None)
    return getter(key, default) if callable(getter) else getattr(cfg, key, default)


def selection(policy_loss_cfg: Any, key: str = HOOK_KEY, params_key: str = HOOK_PARAMS_KEY) -> tuple[Optional[str], dict]:
    """``(name or None, its params)`` of the extension selected by ``key`` on an ``actor.policy_loss`` config
    (the trainer hook by default; the entropy controller's keys are read the same way)."""
    name = _cfg_get(policy_loss_cfg, key)
    if name is None or (isinstance(name, str) and name.strip().lower() in ("", "none", "null")):
        return None, {}
    params = _cfg_get(policy_loss_cfg, params_key) or {}
    return str(name), {str(k): v for k, v in dict(params).items()}


def check_selection(policy_loss_cfg: Any, kind: str = "trainer_hook", key: str = HOOK_KEY,
                    params_key: str = HOOK_PARAMS_KEY) -> Optional[str]:
    """Refuse an unknown, unavailable or unfeedable extension of ``kind`` (a trainer hook by default) and bad
    hyper-parameters where the config is built."""
    import stablerl
    from stablerl.frameworks import resolve
    from stablerl.params import StableRLError, build_params

    name, params = selection(policy_loss_cfg, key, params_key)
    if name is None:
        if _cfg_get(policy_loss_cfg, params_key):
            raise StableRLError(f"policy_loss.{params_key} is set but policy_loss.{key} is not")
        return None
    resolve("verl", kind, name)  # unknown name / an input verl cannot feed: the reason in verl's words
    build_params(stablerl.get_spec(kind, name), params)
    return name


def hook_for(worker_config: Any):
    """This process's hook for the worker's config (built on first use, tracked in the loss-state store)."""
    import stablerl
    from stablerl.contracts import TRAINER_HOOK

    from . import _inputs

    policy_loss = _cfg_get(_cfg_get(worker_config, "actor"), "policy_loss")
    name, params = selection(policy_loss)
    if name is None:
        return None
    hook = _HOOKS.get(name)
    if hook is None:
        hook = stablerl.make_trainer_hook(name, **params)
        _HOOKS[name] = hook
        _inputs.STATE.track(TRAINER_HOOK, name, hook)  # saved / restored with the per-rank loss state
        logger.warning("stablerl/verl: trainer hook %r runs with %s", name, params or "its defaults")
    return hook


def _as_float(value: Any) -> Optional[float]:
    if value is None:
        return None
    aggregate = getattr(value, "aggregate", None)
    if callable(aggregate):  # verl's Metric
        return float(aggregate())
    if isinstance(value, (list, tuple)):
        values = [v for v in (_as_float(x) for x in value) if v is not None]
        return sum(values) / len(values) if values else None
    if isinstance(value, torch.Tensor):
        return float(value.float().mean())
    return float(value)


def _metrics(output: Any) -> Optional[dict]:
    if output is None:
        return None
    try:
        from verl.utils import tensordict_utils as tu

        return tu.get(output, "metrics")
    except Exception:  # noqa: BLE001 - no metrics on this rank
        return None


def _agreed(value: Optional[float]) -> Optional[float]:
    """The pass's statistic as rank 0 of those that have it sees it: every rank feeds the hook the same."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, value)
    return next((v for v in gathered if v is not None), None)


def run_passes(worker: Any, hook: Any, update: Any, data: Any, args: tuple, kwargs: dict) -> Any:
    """``hook.passes_per_batch()`` calls of verl's ``update_actor`` on the same batch, the hook between them."""
    from stablerl import ParamsView
    from stablerl.params import StableRLError

    from tensordict import TensorDict

    if not isinstance(data, TensorDict):
        raise StableRLError(
            f"stablerl trainer hook: update_actor got a {type(data).__name__}, not verl's TensorDict: trainer hooks "
            "run with verl's legacy trainer (trainer.use_v1=false); under the v1 trainer update_actor receives "
            "TransferQueue metadata, which the adapter does not copy for another pass (untested)")
    engine = worker.actor.engine
    module = engine.module
    view = ParamsView(parameters=lambda: [p for p in module.parameters() if p.requires_grad],
                      optimizer=getattr(engine, "optimizer", None))
    passes = hook.passes_per_batch()
    hook.before_batch(view)
    extra: dict[str, Any] = {}
    output = None
    for k in range(passes):
        output = update(worker, data.copy(), *args, **kwargs)  # train_mini_batch pops its options from the batch
        metrics = _metrics(output)
        entropy = _agreed(_as_float(metrics.get(ENTROPY_METRIC)) if metrics is not None else None)
        if entropy is None and "no_entropy" not in _WARNED:
            _WARNED.add("no_entropy")
            logger.warning("stablerl/verl: the trainer hook gets no entropy (verl reports %s only with "
                           "actor.calculate_entropy=True or entropy_coeff != 0): its entropy rule does not advance",
                           ENTROPY_METRIC)
        out = hook.after_pass(view, k, entropy=entropy) or {}
        for key, v in out.items():
            if isinstance(v, (bool, int, float)):
                extra[f"stablerl/{key}"] = float(v)
    metrics = _metrics(output)
    if metrics is not None:
        name = next(n for n, h in _HOOKS.items() if h is hook)
        for key, v in extra.items():
            metrics[key.replace("stablerl/", f"stablerl/{name}/", 1)] = [v]
        metrics[f"stablerl/{name}/passes"] = [float(passes)]
    return output


def _wrap_update_actor(update):
    @functools.wraps(update)  # keeps verl's dispatch attributes (register's MAGIC_ATTR)
    def update_actor(self, data, *args, **kwargs):
        from . import _controller

        config = getattr(self, "config", None)
        controller = _controller.controller_for(config)
        applied = _controller.before_update(self, controller) if controller is not None else None
        hook = hook_for(config)
        if hook is None:
            output = update(self, data, *args, **kwargs)
        else:
            output = run_passes(self, hook, update, data, args, kwargs)
        if controller is not None:
            name = _controller.selection(_cfg_get(_cfg_get(config, "actor"), "policy_loss"))[0]
            _controller.after_update(controller, name, output, applied)
        return output

    return update_actor


def _patch_workers_module(module) -> None:
    cls = getattr(module, "ActorRolloutRefWorker", None)
    if cls is None or not hasattr(cls, "update_actor"):
        logger.error("stablerl: verl's %s has no ActorRolloutRefWorker.update_actor; trainer hooks are off", WORKERS_MODULE)
        return
    LEDGER.set_attr(f"{_KEY}:update_actor", cls, "update_actor", _wrap_update_actor(cls.update_actor))


def instrument() -> None:
    """Wrap ``ActorRolloutRefWorker.update_actor`` now, or when verl's engine workers are imported."""
    LEDGER.on_import(f"{_KEY}:on_import", {WORKERS_MODULE: _patch_workers_module})


def status() -> str:
    return "patched" if f"{_KEY}:update_actor" in LEDGER.keys() else "deferred"
