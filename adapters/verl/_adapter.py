"""``VerlAdapter``: stablerl's :class:`~stablerl.adapter.FrameworkAdapter` for verl 0.9.1.

``_instrument(ledger)`` registers every usable stablerl policy loss and advantage estimator in verl's registries
(``stablerl_<name>``, and the bare ``<name>`` where verl has none of that name; a verl built-in is never replaced)
and arms the call-site patches (``ppo_loss``, ``compute_advantage``, the FSDP engine, the worker's ``update_actor``,
the trainers' checkpoints), each recorded in the adapter's one :class:`~stablerl.patching.PatchLedger`. The inputs
verl can feed are its providers (:mod:`stablerl.adapters.verl._providers`); what one process keeps between steps
is the adapter's :class:`VerlState`.

This module imports neither verl nor the adapter's call-site modules at import time: ``stablerl list`` builds verl's
declaration (:mod:`stablerl.adapters.verl._spec`) from this class where verl is not installed.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from stablerl.adapter import FrameworkAdapter
from stablerl.contracts import ADVANTAGE_ESTIMATOR, POLICY_LOSS
from stablerl.frameworks import UnsupportedVersionError
from stablerl.state import StateStore

from ._providers import BATCH_FIELD_INPUTS, AdvantageInputs, LossInputs

logger = logging.getLogger("stablerl.adapters.verl")

PREFIX = "stablerl_"
#: stablerl algorithm -> the verl built-in that computes the same thing (checked by parity tests in
#: integrations_tests/verl). Under these names verl's built-in stays in charge.
VERL_EQUIVALENTS = {
    POLICY_LOSS: {"vanilla": "vanilla", "gspo": "gspo", "gmpo": "geo_mean", "cispo": "cispo"},
    ADVANTAGE_ESTIMATOR: {"grpo": "grpo", "rloo": "rloo", "opo": "opo"},
}
#: StablePolicyLossConfig's fields beyond the losses' hyper-parameters: ``stablerl_params``, stablerl keys for any
#: hyper-parameter, including names verl's PolicyLossConfig already has (``+...policy_loss.stablerl_params=
#: {kl_cov_ratio:0.002}``); the trainer hook and entropy controller selections, read by the update_actor wrapper
POLICY_LOSS_EXTRA_FIELDS = (
    ("stablerl_params", dict, "*"),
    ("stablerl_trainer_hook", str, "(trainer hook)"), ("stablerl_trainer_hook_params", dict, "(trainer hook)"),
    ("stablerl_entropy_controller", str, "(entropy controller)"),
    ("stablerl_entropy_controller_params", dict, "(entropy controller)"),
)


class UnsupportedVerlVersion(UnsupportedVersionError):
    """verl is outside the supported range, or lacks an interface this adapter relies on."""


def _new_report() -> dict[str, Any]:
    return {"ok": False, "verl_version": None, "error": None, "ppo_loss_patch": None, "compute_advantage_patch": None,
            "registered": [], "skipped": [], "policy_loss_config_fields": {}}


@dataclass
class VerlState:
    """What the verl adapter keeps in one process, in one object.

    ``driver``: the advantage call site's store (``ctx.step``, generators, filter/shaper state; saved with the
    trainer's checkpoint); ``loss``: the losses', trainer hooks' and controllers' store in an actor worker (saved
    with the actor's shards); ``metrics``: the last ``compute_advantage``'s ``stablerl/...`` metrics, until verl's
    ``Tracking.log`` takes them; ``total_steps``: the trainer's ``total_training_steps`` (``Context.total_steps``);
    ``names``: kind -> verl name -> stablerl name registered in this process; ``report``: what instrument did;
    ``feeds``: kind -> the inputs this process feeds (the providers', less a call site whose patch failed)."""

    driver: StateStore = field(default_factory=lambda: StateStore(holds="driver"))
    loss: StateStore = field(default_factory=lambda: StateStore(holds="loss"))
    metrics: dict = field(default_factory=dict)
    total_steps: Optional[int] = None
    names: dict = field(default_factory=lambda: {POLICY_LOSS: {}, ADVANTAGE_ESTIMATOR: {}})
    report: dict = field(default_factory=_new_report)
    feeds: dict = field(default_factory=dict)
    policy_loss_config: Optional[type] = None

    def reset(self) -> None:
        """Forget generators, step counter, state and unlogged metrics of the advantage call site (a fresh run)."""
        self.driver.clear()
        self.metrics.clear()


def _check_signatures(core_algos) -> None:
    """Gate on the interface facts themselves, not only the version string."""
    import inspect

    problems = []
    agg = inspect.signature(core_algos.agg_loss).parameters
    problems += [f"core_algos.agg_loss has no {p!r} (global_batch_info, verl >= 0.7.0)"
                 for p in ("dp_size", "batch_num_tokens", "global_batch_size") if p not in agg]
    vanilla = core_algos.POLICY_LOSS_REGISTRY.get("vanilla")
    if vanilla is None or "rollout_is_weights" not in inspect.signature(vanilla).parameters:
        problems.append("policy losses do not take rollout_is_weights (verl >= 0.7.0)")
    needed = ("register_adv_est", "get_adv_estimator_fn", "ADV_ESTIMATOR_REGISTRY", "get_policy_loss_fn")
    problems += [f"core_algos has no {a}" for a in needed if not hasattr(core_algos, a)]
    if problems:
        from stablerl.frameworks import get_framework

        raise UnsupportedVerlVersion(f"stablerl.adapters.verl supports verl {get_framework('verl').supported}; "
                                     "this verl lacks: " + "; ".join(problems))


class VerlAdapter(AdvantageInputs, LossInputs, FrameworkAdapter):
    """verl 0.9.1: registries, call sites, engine, workers and trainers (see the module docstring)."""

    name = "verl"
    version_error = UnsupportedVerlVersion

    @functools.cached_property
    def state(self) -> VerlState:
        return VerlState()

    def installed_version(self) -> Optional[str]:
        """verl's version from its metadata, or (a source checkout) its ``__version__``; None without verl."""
        found = super().installed_version()
        if found is None:
            import importlib.util
            import sys

            if "verl" in sys.modules or importlib.util.find_spec("verl") is not None:
                import verl

                found = str(getattr(verl, "__version__", "0"))
        return found

    def instrument(self, **options: Any) -> bool:
        """:meth:`FrameworkAdapter.instrument`, and a failure logged at ERROR (verl hides plugin errors at DEBUG)."""
        report = self.state.report
        if self.is_instrumented:
            return False
        report.update(error=None, registered=[], skipped=[])
        try:
            done = super().instrument(**options)
        except Exception as e:
            report["error"] = f"{type(e).__name__}: {e}"
            logger.error("stablerl: verl adapter failed, no stablerl names registered in verl: %s", report["error"])
            raise
        names = self.state.names
        logger.info("stablerl: registered into verl %s: policy losses %s; advantage estimators %s; skipped %d",
                    report["verl_version"], sorted(names[POLICY_LOSS]), sorted(names[ADVANTAGE_ESTIMATOR]),
                    len(report["skipped"]))
        return done

    def _instrument(self, ledger, **options: Any) -> None:
        """Every patch, each recorded in ``ledger`` (the call-site modules patch verl's modules now, or right after
        verl imports them): ``ppo_loss`` (losses' declared inputs), ``compute_advantage`` (the advantage step),
        the FSDP engine subclass (routing replay, loss state in checkpoints), the routing-replay worker switch,
        the trainers' ``_save_checkpoint`` / ``_load_checkpoint`` (the driver's state), ``update_actor`` (trainer
        hooks, entropy controllers), then the registry entries and ``StablePolicyLossConfig``."""
        import stablerl
        from verl.trainer.ppo import core_algos
        from verl.workers.config import PolicyLossConfig  # already imported by core_algos

        from stablerl.adapters.verl import (_advantage, _engine, _groups, _inputs, _routing_replay, _sampling_mask,
                                            _state, _trainer_hook)
        from stablerl.config_fields import config_subclass

        state, report = self.state, self.state.report
        report["verl_version"] = self.version
        _check_signatures(core_algos)
        feeds = dict(self.feedable())
        report["ppo_loss_patch"] = _inputs.instrument()
        if report["ppo_loss_patch"] == "failed":  # no wrapper: only verl's own loss arguments reach the losses
            feeds[POLICY_LOSS] = frozenset()
        report["compute_advantage_patch"] = _advantage.instrument()
        if report["compute_advantage_patch"] == "failed":  # no wrapper: verl passes the uid only
            feeds[ADVANTAGE_ESTIMATOR] = frozenset({"index"})
        state.feeds = feeds
        _engine.instrument()
        _routing_replay.instrument()
        _state.instrument()
        _trainer_hook.instrument()
        _groups.instrument()
        _sampling_mask.instrument()
        usable = [s for s in stablerl.list_algorithms(POLICY_LOSS)
                  if s.status != stablerl.UNAVAILABLE and set(s.requires) <= feeds.get(POLICY_LOSS, frozenset())]
        # StablePolicyLossConfig: verl rejects unknown policy_loss keys, even with "+"; this _target_ takes them
        state.policy_loss_config, report["policy_loss_config_fields"] = config_subclass(
            PolicyLossConfig, usable, name="StablePolicyLossConfig", module="stablerl.adapters.verl",
            extra=POLICY_LOSS_EXTRA_FIELDS, check=self.check_policy_loss_config)
        self._register(core_algos, ledger)
        report["ok"] = True

    def _uninstrument(self) -> None:
        for names in self.state.names.values():
            names.clear()
        self.state.report.update(ok=False, registered=[], skipped=[], ppo_loss_patch=None, compute_advantage_patch=None)

    # -- verl's registries -----------------------------------------------------------------------

    def _register(self, core_algos, ledger, only=None, feeds=None) -> None:
        """Register each stablerl loss / estimator whose required inputs this process feeds (``feeds``; all of them,
        or those in ``only``), under ``stablerl_<name>`` and the bare name where free; the rest is skipped, and why."""
        from stablerl.adapters.verl import _translate as tr
        from stablerl.name_registration import register_algorithms

        feeds = feeds or self.state.feeds
        makers = {POLICY_LOSS: (core_algos.POLICY_LOSS_REGISTRY, tr.make_policy_loss_fn),
                  ADVANTAGE_ESTIMATOR: (core_algos.ADV_ESTIMATOR_REGISTRY, tr.make_adv_estimator_fn)}
        # verl's grpo and gae are hard-coded branches of compute_advantage: treat as taken even if absent
        reserved = {ADVANTAGE_ESTIMATOR: {"gae", "grpo"}, POLICY_LOSS: set()}
        for kind, (registry, make) in makers.items():
            register_algorithms(ledger, kind, registry, make, feeds=feeds.get(kind, frozenset()), prefix=PREFIX,
                                mark="_stablerl_verl", label="verl", record=self._record, skip=self._skip,
                                why_unfed=functools.partial(self._why_unfed, kind), reserved=reserved[kind], only=only)

    def _why_unfed(self, kind: str, missing: list) -> str:
        from ._providers import WHERE

        notes = (dict(self.spec.why_not["*"]) if kind == POLICY_LOSS
                 else {m: WHERE[m] for m in missing if m in BATCH_FIELD_INPUTS})
        why = "; ".join(f"{m}: {notes[m]}" for m in missing if notes.get(m))
        if kind == ADVANTAGE_ESTIMATOR and set(missing) <= BATCH_FIELD_INPUTS:
            why += "; opt in with +algorithm.stablerl_batch_field_estimators=true if your pipeline writes them"
        return f"needs {', '.join(missing)}, which verl 0.9 cannot provide to a {kind}" + (f" ({why})" if why else "")

    def _record(self, kind: str, verl_name: str, name: str) -> None:
        self.state.names[kind][verl_name] = name
        self.state.report["registered"].append({"kind": kind, "verl_name": verl_name, "stablerl_name": name})

    def _skip(self, kind: str, name: str, reason: str) -> None:
        self.state.report["skipped"].append({"kind": kind, "name": name, "reason": reason})

    def stablerl_name(self, kind: str, verl_name: Any) -> Optional[str]:
        """The stablerl algorithm registered in verl's registry of ``kind`` under ``verl_name`` (None: verl's own)."""
        from verl.trainer.ppo import core_algos

        registry = core_algos.POLICY_LOSS_REGISTRY if kind == POLICY_LOSS else core_algos.ADV_ESTIMATOR_REGISTRY
        key = getattr(verl_name, "value", verl_name)
        mark = getattr(registry.get(key) if isinstance(key, str) else None, "_stablerl_verl", None)
        return mark[1] if mark is not None and mark[0] == kind else None

    def register_batch_field_estimators(self) -> list[str]:
        """Also register the estimators whose declared inputs only a customised pipeline puts in verl's batch
        (per-row ``anchor_ids`` / ``step_returns``, per-token ``turn_ids``: e.g. ``gigpo``). Idempotent; returns
        the verl names registered by this call."""
        import stablerl
        from verl.trainer.ppo import core_algos

        from stablerl.adapters.verl import _advantage

        kind, report = ADVANTAGE_ESTIMATOR, self.state.report
        if not _advantage.is_patched():
            raise stablerl.StableRLError("the compute_advantage wrapper is off (stablerl.adapters.verl.instrument()): "
                                         "the batch fields would not reach the estimators")
        fed = self.state.feeds.get(kind, frozenset())
        extended = fed | BATCH_FIELD_INPUTS
        candidates = {(kind, s.name) for s in stablerl.list_algorithms(kind) if s.status != stablerl.UNAVAILABLE
                      and set(s.requires) <= extended and not set(s.requires) <= fed}
        before = set(self.state.names[kind])
        report["skipped"][:] = [s for s in report["skipped"] if (s["kind"], s["name"]) not in candidates]
        self._register(core_algos, self.ledger, only=candidates, feeds={kind: extended})
        # a second call re-records the same names: keep one entry each
        report["skipped"][:] = [s for i, s in enumerate(report["skipped"]) if s not in report["skipped"][:i]]
        report["registered"][:] = list({(r["kind"], r["verl_name"]): r for r in report["registered"]}.values())
        return sorted(set(self.state.names[kind]) - before)

    # -- config and reports ------------------------------------------------------------------------

    def check_policy_loss_config(self, cfg: Any) -> None:
        """Validate the stablerl hyper-parameters of a ``StablePolicyLossConfig`` when it is built."""
        import stablerl
        from stablerl.frameworks import check_call_options, split_call_options
        from stablerl.params import build_params

        from stablerl.adapters.verl import _controller, _trainer_hook

        _trainer_hook.check_selection(cfg)  # a trainer hook (e.g. sfpo) may go with any loss, verl's own too
        _controller.check_selection(cfg)  # so may an entropy controller (adaptive_entropy)
        name = self.state.names[POLICY_LOSS].get(getattr(cfg, "loss_mode", None))
        if name is None:  # a verl loss (or one registered later): verl decides
            return
        extra = set(self.state.report["policy_loss_config_fields"]) - {
            _trainer_hook.HOOK_KEY, _trainer_hook.HOOK_PARAMS_KEY, _controller.KEY, _controller.PARAMS_KEY}
        spec = stablerl.get_spec(POLICY_LOSS, name)
        own = set(spec.params.field_names())
        given = {k: getattr(cfg, k) for k in own if getattr(cfg, k, None) is not None}
        given.update(dict(getattr(cfg, "stablerl_params", None) or {}))
        # stablerl_params may also carry compute_policy_loss options (loss_agg_mode=delta_l, rollout_correction=tis)
        given, options = split_call_options(given)
        build_params(spec, given)  # raises StableRLError naming a bad value (or an unknown stablerl_params key)
        check_call_options(self.spec, spec, options, given)
        unused = sorted(k for k in extra - own - {"stablerl_params"} if getattr(cfg, k, None) is not None)
        if unused:
            logger.warning("stablerl: policy_loss keys %s are not hyper-parameters of loss_mode=%s (%s) and are "
                           "ignored", unused, cfg.loss_mode, sorted(own) or "it has none")

    def registration_report(self) -> dict[str, Any]:
        """What this adapter registered in verl in this process, what it skipped and why, and the patches' status.

        Keys: ``ok``, ``verl_version``, ``supported``, ``error`` (why nothing was registered, or None),
        ``registered`` (``{kind, verl_name, stablerl_name, live}``; ``live`` False when something registered over
        it later), ``skipped`` (``{kind, name, reason}``), ``policy_loss_config_fields`` (the StablePolicyLossConfig
        fields and the algorithms that use each), and the status of each call-site patch."""
        from stablerl.adapters.verl import (_advantage, _controller, _engine, _groups, _inputs, _routing_replay,
                                            _trainer_hook)

        report, live_registry = self.state.report, {}
        try:
            from verl.trainer.ppo import core_algos

            live_registry = {POLICY_LOSS: core_algos.POLICY_LOSS_REGISTRY,
                             ADVANTAGE_ESTIMATOR: core_algos.ADV_ESTIMATOR_REGISTRY}
        except Exception:  # noqa: BLE001
            pass
        def live(r: dict) -> bool:  # False when something registered over it later
            fn = live_registry.get(r["kind"], {}).get(r["verl_name"])
            return getattr(fn, "_stablerl_verl", None) == (r["kind"], r["stablerl_name"])

        registered = [{**r, "live": live(r)} for r in report["registered"]]
        return {
            "ok": report["ok"], "verl_version": report["verl_version"], "supported": self.spec.supported,
            "error": report["error"], "ppo_loss_patch": report["ppo_loss_patch"],
            "compute_advantage_patch": report["compute_advantage_patch"],
            "compute_advantage_patched": _advantage.is_patched(), "engine": _engine.status(),
            "routing_replay": _routing_replay.status(), "trainer_hook": _trainer_hook.status(),
            "entropy_controller": _controller.status(), "whole_groups": _groups.status(), "advantage_inputs": _advantage.describe(),
            "ppo_loss_patched": _inputs.is_patched(), "declared_inputs": _inputs.describe(),
            "registered": registered, "skipped": [dict(s) for s in report["skipped"]],
            "policy_loss_config_fields": dict(report["policy_loss_config_fields"]),
        }


__all__ = ["VerlAdapter", "VerlState", "UnsupportedVerlVersion", "PREFIX", "VERL_EQUIVALENTS", "BATCH_FIELD_INPUTS"]
