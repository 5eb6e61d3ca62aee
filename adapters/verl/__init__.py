"""stablerl for verl: registers every stablerl policy loss and advantage estimator into verl.

Importing this module (verl does it on every ``import verl`` through the ``verl.plugins`` entry
point of the stablerl distribution) registers, in verl's own registries:

* every stablerl policy loss as ``stablerl_<name>`` in ``core_algos.POLICY_LOSS_REGISTRY``, and
  also as the bare ``<name>`` when verl has no loss of that name (``m2po``, ``gmpo``, ``cpgd``...);
* every stablerl advantage estimator as ``stablerl_<name>`` in ``ADV_ESTIMATOR_REGISTRY``, and as
  the bare ``<name>`` when free (``qae``, ``bnpo``, ``dr_grpo``...).

A verl built-in is never replaced (``vanilla``, ``gspo``, ``cispo``, ``grpo``, ``rloo``, ``opo``
stay verl's; stablerl's are ``stablerl_vanilla``...). Algorithms with status ``unavailable``, and
algorithms that need an input verl cannot provide to that kind of function, are skipped;
:func:`registration_report` says why.

verl's loss call passes no entropy, token ids, rollout log-probs, uids or scores. The adapter
therefore wraps verl's loss call site ``verl.workers.utils.losses.ppo_loss`` (see
:mod:`stablerl.adapters.verl._inputs`): for the selected stablerl loss it gathers exactly the
inputs the loss declares from verl's ``model_output``/batch and hands them over; verl's own
entropy bonus, KL loss and metrics still run. ``entropy`` needs
``actor_rollout_ref.actor.calculate_entropy=True``.

The adapter is :class:`~stablerl.adapters.verl._adapter.VerlAdapter` (a :class:`stablerl.adapter.FrameworkAdapter`);
this package's functions are aliases of its one instance's methods. Every change to verl (registry entries,
wrapped call sites, engine and trainer patches) is recorded in its patch ledger: :func:`instrument` makes them
(on import when verl is being imported, as verl's entry point and ``external_lib`` do; idempotent) and
:func:`uninstrument` puts verl's own objects back. A verl outside :data:`SUPPORTED_VERL` is refused, logged at
ERROR (verl hides plugin errors), unless ``STABLERL_ALLOW_UNSUPPORTED=1``. Where verl is not imported, importing
this package does nothing (``stablerl list`` reads verl's declaration from :mod:`._spec` without verl).

Usage (verl >= 0.9: nothing but the name)::

    actor_rollout_ref.actor.policy_loss.loss_mode=m2po
    algorithm.adv_estimator=qae  +algorithm.quantile_k=0.6
    # loss hyper-parameters:
    actor_rollout_ref.actor.policy_loss._target_=stablerl.adapters.verl.StablePolicyLossConfig
    +actor_rollout_ref.actor.policy_loss.m2_threshold=0.05

MoE routing replay on verl's FSDP engine (:mod:`stablerl.adapters.verl._routing_replay`)::

    +actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3   # or R2
    actor_rollout_ref.rollout.enable_rollout_routing_replay=True  # R3 only

Trainer hooks (SFPO) around the worker's ``update_actor`` (:mod:`stablerl.adapters.verl._trainer_hook`)::

    actor_rollout_ref.actor.policy_loss._target_=stablerl.adapters.verl.StablePolicyLossConfig
    +actor_rollout_ref.actor.policy_loss.stablerl_trainer_hook=sfpo

Entropy controllers that steer verl's entropy bonus (adaptive_entropy), stepped by the same wrapper
(:mod:`stablerl.adapters.verl._controller`)::

    +actor_rollout_ref.actor.policy_loss.stablerl_entropy_controller=adaptive_entropy
    actor_rollout_ref.actor.calculate_entropy=True

Fallback when entry points are disabled (``VERL_USE_EXTERNAL_PLUGINS=none``):
``actor_rollout_ref.model.external_lib=stablerl.adapters.verl`` or
``VERL_USE_EXTERNAL_MODULES=stablerl.adapters.verl``.

The module is light (torch, stablerl and ``verl.trainer.ppo.core_algos`` only; no CUDA), and
idempotent: importing it twice, or under two module names, registers nothing twice (one adapter instance).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from typing import Any

# absolute imports: one adapter instance (one ledger, one state) per process, even when this package is executed
# a second time under another module name
from stablerl.adapters.verl._adapter import PREFIX, VERL_EQUIVALENTS, UnsupportedVerlVersion, VerlAdapter

logger = logging.getLogger("stablerl.adapters.verl")

#: the adapter (one per process)
ADAPTER = VerlAdapter()
#: every name this adapter registered in verl in this process, per kind: ``{"policy_loss": {verl_name:
#: stablerl_name}, "advantage_estimator": {...}}``. Use the verl name in ``actor.policy_loss.loss_mode`` /
#: ``algorithm.adv_estimator``.
VERL_NAMES: dict[str, dict[str, str]] = ADAPTER.state.names

# the adapter's call-site modules under their public names (imported on first use: they import no verl)
_SUBMODULES = {"routing_replay": "_routing_replay", "engine": "_engine", "checkpoint_state": "_state",
               "trainer_hook": "_trainer_hook", "entropy_controller": "_controller"}


def instrument(**options: Any) -> None:
    """Register the stablerl names in verl's registries and wrap verl's call sites (``VerlAdapter.instrument``).
    Idempotent. A verl outside :data:`SUPPORTED_VERL` is refused (:class:`UnsupportedVerlVersion` naming both)
    unless ``STABLERL_ALLOW_UNSUPPORTED=1``, then a warning."""
    ADAPTER.instrument(**options)


def uninstrument() -> None:
    """Undo :func:`instrument`: verl's registries, call sites, engine registry and trainer methods hold verl's own
    objects again and the post-import hooks are gone. Idempotent."""
    ADAPTER.uninstrument()


def registration_report() -> dict[str, Any]:
    """What this adapter registered in verl, what it skipped and why (``VerlAdapter.registration_report``)."""
    return ADAPTER.registration_report()


def register_batch_field_estimators() -> list[str]:
    """Also register the estimators whose inputs only a customised pipeline writes (``gigpo``; see
    ``VerlAdapter.register_batch_field_estimators``). Call it in the driver. Idempotent."""
    return ADAPTER.register_batch_field_estimators()


def doctor_report() -> dict[str, Any]:
    """For ``stablerl doctor``: verl's entry point for stablerl and what this process registered."""
    from importlib import metadata

    eps = [ep.value for ep in metadata.entry_points(group="verl.plugins") if ep.name == "stablerl"]
    return {"entry_point": eps[0] if eps else None, **registration_report()}


