"""Inputs as providers: what a framework can feed is what its adapter can compute, declared next to the code.

An adapter (a :class:`stablerl.adapter.FrameworkAdapter` subclass) marks one method per optional input it can
feed to some kinds of algorithm with :func:`provides`::

    class VerlAdapter(FrameworkAdapter):
        name = "verl"

        @provides("old_entropy", to=(ADVANTAGE_ESTIMATOR, BATCH_FILTER))
        def old_entropy(self, record):          # record: the batch's BatchRecord (stablerl.steps)
            return record.host.batch.get("stablerl_old_entropys")

        @provides("sum_pi_squared", to=(ADVANTAGE_ESTIMATOR,), extra_pass=True,
                  condition="actor_rollout_ref.actor.calculate_sum_pi_squared=True")
        def sum_pi_squared(self, record): ...

``FrameworkSpec.feedable`` and ``FrameworkSpec.conditions`` are derived from these declarations
(:func:`feedable_of`, :func:`conditions_of`), never written by hand, so `stablerl list`, the refusal messages
and the adapter's own call sites agree by construction. A provider that costs a pass the framework would
not run anyway (``extra_pass=True``) runs only when a selected algorithm declares its input
(:meth:`stablerl.steps.BatchRecord.input` asks for an input only when something reads it).

Providers are declared on a class that imports no framework at module level (a provider's body imports
what it needs), so the declaration can be read by `stablerl list` where the framework is not installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

from .contracts import ESTIMATOR_ONLY_INPUTS, KINDS, OPTIONAL_INPUTS
from .params import StableRLError

_ATTR = "__stablerl_provides__"


@dataclass(frozen=True)
class Provider:
    """One optional input an adapter can feed: to which kinds of algorithm, under which user setting, and
    whether it costs a pass of its own. ``fn(adapter, record)`` returns the value, or None when this batch
    has none (the step then raises naming the input and ``condition``)."""

    input: str
    kinds: frozenset
    fn: Callable[[Any, Any], Any]
    condition: Optional[str] = None  # what the user must set for the framework to feed it (-> "partial")
    extra_pass: bool = False  # the framework does not compute it anyway: run only when an algorithm reads it
    doc: str = ""

    def __call__(self, adapter: Any, record: Any) -> Any:
        return self.fn(adapter, record)


def provides(input_name: str, *, to: Iterable[str], condition: Optional[str] = None,
             extra_pass: bool = False) -> Callable[[Callable], Callable]:
    """Mark an adapter method as the provider of ``input_name`` for algorithms of the kinds ``to``.

    A method may be stacked with several ``@provides`` (one input fed to several kinds under different
    conditions). Unknown input names and kinds raise at class creation, naming the valid ones."""
    kinds = frozenset(to)
    known_inputs = set(OPTIONAL_INPUTS) | set(ESTIMATOR_ONLY_INPUTS)
    if input_name not in known_inputs:
        raise StableRLError(f"@provides({input_name!r}): not an optional input (stablerl.contracts.OPTIONAL_INPUTS "
                            f"or ESTIMATOR_ONLY_INPUTS); declare it there first")
    bad = sorted(kinds - set(KINDS))
    if bad or not kinds:
        raise StableRLError(f"@provides({input_name!r}, to={sorted(kinds)}): kinds must be a non-empty subset of "
                            f"{list(KINDS)}")

    def mark(fn: Callable) -> Callable:
        declared = list(getattr(fn, _ATTR, ()))
        declared.append((input_name, kinds, condition, extra_pass))
        setattr(fn, _ATTR, tuple(declared))
        return fn

    return mark


def collect(namespace: Mapping[str, Any]) -> dict[tuple[str, str], Provider]:
    """``(kind, input) -> Provider`` of every ``@provides`` method in a class namespace."""
    out: dict[tuple[str, str], Provider] = {}
    for attr, fn in namespace.items():
        for input_name, kinds, condition, extra_pass in getattr(fn, _ATTR, ()):
            for kind in kinds:
                if (kind, input_name) in out:
                    raise StableRLError(f"two providers of {input_name!r} for {kind}: {out[kind, input_name].fn.__name__} "
                                        f"and {attr}")
                out[kind, input_name] = Provider(input_name, kinds, fn, condition, extra_pass,
                                                 (getattr(fn, "__doc__", "") or "").strip().split("\n")[0])
    return out


def feedable_of(providers: Mapping[tuple[str, str], Provider]) -> dict[str, frozenset]:
    """kind -> the inputs the adapter can feed to it (``FrameworkSpec.feedable``)."""
    out: dict[str, set] = {}
    for kind, input_name in providers:
        out.setdefault(kind, set()).add(input_name)
    return {kind: frozenset(names) for kind, names in out.items()}


def conditions_of(providers: Mapping[tuple[str, str], Provider]) -> dict[str, dict[str, str]]:
    """kind -> input -> what the user must set (``FrameworkSpec.conditions``) for the conditional providers."""
    out: dict[str, dict[str, str]] = {}
    for (kind, input_name), provider in providers.items():
        if provider.condition:
            out.setdefault(kind, {})[input_name] = provider.condition
    return out


__all__ = ["Provider", "provides", "collect", "feedable_of", "conditions_of"]
