"""Getting stablerl into every Ray worker of a framework that starts Ray itself (OpenRLHF): Ray's job-level
``worker_process_setup_hook`` in the ``runtime_env``, which a ``RAY_RUNTIME_ENV_HOOK`` or a wrapper CLI adds,
keeping what the user had there. Framework-free (Ray is not imported)."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Optional, Sequence

#: Ray's zero-copy tensor serializer (a framework may turn it on): it drops attributes set on a tensor
ZERO_COPY_ENV = "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"


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


def without_zero_copy(runtime_env: dict, *, why: str, what: str, carrier: str, label: str) -> dict:
    """``runtime_env`` with :data:`ZERO_COPY_ENV` = 0 for the workers: ``what`` rides as an attribute on the
    ``carrier`` tensors (for ``why``), which Ray's zero-copy serializer drops. Turning off a value that was on is
    said on stderr (``label``: who says it)."""
    env_vars = runtime_env.setdefault("env_vars", {})
    if env_vars.get(ZERO_COPY_ENV, "0") != "0":
        print(f"{label}: {why} sets {ZERO_COPY_ENV}=0 for the Ray workers (was {env_vars[ZERO_COPY_ENV]!r}): Ray's "
              f"zero-copy tensor serializer drops the {what} carried on the {carrier}", file=sys.stderr, flush=True)
    env_vars[ZERO_COPY_ENV] = "0"
    return runtime_env


__all__ = ["ZERO_COPY_ENV", "load_callable", "with_setup_hook", "without_zero_copy"]
