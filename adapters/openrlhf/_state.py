"""stablerl's per-process state in OpenRLHF checkpoints, in core's one format (``StateStore.state_dict()``); this
module only says where OpenRLHF keeps it:

* actor workers: the policy loss's state (EntroPIC's integral, CAPO's moments) and the entropy controller's in
  DeepSpeed's ``client_state`` (the adapter's ``loss_state`` / ``controller_state``, core's ``CheckpointSlot``),
  taken out again by ``load_ckpt`` (so they never reach the driver) and handed to the loss / controller
  ``ActorPPOTrainer`` builds right after.
  DeepSpeed writes rank 0's ``client_state`` only: exact for the built-ins, whose state comes from quantities
  reduced over the ranks;
* the trainer process: the reward shapers' / batch filters' store in the ``client_states`` ``BasePPOTrainer``
  sends the actors (:data:`DRIVER_KEY`; the adapter's ``driver_state``). A checkpoint without these keys loads as
  before.
"""

from __future__ import annotations

import logging
from typing import Any

from stablerl.checkpoint_slot import with_state

logger = logging.getLogger("stablerl.adapters.openrlhf")

DRIVER_KEY = "stablerl_driver_state"


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
        for slot in (adapter.loss_state, adapter.controller_state):
            client_state = slot.saved_into(client_state)
        return save(self, model, save_dir, tag, max_num, max_mem, client_state, *args, **kwargs)

    @ledger.around(module.DeepspeedStrategy, "load_ckpt")
    def load_ckpt(load, self, model, load_dir, *args, **kwargs):
        load_path, states = load(self, model, load_dir, *args, **kwargs)
        for slot in (adapter.loss_state, adapter.controller_state):
            slot.take(states, str(load_path))
        return load_path, states


def patch_trainer_module(module, ledger, adapter) -> None:
    """``BasePPOTrainer``: the shapers' / filters' state into the actors' client_states, and back on resume."""

    @ledger.around(module.BasePPOTrainer, "save_logs_and_checkpoints")
    def save_logs_and_checkpoints(save, self, global_step, logs_dict=None, client_states=None):
        return save(self, global_step, logs_dict, with_state(client_states, DRIVER_KEY, adapter.driver_state))

    @ledger.around(module.BasePPOTrainer, "save_best_checkpoint")
    def save_best_checkpoint(save_best, self, eval_metrics, global_step, client_states=None):
        return save_best(self, eval_metrics, global_step, with_state(client_states, DRIVER_KEY, adapter.driver_state))

    @ledger.around(module.BasePPOTrainer, "init_checkpoint_states")
    def init_checkpoint_states(init_states, self):
        states = init_states(self)
        restore_driver_state(adapter, states)
        return states
