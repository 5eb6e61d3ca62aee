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


# ----------------------------------------------------------------------------- version policy

#: ``STABLERL_ALLOW_UNSUPPORTED=1``: a framework version outside an adapter's supported range is a warning,
#: not an error (to try a newer release before stablerl declares it)
ALLOW_UNSUPPORTED_ENV = "STABLERL_ALLOW_UNSUPPORTED"


class UnsupportedVersionError(ImportError):
    """The installed framework is outside the range its adapter declares (``FrameworkSpec.supported``)."""


def _release(text: str) -> tuple[int, ...]:
    # "0.11.2+cu121" -> (0, 11, 2); "1.17.0rc1" -> (1, 17, 0); a pre-release counts as its release
    import re

    return tuple(int(x) for x in re.findall(r"\d+", re.split(r"[+a-zA-Z]", text.strip(), maxsplit=1)[0]))


def version_in_range(found_version: str, specifier: str) -> bool:
    """Whether ``found_version`` satisfies ``specifier``: comma-separated ``>=``, ``>``, ``<=``, ``<``, ``==``,
    ``!=`` clauses on release numbers (missing parts count as 0: ``0.10`` == ``0.10.0``)."""
    import operator
    import re

    ops = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq,
           "!=": operator.ne}
    found = _release(found_version)
    for clause in filter(None, (c.strip() for c in specifier.split(","))):
        m = re.fullmatch(r"(>=|<=|==|!=|>|<)\s*([0-9][0-9.]*)", clause)
        if m is None:
            raise ValueError(f"unsupported version clause {clause!r} in {specifier!r}")
        bound = _release(m.group(2))
        width = max(len(found), len(bound))
        pad = lambda v: v + (0,) * (width - len(v))  # noqa: E731
        if not ops[m.group(1)](pad(found), pad(bound)):
            return False
    return True


def check_version(framework_name: str, found_version: Optional[str], *, error: type = UnsupportedVersionError,
                  allow: Optional[bool] = None) -> Optional[str]:
    """The one version policy of every framework adapter: a version outside the framework's declared
    ``supported`` range (or no framework at all) raises ``error`` naming the found version and the range;
    with ``STABLERL_ALLOW_UNSUPPORTED=1`` (or ``allow=True``) an out-of-range version is a RuntimeWarning
    instead. Returns ``found_version``."""
    import os
    import warnings

    spec = get_framework(framework_name)
    install = f"pip install '{spec.distribution}{spec.supported}'"
    if found_version is None:
        raise error(f"{spec.adapter} needs {spec.distribution}{spec.supported}, which is not installed: {install}")
    if version_in_range(found_version, spec.supported):
        return found_version
    message = (f"{spec.adapter} supports {spec.distribution}{spec.supported}, found {spec.distribution} "
               f"{found_version}: install a supported version ({install})")
    if allow is None:
        allow = os.environ.get(ALLOW_UNSUPPORTED_ENV, "") == "1"
    if not allow:
        raise error(f"{message}, or set {ALLOW_UNSUPPORTED_ENV}=1 to try this one anyway")
    warnings.warn(f"{message}. Continuing because {ALLOW_UNSUPPORTED_ENV}=1.", RuntimeWarning, stacklevel=2)
    return found_version
