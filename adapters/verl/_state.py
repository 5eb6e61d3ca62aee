"""stablerl's per-process state in verl checkpoints: nothing an algorithm carries across steps is lost on resume.

Two kinds of state live outside verl's model/optimizer/dataloader checkpoint:

* **in the actor workers**: each stablerl loss's ``Context.state`` (EntroPIC's controller integral, CAPO's
  tracked Adam moments), the adapter's ``state.loss`` store. The FSDP engine subclass
  saves it next to the actor's shards as ``stablerl_loss_state_rank<r>.pt`` and restores it on load (one file per
  rank: the state is per process);
* **in the driver**: the state of the advantage call site (the call counter ``ctx.step`` that scheduled
  estimators/shapers read, random generators of filters/shapers, their state dicts),
  the adapter's ``state.driver`` store. verl's trainers' ``_save_checkpoint`` /
  ``_load_checkpoint`` (legacy ``RayPPOTrainer`` and v1 ``PPOTrainer``) are wrapped to save it as
  ``global_step_<n>/stablerl_driver_state.pt`` and restore it.

Both files hold :meth:`stablerl.state.StateStore.state_dict` (core's one format); this module only says where
verl keeps them. A checkpoint without these files (written before stablerl, or by a run without stateful algorithms)
loads as before; a warning says the state starts fresh only when a file was expected but is missing.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from stablerl.adapters.verl._ledger import LEDGER, guarded, verl_adapter

logger = logging.getLogger("stablerl.adapters.verl")

LOSS_STATE_FILE = "stablerl_loss_state_rank{rank}.pt"
DRIVER_STATE_FILE = "stablerl_driver_state.pt"
TRAINER_CLASSES = {"verl.trainer.ppo.ray_trainer": "RayPPOTrainer", "verl.trainer.ppo.v1.trainer_base": "PPOTrainer"}
_KEY = "checkpoint_state"  # prefix of this module's ledger keys


# ---- actor workers (called by the FSDP engine subclass) ------------------------------------------


def save_loss_state(folder: str, rank: int) -> None:
    store = verl_adapter().state.loss
    if store:
        store.save(os.path.join(folder, LOSS_STATE_FILE.format(rank=rank)))


def load_loss_state(folder: str, rank: int) -> bool:
    return verl_adapter().state.loss.load(os.path.join(folder, LOSS_STATE_FILE.format(rank=rank)))


# ---- the driver ----------------------------------------------------------------------------------


def save_driver_state(folder: str) -> None:
    store = verl_adapter().state.driver
    if store:
        store.save(os.path.join(folder, DRIVER_STATE_FILE))


def load_driver_state(folder: str) -> bool:
    return verl_adapter().state.driver.load(os.path.join(folder, DRIVER_STATE_FILE))


def _step_folder(trainer: Any, loading: bool) -> str:
    cfg = trainer.config.trainer
    if loading and cfg.get("resume_mode") == "resume_path" and cfg.get("resume_from_path"):
        folder = cfg.resume_from_path
    else:
        folder = os.path.join(cfg.default_local_dir, f"global_step_{trainer.global_steps}")
    return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)


def _patch_trainer_module(module, class_name: str) -> None:
    cls = getattr(module, class_name)
    save, load = cls._save_checkpoint, cls._load_checkpoint

    @functools.wraps(save)
    def _save_checkpoint(self, *args, **kwargs):
        out = save(self, *args, **kwargs)
        save_driver_state(_step_folder(self, loading=False))
        return out

    @functools.wraps(load)
    def _load_checkpoint(self, *args, **kwargs):
        out = load(self, *args, **kwargs)
        if getattr(self, "global_steps", 0):  # resumed from a checkpoint
            folder = _step_folder(self, loading=True)
            if load_driver_state(folder):
                logger.info("stablerl: restored the advantage-side state from %s", folder)
        return out

    LEDGER.set_attr(f"{_KEY}:{class_name}._save_checkpoint", cls, "_save_checkpoint", _save_checkpoint)
    LEDGER.set_attr(f"{_KEY}:{class_name}._load_checkpoint", cls, "_load_checkpoint", _load_checkpoint)


def instrument() -> None:
    """Wrap the trainers' checkpoint methods (now if imported, else on import). Idempotent; the adapter's
    ``uninstrument()`` restores them."""
    lost = "the driver's stablerl state is not saved"
    LEDGER.on_import(f"{_KEY}:on_import", {name: guarded(functools.partial(_patch_trainer_module, class_name=cls), lost)
                                           for name, cls in TRAINER_CLASSES.items()})
