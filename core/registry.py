"""The plugin manager, the registry it fills, and the lookups of what is registered (algorithms by kind and
name, frameworks by name: :func:`get_framework`, :func:`load_adapter`).

Built-in plugins (the algorithms in ``stablerl.plugins`` and the framework declarations in
``stablerl.adapters``, both named by stablerl's own entry-point group ``stablerl.builtin``, so core
imports neither by name) and third-party packages discovered in the entry-point group ``stablerl``
register through the same hooks, called through pluggy. ``STABLERL_PLUGINS``
controls discovery of third-party plugins: unset or ``all`` loads every one, ``none`` loads
none, a comma-separated list loads only those entry-point names. A third-party plugin that
fails to import, raises while registering, or registers a name that is already taken is
reported (a warning now, ``stablerl doctor`` later) and skipped; everything else keeps working.
"""

from __future__ import annotations

import importlib
import logging
import os
import traceback
import warnings
from dataclasses import dataclass, field, replace
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any, Optional

import pluggy

from . import hookspecs
from .contracts import KINDS, AlgorithmSpec
from .framework_spec import FrameworkSpec
from .params import UnknownNameError, unknown_name_message

logger = logging.getLogger("stablerl")

ENTRY_POINT_GROUP = "stablerl"
BUILTIN_ENTRY_POINT_GROUP = "stablerl.builtin"
HOOK_KINDS = {
    "register_policy_losses": "policy_loss",
    "register_advantage_estimators": "advantage_estimator",
    "register_aggregations": "aggregation",
    "register_reward_shapers": "reward_shaper",
    "register_batch_filters": "batch_filter",
    "register_controllers": "controller",
    "register_router_families": "router_family",
    "register_rollout_corrections": "rollout_correction",
    "register_trainer_hooks": "trainer_hook",
}
FRAMEWORK_HOOK = "register_frameworks"


@dataclass
class PluginFailure:
    plugin: str
    error: str
    detail: str = ""


@dataclass
class Registry:
    specs: dict[tuple[str, str], AlgorithmSpec] = field(default_factory=dict)
    failures: list[PluginFailure] = field(default_factory=list)
    plugins: list[str] = field(default_factory=list)
    frameworks: dict[str, FrameworkSpec] = field(default_factory=dict)  # in declaration order

    def get(self, kind: str, name: str) -> AlgorithmSpec:
        try:
            return self.specs[(kind, name)]
        except KeyError:
            valid = [n for (k, n) in self.specs if k == kind]
            raise UnknownNameError(unknown_name_message(kind.replace("_", " "), name, valid)) from None

    def names(self, kind: Optional[str] = None) -> list[str]:
        return sorted(n for (k, n) in self.specs if kind is None or k == kind)

    def list(self, kind: Optional[str] = None) -> list[AlgorithmSpec]:
        if kind is not None and kind not in KINDS:
            raise UnknownNameError(unknown_name_message("kind", kind, KINDS))
        return sorted((s for s in self.specs.values() if kind is None or s.kind == kind), key=lambda s: (s.kind, s.name))


def _builtin_modules() -> list[str]:
    """Module names of the built-in plugins: each entry point of ``stablerl.builtin`` names a module,
    or (``module:attr``) a tuple of module names."""
    modules: list[str] = []
    for ep in sorted(entry_points(group=BUILTIN_ENTRY_POINT_GROUP), key=lambda ep: ep.name):
        loaded = ep.load()
        if isinstance(loaded, (tuple, list)):
            modules.extend(loaded)
        else:
            modules.append(loaded.__name__)
    if not modules:
        raise RuntimeError(
            "stablerl's built-in entry points (group 'stablerl.builtin') are missing: reinstall stablerl "
            "(pip install -e . after a checkout)"
        )
    return modules


def _allowed_entry_points() -> Optional[set[str]]:
    policy = os.environ.get("STABLERL_PLUGINS", "all").strip().lower()
    if policy in ("", "all", "auto"):
        return None
    if policy == "none":
        return set()
    return {p.strip() for p in policy.split(",") if p.strip()}


