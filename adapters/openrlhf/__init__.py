"""stablerl in OpenRLHF 0.11.2: every stablerl policy loss and advantage estimator behind OpenRLHF's flags
(docs/openrlhf.md).

The adapter is :class:`OpenRLHFAdapter` (``_adapter``; its patches: ``_patches``): OpenRLHF's built-in names keep
OpenRLHF's code; a stablerl algorithm whose name collides is reachable as ``stablerl_<name>``. The patches reach the
Ray workers through Ray's ``worker_process_setup_hook`` (:data:`SETUP_HOOK`, this module's :func:`instrument`): the
wrapper CLI ``python -m stablerl.adapters.openrlhf.train_ppo_ray`` adds it, or ``RAY_RUNTIME_ENV_HOOK=
stablerl.adapters.openrlhf.add_setup_hook`` with the ``STABLERL_*`` variables (no wrapper). :func:`instrument`
imports no OpenRLHF module (a post-import hook patches each module when imported); :func:`uninstrument` undoes
every patch.
"""

from __future__ import annotations

# The package only re-exports (framework-free, no side effects): its submodules never import it.
from ._adapter import OpenRLHFAdapter, PolicyWorker  # noqa: F401
from ._flags import (ENV_ADVANTAGE, ENV_ADVANTAGE_PARAMS, ENV_BATCH_FILTER, ENV_BATCH_FILTER_PARAMS,  # noqa: F401
                     ENV_CHAINED_SETUP_HOOK, ENV_POLICY_LOSS, ENV_POLICY_LOSS_PARAMS, ENV_PREVIOUS_RUNTIME_ENV_HOOK,
                     ENV_REWARD_SHAPER, ENV_REWARD_SHAPER_PARAMS, ENV_ROUTING_REPLAY, FILTER_FLAG,
                     OPENRLHF_ADV_ESTIMATORS, OPENRLHF_POLICY_LOSSES, PREFIX, SETUP_HOOK, SHAPER_FLAG,
                     SUPPORTED_OPENRLHF, UnsupportedOpenRLHFVersionError, check_openrlhf, openrlhf_version)
from ._selection import (Selection, add_setup_hook, advantage_settings, loss_settings, openrlhf_choices,  # noqa: F401
                         parse_params, resolve, selection_from_args)

def instrument(now: bool = False) -> bool:
    """``OpenRLHFAdapter().instrument(now=now)``: arm the patches in this process (Ray's setup hook,
    :data:`SETUP_HOOK`)."""
    return OpenRLHFAdapter().instrument(now=now)


def uninstrument() -> bool:
    """``OpenRLHFAdapter().uninstrument()``: undo every patch and disarm the import hook."""
    return OpenRLHFAdapter().uninstrument()


def is_applied() -> dict[str, bool]:
    """Which patches are in place in this process."""
    return OpenRLHFAdapter().is_applied()


def _deprecated(old: str, new: str) -> None:
    import warnings

    warnings.warn(f"stablerl.adapters.openrlhf.{old}() is deprecated; use {new}", DeprecationWarning, stacklevel=3)


def setup() -> None:
    """Deprecated name of :func:`instrument` (a ``worker_process_setup_hook`` naming it still works)."""
    _deprecated("setup", "instrument()")
    instrument()


def apply() -> None:
    """Deprecated: ``instrument(now=True)``."""
    _deprecated("apply", "instrument(now=True)")
    instrument(now=True)


def remove() -> None:
    """Deprecated: :func:`uninstrument`."""
    _deprecated("remove", "uninstrument()")
    uninstrument()


def __getattr__(name: str):
    # StablePolicyLoss subclasses OpenRLHF's PolicyLoss, whose import is heavy (openrlhf.models): on first access
    # only, so `instrument` stays light; OPENRLHF (the declaration) from the registry, once it is built
    if name == "StablePolicyLoss":
        from ._loss import StablePolicyLoss

        return StablePolicyLoss
    if name == "OPENRLHF":
        from stablerl.frameworks import get_framework

        return get_framework("openrlhf")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SUPPORTED_OPENRLHF", "OPENRLHF_POLICY_LOSSES", "OPENRLHF_ADV_ESTIMATORS", "PREFIX", "Selection",
    "UnsupportedOpenRLHFVersionError", "check_openrlhf", "openrlhf_choices", "resolve", "parse_params",
    "loss_settings", "advantage_settings", "OPENRLHF",
    "selection_from_args", "instrument", "uninstrument", "is_applied",
    "add_setup_hook", "StablePolicyLoss", "OpenRLHFAdapter",
]
