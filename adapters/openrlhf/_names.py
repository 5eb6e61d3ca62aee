"""Name resolution of the OpenRLHF adapter (moved verbatim out of the package ``__init__``, so that the
submodules that resolve names do not import their package)."""

from __future__ import annotations

from typing import Optional

from ._spec import (
    _SHAPER,
    _WHY_NOT,
    _WHY_NOT_EXTENSION,
    FEEDABLE_ADVANTAGE_INPUTS,
    FEEDABLE_EXTENSION_INPUTS,
    FEEDABLE_LOSS_INPUTS,
    FILTER_FLAG,
    OPENRLHF_ADV_ESTIMATORS,
    OPENRLHF_POLICY_LOSSES,
    PREFIX,
    SHAPER_FLAG,
)

# ----------------------------------------------------------------------------- names and selection


def _registry_names(kind: str) -> list[str]:
    import stablerl

    return [s.name for s in stablerl.list_algorithms(kind) if s.status != stablerl.UNAVAILABLE]


def _feedable(kind: str) -> frozenset:
    from stablerl.contracts import POLICY_LOSS

    return FEEDABLE_LOSS_INPUTS if kind == POLICY_LOSS else FEEDABLE_ADVANTAGE_INPUTS


def openrlhf_choices(kind: str) -> list[str]:
    """The names the wrapper's argparse lists: OpenRLHF's, then every stablerl algorithm OpenRLHF
    can feed (bare where free, ``stablerl_<name>`` where OpenRLHF has the same name)."""
    import stablerl

    builtins = OPENRLHF_POLICY_LOSSES if kind == stablerl.POLICY_LOSS else OPENRLHF_ADV_ESTIMATORS
    out = list(builtins)
    for spec in stablerl.list_algorithms(kind):
        if spec.status == stablerl.UNAVAILABLE or not set(spec.requires) <= _feedable(kind):
            continue
        out.append(PREFIX + spec.name if spec.name in builtins else spec.name)
    return out


def resolve(kind: str, name: Optional[str]) -> Optional[str]:
    """The stablerl algorithm ``name`` selects, or None for an OpenRLHF built-in (or None).

    Unknown names raise :class:`stablerl.UnknownNameError` listing the valid ones.
    """
    import stablerl
    from stablerl.params import UnknownNameError, unknown_name_message

    if name is None:
        return None
    builtins = OPENRLHF_POLICY_LOSSES if kind == stablerl.POLICY_LOSS else OPENRLHF_ADV_ESTIMATORS
    if name in builtins:
        return None
    bare = name[len(PREFIX):] if name.startswith(PREFIX) else name
    registered = stablerl.get_registry().names(kind)
    if bare not in registered:
        what = "--actor.policy_loss_type" if kind == stablerl.POLICY_LOSS else "--algo.advantage.estimator"
        raise UnknownNameError(unknown_name_message(what, name, openrlhf_choices(kind)))
    spec = stablerl.get_spec(kind, bare)  # raises for 'unavailable' entries, with the reason
    missing = [r for r in spec.requires if r not in _feedable(kind)]
    if missing:
        reasons = "; ".join(f"{m}: {_WHY_NOT.get(m, 'not provided by OpenRLHF')}" for m in missing)
        raise stablerl.MissingInputError(f"{kind.replace('_', ' ')} {bare!r} needs input(s) OpenRLHF cannot provide ({reasons})")
    return bare


def extension_choices(kind: str) -> list[str]:
    """The reward shapers / batch filters OpenRLHF can feed (names of the wrapper's argparse choices)."""
    import stablerl

    return [s.name for s in stablerl.list_algorithms(kind)
            if s.status != stablerl.UNAVAILABLE and set(s.requires) <= FEEDABLE_EXTENSION_INPUTS]


def resolve_extension(kind: str, name: Optional[str]) -> Optional[str]:
    """The stablerl reward shaper / batch filter ``name`` (None: none). Unknown names raise
    :class:`stablerl.UnknownNameError` with the nearest one; inputs OpenRLHF cannot provide at its
    advantage step raise :class:`stablerl.MissingInputError` with the reason."""
    import stablerl
    from stablerl.params import UnknownNameError, unknown_name_message

    if name is None or name == "":
        return None
    flag = SHAPER_FLAG if kind == _SHAPER else FILTER_FLAG
    if name not in stablerl.get_registry().names(kind):
        raise UnknownNameError(unknown_name_message(flag, name, extension_choices(kind)))
    spec = stablerl.get_spec(kind, name)  # raises for 'unavailable' entries, with the reason
    missing = [r for r in spec.requires if r not in FEEDABLE_EXTENSION_INPUTS]
    if missing:
        reasons = "; ".join(f"{m}: {_WHY_NOT_EXTENSION.get(m, 'not provided by OpenRLHF')}" for m in missing)
        raise stablerl.MissingInputError(
            f"{kind.replace('_', ' ')} {name!r} ({flag}) needs input(s) OpenRLHF cannot provide ({reasons})"
        )
    return name
