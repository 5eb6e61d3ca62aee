"""A framework's config dataclass, subclassed with one optional field per stablerl hyper-parameter.

Frameworks that build their config from dataclasses reject unknown keys (verl's ``PolicyLossConfig``, built from
its Hydra ``_target_``). :func:`config_subclass` makes the subclass a user selects instead, with one field per
hyper-parameter of the given algorithms (``None`` = the algorithm's default) and any extra fields the adapter reads
(a params dict, a trainer-hook selection); generated from the registry, so third-party plugins get their keys too.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable, Iterable, Optional

_SIMPLE = (int, float, bool, str)


def _field_type(annotation: Any) -> Any:
    """``T`` for a simple (optionally Optional) scalar type, else ``Any``."""
    if annotation in _SIMPLE:
        return annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Union and len(args) == 1 and args[0] in _SIMPLE:
        return args[0]
    return Any


def hyperparameter_fields(specs, reserved: set[str], extra: Iterable[tuple[str, Any, str]] = ()
                          ) -> tuple[list[tuple[str, Any, Any]], dict[str, list[str]]]:
    """``(fields, owners)``: one ``(name, Optional[type], field(default=None))`` per hyper-parameter name of
    ``specs`` not in ``reserved``, then each ``extra`` ``(name, type, owner)``; ``owners`` maps each name to the
    algorithms (or the ``owner`` label) that use it."""
    types: dict[str, Any] = {}
    owners: dict[str, list[str]] = {}
    for spec in specs:
        try:
            hints = typing.get_type_hints(spec.params)
        except Exception:  # noqa: BLE001 - unresolvable annotation: accept any value
            hints = {}
        for f in dataclasses.fields(spec.params):
            if f.name in reserved or f.name.startswith("_"):
                continue
            t = _field_type(hints.get(f.name, Any))
            if f.name in types and types[f.name] != t:
                t = Any  # two algorithms disagree on the type of a same-named parameter
            types[f.name] = t
            owners.setdefault(f.name, []).append(spec.name)
    fields = [(n, Optional[t], dataclasses.field(default=None)) for n, t in sorted(types.items())]
    for name, typ, owner in extra:
        if name not in reserved:
            fields.append((name, Optional[typ], dataclasses.field(default=None)))
            owners[name] = [spec.name for spec in specs] if owner == "*" else [owner]
    return fields, owners


def config_subclass(base: type, specs, *, name: str, module: str, extra: Iterable[tuple[str, Any, str]] = (),
                    check: Optional[Callable[[Any], None]] = None) -> tuple[type, dict[str, list[str]]]:
    """``(cls, owners)``: dataclass ``name`` subclassing ``base`` with the hyper-parameters of ``specs`` (names
    ``base`` already has are left to its field) and the ``extra`` fields (``owner`` ``"*"``: every algorithm).

    ``check(config)``, if given, runs after construction (where the framework builds its config), so a bad value
    fails before the first rollout, not after it. ``module``: where pickling and Hydra's ``_locate`` find it."""
    reserved = {f.name for f in dataclasses.fields(base)}
    fields, owners = hyperparameter_fields(specs, reserved, extra)

    def __post_init__(self) -> None:
        parent = getattr(super(cls, self), "__post_init__", None)
        if parent is not None:
            parent()
        if check is not None:
            check(self)

    doc = (f"{base.__name__} with one optional field per stablerl hyper-parameter (None = the algorithm's "
           "default). Fields: " + ", ".join(f"{n} ({'/'.join(owners[n])})" for n, _, _ in fields))
    cls = dataclasses.make_dataclass(name, fields, bases=(base,),
                                     namespace={"__post_init__": __post_init__, "__doc__": doc})
    cls.__module__, cls.__qualname__ = module, name
    return cls, owners


__all__ = ["hyperparameter_fields", "config_subclass"]
