"""Reversible patches of framework code: one ledger of what was replaced, for every adapter.

Every change an adapter makes to a framework goes through a :class:`PatchLedger`: an attribute of a
class or module (:meth:`~PatchLedger.set_attr`), a registry entry (:meth:`~PatchLedger.set_item`), a
module function together with the names its callers bound with ``from ... import`` (:meth:`~PatchLedger.rebind`),
and the post-import hooks that apply patches when a framework module is first imported
(:meth:`~PatchLedger.on_import`). Each change is made once per process; the ledger keeps what was there
and :meth:`~PatchLedger.restore` puts every original back, newest first (an adapter's ``uninstrument()``).

The replacement is marked (``mark``), so that a second copy of an adapter (imported under another name)
sees the patch and does not wrap it again (nor a subclass that inherits a patched method). An attribute
a class only inherited is deleted again on restore, not shadowed by a copy.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from typing import Any, Callable, Iterable, Mapping, MutableMapping

from . import post_import

_MISSING = object()


class PatchLedger:
    def __init__(self, mark: str):
        self.mark = mark
        self._lock = threading.RLock()
        self._undo: dict[str, Callable[[], None]] = {}  # key -> puts the original back (insertion ordered)
        self._targets: dict[tuple, tuple[str, Any]] = {}  # (id(owner), attr/name) -> (key, replacement)

    def _claim(self, key: str, target: tuple, current: Any) -> str | None:
        """The key to record a patch of ``target`` under, or None when this ledger's patch is still in place
        (``current`` is its replacement). A patch someone else has replaced since is forgotten, and the
        target is patched again over what is there now (restore puts that back). A target under a key in use for another object (e.g. a re-imported
        module) gets a numbered key."""
        held = self._targets.get(target)
        if held is not None:
            if held[1] is current:
                return None
            self._targets.pop(target)
            self._undo.pop(held[0], None)
        n, unique = 1, key
        while unique in self._undo:
            n += 1
            unique = f"{key}#{n}"
        return unique

    def _record(self, key: str, target: tuple, new: Any, undo: Callable[[], None]) -> None:
        self._targets[target] = (key, new)

        def _undo():
            self._targets.pop(target, None)
            undo()

        self._undo[key] = _undo

    def set_attr(self, key: str, owner: Any, attr: str, new: Any) -> bool:
        """``owner.attr = new`` unless ``owner.attr`` is already patched or the current value carries the
        mark; returns whether it patched."""
        with self._lock:
            own = owner.__dict__.get(attr, _MISSING) if isinstance(owner, type) else getattr(owner, attr, _MISSING)
            # the resolved value (inherited included): a patched base class is not wrapped again in a subclass
            key = self._claim(key, (id(owner), attr), own)
            if key is None or getattr(getattr(owner, attr, None), self.mark, False):
                return False
            self._mark(new)
            setattr(owner, attr, new)
            self._record(key, (id(owner), attr), new,
                         (lambda: delattr(owner, attr)) if own is _MISSING else (lambda: setattr(owner, attr, own)))
            return True

    def around(self, owner: Any, attr: str, key: str | None = None) -> Callable[[Callable], Callable]:
        """Decorator: ``owner.attr`` (a class's or module's own attribute) becomes a wrapper calling
        ``fn(original, *args, **kwargs)`` (awaited for a coroutine function), with the original's name, doc and
        ``__wrapped__``; ledger key ``"<Owner>.<attr>"`` unless ``key`` is given. Returns ``fn``."""

        def decorate(fn: Callable) -> Callable:
            original = owner.__dict__[attr]
            if inspect.iscoroutinefunction(original):
                async def wrapper(*args, **kwargs):
                    return await fn(original, *args, **kwargs)
            else:
                def wrapper(*args, **kwargs):
                    return fn(original, *args, **kwargs)
            self.set_attr(key or f"{owner.__name__}.{attr}", owner, attr, functools.wraps(original)(wrapper))
            return fn

        return decorate

    def set_item(self, key: str, mapping: MutableMapping, name: Any, new: Any) -> bool:
        """``mapping[name] = new`` (e.g. a framework registry entry), with the same rules as :meth:`set_attr`;
        restore removes an entry that was not there before."""
        with self._lock:
            old = mapping.get(name, _MISSING)
            key = self._claim(key, (id(mapping), name), old)
            if key is None or getattr(old, self.mark, False):
                return False
            self._mark(new)
            mapping[name] = new
            self._record(key, (id(mapping), name), new, (lambda: mapping.pop(name, None)) if old is _MISSING else (
                lambda: mapping.__setitem__(name, old)))
            return True

    def rebind(self, key: str, module: Any, attr: str, new: Any, callers: Iterable[str] = ()) -> bool:
        """``module.attr = new``, and the same name in each already-imported module of ``callers`` that bound
        the original with ``from module import attr`` (a caller imported later binds ``new`` by itself)."""
        callers = tuple(callers)
        with self._lock:
            original = getattr(module, attr)
            if not self.set_attr(key, module, attr, new):
                return False

            def point_callers(old: Any, to: Any) -> None:
                for name in callers:
                    caller = sys.modules.get(name)
                    if caller is not None and caller.__dict__.get(attr) is old:
                        setattr(caller, attr, to)

            point_callers(original, new)
            # on restore, also the callers imported after the patch (they bound ``new``)
            target = (id(module), attr, "callers")
            self._record(self._claim(f"{key}@callers", target, _MISSING), target, None,
                         lambda: point_callers(new, original))
            return True

    def on_import(self, key: str, patchers: Mapping[str, Callable[[Any], object]]) -> bool:
        """Run each ``patchers[module_name](module)`` now if the module is imported, else right after its
        import (a post-import hook; it imports nothing itself). Restore disarms the hook; the patchers record
        their own changes in this ledger. Returns False when ``key`` is armed already."""
        with self._lock:
            if key in self._undo:
                return False
            self._undo[key] = lambda: post_import.remove(key)
            post_import.patch_now_or_on_import(key, patchers)
            return True

    def wrap_function(self, key: str, module_name: str, attr: str, wrap: Callable[[Any], Any],
                      callers: Iterable[str] = (), missing: Callable[[Any], None] | None = None) -> str:
        """Replace function ``attr`` of module ``module_name`` by ``wrap(original)`` (and the callers' bound
        names, see :meth:`rebind`), now or right after the module is imported. Returns ``"patched"``,
        ``"deferred"`` (on import) or ``"failed"`` (the module has no ``attr``; ``missing(module)`` is called)."""
        callers = tuple(callers)

        def patch(module) -> None:
            fn = getattr(module, attr, None)
            if fn is None:
                if missing is not None:
                    missing(module)
                return
            self.rebind(key, module, attr, wrap(fn), callers)

        self.on_import(key + ":on_import", {module_name: patch})
        return self.function_status(key, module_name, attr)

    def function_status(self, key: str, module_name: str, attr: str) -> str:
        """``"patched"``, ``"deferred"`` (armed, module not imported yet), ``"failed"`` or ``"off"``."""
        module = sys.modules.get(module_name)
        if module is None:
            return "deferred" if key + ":on_import" in self else "off"
        if getattr(getattr(module, attr, None), self.mark, False):
            return "patched"
        return "failed" if key + ":on_import" in self else "off"

    def _mark(self, new: Any) -> None:
        try:
            setattr(new, self.mark, True)
        except (AttributeError, TypeError):  # e.g. a bound method: marked by its key only
            pass

    def restore(self, *prefixes: str) -> None:
        """Put every original back, the newest patch first; with ``prefixes``, only the patches whose key
        starts with one of them."""
        with self._lock:
            for key in reversed(list(self._undo)):
                if not prefixes or key.startswith(prefixes):
                    self._undo.pop(key)()

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._undo)

    def __contains__(self, key: str) -> bool:
        return key in self._undo
