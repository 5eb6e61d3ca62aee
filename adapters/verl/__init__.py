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

Every change to verl (registry entries, wrapped call sites, engine and trainer patches) is recorded in
one patch ledger: :func:`instrument` makes them (on import; idempotent) and :func:`uninstrument` puts
verl's own objects back. A verl outside :data:`SUPPORTED_VERL` is refused, logged at ERROR (verl
hides plugin errors), unless ``STABLERL_ALLOW_UNSUPPORTED=1``.

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
idempotent: importing it twice, or under two module names, registers nothing twice.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("stablerl.adapters.verl")

# absolute: one ppo_loss wrapper / ContextVar / state dict per process (see _translate)
from stablerl.adapters.verl import _inputs as _declared  # noqa: E402  (imports no verl)

# verl's advantage call site (ray_trainer.compute_advantage): declared estimator inputs, reward
# shapers and batch filters (``+algorithm.stablerl_reward_shaper`` / ``stablerl_batch_filter``)
from stablerl.adapters.verl import _advantage as _adv_site  # noqa: E402  (imports no verl)

# verl's FSDP engine subclass (MoE routing replay, checkpointed loss state), the worker switch for
# +actor_rollout_ref.actor.fsdp_config.router_replay.mode, and the trainers' driver-state checkpoint
from stablerl.adapters.verl import _engine as engine  # noqa: E402  (imports no verl)
from stablerl.adapters.verl import _routing_replay as routing_replay  # noqa: E402
from stablerl.adapters.verl import _state as checkpoint_state  # noqa: E402
from stablerl.adapters.verl import _trainer_hook as trainer_hook  # noqa: E402  (imports no verl)
from stablerl.adapters.verl import _controller as entropy_controller  # noqa: E402  (imports no verl)
from stablerl.adapters.verl._ledger import LEDGER as _LEDGER  # noqa: E402
from stablerl.frameworks import UnsupportedVersionError, check_version, get_framework  # noqa: E402

#: verl versions this adapter supports: declared once, in ``stablerl.adapters.frameworks`` (the
#: ``(loss, metrics)`` return, ``rollout_is_weights`` and ``config.global_batch_info`` are checked by
#: signature too); tested with 0.9.1.
SUPPORTED_VERL = get_framework("verl").supported
PREFIX = "stablerl_"

#: stablerl algorithm -> the verl built-in that computes the same thing (checked by parity tests
#: in integrations_tests/verl). Under these names verl's built-in stays in charge.
VERL_EQUIVALENTS = {
    "policy_loss": {"vanilla": "vanilla", "gspo": "gspo", "gmpo": "geo_mean", "cispo": "cispo"},
    "advantage_estimator": {"grpo": "grpo", "rloo": "rloo", "opo": "opo"},
}

#: Every name this module registered in verl in this process, per kind:
#: ``{"policy_loss": {verl_name: stablerl_name}, "advantage_estimator": {...}}``. Use the verl
#: name in ``actor.policy_loss.loss_mode`` / ``algorithm.adv_estimator``. Filled on import.
VERL_NAMES: dict[str, dict[str, str]] = {"policy_loss": {}, "advantage_estimator": {}}

_REPORT: dict[str, Any] = {
    "ok": False,
    "verl_version": None,
    "error": None,
    "ppo_loss_patch": None,  # "patched" | "deferred" (on import of verl.workers.utils.losses) | "failed"
    "registered": [],  # {"kind", "verl_name", "stablerl_name"}
    "skipped": [],  # {"kind", "name", "reason"}
    "policy_loss_config_fields": {},
}


class UnsupportedVerlVersion(UnsupportedVersionError):
    """verl is outside :data:`SUPPORTED_VERL`, or lacks an interface this adapter relies on."""


def _verl_version() -> str:
    try:
        from importlib.metadata import version

        return version("verl")
    except Exception:  # noqa: BLE001 - source checkout without metadata
        import importlib.util
        import sys

        verl = sys.modules.get("verl")
        if verl is None and importlib.util.find_spec("verl") is None:
            raise ImportError('verl is not installed: pip install "stablerl[verl]"') from None
        if verl is None:
            import verl
        return str(getattr(verl, "__version__", "0"))


