"""stablerl's per-process state in OpenRLHF checkpoints, in core's one format (``StateStore.state_dict()``); this
module only says where OpenRLHF keeps it:

* actor workers: the policy loss's state (EntroPIC's integral, CAPO's moments) and the entropy controller's in
  DeepSpeed's ``client_state`` (the adapter's ``loss_state`` / ``controller_state``), taken out again by ``load_ckpt`` (so
  they never reach the driver) and handed to the loss / controller ``ActorPPOTrainer`` builds right after.
  DeepSpeed writes rank 0's ``client_state`` only: exact for the built-ins, whose state comes from quantities
  reduced over the ranks;
* the trainer process: the reward shapers' / batch filters' store in the ``client_states`` ``BasePPOTrainer``
  sends the actors (:data:`DRIVER_KEY`; the adapter's ``driver_state``). A checkpoint without these keys loads as before.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Optional

import torch

from stablerl.state import StateStore

logger = logging.getLogger("stablerl.adapters.openrlhf")

DRIVER_KEY = "stablerl_driver_state"


class WorkerState:
    """One stablerl store of an actor worker, saved in DeepSpeed's ``client_state`` under ``key``: the store is
    adopted when the object that owns it is built (the loss, the controller: in ``ActorPPOTrainer.__init__``),
    and a state ``load_ckpt`` read before then waits for it."""

    def __init__(self, key: str, holds: str, owner: str):
        self.key, self.holds, self.owner = key, holds, owner
        self.live: Optional[weakref.ref] = None
        self.pending: Optional[tuple] = None  # (state, where) read by load_ckpt before the store exists

    def adopt(self, store: StateStore) -> None:
        self.live = weakref.ref(store)
        if self.pending is not None:
            _restore_loss_state(store, *self.pending)
            self.pending = None
            logger.info("stablerl: restored the %s state from the checkpoint", self.owner)

    def store(self) -> Optional[StateStore]:
        return self.live() if self.live is not None else None

    def take(self, states: Any, where: str) -> None:
        """Take this key out of the client_states ``load_ckpt`` returns (it never reaches the driver)."""
        if not isinstance(states, dict) or self.key not in states:
            return
        state, where = states.pop(self.key), f"{where} ({self.key})"
        StateStore(holds=self.holds).check(state, where)  # refuse a foreign blob now, not when the owner is built
        store = self.store()
        if store is not None:  # a load after the owner was built: restore now
            _restore_loss_state(store, state, where)
        else:
            self.pending = (state, where)


def _with(states: Optional[dict], key: str, store: Optional[StateStore]) -> Optional[dict]:
    return {**(states or {}), key: store.state_dict()} if store else states


def _restore_loss_state(store: StateStore, state: Any, where: str, device: Any = None) -> None:
    # DeepSpeed loads client_state onto the CPU: tensors go back to this worker's accelerator
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    store.load_state_dict(state, where=where, device=device)


def restore_driver_state(adapter, states: Any) -> bool:
    if not isinstance(states, dict) or states.get(DRIVER_KEY) is None:
        return False
    adapter.driver_state.load_state_dict(states[DRIVER_KEY], where=DRIVER_KEY)
    logger.info("stablerl: restored the reward shapers' / batch filters' state from the checkpoint")
    return True


def patch_strategy_module(module, ledger, adapter) -> None:
    """``DeepspeedStrategy.save_ckpt`` / ``load_ckpt``: the actor's loss and controller state in DeepSpeed's
    client_state."""

    @ledger.around(module.DeepspeedStrategy, "save_ckpt")
    def save_ckpt(save, self, model, save_dir, tag=None, max_num=3, max_mem=1000, client_state=None, *args, **kwargs):
        for worker_state in (adapter.loss_state, adapter.controller_state):
            client_state = _with(client_state, worker_state.key, worker_state.store())
        return save(self, model, save_dir, tag, max_num, max_mem, client_state, *args, **kwargs)

    @ledger.around(module.DeepspeedStrategy, "load_ckpt")
    def load_ckpt(load, self, model, load_dir, *args, **kwargs):
        load_path, states = load(self, model, load_dir, *args, **kwargs)
        for worker_state in (adapter.loss_state, adapter.controller_state):
            worker_state.take(states, str(load_path))
        return load_path, states


def patch_trainer_module(module, ledger, adapter) -> None:
    """``BasePPOTrainer``: the shapers' / filters' state into the actors' client_states, and back on resume."""

    @ledger.around(module.BasePPOTrainer, "save_logs_and_checkpoints")
    def save_logs_and_checkpoints(save, self, global_step, logs_dict=None, client_states=None):
        return save(self, global_step, logs_dict, _with(client_states, DRIVER_KEY, adapter.driver_state))

    @ledger.around(module.BasePPOTrainer, "save_best_checkpoint")
    def save_best_checkpoint(save_best, self, eval_metrics, global_step, client_states=None):
        return save_best(self, eval_metrics, global_step, _with(client_states, DRIVER_KEY, adapter.driver_state))

    @ledger.around(module.BasePPOTrainer, "init_checkpoint_states")
    def init_checkpoint_states(init_states, self):
        states = init_states(self)
        restore_driver_state(adapter, states)
        return states
