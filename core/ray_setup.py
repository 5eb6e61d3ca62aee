"""Getting stablerl into every Ray worker of a framework that starts Ray itself (OpenRLHF): Ray's job-level
``worker_process_setup_hook`` in the ``runtime_env``, which a ``RAY_RUNTIME_ENV_HOOK`` or a wrapper CLI adds,
keeping what the user had there. Framework-free (Ray is not imported)."""

from __future__ import annotations

import importlib
import os
from typing import Optional, Sequence


def load_callable(path: str):
    """The callable a ``"module.function"`` string names (Ray's form for hooks)."""
    module, _, attr = path.rpartition(".")
    if not module:
        raise ValueError(f"expected 'module.function', got {path!r}")
    return getattr(importlib.import_module(module), attr)


def with_setup_hook(runtime_env: Optional[dict], hook: str, *, ours: Sequence[str] = (), chained_env: str,
                    previous_env: str = "", forward: Sequence[str] = ()) -> dict:
    """``runtime_env`` with ``worker_process_setup_hook = hook``: a previous ``RAY_RUNTIME_ENV_HOOK`` (named in
    ``$previous_env``) is applied first; a user's own setup hook (a ``"module.function"`` string, not one of
    ``ours``) is kept in ``env_vars[chained_env]`` for ``hook`` to run; the variables ``forward`` set in this
    process reach every worker (``env_vars``, unless set there already)."""
    previous = os.environ.get(previous_env) if previous_env else None
    if previous and previous not in ours:
        runtime_env = load_callable(previous)(runtime_env)
    env = dict(runtime_env or {})
    existing = env.get("worker_process_setup_hook")
    env_vars = dict(env.get("env_vars") or {})
    if existing and existing != hook and existing not in ours:
        if not isinstance(existing, str):
            raise ValueError("runtime_env already has a callable worker_process_setup_hook; give it as a "
                             "'module.function' string so stablerl can chain it")
        env_vars[chained_env] = existing
    env["worker_process_setup_hook"] = hook
    for key in forward:
        if key in os.environ and key not in env_vars:
            env_vars[key] = os.environ[key]
    if env_vars:
        env["env_vars"] = env_vars
    return env


__all__ = ["load_callable", "with_setup_hook"]
