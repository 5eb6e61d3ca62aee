"""What the adapter's ``update_actor`` wrapper shares between trainer hooks and entropy controllers: reading
the selection keys on the stablerl policy-loss config, and the update's metrics (the same value on every rank).
Imports no verl at import time."""

from __future__ import annotations

from typing import Any, Optional

import torch

from stablerl.selection import config_get as cfg_get  # noqa: F401  (the workers' config reader)
from stablerl.selection import read_selection


def selection(policy_loss_cfg: Any, key: str, params_key: str) -> tuple[Optional[str], dict]:
    """``(name or None, its params)`` of the extension selected by ``key`` on an ``actor.policy_loss`` config
    (``stablerl_trainer_hook`` / ``stablerl_entropy_controller`` and their ``_params``)."""
    return read_selection(policy_loss_cfg, key, params_key, prefix="policy_loss.")


def check_selection(policy_loss_cfg: Any, kind: str, key: str, params_key: str) -> Optional[str]:
    """Refuse an unknown, unavailable or unfeedable extension of ``kind`` and bad hyper-parameters where the
    config is built."""
    import stablerl
    from stablerl.frameworks import resolve
    from stablerl.params import build_params

    name, params = selection(policy_loss_cfg, key, params_key)
    if name is not None:
        resolve("verl", kind, name)  # unknown name / an input verl cannot feed: the reason in verl's words
        build_params(stablerl.get_spec(kind, name), params)
    return name


def as_float(value: Any) -> Optional[float]:
    if value is None:
        return None
    aggregate = getattr(value, "aggregate", None)
    if callable(aggregate):  # verl's Metric
        return float(aggregate())
    if isinstance(value, (list, tuple)):
        values = [v for v in (as_float(x) for x in value) if v is not None]
        return sum(values) / len(values) if values else None
    if isinstance(value, torch.Tensor):
        return float(value.float().mean())
    return float(value)


def metrics_of(output: Any) -> Optional[dict]:
    if output is None:
        return None
    try:
        from verl.utils import tensordict_utils as tu

        return tu.get(output, "metrics")
    except Exception:  # noqa: BLE001 - no metrics on this rank
        return None


def agreed(value: Optional[float]) -> Optional[float]:
    """The pass's statistic as rank 0 of those that have it sees it: every rank feeds the hook the same."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, value)
    return next((v for v in gathered if v is not None), None)
