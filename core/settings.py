"""Effective hyper-parameters: one precedence rule in every framework (:data:`PRECEDENCE`), the settings a
selection runs with (:func:`effective_hyperparameters`), and the table printed at start-up."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from .call_options import CALL_OPTIONS, split_call_options, stablerl_key
from .contracts import AlgorithmSpec
from .framework_spec import FrameworkSpec
from .params import StableRLError, UnknownNameError, unknown_name_message
from .registry import framework_of


#: where an effective hyper-parameter value came from, highest precedence first
FROM_STABLERL_KEY = "stablerl key"
FROM_FRAMEWORK_KEY = "framework key"
FROM_PAPER_DEFAULT = "paper default"

PRECEDENCE = (
    "One precedence rule in every framework: (1) a stablerl key (verl: policy_loss./algorithm. fields, "
    "TRL: stablerl_*_params, OpenRLHF: --*.stablerl_params) > (2) a framework key the user set (verl's "
    "actor clip keys at a value other than verl's default, TRL's epsilon/epsilon_high, OpenRLHF's clip "
    "flags given on the command line) > (3) the paper's default. A framework key left at the framework's "
    "own default never replaces a paper default; where the two differ, start-up says so and names the key."
)


@dataclass(frozen=True)
class Setting:
    """One effective hyper-parameter: its value, where it came from, and the key that sets it."""

    name: str
    value: Any
    source: str  # FROM_STABLERL_KEY, FROM_FRAMEWORK_KEY or FROM_PAPER_DEFAULT
    key: str  # the key that set it, or the stablerl key that would set it
    note: str = ""  # e.g. a framework default that differs from the paper default and was not used


def effective_hyperparameters(
    framework: FrameworkSpec | str,
    spec: AlgorithmSpec,
    stablerl_params: Optional[Mapping[str, Any]] = None,
    framework_values: Optional[Mapping[str, Any]] = None,
    user_set: Optional[Any] = None,
) -> list[Setting]:
    """Every hyper-parameter of ``spec`` as it will run in ``framework``, under :data:`PRECEDENCE`.

    ``stablerl_params``: the stablerl keys the user set. ``framework_values``: stablerl name -> the
    value of the framework key declared for it (``FrameworkSpec.hyperparameter_keys``), as read from
    the framework's config. ``user_set``: the names whose framework key the user set explicitly, when
    the framework can tell (OpenRLHF's command line); otherwise a framework value counts as set when
    it differs from the framework's declared default.
    """
    fw = framework_of(framework)
    stablerl_params = dict(stablerl_params or {})
    framework_values = dict(framework_values or {})
    keys = fw.hyperparameter_keys.get(spec.kind, {})
    defaults = spec.defaults()
    options = {}
    if spec.kind == "policy_loss":  # aggregation / rollout correction through the same channel (CALL_OPTIONS)
        stablerl_params, options = split_call_options(stablerl_params)
    for name in stablerl_params:  # a typo is an error naming the valid keys, never a silently dropped value
        if name not in defaults:
            valid = list(defaults) + (list(CALL_OPTIONS) if spec.kind == "policy_loss" else [])
            raise UnknownNameError(unknown_name_message(f"hyper-parameter for {spec.name!r}", name, valid))
    out: list[Setting] = []
    for name, default in defaults.items():
        own_key = stablerl_key(fw, spec.kind, name)
        if name in stablerl_params:
            out.append(Setting(name, stablerl_params[name], FROM_STABLERL_KEY,
                               stablerl_key(fw, spec.kind, name, stablerl_params[name])))
            continue
        fk = keys.get(name)
        value = framework_values.get(name)
        if fk is not None and value is not None:
            explicitly = (name in user_set) if user_set is not None else not _same(value, fk.default)
            if explicitly:
                out.append(Setting(name, value, FROM_FRAMEWORK_KEY, fk.show(value)))
                continue
            if not _same(value, default):
                out.append(Setting(
                    name, default, FROM_PAPER_DEFAULT, own_key,
                    note=f"{fk.show(value)} is {fw.name}'s default, not applied; to run with it set "
                         f"{stablerl_key(fw, spec.kind, name, value)}",
                ))
                continue
        out.append(Setting(name, default, FROM_PAPER_DEFAULT, own_key))
    for name, value in options.items():
        out.append(Setting(name, value, FROM_STABLERL_KEY, stablerl_key(fw, spec.kind, name, value)))
    return out


def check_framework_keys_used(
    framework: FrameworkSpec | str, spec: AlgorithmSpec, framework_values: Optional[Mapping[str, Any]] = None,
    user_set: Optional[Any] = None,
) -> None:
    """Refuse a framework knob the user set that ``spec`` has no hyper-parameter for, where ignoring it
    would silently change the run (``FrameworkKey.refuse_if_unused``: knobs that change advantages)."""
    fw = framework_of(framework)
    fields = set(spec.defaults())
    for name, fk in fw.hyperparameter_keys.get(spec.kind, {}).items():
        value = (framework_values or {}).get(name)
        if not fk.refuse_if_unused or name in fields or value is None:
            continue
        explicitly = (name in user_set) if user_set is not None else not _same(value, fk.default)
        if explicitly:
            raise StableRLError(
                f"{fw.name}: {fk.show(value)} has no effect on the stablerl {spec.kind.replace('_', ' ')} "
                f"{spec.name!r} (it has no {name!r}); remove it, or choose an algorithm with that "
                f"hyper-parameter (ignoring it would change your advantages without a word)"
            )


def _same(a: Any, b: Any) -> bool:
    try:
        return a == b or (a is not None and b is not None and float(a) == float(b))
    except (TypeError, ValueError):
        return False


def as_params(settings: list[Setting]) -> dict[str, Any]:
    """The keyword arguments for ``compute_policy_loss`` / ``compute_advantage``: every value that is
    not the paper default (the defaults are the Params dataclass's own)."""
    return {s.name: s.value for s in settings if s.source != FROM_PAPER_DEFAULT}


def format_settings(framework: FrameworkSpec | str, spec: AlgorithmSpec, settings: list[Setting]) -> str:
    """The effective-settings table printed at start-up and by ``stablerl describe --framework``."""
    fw = framework_of(framework)
    head = f"stablerl/{fw.name}: {spec.kind.replace('_', ' ')} {spec.name!r} runs with"
    if not settings:
        return head + " no hyper-parameters"
    w = max(len(s.name) for s in settings)
    v = max(len(repr(s.value)) for s in settings)
    lines = [head + ":"]
    for s in settings:
        lines.append(f"  {s.name:<{w}} = {s.value!r:<{v}}  ({s.source}: {s.key})")
        if s.note:
            lines.append(f"  {'':<{w}}   note: {s.note}")
    return "\n".join(lines)


_LOGGED: set = set()


def log_effective_settings(framework: FrameworkSpec | str, spec: AlgorithmSpec, settings: list[Setting],
                           logger: Any = None) -> None:
    """Print the effective-settings table to stderr once per process and selection (Ray forwards a
    worker's stderr to the driver's console, and no logging set-up can hide it), and log each note (a
    framework default that differs from the paper's and was not applied) as a WARNING."""
    fw = framework_of(framework)
    # verl calls this at every loss call: the table is formatted only for settings not printed yet
    key = (fw.name, spec.kind, spec.name, tuple((s.name, repr(s.value), s.source, s.key) for s in settings))
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger = logger or logging.getLogger(f"stablerl.adapters.{fw.name}")
        print(format_settings(fw, spec, settings), file=sys.stderr, flush=True)
        for s in settings:
            if s.note:
                logger.warning("stablerl/%s: %s %s = %r (paper default): %s", fw.name, spec.name, s.name, s.value, s.note)
