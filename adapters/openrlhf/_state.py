"""stablerl's per-process state in OpenRLHF checkpoints: nothing an algorithm carries across steps is lost on resume.

Two kinds of state live outside OpenRLHF's model/optimizer/dataloader checkpoint:

* **in each actor worker**: the stablerl policy loss's ``Context.state`` (``StablePolicyLoss.stablerl_state``:
  EntroPIC's controller integral, CAPO's tracked Adam moments). ``DeepspeedStrategy.save_ckpt`` is wrapped
  to add it to DeepSpeed's ``client_state`` (key :data:`LOSS_KEY`) in the process whose actor built the loss;
  ``DeepspeedStrategy.load_ckpt`` takes it back out (so it never travels to the driver with
  ``get_checkpoint_states``) and hands it to the loss when ``ActorPPOTrainer`` builds it, right after.
  DeepSpeed writes the ``client_state`` of data-parallel rank 0 only, so every rank resumes with rank 0's
  state: exact for the built-ins, whose state comes from quantities reduced over the ranks (EntroPIC's
  global entropy, CAPO's summed moment updates).
* **in the trainer process** (``BasePPOTrainer``, which runs the experience maker): the call counter,
  random generators and state dicts of reward shapers and batch filters
  (:data:`stablerl.adapters.openrlhf._shape_filter.STATE`). ``save_logs_and_checkpoints`` and
  ``save_best_checkpoint`` add it to the ``client_states`` they send the actors (key :data:`DRIVER_KEY`);
  ``init_checkpoint_states`` restores it from what the actors loaded.

``PolicyModelActor`` is a ``@ray.remote`` class shipped by value, so its methods cannot be patched in a
worker: the hooks sit on ``DeepspeedStrategy``, ``ActorPPOTrainer`` and ``BasePPOTrainer``, plain classes
imported by reference. Both keys hold :meth:`stablerl.state.StateStore.state_dict` (core's one format); this
module only says where OpenRLHF keeps them. A checkpoint without these keys (written before stablerl, or by a run without
stateful algorithms) loads as before.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Callable, Optional

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


def _with_loss_state(client_state: Optional[dict]) -> Optional[dict]:
    loss = _live_loss() if _live_loss is not None else None
    if loss is None or not loss.stablerl_state:
        return client_state
    return {**(client_state or {}), LOSS_KEY: loss.stablerl_state.state_dict()}


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
    loss = _live_loss() if _live_loss is not None else None
    if loss is not None:  # a load after the loss was built: restore now
        _restore_loss_state(loss.stablerl_state, state, where)
    else:
        _pending_loss_state = (state, where)


def driver_state() -> Optional[dict]:
    from . import _shape_filter

    return _shape_filter.STATE.state_dict() if _shape_filter.STATE else None


def restore_driver_state(states: Any) -> bool:
    from . import _shape_filter

    if not isinstance(states, dict) or states.get(DRIVER_KEY) is None:
        return False
    _shape_filter.STATE.load_state_dict(states[DRIVER_KEY], where=DRIVER_KEY)
    logger.info("stablerl: restored the reward shapers' / batch filters' state from the checkpoint")
    return True


def _with_driver_state(client_states: Optional[dict]) -> Optional[dict]:
    packed = driver_state()
    return client_states if packed is None else {**(client_states or {}), DRIVER_KEY: packed}


def patch_strategy_module(module, set_patch: Callable) -> None:
    """``DeepspeedStrategy.save_ckpt`` / ``load_ckpt``: the actor's loss state in DeepSpeed's client_state."""
    cls = module.DeepspeedStrategy
    save, load = cls.__dict__["save_ckpt"], cls.__dict__["load_ckpt"]

    @functools.wraps(save)
    def save_ckpt(self, model, save_dir, tag=None, max_num=3, max_mem=1000, client_state=None, *args, **kwargs):
        return save(self, model, save_dir, tag, max_num, max_mem, _with_loss_state(client_state), *args, **kwargs)

    @functools.wraps(load)
    def load_ckpt(self, model, load_dir, *args, **kwargs):
        load_path, states = load(self, model, load_dir, *args, **kwargs)
        _take_loss_state(states, str(load_path))
        return load_path, states

    set_patch("DeepspeedStrategy.save_ckpt", cls, "save_ckpt", save_ckpt)
    set_patch("DeepspeedStrategy.load_ckpt", cls, "load_ckpt", load_ckpt)


def patch_trainer_module(module, set_patch: Callable) -> None:
    """``BasePPOTrainer``: the shapers' / filters' state into the actors' client_states, and back on resume."""
    cls = module.BasePPOTrainer
    save, save_best = cls.__dict__["save_logs_and_checkpoints"], cls.__dict__["save_best_checkpoint"]
    init_states = cls.__dict__["init_checkpoint_states"]

    @functools.wraps(save)
    def save_logs_and_checkpoints(self, global_step, logs_dict=None, client_states=None):
        return save(self, global_step, logs_dict, _with_driver_state(client_states))

    @functools.wraps(save_best)
    def save_best_checkpoint(self, eval_metrics, global_step, client_states=None):
        return save_best(self, eval_metrics, global_step, _with_driver_state(client_states))

    @functools.wraps(init_states)
    def init_checkpoint_states(self):
        states = init_states(self)
        restore_driver_state(states)
        return states

    set_patch("BasePPOTrainer.save_logs_and_checkpoints", cls, "save_logs_and_checkpoints", save_logs_and_checkpoints)
    set_patch("BasePPOTrainer.save_best_checkpoint", cls, "save_best_checkpoint", save_best_checkpoint)
    set_patch("BasePPOTrainer.init_checkpoint_states", cls, "init_checkpoint_states", init_checkpoint_states)
