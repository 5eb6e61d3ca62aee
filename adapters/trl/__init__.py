"""TRL adapter: ``from stablerl.adapters.trl import GRPOTrainer, GRPOConfig`` (trl >= 1.16, < 1.17).

A drop-in for TRL's classes: ``GRPOConfig(loss_type="m2po", advantage_estimator="qae", ...)``.
TRL's built-in ``loss_type`` names keep TRL's behaviour; see :mod:`stablerl.adapters.trl.trainer`.

TRL is imported lazily (on first attribute access), so that ``stablerl.demo`` (the ``stablerl demo``
command) can set its offline environment before TRL and the Hugging Face Hub client are imported.
"""

from __future__ import annotations

_EXPORTS = (
    "GRPOConfig",
    "GRPOTrainer",
    "SUPPORTED_TRL",
    "TRL_LOSS_TYPES",
    "UnsupportedTRLVersionError",
    "check_trl",
    "resolve_loss_type",
    "validate_stablerl_args",
)

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
