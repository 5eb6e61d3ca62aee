"""stablerl's per-process state in OpenRLHF checkpoints, in core's one format (``StateStore.state_dict()``); this
module only says where OpenRLHF keeps it:

* actor workers: the policy loss's state (EntroPIC's integral, CAPO's moments) in DeepSpeed's ``client_state``
  (:data:`LOSS_KEY`), taken out again by ``load_ckpt`` (so it never reaches the driver) and handed to the loss
  ``ActorPPOTrainer`` builds right after. DeepSpeed writes rank 0's ``client_state`` only: exact for the
  built-ins, whose state comes from quantities reduced over the ranks;
* the trainer process: the reward shapers' / batch filters' store in the ``client_states`` ``BasePPOTrainer``
  sends the actors (:data:`DRIVER_KEY`). A checkpoint without these keys loads as before.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Optional

import torch

from stablerl.state import StateStore

logger = logging.getLogger("stablerl.adapters.openrlhf")

LOSS_KEY = "stablerl_loss_state"
DRIVER_KEY = "stablerl_driver_state"

_live_loss: Optional[weakref.ref] = None  # the StablePolicyLoss this process's actor trains with
_pending_loss_state: Optional[tuple] = None  # (state, where) read by load_ckpt before the loss exists


def adopt_loss(loss: Any) -> None:
    """Called when ``ActorPPOTrainer`` built its ``StablePolicyLoss``: its state is saved with this process's
    checkpoints, and a state just loaded from a checkpoint is restored into it."""
    global _live_loss, _pending_loss_state
    _live_loss = weakref.ref(loss)
    if _pending_loss_state is not None:
        _restore_loss_state(loss.stablerl_state, *_pending_loss_state)
        _pending_loss_state = None
        logger.info("stablerl: restored the policy loss's state from the checkpoint")


def _with(states: Optional[dict], key: str, store: Optional[StateStore]) -> Optional[dict]:
    return {**(states or {}), key: store.state_dict()} if store else states


def _loss_store() -> Optional[StateStore]:
    loss = _live_loss() if _live_loss is not None else None
    return None if loss is None else loss.stablerl_state


def _restore_loss_state(store: StateStore, state: Any, where: str, device: Any = None) -> None:
    # DeepSpeed loads client_state onto the CPU: tensors go back to this worker's accelerator
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    store.load_state_dict(state, where=where, device=device)


def _take_loss_state(states: Any, where: str) -> None:
    global _pending_loss_state
    if not isinstance(states, dict) or LOSS_KEY not in states:
        return
    state, where = states.pop(LOSS_KEY), f"{where} ({LOSS_KEY})"
    StateStore(holds="loss").check(state, where)  # refuse a foreign blob now, not when the loss is built
    store = _loss_store()
    if store is not None:  # a load after the loss was built: restore now
        _restore_loss_state(store, state, where)
    else:
        _pending_loss_state = (state, where)


def _driver_store() -> StateStore:
    from ._advantage import STATE

    return STATE


def restore_driver_state(states: Any) -> bool:
    if not isinstance(states, dict) or states.get(DRIVER_KEY) is None:
        return False
    _driver_store().load_state_dict(states[DRIVER_KEY], where=DRIVER_KEY)
    logger.info("stablerl: restored the reward shapers' / batch filters' state from the checkpoint")
    return True


def patch_strategy_module(module, ledger) -> None:
    """``DeepspeedStrategy.save_ckpt`` / ``load_ckpt``: the actor's loss state in DeepSpeed's client_state."""

    @ledger.around(module.DeepspeedStrategy, "save_ckpt")
    def save_ckpt(save, self, model, save_dir, tag=None, max_num=3, max_mem=1000, client_state=None, *args, **kwargs):
        return save(self, model, save_dir, tag, max_num, max_mem, _with(client_state, LOSS_KEY, _loss_store()), *args,
                    **kwargs)

    @ledger.around(module.DeepspeedStrategy, "load_ckpt")
    def load_ckpt(load, self, model, load_dir, *args, **kwargs):
        load_path, states = load(self, model, load_dir, *args, **kwargs)
        _take_loss_state(states, str(load_path))
        return load_path, states


def patch_trainer_module(module, ledger) -> None:
    """``BasePPOTrainer``: the shapers' / filters' state into the actors' client_states, and back on resume."""

    @ledger.around(module.BasePPOTrainer, "save_logs_and_checkpoints")
    def save_logs_and_checkpoints(save, self, global_step, logs_dict=None, client_states=None):
        return save(self, global_step, logs_dict, _with(client_states, DRIVER_KEY, _driver_store()))

    @ledger.around(module.BasePPOTrainer, "save_best_checkpoint")
    def save_best_checkpoint(save_best, self, eval_metrics, global_step, client_states=None):
        return save_best(self, eval_metrics, global_step, _with(client_states, DRIVER_KEY, _driver_store()))

    @ledger.around(module.BasePPOTrainer, "init_checkpoint_states")
    def init_checkpoint_states(init_states, self):
        states = init_states(self)
        restore_driver_state(states)
        return states
