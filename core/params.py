"""Typed hyper-parameters: building an algorithm's Params from user keys, with clear errors."""

from __future__ import annotations

import dataclasses
import difflib
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
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if isinstance(value, float) and value != value:
            raise StableRLError(f"{spec.name}: hyper-parameter {f.name} is NaN")
    try:
        params.validate()
    except StableRLError:
        raise
    except (ValueError, AssertionError) as e:  # plugin validate() may raise plain errors
        raise StableRLError(f"{spec.name}: {e}") from e
    return params


def check(condition: bool, message: str) -> None:
    """Raise :class:`StableRLError` with ``message`` unless ``condition``. For ``Params.validate``."""
    if not condition:
        raise StableRLError(message)
