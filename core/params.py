"""Typed hyper-parameters: building an algorithm's Params from user keys, with clear errors."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from typing import Any, Iterable, Mapping

from .contracts import AlgorithmSpec, Params


class StableRLError(ValueError):
    """Bad input to stablerl: a message that says what is wrong and what is valid."""


class UnknownNameError(StableRLError, KeyError):
    """An algorithm or hyper-parameter name that does not exist."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class MissingInputError(StableRLError):
    """An algorithm was called without an input it declares it needs."""


def nearest(name: str, valid: Iterable[str]) -> str:
    """' (did you mean X?)' or ''."""
    match = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def unknown_name_message(what: str, name: str, valid: Iterable[str]) -> str:
    valid = sorted(valid)
    return f"unknown {what} {name!r}{nearest(name, valid)}; valid: {', '.join(valid) if valid else '(none)'}"


def params_dict(value: Any, key: str) -> dict:
    """Hyper-parameters given under config key ``key``: a mapping, a JSON object string (from a command line or
    YAML) or nothing (None, ""), as a new dict; anything else raises naming ``key``."""
    import json

    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise StableRLError(f"{key} must be a JSON object such as '{{\"m2_threshold\": 0.04}}': {e}") from None
    if not isinstance(value, Mapping):
        raise StableRLError(f"{key} must be a dict (or a JSON object string), got {type(value).__name__}")
    return dict(value)


def build_params(spec: AlgorithmSpec, overrides: Mapping[str, Any] | None = None) -> Params:
    """The spec's Params with ``overrides`` applied; unknown keys and bad values raise."""
    overrides = dict(overrides or {})
    valid = spec.params.field_names()
    for key in overrides:
        if key not in valid:
            raise UnknownNameError(
                unknown_name_message(f"hyper-parameter for {spec.name!r}", key, valid)
            )
    params = spec.params(**overrides)
    hints = _type_hints(spec.params)
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if isinstance(value, float) and value != value:
            raise StableRLError(f"{spec.name}: hyper-parameter {f.name} is NaN")
        problem = _type_problem(value, hints.get(f.name))
        if problem:
            raise StableRLError(f"{spec.name}: hyper-parameter {f.name} must be {problem}, got {value!r} "
                                f"({type(value).__name__})")
        if hints.get(f.name) in (int, typing.Optional[int]) and value is not None and not isinstance(value, int):
            object.__setattr__(params, f.name, int(value))  # an integral 2.0 (from JSON or YAML) is the int 2
    try:
        params.validate()
    except StableRLError:
        raise
    except (ValueError, AssertionError) as e:  # plugin validate() may raise plain errors
        raise StableRLError(f"{spec.name}: {e}") from e
    return params


def _type_hints(params_cls: type) -> dict:
    # resolved once per class (typing.get_type_hints evaluates the string annotations on every call,
    # a fixed cost of every loss call); a copy, so a caller cannot change the cached dict
    return dict(_resolved_type_hints(params_cls))


@functools.lru_cache(maxsize=None)
def _resolved_type_hints(params_cls: type) -> dict:
    import typing

    try:
        return typing.get_type_hints(params_cls)
    except Exception:  # noqa: BLE001 - an unresolvable annotation: no type check for that class
        return {}


def _type_problem(value: Any, hint: Any) -> str:
    """What ``value`` must be to match the field's annotation (``float``, ``int``, ``bool``, ``str``, or
    ``Optional`` of one), or ``""`` when it matches. A float must be finite; an int must be integral; a bool
    must be a bool (the string ``"False"`` is truthy); a number is never a bool."""
    import math
    import numbers
    import typing

    optional = False
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0] if len(args) == 1 else None
    if value is None:
        return "" if optional or hint not in (float, int, bool, str) else f"a {hint.__name__}, not None"
    if hint is bool:
        return "" if isinstance(value, bool) or type(value).__name__ == "bool_" else "true or false"
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return "a finite number"
        return "" if math.isfinite(float(value)) else "a finite number"
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return "an integer"
        return "" if math.isfinite(float(value)) and float(value) == int(value) else "an integer"
    if hint is str:
        return "" if isinstance(value, str) else "a string"
    return ""


def parse_params(value: Any, where: str) -> dict[str, Any]:
    """Hyper-parameters as a user writes them on a command line or in an environment variable: ``KEY=VALUE``
    items (a string or a list; each VALUE read as JSON, else kept as a string), or one JSON object; a mapping
    passes through and None / "" / [] give {}. ``where`` (the flag or variable) names the source in errors."""
    import json

    if value is None or value == "" or value == []:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    items = [value] if isinstance(value, str) else list(value)
    if len(items) == 1 and items[0].lstrip().startswith("{"):
        try:
            return dict(json.loads(items[0]))  # "{...}" parses to a dict or fails
        except json.JSONDecodeError as e:
            raise StableRLError(f"{where}: not a JSON object ({e}): {items[0]!r}") from None
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise StableRLError(f"{where}: expected KEY=VALUE items (e.g. m2_threshold=0.04), got {item!r}")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def check(condition: bool, message: str) -> None:
    """Raise :class:`StableRLError` with ``message`` unless ``condition``. For ``Params.validate``."""
    if not condition:
        raise StableRLError(message)
