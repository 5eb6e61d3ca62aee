"""Patch a framework module right after it is first imported, without importing it ourselves.

Adapters run in every framework process (verl's entry point, Ray's worker setup hook) and must stay
light, yet some framework functions are bound by name by their callers at import time; patching
them after the fact would miss those callers. A ``sys.meta_path`` finder that imports nothing
wraps the real loader of the target module and calls the patch right after the module is executed,
before anyone can import a name from it.

Finders are identified by a ``tag`` so that installing twice (also from a second copy of the
adapter, imported under another name) is a no-op, and removal removes every copy.
"""

from __future__ import annotations

import importlib.abc
import sys
from types import ModuleType
from typing import Callable, Mapping

Patcher = Callable[[ModuleType], object]


class _PatchingLoader(importlib.abc.Loader):
    """Delegates to the real loader, then patches the freshly executed module."""

    def __init__(self, loader, patcher: Patcher, after: Callable[[], None]):
        self._loader, self._patcher, self._after = loader, patcher, after

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._after()
        self._patcher(module)

    def __getattr__(self, attr):  # get_source, get_filename, is_package... (linecache, inspect)
        return getattr(self._loader, attr)


class PostImportHook(importlib.abc.MetaPathFinder):
    """Calls ``patchers[name](module)`` right after module ``name`` is executed.

    With ``once=True`` the hook removes itself (every finder with its tag) after the first patch.
    """

    def __init__(self, tag: str, patchers: Mapping[str, Patcher], once: bool = True):
        self.stablerl_hook_tag = tag
        self.patchers = dict(patchers)
        self.once = once
        self._busy: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        patcher = self.patchers.get(fullname)
        if patcher is None or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                if getattr(finder, "stablerl_hook_tag", None) == self.stablerl_hook_tag:
                    continue
                find = getattr(finder, "find_spec", None)
                spec = find(fullname, path, target) if find is not None else None
                if spec is not None:
                    break
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        after = (lambda: remove(self.stablerl_hook_tag)) if self.once else (lambda: None)
        spec.loader = _PatchingLoader(spec.loader, patcher, after)
        return spec


def install(tag: str, patchers: Mapping[str, Patcher], once: bool = True) -> None:
    """Arm a hook for ``patchers`` unless one with ``tag`` is already armed."""
    if not installed(tag):
        sys.meta_path.insert(0, PostImportHook(tag, patchers, once=once))


def installed(tag: str) -> bool:
    return any(getattr(f, "stablerl_hook_tag", None) == tag for f in sys.meta_path)


def remove(tag: str) -> None:
    """Disarm every hook with ``tag``."""
    sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "stablerl_hook_tag", None) != tag]


def patch_now_or_on_import(tag: str, patchers: Mapping[str, Patcher]) -> None:
    """Patch each module of ``patchers`` now if it is imported already, else right after its import (one
    hook with ``tag``, kept armed so that a re-import is patched too; a patcher must be idempotent)."""
    pending = {}
    for name, patcher in patchers.items():
        module = sys.modules.get(name)
        if module is not None:
            patcher(module)
        else:
            pending[name] = patcher
    if pending:
        install(tag, pending, once=False)