def _report(failures: list[PluginFailure], plugin: str, error: str, exc: Optional[BaseException] = None,
            what: str = "skipped") -> None:
    detail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)) if exc else ""
    failures.append(PluginFailure(plugin, error, detail))
    message = f"stablerl: plugin {plugin!r} {what}: {error}"
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def build_registry() -> Registry:
    """Load built-in and third-party plugins and collect every registered algorithm."""
    pm = pluggy.PluginManager("stablerl")
    pm.add_hookspecs(hookspecs)
    registry = Registry()
    # the plugin manager loads the built-ins (stablerl.plugins, stablerl.adapters.frameworks) by the module names
    # their entry points give, here, when the registry is first asked for: core imports neither by name
    builtin: list[tuple[str, Any]] = [(m, importlib.import_module(m)) for m in _builtin_modules()]
    third_party: list[tuple[str, Any]] = []
    allowed = _allowed_entry_points()
    if allowed is None or allowed:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if allowed is not None and ep.name not in allowed:
                continue
            label = f"{ep.name} ({ep.value})"
            try:
                third_party.append((label, ep.load()))
            except (Exception, SystemExit) as e:  # noqa: BLE001 - a broken plugin must not break the others
                _report(registry.failures, label, f"import failed: {type(e).__name__}: {e}", e)

    for label, module in builtin + third_party:
        is_builtin = (label, module) in builtin
        try:
            pm.register(module, name=label)
            pm.check_pending()  # a misspelt hook name (register_policy_loss) is an error, not a no-op
        except Exception as e:  # noqa: BLE001
            if pm.is_registered(module):
                pm.unregister(module)
            _report(registry.failures, label, f"invalid plugin: {type(e).__name__}: {e}", e)
            continue
        registry.plugins.append(label)
        staged: dict[tuple[str, str], AlgorithmSpec] = {}
        frameworks: dict[str, Any] = {}
        try:
            # through pluggy's own records of this plugin's marked implementations (pm.hook), so an
            # unmarked function that happens to carry a hook's name is never called
            for hook_name, kind in HOOK_KINDS.items():
                for impl in _impls_of(pm, hook_name, module):
                    impl.function(register=_make_register(kind, label, staged))
            for impl in _impls_of(pm, FRAMEWORK_HOOK, module):
                impl.function(register=_make_framework_register(label, frameworks))
        except (Exception, SystemExit) as e:  # noqa: BLE001 - sys.exit() in a hook must not exit the host
            if is_builtin:
                raise
            _report(registry.failures, label, f"registration failed: {type(e).__name__}: {e}", e)
            continue
        clash = [n for n in frameworks if n in registry.frameworks]
        if clash:
            error = f"framework {clash[0]!r} is already declared by another plugin"
            if is_builtin:
                raise RuntimeError(error)
            _report(registry.failures, label, f"name clash: {error}")
            continue
        registry.frameworks.update(frameworks)
        for key, spec in staged.items():
            if key in registry.specs:
                owner = registry.specs[key].plugin
                error = f"{spec.kind} {spec.name!r} is already registered by {owner!r}"
                if is_builtin:
                    raise RuntimeError(error)
                _report(registry.failures, label, f"name clash: {error}",
                        what=f"{spec.kind} {spec.name!r} not registered (its other names are)")
                continue
            registry.specs[key] = spec
    return registry


def _impls_of(pm: pluggy.PluginManager, hook_name: str, module: Any) -> list:
    caller = getattr(pm.hook, hook_name)
    return [impl for impl in caller.get_hookimpls() if impl.plugin is module]


def _make_framework_register(plugin: str, staged: dict):
    def register(framework: Any) -> Any:
        if not isinstance(framework, FrameworkSpec):
            raise TypeError(f"register_frameworks: register() takes a stablerl.frameworks.FrameworkSpec, got {framework!r}")
        if framework.name in staged:
            raise ValueError(f"framework {framework.name!r} declared twice by the same plugin")
        staged[framework.name] = framework
        return framework

    return register


def _make_register(kind: str, plugin: str, staged: dict):
    def register(spec: Optional[AlgorithmSpec] = None, /, **fields: Any) -> AlgorithmSpec:
        if spec is None:
            fields.setdefault("kind", kind)
            spec = AlgorithmSpec(**fields)
        elif fields:
            raise TypeError("register() takes an AlgorithmSpec or keyword fields, not both")
        if spec.kind != kind:
            raise ValueError(f"{spec.name!r} has kind {spec.kind!r} but was registered through the {kind} hook")
        spec = replace(spec, plugin=plugin)
        key = (spec.kind, spec.name)
        if key in staged:
            raise ValueError(f"{spec.kind} {spec.name!r} registered twice by the same plugin")
        staged[key] = spec
        return spec

    return register


_REGISTRY: Optional[Registry] = None


def get_registry() -> Registry:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = build_registry()
    return _REGISTRY


def reload_registry() -> Registry:
    """Rebuild the registry (after installing a plugin, or changing ``STABLERL_PLUGINS``)."""
    global _REGISTRY
    _REGISTRY = None
    return get_registry()


# ----------------------------------------------------------------------------- frameworks


def list_frameworks() -> list[FrameworkSpec]:
    """Every framework declared through ``register_frameworks`` (built-in and third-party)."""
    return list(get_registry().frameworks.values())  # in declaration order


def get_framework(name: str) -> FrameworkSpec:
    """The declaration of framework ``name``; unknown names raise naming the declared ones."""
    frameworks = get_registry().frameworks
    try:
        return frameworks[name]
    except KeyError:
        raise UnknownNameError(unknown_name_message("framework", name, frameworks)) from None


def framework_of(framework: FrameworkSpec | str) -> FrameworkSpec:
    """``framework`` itself, or the declaration of the framework of that name."""
    return get_framework(framework) if isinstance(framework, str) else framework


def load_adapter(name: str) -> ModuleType:
    """Import and return the adapter module of framework ``name`` (this imports the framework). Core never
    imports an adapter by name: this imports the module the framework's declaration names."""
    return importlib.import_module(get_framework(name).adapter)


def switch_names(switch: str) -> str:
    """``"verl: <key>; trl: <key>; ..."`` for a named framework switch (core's error messages name the
    frameworks' keys through the declarations, never by writing them itself)."""
    return "; ".join(f"{fw.name}: {fw.switches[switch]}" for fw in list_frameworks() if switch in fw.switches)