def _check_signatures(core_algos) -> None:
    """Gate on the interface facts themselves, not only the version string."""
    import inspect

    problems = []
    agg = inspect.signature(core_algos.agg_loss).parameters
    for p in ("dp_size", "batch_num_tokens", "global_batch_size"):
        if p not in agg:
            problems.append(f"core_algos.agg_loss has no {p!r} (global_batch_info, verl >= 0.7.0)")
    vanilla = core_algos.POLICY_LOSS_REGISTRY.get("vanilla")
    if vanilla is None or "rollout_is_weights" not in inspect.signature(vanilla).parameters:
        problems.append("policy losses do not take rollout_is_weights (verl >= 0.7.0)")
    for attr in ("register_adv_est", "get_adv_estimator_fn", "ADV_ESTIMATOR_REGISTRY", "get_policy_loss_fn"):
        if not hasattr(core_algos, attr):
            problems.append(f"core_algos has no {attr}")
    if problems:
        raise UnsupportedVerlVersion(
            f"stablerl.adapters.verl supports verl {SUPPORTED_VERL}; this verl lacks: " + "; ".join(problems)
        )


def _owner(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _is_ours(fn: Any, kind: str, name: str) -> bool:
    return getattr(fn, "_stablerl_verl", None) == (kind, name)


#: extra inputs this process can hand to each kind (verl's, plus the ppo_loss wrapper's gathered
#: inputs for policy losses while the wrapper is installed); set by _setup
_PROVIDES: dict[str, frozenset] = {}


def _register_all(core_algos, only=None, provides=None) -> None:
    import stablerl

    from . import _translate as tr

    registries = {
        stablerl.POLICY_LOSS: (core_algos.POLICY_LOSS_REGISTRY, core_algos.register_policy_loss, tr.make_policy_loss_fn),
        stablerl.ADVANTAGE_ESTIMATOR: (
            core_algos.ADV_ESTIMATOR_REGISTRY,
            core_algos.register_adv_est,
            tr.make_adv_estimator_fn,
        ),
    }
    # verl's grpo and gae are hard-coded branches of compute_advantage: treat as taken even if absent
    reserved = {stablerl.ADVANTAGE_ESTIMATOR: {"gae", "grpo"}, stablerl.POLICY_LOSS: set()}
    for kind, (registry, register, make) in registries.items():
        for spec in stablerl.list_algorithms(kind):
            if only is not None and (kind, spec.name) not in only:
                continue
            if spec.status == stablerl.UNAVAILABLE:
                _skip(kind, spec.name, f"status unavailable: {spec.notes}")
                continue
            missing = [r for r in spec.requires if r not in (provides or _PROVIDES).get(kind, tr.VERL_PROVIDES[kind])]
            if missing:
                notes = _declared.NOT_PROVIDED if kind == stablerl.POLICY_LOSS else {
                    k: v[1] for k, v in _adv_site.SOURCES.items() if k in _adv_site.BATCH_FIELD_INPUTS}
                why = "; ".join(f"{m}: {notes[m]}" for m in missing if m in notes)
                if kind == stablerl.ADVANTAGE_ESTIMATOR and set(missing) <= _adv_site.BATCH_FIELD_INPUTS:
                    why += f"; opt in with +algorithm.{_adv_site.BATCH_FIELDS_KEY}=true if your pipeline writes them"
                _skip(
                    kind, spec.name,
                    f"needs {', '.join(missing)}, which verl 0.9 cannot provide to a {kind}" + (f" ({why})" if why else ""),
                )
                continue
            fn = make(spec.name)
            for verl_name, bare in ((PREFIX + spec.name, False), (spec.name, True)):
                existing = registry.get(verl_name)
                if existing is not None:
                    if _is_ours(existing, kind, spec.name):  # imported before (maybe under another module name)
                        _record(kind, verl_name, spec.name)
                    elif bare:
                        _skip(kind, verl_name, f"verl already has {verl_name!r} ({_owner(existing)}); use {PREFIX}{spec.name}")
                    else:
                        _skip(kind, verl_name, f"name taken by {_owner(existing)}")
                    continue
                if verl_name in reserved[kind]:
                    _skip(kind, verl_name, f"{verl_name!r} is hard-coded in verl; use {PREFIX}{spec.name}")
                    continue
                _LEDGER.set_item(f"{kind}:{verl_name}", registry, verl_name, fn)  # undone by uninstrument()
                _record(kind, verl_name, spec.name)


def _record(kind: str, verl_name: str, name: str) -> None:
    VERL_NAMES[kind][verl_name] = name
    _REPORT["registered"].append({"kind": kind, "verl_name": verl_name, "stablerl_name": name})


def _skip(kind: str, name: str, reason: str) -> None:
    _REPORT["skipped"].append({"kind": kind, "name": name, "reason": reason})


def _check_policy_loss_config(cfg: Any) -> None:
    """Validate the stablerl hyper-parameters of a ``StablePolicyLossConfig`` when it is built."""
    import stablerl
    from stablerl.params import build_params

    trainer_hook.check_selection(cfg)  # a trainer hook (e.g. sfpo) may go with any loss, verl's own too
    entropy_controller.check_selection(cfg)  # so may an entropy controller (adaptive_entropy)
    name = VERL_NAMES["policy_loss"].get(getattr(cfg, "loss_mode", None))
    extra = set(_REPORT["policy_loss_config_fields"]) - {trainer_hook.HOOK_KEY, trainer_hook.HOOK_PARAMS_KEY,
                                                          entropy_controller.KEY, entropy_controller.PARAMS_KEY}
    if name is None:  # a verl loss (or one registered later): verl decides
        return
    spec = stablerl.get_spec(stablerl.POLICY_LOSS, name)
    own = set(spec.params.field_names())
    given = {k: getattr(cfg, k) for k in own if getattr(cfg, k, None) is not None}
    given.update(dict(getattr(cfg, "stablerl_params", None) or {}))
    from stablerl.frameworks import check_call_options, get_framework, split_call_options

    # stablerl_params may also carry compute_policy_loss options (loss_agg_mode=delta_l, rollout_correction=tis)
    given, options = split_call_options(given)
    build_params(spec, given)  # raises StableRLError naming a bad value (or an unknown stablerl_params key)
    check_call_options(get_framework("verl"), spec, options, given)
    unused = sorted(k for k in extra - own - {"stablerl_params"} if getattr(cfg, k, None) is not None)
    if unused:
        logger.warning(
            "stablerl: policy_loss keys %s are not hyper-parameters of loss_mode=%s (%s) and are ignored",
            unused, cfg.loss_mode, sorted(own) or "it has none",
        )


def doctor_report() -> dict[str, Any]:
    """For ``stablerl doctor``: verl's entry point for stablerl and what this process registered."""
    from importlib import metadata

    eps = [ep.value for ep in metadata.entry_points(group="verl.plugins") if ep.name == "stablerl"]
    return {"entry_point": eps[0] if eps else None, **registration_report()}


def registration_report() -> dict[str, Any]:
    """What this adapter registered in verl in this process, and what it skipped and why.

    Keys: ``ok`` (bool), ``verl_version``, ``supported`` (the version range), ``error`` (why
    nothing was registered, or None), ``registered`` (list of ``{kind, verl_name, stablerl_name,
    live}``; ``live`` is False when something registered over it later), ``skipped`` (list of
    ``{kind, name, reason}``), ``policy_loss_config_fields`` (the StablePolicyLossConfig fields and
    the algorithms that use each).
    """
    live_registry: dict[str, Any] = {}
    try:
        from verl.trainer.ppo import core_algos

        live_registry = {"policy_loss": core_algos.POLICY_LOSS_REGISTRY, "advantage_estimator": core_algos.ADV_ESTIMATOR_REGISTRY}
    except Exception:  # noqa: BLE001
        pass
    registered = []
    for r in _REPORT["registered"]:
        reg = live_registry.get(r["kind"], {})
        registered.append({**r, "live": _is_ours(reg.get(r["verl_name"]), r["kind"], r["stablerl_name"])})
    return {
        "ok": _REPORT["ok"],
        "verl_version": _REPORT["verl_version"],
        "supported": SUPPORTED_VERL,
        "error": _REPORT["error"],
        "ppo_loss_patch": _REPORT["ppo_loss_patch"],
        "compute_advantage_patch": _REPORT.get("compute_advantage_patch"),
        "compute_advantage_patched": _adv_site.is_patched(),
        "engine": engine.status(),
        "routing_replay": routing_replay.status(),
        "trainer_hook": trainer_hook.status(),
        "entropy_controller": entropy_controller.status(),
        "advantage_inputs": _adv_site.describe(),
        "ppo_loss_patched": _declared.is_patched(),
        "declared_inputs": _declared.describe(),
        "registered": registered,
        "skipped": [dict(s) for s in _REPORT["skipped"]],
        "policy_loss_config_fields": dict(_REPORT["policy_loss_config_fields"]),
    }


def _setup():
    version = _verl_version()
    _REPORT["verl_version"] = version
    check_version("verl", version, error=UnsupportedVerlVersion)  # outside the range: refused (see instrument)
    from verl.trainer.ppo import core_algos
    from verl.workers.config import PolicyLossConfig  # already imported by core_algos

    import stablerl

    from ._config import build_policy_loss_config

    from ._translate import VERL_PROVIDES

    _check_signatures(core_algos)
    status = _declared.instrument()  # wrap verl's loss call site (now, or when its module is imported)
    _REPORT["ppo_loss_patch"] = status
    _PROVIDES.update(VERL_PROVIDES)
    if status == "failed":  # no wrapper: only verl's own loss arguments reach the losses
        _PROVIDES[stablerl.POLICY_LOSS] = frozenset()
    adv_status = _adv_site.instrument()  # wrap verl's advantage call site (now, or when ray_trainer is imported)
    _REPORT["compute_advantage_patch"] = adv_status
    if adv_status == "failed":  # no wrapper: verl passes the uid only
        _PROVIDES[stablerl.ADVANTAGE_ESTIMATOR] = frozenset({"index"})
    engine.instrument()  # FSDP engine subclass, on import of its module
    routing_replay.instrument()  # worker switch for fsdp_config.router_replay.mode
    checkpoint_state.instrument()  # trainers' _save_checkpoint / _load_checkpoint: the driver's stablerl state
    trainer_hook.instrument()  # ActorRolloutRefWorker.update_actor: passes and trainer hooks (SFPO)
    usable = [
        s
        for s in stablerl.list_algorithms(stablerl.POLICY_LOSS)
        if s.status != stablerl.UNAVAILABLE and set(s.requires) <= _PROVIDES[stablerl.POLICY_LOSS]
    ]
    cls, owners = build_policy_loss_config(PolicyLossConfig, usable, __name__, check=_check_policy_loss_config)
    _REPORT["policy_loss_config_fields"] = owners
    _register_all(core_algos)
    _REPORT["ok"] = True
    return cls


def register_batch_field_estimators() -> list[str]:
    """Also register the stablerl estimators whose declared inputs only a customised pipeline puts in
    verl's batch (per-row ``anchor_ids`` / ``step_returns``, per-token ``turn_ids``; see
    :data:`stablerl.adapters.verl._advantage.SOURCES`): e.g. ``gigpo``. No stock verl 0.9.1 trainer
    writes these fields at ``compute_advantage`` (v1 fetches a fixed field list), so they are opt-in;
    a missing field raises a ``MissingInputError`` naming it at the first step. Call it in the driver
    (e.g. from your trainer subclass' module). Idempotent.
    Returns the verl names registered by this call."""
    import stablerl
    from verl.trainer.ppo import core_algos

    kind = stablerl.ADVANTAGE_ESTIMATOR
    if not _adv_site.is_patched():
        raise stablerl.StableRLError(
            "the compute_advantage wrapper is off (stablerl.adapters.verl.instrument()): the batch fields "
            "would not reach the estimators"
        )
    extended = _PROVIDES.get(kind, frozenset()) | _adv_site.BATCH_FIELD_INPUTS
    candidates = {
        (kind, s.name)
        for s in stablerl.list_algorithms(kind)
        if s.status != stablerl.UNAVAILABLE and set(s.requires) <= extended
        and not set(s.requires) <= _PROVIDES.get(kind, frozenset())
    }
    before = set(VERL_NAMES[kind])
    skipped = list(_REPORT["skipped"])
    _REPORT["skipped"][:] = [s for s in skipped if (s["kind"], s["name"]) not in candidates]
    _register_all(core_algos, only=candidates, provides={kind: extended})
    # a second call re-records the same names: keep one entry each
    _REPORT["skipped"][:] = [s for i, s in enumerate(_REPORT["skipped"]) if s not in _REPORT["skipped"][:i]]
    _REPORT["registered"][:] = list({(r["kind"], r["verl_name"]): r for r in _REPORT["registered"]}.values())
    return sorted(set(VERL_NAMES[kind]) - before)


def instrument() -> None:
    """Register the stablerl names in verl's registries and wrap verl's call sites (the entry point does it
    on ``import verl``). Idempotent. A verl outside :data:`SUPPORTED_VERL` is refused
    (:class:`UnsupportedVerlVersion` naming both) unless ``STABLERL_ALLOW_UNSUPPORTED=1``, then a warning."""
    global StablePolicyLossConfig
    if _REPORT["ok"]:
        return
    _REPORT.update(error=None, registered=[], skipped=[])
    try:
        StablePolicyLossConfig = _setup()
    except Exception as e:  # verl hides plugin import errors at DEBUG: say it loudly here
        _REPORT["error"] = f"{type(e).__name__}: {e}"
        logger.error("stablerl: verl adapter failed, no stablerl names registered in verl: %s", _REPORT["error"])
        _LEDGER.restore()  # nothing half-done stays
        raise
    _REPORT["ok"] = True
    if _adv_site.BATCH_FIELD_REGISTRAR is _adv_site._no_registrar:  # for +algorithm.stablerl_batch_field_estimators
        _adv_site.BATCH_FIELD_REGISTRAR = register_batch_field_estimators
    logger.info(
        "stablerl: registered into verl %s: policy losses %s; advantage estimators %s; skipped %d",
        _REPORT["verl_version"], sorted(VERL_NAMES["policy_loss"]), sorted(VERL_NAMES["advantage_estimator"]),
        len(_REPORT["skipped"]),
    )


def uninstrument() -> None:
    """Undo :func:`instrument`: verl's registries, call sites, engine registry and trainer methods hold
    verl's own objects again and the post-import hooks are gone. Idempotent."""
    _LEDGER.restore()
    for names in VERL_NAMES.values():
        names.clear()
    _REPORT.update(ok=False, registered=[], skipped=[], ppo_loss_patch=None, compute_advantage_patch=None)


def _deprecated(old: str, new: str) -> None:
    import warnings

    warnings.warn(f"stablerl.adapters.verl.{old}() is deprecated; use {new}", DeprecationWarning, stacklevel=3)


def patch_ppo_loss() -> str:
    """Deprecated: :func:`instrument` wraps ``ppo_loss`` with everything else."""
    _deprecated("patch_ppo_loss", "instrument()")
    return _declared.instrument()


def unpatch_ppo_loss() -> None:
    """Deprecated: :func:`uninstrument` restores ``ppo_loss`` with everything else."""
    _deprecated("unpatch_ppo_loss", "uninstrument()")
    _LEDGER.restore(_declared.PATCH_KEY)


def patch_compute_advantage() -> str:
    """Deprecated: :func:`instrument` wraps ``compute_advantage`` with everything else."""
    _deprecated("patch_compute_advantage", "instrument()")
    return _adv_site.instrument()


def unpatch_compute_advantage() -> None:
    """Deprecated: :func:`uninstrument` restores ``compute_advantage`` with everything else."""
    _deprecated("unpatch_compute_advantage", "uninstrument()")
    _LEDGER.restore(_adv_site.PATCH_KEY)


def __getattr__(name: str):
    if name == "StablePolicyLossConfig":  # instrument() refused or failed: say why, not just "no attribute"
        raise ImportError(f"stablerl.adapters.verl is not instrumented: {_REPORT['error'] or 'call instrument()'}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


try:
    instrument()
except Exception:  # noqa: BLE001 - logged at ERROR above; raising here would only reach verl's DEBUG log
    pass

__all__ = [
    "instrument",
    "uninstrument",
    "StablePolicyLossConfig",
    "VERL_NAMES",
    "VERL_EQUIVALENTS",
    "SUPPORTED_VERL",
    "registration_report",
    "UnsupportedVerlVersion",
    "patch_ppo_loss",
    "unpatch_ppo_loss",
    "patch_compute_advantage",
    "unpatch_compute_advantage",
    "register_batch_field_estimators",
    "routing_replay",
    "engine",
    "checkpoint_state",
    "trainer_hook",
    "entropy_controller",
]
