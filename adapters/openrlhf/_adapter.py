"""``OpenRLHFAdapter``: stablerl in OpenRLHF 0.11.2 (framework-free at import: provider bodies and patches import
OpenRLHF when they run).

OpenRLHF has no registry, no entry point and no import hook, and its loss and advantage code run inside Ray
actors, so :meth:`OpenRLHFAdapter._instrument` arms a post-import hook (``_patches`` lists every patched module
and what each patch does) in every Ray worker that owns that code. The adapter instance holds this process's
stablerl state: the trainer process's reward-shaper / batch-filter store and last metrics, the actor workers'
checkpointed loss and controller stores, and one :class:`PolicyWorker` per armed policy ``Actor``.

What OpenRLHF feeds to each kind of algorithm is what the ``@provides`` methods (``_providers``) compute from one
:class:`~stablerl.steps.BatchRecord`: the rollout batch at ``compute_advantages_and_returns`` (``record.host``: the
list of experiences) or one micro-batch at ``training_step`` (``record.host``: the ``Experience``).
"""

from __future__ import annotations

import importlib
import os
import weakref
from dataclasses import dataclass
from typing import Any, Optional

from stablerl.adapter import FrameworkAdapter
from stablerl.state import StateStore

from ._flags import (ENV_CHAINED_SETUP_HOOK, LEGACY_SETUP_HOOK, NAME, SETUP_HOOK,  # noqa: F401 (re-export)
                     UnsupportedOpenRLHFVersionError)
from ._providers import TEACHER_CONDITION, AdvantageInputs, LossInputs  # noqa: F401 (re-export)

@dataclass
class PolicyWorker:
    """What ``ActorPPOTrainer.__init__`` armed on its policy ``Actor`` (one per actor worker): the statistics its
    old-log-prob pass also returns (``entropy``, ``sum_pi_squared``: only when a selected algorithm declares them),
    routing replay (``routes``, ``_routing_replay``) and the entropy controller with its meter of the training
    forwards' entropy since the last optimizer step (``_controller``)."""

    old_pass_stats: frozenset = frozenset()
    routes: Any = None
    controller: Any = None
    controller_store: Optional[StateStore] = None
    meter: Any = None
    sampling_rule: Any = None  # sampling-mask replay: the rollout's SamplingRule (``_sampling_mask``)


class OpenRLHFAdapter(AdvantageInputs, LossInputs, FrameworkAdapter):
    """The OpenRLHF adapter: one instance per process (``OpenRLHFAdapter()``); ``stablerl.adapters.openrlhf.instrument``
    / ``uninstrument`` are its methods."""

    name = NAME
    version_error = UnsupportedOpenRLHFVersionError

    def __init__(self) -> None:
        if "driver_state" in vars(self):
            return  # the one instance, already set up
        from stablerl.checkpoint_slot import CheckpointSlot

        #: the trainer process's reward shapers' / batch filters' state (ctx.step, generators) and last metrics
        self.driver_state = StateStore(holds="driver")
        self.last_metrics: dict[str, float] = {}
        #: the actor workers' checkpointed stores: the policy loss's and the entropy controller's (``_state``)
        self.loss_state = CheckpointSlot("stablerl_loss_state", "loss", "policy loss's")
        self.controller_state = CheckpointSlot("stablerl_controller_state", "controller", "entropy controller's")
        self.workers: "weakref.WeakKeyDictionary[Any, PolicyWorker]" = weakref.WeakKeyDictionary()
        self._chained = False

    def __reduce__(self):
        # one instance per process: a closure Ray pickles (a patched method of a by-value actor class) gets the
        # receiving process's own instance
        return type(self), ()

    def worker(self, owner: Any, create: bool = False) -> Optional[PolicyWorker]:
        """The :class:`PolicyWorker` armed on OpenRLHF ``Actor`` ``owner``, or on an ``ActorPPOTrainer``'s actor (on
        the trainer itself when it has none); None if not armed."""
        key = owner if getattr(owner, "actor", None) is None else owner.actor
        if key is None:
            return None
        if create and key not in self.workers:
            self.workers[key] = PolicyWorker()
        return self.workers.get(key)

    # -- instrument / uninstrument ----------------------------------------------------------------

    def check_dependencies(self, found: Optional[str] = None, *, allow: Optional[bool] = None) -> Optional[str]:
        """The version check where OpenRLHF is installed; without it the post-import hook has nothing to patch
        (each OpenRLHF module is checked again when patched)."""
        found = found if found is not None else self.installed_version()
        return None if found is None else super().check_dependencies(found, allow=allow)

    def _instrument(self, ledger, now: bool = False) -> None:
        """Arm the patches in this process: modules already imported are patched now, the others when (and if)
        they are imported (a post-import hook; imports no OpenRLHF module). With ``now=True`` also import
        OpenRLHF's patched modules (and ``vllm.engine.arg_utils``) at once (heavy: ``openrlhf.models``). As Ray's
        ``worker_process_setup_hook`` it then runs ``$STABLERL_CHAINED_SETUP_HOOK`` (a user's own) once."""
        from ._patches import PATCHERS, patcher

        ledger.on_import("stablerl.openrlhf", {name: patcher(name, patch, ledger, self)
                                               for name, patch in PATCHERS.items()})
        if now:
            for name in PATCHERS:
                importlib.import_module(name)  # the post-import hook (or the call above) patches it
        chained = os.environ.get(ENV_CHAINED_SETUP_HOOK)
        if chained and chained not in (SETUP_HOOK, LEGACY_SETUP_HOOK) and not self._chained:
            from stablerl.ray_setup import load_callable

            self._chained = True
            load_callable(chained)()

    def is_applied(self) -> dict[str, bool]:
        """Which patches are in place in this process."""
        from ._patches import PATCH_KEYS

        return {key: key in self.ledger for key in PATCH_KEYS}


__all__ = ["OpenRLHFAdapter", "PolicyWorker", "UnsupportedOpenRLHFVersionError"]
