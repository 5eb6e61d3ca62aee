"""Reversible patches of framework code: one ledger of what was replaced, for every adapter.

A :class:`PatchLedger` sets an attribute (of a class or module) or a mapping entry under a key, once per
process, keeps what was there, and puts every original back on :meth:`PatchLedger.restore`, newest first.
The replacement is marked (``mark``), so that a second copy of an adapter (imported under another name)
sees the patch and does not wrap it again (nor a subclass that inherits a patched method). An attribute
a class only inherited is deleted again on restore, not shadowed by a copy.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, MutableMapping

_MISSING = object()


class PatchLedger:
    def __init__(self, mark: str):
        self.mark = mark
        self._lock = threading.RLock()
        self._undo: dict[str, Callable[[], None]] = {}  # key -> puts the original back (insertion ordered)

    def set_attr(self, key: str, owner: Any, attr: str, new: Any) -> bool:
        """``owner.attr = new`` unless ``key`` is already patched or the current value carries the mark;
        returns whether it patched."""
        with self._lock:
            own = owner.__dict__.get(attr, _MISSING) if isinstance(owner, type) else getattr(owner, attr, _MISSING)
            # the resolved value (inherited included): a patched base class is not wrapped again in a subclass
            if key in self._undo or getattr(getattr(owner, attr, None), self.mark, False):
                return False
            self._mark(new)
            setattr(owner, attr, new)
            self._undo[key] = (lambda: delattr(owner, attr)) if own is _MISSING else (lambda: setattr(owner, attr, own))
            return True

    def set_item(self, key: str, mapping: MutableMapping, name: Any, new: Any) -> bool:
        """``mapping[name] = new`` (e.g. a framework registry entry), with the same rules as :meth:`set_attr`."""
        with self._lock:
            old = mapping.get(name, _MISSING)
            if key in self._undo or getattr(old, self.mark, False):
                return False
            self._mark(new)
            mapping[name] = new
            self._undo[key] = (lambda: mapping.pop(name, None)) if old is _MISSING else (
                lambda: mapping.__setitem__(name, old))
            return True

    def _mark(self, new: Any) -> None:
        try:
            setattr(new, self.mark, True)
        except (AttributeError, TypeError):  # e.g. a bound method: marked by its key only
            pass

    def restore(self) -> None:
        """Put every original back, the newest patch first."""
        with self._lock:
            for key in reversed(list(self._undo)):
                self._undo.pop(key)()

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._undo)

    def __contains__(self, key: str) -> bool:
        return key in self._undo
