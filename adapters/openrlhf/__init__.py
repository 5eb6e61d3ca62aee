"""stablerl in OpenRLHF 0.11.2: every stablerl policy loss and advantage estimator behind OpenRLHF's flags
(docs/openrlhf.md).

OpenRLHF has no registry, no entry point and no import hook, and its loss and advantage code run inside Ray
actors, so this adapter patches, in every Ray worker that owns that code (each patch's module says why):

* ``ActorPPOTrainer.__init__``: a stablerl ``--actor.policy_loss_type`` replaces the ``PolicyLoss`` OpenRLHF
  built by a :class:`StablePolicyLoss` built from the same flags (``_loss``);
* ``RemoteExperienceMaker.compute_advantages_and_returns``: a stablerl ``--algo.advantage.estimator``
  with reward shapers and batch filters (``_advantage``); OpenRLHF's names keep OpenRLHF's code;
* ``training_step`` / ``Actor.forward``: a loss's declared inputs beyond OpenRLHF's call (``_inputs``), prompt
  groups (``_groups``) and MoE routing replay R2/R3 (``_routing_replay``, with the R3 rollout-side patches);
* checkpoints: the algorithms' state in DeepSpeed's ``client_state`` (``_state``).

OpenRLHF's built-in names keep OpenRLHF's code; a stablerl algorithm whose name collides is reachable as
``stablerl_<name>``. The patches reach the workers through Ray's ``worker_process_setup_hook``: the wrapper CLI
``python -m stablerl.adapters.openrlhf.train_ppo_ray`` adds it, or ``RAY_RUNTIME_ENV_HOOK=
stablerl.adapters.openrlhf.add_setup_hook`` with the ``STABLERL_*`` variables (no wrapper). :func:`instrument`
imports no OpenRLHF module (a post-import hook patches each module when imported); every patch is recorded in
one ledger (``_patches``) and undone by :func:`uninstrument`.
"""

from __future__ import annotations

# The package only re-exports: its submodules import each other, never this module.
from ._patches import instrument, is_applied, uninstrument
from ._selection import (Selection, add_setup_hook, advantage_settings, loss_settings, openrlhf_choices,  # noqa: F401
                         parse_params, resolve, selection_from_args)
from ._spec import (ENV_ADVANTAGE, ENV_ADVANTAGE_PARAMS, ENV_BATCH_FILTER, ENV_BATCH_FILTER_PARAMS,  # noqa: F401
                    ENV_CHAINED_SETUP_HOOK, ENV_POLICY_LOSS, ENV_POLICY_LOSS_PARAMS, ENV_PREVIOUS_RUNTIME_ENV_HOOK,
                    ENV_REWARD_SHAPER, ENV_REWARD_SHAPER_PARAMS, ENV_ROUTING_REPLAY, FILTER_FLAG, OPENRLHF,
                    OPENRLHF_ADV_ESTIMATORS, OPENRLHF_POLICY_LOSSES, PREFIX, SETUP_HOOK, SHAPER_FLAG,
                    SUPPORTED_OPENRLHF, UnsupportedOpenRLHFVersionError, check_openrlhf, openrlhf_version)


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
    # StablePolicyLoss subclasses OpenRLHF's PolicyLoss, whose import is heavy (openrlhf.models):
    # build it on first access only, so `instrument` stays light.
    if name == "StablePolicyLoss":
        from ._loss import StablePolicyLoss

        return StablePolicyLoss
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SUPPORTED_OPENRLHF", "OPENRLHF_POLICY_LOSSES", "OPENRLHF_ADV_ESTIMATORS", "PREFIX", "Selection",
    "UnsupportedOpenRLHFVersionError", "check_openrlhf", "openrlhf_choices", "resolve", "parse_params",
    "loss_settings", "advantage_settings", "OPENRLHF",
    "selection_from_args", "instrument", "uninstrument", "is_applied",
    "add_setup_hook", "StablePolicyLoss",
]
