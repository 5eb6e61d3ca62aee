"""Run a framework's command-line script with stablerl's names, for frameworks whose entry point is the
``if __name__ == "__main__":`` block of a script (OpenRLHF's ``openrlhf.cli.train_ppo_ray``: its parser, config
and ``ray.init`` live there, with nothing to call or subclass).

The script runs as ``__main__`` (``runpy``) and its own ``import`` statements see *views* of some modules, each
with a few names replaced, through an ``__import__`` in that namespace's builtins only: the real modules
(argparse, the framework's, Ray) are never patched. Also the argparse pieces such a wrapper needs: a name flag's
``choices`` extended with the stablerl algorithms the framework can feed, its help text, whether a flag was given.
"""

from __future__ import annotations

import builtins
import os
import runpy
import sys
import types
from typing import Any, Callable, Mapping, Optional, Sequence

from .frameworks import FrameworkSpec, selectable_names


class ModuleView(types.ModuleType):
    """What the script sees under ``import <module>``: the real module (read at each access, so it stays live)
    with the names in ``replaced`` replaced."""

    def __init__(self, module: types.ModuleType, **replaced: Any):
        super().__init__(module.__name__, module.__doc__)
        self.__dict__.update(replaced, _stablerl_module=module)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_stablerl_module"], name)


def argparse_view(module: types.ModuleType, extend: Callable[..., Optional[Any]]) -> ModuleView:
    """argparse with an ``ArgumentParser`` whose ``add_argument`` first asks ``extend(parser, add_argument, args,
    kwargs)``: its action when it added the flag itself (e.g. with more choices, and flags of its own after it),
    None to add the flag unchanged."""

    class ArgumentParser(module.ArgumentParser):
        def add_argument(self, *args, **kwargs):
            action = extend(self, super().add_argument, args, kwargs)
            return super().add_argument(*args, **kwargs) if action is None else action

    return ModuleView(module, ArgumentParser=ArgumentParser)


def run_script(module_name: str, views: Mapping[str, Callable[[types.ModuleType], types.ModuleType]],
               argv: Optional[Sequence[str]] = None, restore_env: Sequence[str] = ()) -> None:
    """Run ``module_name`` as ``__main__`` whose ``import <name>`` of each name in ``views`` returns
    ``views[name](real module)``. ``argv``: the script's arguments (default: this process's); ``sys.argv`` and the
    environment variables ``restore_env`` are as before afterwards."""
    real_import = builtins.__import__

    def __import__(name, globals=None, locals=None, fromlist=(), level=0):
        module = real_import(name, globals, locals, fromlist, level)
        if level == 0 and name in views and (fromlist or "." not in name):
            return views[name](module)
        return module

    saved_argv, saved_env = list(sys.argv), {key: os.environ.get(key) for key in restore_env}
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        runpy.run_module(module_name, run_name="__main__", alter_sys=True,
                         init_globals={"__builtins__": {**vars(builtins), "__import__": __import__}})
    finally:
        sys.argv = saved_argv
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class NameChoices(list):
    """argparse ``choices`` of a framework's algorithm-name flag: lists (and iterates) the framework's own names,
    then every stablerl algorithm of ``kind`` it can feed; also accepts ``<prefix><name>`` for each of those."""

    def __init__(self, framework: FrameworkSpec, kind: str):
        super().__init__(selectable_names(framework, kind))
        own, prefix = framework.builtin_names.get(kind, ()), framework.prefix
        self._prefixed = frozenset(prefix + (n[len(prefix):] if n.startswith(prefix) else n) for n in self
                                   if n not in own)

    def __contains__(self, item) -> bool:
        return list.__contains__(self, item) or item in self._prefixed


def name_flag_help(framework: FrameworkSpec, kind: str, original_help: Optional[str], label: str) -> str:
    """The help of a name flag: the framework's text, then its own names (under ``label``) and stablerl's."""
    own = list(framework.builtin_names.get(kind, ()))
    names = [n for n in selectable_names(framework, kind) if n not in own]
    text = (original_help or "").replace("%", "%%").rstrip()
    if text and not text.endswith("."):
        text += "."
    text += (" " if text else "") + f"{label}: {', '.join(own)}. stablerl: {', '.join(names)}"
    return text + (f" (every stablerl name also as {framework.prefix}<name>; `stablerl describe <name>` shows its "
                   "parameters).")


def flag_given(argv: Sequence[str], flag: str) -> bool:
    """Whether ``flag`` is on the command line ``argv`` (``--flag value`` or ``--flag=value``)."""
    return any(a == flag or a.startswith(flag + "=") for a in argv)


__all__ = ["ModuleView", "argparse_view", "run_script", "NameChoices", "name_flag_help", "flag_given"]
