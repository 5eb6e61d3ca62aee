"""A statistic a framework reports for a step (a loss's entropy, a pass's mean), read the way a stateful algorithm
needs it: one float (a framework's metric object, a list of per-micro-batch values or a tensor averaged), the same
on every data-parallel rank (rank 0's, of the ranks that have it), so that every rank's controller or trainer
hook takes the same decision."""

from __future__ import annotations

from typing import Any, Optional

import torch


def as_float(value: Any) -> Optional[float]:
    """``value`` as one float: a metric object's ``aggregate()``, the mean of a list's values, a tensor's mean."""
    if value is None:
        return None
    aggregate = getattr(value, "aggregate", None)
    if callable(aggregate):  # e.g. verl's Metric
        return float(aggregate())
    if isinstance(value, (list, tuple)):
        values = [v for v in (as_float(x) for x in value) if v is not None]
        return sum(values) / len(values) if values else None
    if isinstance(value, torch.Tensor):
        return float(value.float().mean())
    return float(value)


def agreed(value: Optional[float]) -> Optional[float]:
    """The statistic as rank 0 of those that have it sees it (no process group: ``value``)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, value)
    return next((v for v in gathered if v is not None), None)


__all__ = ["as_float", "agreed"]
