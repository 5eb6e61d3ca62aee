"""One stablerl :class:`~stablerl.state.StateStore` saved under one key of a framework's own checkpoint dict
(DeepSpeed's ``client_state``, a trainer's ``client_states``), for frameworks that build the object owning the store (a loss, a
controller) only after they read the checkpoint: a state read before then waits for the owner, and is taken out of
the dict so the framework never sees it."""

from __future__ import annotations

import logging
import weakref
from typing import Any, Optional

import torch

from .state import StateStore

logger = logging.getLogger("stablerl")


def restore_store(store: StateStore, state: Any, where: str, device: Any = None) -> None:
    """Load ``state`` into ``store``; tensors onto ``device`` (default: this process's accelerator, where there is
    one: frameworks load checkpoint side-channels onto the CPU)."""
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    store.load_state_dict(state, where=where, device=device)


def with_state(states: Optional[dict], key: str, store: Optional[StateStore]) -> Optional[dict]:
    """``states`` plus ``store``'s state under ``key`` (``states`` as is without a store, or an empty one)."""
    return {**(states or {}), key: store.state_dict()} if store else states


class CheckpointSlot:
    """``key`` in the checkpoint dict, holding the state of a store of kind ``holds`` owned by ``owner`` (for the
    log line): :meth:`adopt` when the owner is built, :meth:`take` when the framework has read a checkpoint."""

    def __init__(self, key: str, holds: str, owner: str):
        self.key, self.holds, self.owner = key, holds, owner
        self.live: Optional[weakref.ref] = None  # the owner keeps the store alive
        self.pending: Optional[tuple] = None  # (state, where) read before the store exists

    def adopt(self, store: StateStore) -> None:
        self.live = weakref.ref(store)
        if self.pending is not None:
            restore_store(store, *self.pending)
            self.pending = None
            logger.info("stablerl: restored the %s state from the checkpoint", self.owner)

    def store(self) -> Optional[StateStore]:
        return self.live() if self.live is not None else None

    def saved_into(self, states: Optional[dict]) -> Optional[dict]:
        """``states`` plus this slot's state (what the framework saves)."""
        return with_state(states, self.key, self.store())

    def take(self, states: Any, where: str) -> None:
        """Take this key out of the ``states`` a checkpoint load returned: restored now if the store exists, else
        when it is adopted (a foreign blob is refused now, not when the owner is built)."""
        if not isinstance(states, dict) or self.key not in states:
            return
        state, where = states.pop(self.key), f"{where} ({self.key})"
        StateStore(holds=self.holds).check(state, where)
        store = self.store()
        if store is not None:
            restore_store(store, state, where)
        else:
            self.pending = (state, where)


__all__ = ["CheckpointSlot", "restore_store", "with_state"]
