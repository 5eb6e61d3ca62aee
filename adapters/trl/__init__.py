"""TRL adapter: ``from stablerl.adapters.trl import GRPOTrainer, GRPOConfig`` (trl >= 1.16, < 1.17); see
:mod:`stablerl.adapters.trl.trainer` and docs/trl.md. The adapter class is
:class:`stablerl.adapters.trl._adapter.TRLAdapter` (framework-free; TRL's declaration: ``._spec``).

TRL is imported lazily (on first attribute access), so that ``stablerl.tools.demo`` can set its offline environment
before TRL and the Hugging Face Hub client are imported.
"""

from __future__ import annotations

__all__ = ["GRPOConfig", "GRPOTrainer", "SUPPORTED_TRL", "TRL_LOSS_TYPES", "UnsupportedTRLVersionError", "check_trl",
           "instrument", "uninstrument", "resolve_loss_type", "validate_stablerl_args"]


def __getattr__(name: str):
    if name in __all__:
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
