"""stablerl's algorithms in a framework's own name registry (a dict ``name -> function``, e.g. verl's
``POLICY_LOSS_REGISTRY``): one rule for every adapter whose framework selects an algorithm by a registered name.

Each usable algorithm of a kind (not ``unavailable``, every input it requires fed by the adapter) is registered as
``prefix + name`` and, where the framework has nothing of that name, as the bare name. A framework's own entry is
never replaced, a name the framework hard-codes (``reserved``) is skipped, and an entry this adapter made before
(its function carries ``mark`` = ``(kind, name)``) is kept. Every entry goes through the adapter's
:class:`~stablerl.patching.PatchLedger` (so ``uninstrument()`` takes it out); what was registered, and what was
skipped and why, is reported through ``record`` / ``skip``.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Optional

from .api import list_algorithms
from .contracts import UNAVAILABLE


def owner(fn: Any) -> str:
    """``module.qualname`` of a registry entry (who registered it), for messages."""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def register_algorithms(ledger: Any, kind: str, registry: dict, make: Callable[[str], Any], *, feeds: Collection[str],
                        prefix: str, mark: str, label: str, record: Callable[[str, str, str], None],
                        skip: Callable[[str, str, str], None], why_unfed: Callable[[list], str],
                        reserved: Collection[str] = (), only: Optional[Collection[tuple]] = None) -> None:
    """Register every usable algorithm of ``kind`` (those in ``only``, ``(kind, name)`` pairs, when given) into
    ``registry`` with ``make(name)``; ``record(kind, registered_name, name)`` / ``skip(kind, name, reason)`` report
    each decision, ``why_unfed(missing)`` says why required inputs cannot be fed; ``label``: the framework's name in
    the reasons."""
    for spec in list_algorithms(kind):
        if only is not None and (kind, spec.name) not in only:
            continue
        if spec.status == UNAVAILABLE:
            skip(kind, spec.name, f"status unavailable: {spec.notes}")
            continue
        missing = [r for r in spec.requires if r not in feeds]
        if missing:
            skip(kind, spec.name, why_unfed(missing))
            continue
        fn = make(spec.name)
        for registered, bare in ((prefix + spec.name, False), (spec.name, True)):
            existing = registry.get(registered)
            if existing is not None:
                if getattr(existing, mark, None) == (kind, spec.name):  # this adapter's, from an earlier import
                    record(kind, registered, spec.name)
                else:
                    skip(kind, registered, f"{label} already has {registered!r} ({owner(existing)}); use "
                         f"{prefix}{spec.name}" if bare else f"name taken by {owner(existing)}")
            elif registered in reserved:
                skip(kind, registered, f"{registered!r} is hard-coded in {label}; use {prefix}{spec.name}")
            else:
                ledger.set_item(f"{kind}:{registered}", registry, registered, fn)  # undone by uninstrument()
                record(kind, registered, spec.name)


__all__ = ["owner", "register_algorithms"]