def _deprecated(old: str, new: str) -> None:
    import warnings

    warnings.warn(f"stablerl.adapters.verl.{old}() is deprecated; use {new}", DeprecationWarning, stacklevel=3)


def unpatch_ppo_loss() -> None:
    """Deprecated: :func:`uninstrument` restores ``ppo_loss`` with everything else."""
    from stablerl.adapters.verl import _inputs

    _deprecated("unpatch_ppo_loss", "uninstrument()")
    ADAPTER.ledger.restore(_inputs.PATCH_KEY)


def patch_compute_advantage() -> str:
    """Deprecated: :func:`instrument` wraps ``compute_advantage`` with everything else."""
    from stablerl.adapters.verl import _advantage

    _deprecated("patch_compute_advantage", "instrument()")
    return _advantage.instrument()


def unpatch_compute_advantage() -> None:
    """Deprecated: :func:`uninstrument` restores ``compute_advantage`` with everything else."""
    from stablerl.adapters.verl import _advantage

    _deprecated("unpatch_compute_advantage", "uninstrument()")
    ADAPTER.ledger.restore(_advantage.PATCH_KEY)


def __getattr__(name: str):
    if name == "StablePolicyLossConfig":  # built by instrument(); refused or failed: say why, not "no attribute"
        if ADAPTER.state.policy_loss_config is None and ADAPTER.state.report["error"] is None:
            _instrument_quietly()  # e.g. unpickled (Ray) in a process that imported this package before verl
        if ADAPTER.state.policy_loss_config is None:
            raise ImportError(f"stablerl.adapters.verl is not instrumented: "
                              f"{ADAPTER.state.report['error'] or 'call instrument()'}")
        return ADAPTER.state.policy_loss_config
    if name == "SUPPORTED_VERL":  # declared once, in verl's FrameworkSpec (stablerl.adapters.verl._spec)
        return ADAPTER.spec.supported
    if name in _SUBMODULES:
        return importlib.import_module(f"stablerl.adapters.verl.{_SUBMODULES[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _instrument_quietly(_verl: Any = None) -> None:
    try:
        instrument()
    except Exception:  # noqa: BLE001 - logged at ERROR by the adapter; raising here would only reach verl's DEBUG log
        pass


if "verl" in sys.modules:  # verl's entry point, external_lib, VERL_USE_EXTERNAL_MODULES: verl is being imported
    _instrument_quietly()
elif importlib.util.find_spec("verl") is not None:
    # imported before verl (a script, a Ray worker unpickling a StablePolicyLossConfig): verl's entry point will find
    # this package imported already, so instrument right after verl is (a post-import hook; it imports nothing)
    ADAPTER.ledger.on_import("instrument:on_verl_import", {"verl": _instrument_quietly})

__all__ = [
    "ADAPTER", "VerlAdapter", "instrument", "uninstrument", "StablePolicyLossConfig", "VERL_NAMES", "VERL_EQUIVALENTS",
    "SUPPORTED_VERL", "PREFIX", "registration_report", "doctor_report", "UnsupportedVerlVersion",
    "unpatch_ppo_loss", "patch_compute_advantage", "unpatch_compute_advantage", "register_batch_field_estimators",
    "routing_replay", "engine", "checkpoint_state", "trainer_hook", "entropy_controller",
]
