"""The framework contract: what every framework adapter answers, declared once per framework.

An adapter declares a :class:`FrameworkSpec` through the ``register_frameworks`` hook (the built-in
verl, TRL and OpenRLHF declarations come through the same hook as a third party's). Everything
two adapters would otherwise each write lives here: name resolution, which inputs a framework can
feed and why not, hyper-parameter precedence, and loading the adapter module itself. Core never
imports an adapter by name: :func:`load_adapter` imports the module a declaration names.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Mapping, Optional

from .contracts import AlgorithmSpec
from .params import UnknownNameError, unknown_name_message


@dataclass(frozen=True)
class FrameworkKey:
    """A framework config key that sets a stablerl hyper-parameter (e.g. verl's
    ``actor_rollout_ref.actor.clip_ratio_high``) and the framework's own default for it."""

    key: str
    default: Any = None


@dataclass(frozen=True)
class FrameworkSpec:
    """One framework as its adapter declares it (no framework import needed to build it)."""

    name: str  # "verl", "trl", "openrlhf"
    distribution: str  # the pip distribution whose version is checked
    supported: str  # PEP 440 specifier of the versions the adapter supports, e.g. ">=0.9.1,<0.10"
    adapter: str  # import path of the adapter module; imported only by load_adapter()
    # kind -> names the framework ships itself; a stablerl algorithm of the same name is prefix+name
    builtin_names: Mapping[str, frozenset] = field(default_factory=dict)
    # kind -> optional inputs (contracts.OPTIONAL_INPUTS) the adapter can feed to that kind
    feedable: Mapping[str, frozenset] = field(default_factory=dict)
    # input -> why the framework cannot feed it (shown when an algorithm needing it is refused)
    why_not: Mapping[str, str] = field(default_factory=dict)
    # kind -> the config key / flag that selects an algorithm of that kind
    selection_keys: Mapping[str, str] = field(default_factory=dict)
    # stablerl hyper-parameter name -> the framework key that also sets it (see hyperparameters.py)
    hyperparameter_keys: Mapping[str, FrameworkKey] = field(default_factory=dict)
    prefix: str = "stablerl_"
    # spec -> the config lines that select spec and set its hyper-parameters (docs, `stablerl describe`)
    config_lines: Optional[Callable[[AlgorithmSpec], list]] = None
    # how to install the adapter / run the framework with it (one line, for docs)
    usage: str = ""


def list_frameworks() -> list[FrameworkSpec]:
    """Every framework declared through ``register_frameworks`` (built-in and third-party)."""
    from .registry import get_registry

    return sorted(get_registry().frameworks.values(), key=lambda f: f.name)


def get_framework(name: str) -> FrameworkSpec:
    """The declaration of framework ``name``; unknown names raise naming the declared ones."""
    from .registry import get_registry

    frameworks = get_registry().frameworks
    try:
        return frameworks[name]
    except KeyError:
        raise UnknownNameError(unknown_name_message("framework", name, frameworks)) from None


def load_adapter(name: str) -> ModuleType:
    """Import and return the adapter module of framework ``name`` (this imports the framework)."""
    return importlib.import_module(get_framework(name).adapter)

from .framework_batch import FilteredBatch, apply_filter_result, loss_inputs, pending_loss_inputs  # noqa: E402,F401
