"""Reading a stablerl selection out of a framework's config: a name key and its params key.

Every adapter lets a user name a stablerl algorithm under some config key (verl's ``+algorithm.stablerl_batch_filter``,
a stablerl policy-loss config's ``stablerl_trainer_hook``) with its hyper-parameters under a second key. The config
object is the framework's (an OmegaConf ``DictConfig``, a dataclass, a dict); these helpers read it the same way
everywhere: an empty or ``"none"``/``"null"`` name is no selection, params without a name are refused, params are a
plain dict, and an unknown name or hyper-parameter raises naming the valid ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional

from .params import StableRLError, UnknownNameError, build_params, unknown_name_message


def config_get(obj: Any, key: str, default: Any = None) -> Any:
    """``obj.key`` for a dataclass config, an OmegaConf ``DictConfig`` or a plain mapping (``default`` when absent)."""
    if obj is None:
        return default
    getter = getattr(obj, "get", None)
    if callable(getter):
        try:
            return getter(key, default)
        except Exception:  # noqa: BLE001 - e.g. a struct DictConfig without the key
            pass
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


def name_or_none(value: Any) -> Optional[str]:
    """A selection's name, or None for no selection (None, ``""``, ``"none"``, ``"null"``)."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    return str(value)


def truthy(value: Any) -> bool:
    """A config switch given as a bool or as a string (``"true"``, ``"1"``, ``"yes"``, ``"on"``)."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def as_params(value: Any, key: str) -> dict[str, Any]:
    """A params key's value as a plain dict (an OmegaConf container resolved); anything but a mapping raises."""
    if value is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(value, DictConfig):
            value = OmegaConf.to_container(value, resolve=True)
    except ImportError:  # no omegaconf: the config is not Hydra's
        pass
    if not isinstance(value, Mapping):
        raise StableRLError(f"{key} must be a mapping (e.g. {key}.scale=0.1), got {value!r}")
    return {str(k): v for k, v in dict(value).items()}


def read_selection(config: Any, key: str, params_key: str, *, prefix: str = "",
                   check: Optional[Callable[[str, dict], Any]] = None) -> tuple[Optional[str], dict]:
    """``(name or None, params)`` under ``config.<key>`` / ``config.<params_key>``; ``prefix`` spells the keys in
    errors (``"algorithm."``). Params without a name are refused; ``check(name, params)`` validates a selection
    (e.g. :func:`check_known`)."""
    name = name_or_none(config_get(config, key))
    params = as_params(config_get(config, params_key), prefix + params_key)
    if name is None:
        if params:
            raise StableRLError(f"{prefix}{params_key} is set but {prefix}{key} is not")
        return None, {}
    if check is not None:
        check(name, params)
    return name, params


def check_known(kind: str, key: str, name: str, params: dict) -> None:
    """An unknown name raises naming the registered ones (and the nearest); an unavailable one says why; a bad
    hyper-parameter names itself."""
    from .api import get_registry, get_spec

    names = get_registry().names(kind)
    if name not in names:
        raise UnknownNameError(unknown_name_message(key, name, names))
    build_params(get_spec(kind, name), params)


__all__ = ["config_get", "name_or_none", "truthy", "as_params", "read_selection", "check_known"]
