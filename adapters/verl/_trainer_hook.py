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

from stablerl.adapters.verl import _controller
from stablerl.adapters.verl._ledger import LEDGER, verl_adapter
from stablerl.selection import config_get, read_selection

logger = logging.getLogger("stablerl.adapters.verl")

WORKERS_MODULE = "verl.workers.engine_workers"
HOOK_KEY, HOOK_PARAMS_KEY = "stablerl_trainer_hook", "stablerl_trainer_hook_params"
ENTROPY_METRIC = _controller.ENTROPY_METRIC
_KEY = "trainer_hook"
_HOOKS: dict[str, Any] = {}  # name -> the hook of this process (one actor per worker process)
_WARNED: set = set()


def selection(policy_loss_cfg: Any) -> tuple[Optional[str], dict]:
    """``(hook name or None, its params)`` from an ``actor.policy_loss`` config."""
    return read_selection(policy_loss_cfg, HOOK_KEY, HOOK_PARAMS_KEY, prefix="policy_loss.")


def check_selection(policy_loss_cfg: Any) -> Optional[str]:
    """Refuse an unknown, unavailable or unfeedable hook and bad hyper-parameters where the config is built."""
    return _controller.check_extension(policy_loss_cfg, "trainer_hook", HOOK_KEY, HOOK_PARAMS_KEY)


def hook_for(worker_config: Any):
    """This process's hook for the worker's config (built on first use, tracked in the loss-state store)."""
    import stablerl
    from stablerl.contracts import TRAINER_HOOK

    policy_loss = config_get(config_get(worker_config, "actor"), "policy_loss")
    name, params = selection(policy_loss)
    if name is None:
        return None
    hook = _HOOKS.get(name)
    if hook is None:
        hook = stablerl.make_trainer_hook(name, **params)
        _HOOKS[name] = hook
        verl_adapter().state.loss.track(TRAINER_HOOK, name, hook)  # saved / restored with the per-rank loss state
        logger.warning("stablerl/verl: trainer hook %r runs with %s", name, params or "its defaults")
    return hook


def run_passes(worker: Any, hook: Any, update: Any, data: Any, args: tuple, kwargs: dict) -> Any:
    """``hook.passes_per_batch()`` calls of verl's ``update_actor`` on the same batch, the hook between them."""
    from stablerl.contracts import TRAINER_HOOK
    from stablerl.params import StableRLError

    from tensordict import TensorDict

    if not isinstance(data, TensorDict):
        raise StableRLError(
            f"stablerl trainer hook: update_actor got a {type(data).__name__}, not verl's TensorDict: trainer hooks "
            "run with verl's legacy trainer (trainer.use_v1=false); under the v1 trainer update_actor receives "
            "TransferQueue metadata, which the adapter does not copy for another pass (untested)")
    from stablerl.steps import BatchRecord

    adapter = verl_adapter()
    view = adapter.provide(TRAINER_HOOK, "params_view", BatchRecord(adapter, host=worker))
    passes = hook.passes_per_batch()
    hook.before_batch(view)
    extra: dict[str, Any] = {}
    output = None
    for k in range(passes):
        output = update(worker, data.copy(), *args, **kwargs)  # train_mini_batch pops its options from the batch
        entropy = _controller.update_entropy(_controller.metrics_of(output))
        if entropy is None and "no_entropy" not in _WARNED:
            _WARNED.add("no_entropy")
            logger.warning("stablerl/verl: the trainer hook gets no entropy (verl reports %s only with "
                           "actor.calculate_entropy=True or entropy_coeff != 0): its entropy rule does not advance",
                           ENTROPY_METRIC)
        out = hook.after_pass(view, k, entropy=entropy) or {}
        for key, v in out.items():
            if isinstance(v, (bool, int, float)):
                extra[f"stablerl/{key}"] = float(v)
    metrics = _controller.metrics_of(output)
    if metrics is not None:
        name = next(n for n, h in _HOOKS.items() if h is hook)
        for key, v in extra.items():
            metrics[key.replace("stablerl/", f"stablerl/{name}/", 1)] = [v]
        metrics[f"stablerl/{name}/passes"] = [float(passes)]
    return output


def _wrap_update_actor(update):
    @functools.wraps(update)  # keeps verl's dispatch attributes (register's MAGIC_ATTR)
    def update_actor(self, data, *args, **kwargs):
        config = getattr(self, "config", None)
        controller = _controller.controller_for(config)
        applied = _controller.before_update(self, controller) if controller is not None else None
        hook = hook_for(config)
        if hook is None:
            output = update(self, data, *args, **kwargs)
        else:
            output = run_passes(self, hook, update, data, args, kwargs)
        if controller is not None:
            name = _controller.selection(config_get(config_get(config, "actor"), "policy_loss"))[0]
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
