"""A-3PO's policy versions in verl's legacy trainer: the optimizer steps the actor took on a batch, counted here.

verl's synchronous legacy trainer generates each batch with the weights its update starts from (the adapter marks
the batch with that version, ``global_steps - 1``: :data:`~stablerl.adapters.verl._providers.VERSION_KEY`), then
trains it with ``ppo_epochs`` x (batch / ``ppo_mini_batch_size``) optimizer steps (more with SFPO's passes): the
micro-batches of the mini-batch after L steps are trained by weights L updates newer than the ones that generated
them. verl keeps no count of those steps, so the adapter counts them itself: ``TrainingWorker.train_batch`` (one
optimizer step of the worker's engine) is wrapped to add one to this process's count for the batch's mark, and the
``policy_version`` provider reads ``mark + steps taken on the batch so far`` (A-3PO's v_theta, AReaL's convention:
versions count weight updates; :mod:`stablerl.policy_versions`). Every data-parallel rank counts the same steps.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Optional

#: ledger key of the wrap of TrainingWorker.train_batch
PATCH_KEY = "ppo_loss:optimizer_steps"
WORKERS_MODULE = "verl.workers.engine_workers"

_LOCK = threading.Lock()
_COUNT: dict[str, Any] = {"mark": None, "steps": 0}  # this process: the batch mark being trained, its steps so far


def steps_on(mark: int) -> int:
    """The optimizer steps this process's actor took so far on the batch marked ``mark`` (0 before its first)."""
    with _LOCK:
        return _COUNT["steps"] if _COUNT["mark"] == mark else 0


def stepped(mark: int) -> None:
    """One optimizer step on the batch marked ``mark`` finished."""
    with _LOCK:
        if _COUNT["mark"] != mark:
            _COUNT.update(mark=mark, steps=0)
        _COUNT["steps"] += 1


def _mark_of(data, version_key: str) -> Optional[int]:
    from verl.utils import tensordict_utils as tu

    try:
        mark = tu.get_non_tensor_data(data, version_key, None)
    except Exception:  # noqa: BLE001 - not a TensorDict with non-tensor data: not the marked actor batch
        return None
    return None if mark is None else int(mark)


def _wrap_train_batch(original, version_key: str):
    @functools.wraps(original)
    def train_batch(self, data, *args, **kwargs):
        mark = _mark_of(data, version_key)  # only the actor's batch carries the legacy trainer's mark
        out = original(self, data, *args, **kwargs)
        if mark is not None:
            stepped(mark)
        return out

    return train_batch


def patch_workers(module, version_key: str) -> None:
    """Wrap ``TrainingWorker.train_batch`` of verl's engine workers (recorded in the adapter's ledger); the actor's
    batch carries the legacy trainer's mark under ``version_key`` in its non-tensor data."""
    from stablerl.adapters.verl._ledger import LEDGER, logger

    cls = getattr(module, "TrainingWorker", None)
    if cls is None or not callable(getattr(cls, "train_batch", None)):
        logger.warning("stablerl: verl's %s has no TrainingWorker.train_batch; A-3PO's policy versions do not count "
                       "the actor's optimizer steps on a batch (every call is treated as the first)", module.__name__)
        return
    LEDGER.set_attr(PATCH_KEY, cls, "train_batch", _wrap_train_batch(cls.train_batch, version_key))


__all__ = ["steps_on", "stepped", "patch_workers", "PATCH_KEY", "WORKERS_MODULE"]
