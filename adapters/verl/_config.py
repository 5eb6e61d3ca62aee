"""``StablePolicyLossConfig``: verl's ``PolicyLossConfig`` plus one field per stablerl hyper-parameter.

verl builds ``actor.policy_loss`` from its ``_target_`` and rejects unknown keys, even with ``+``.
Selecting this subclass as the target makes every stablerl policy-loss hyper-parameter a valid key::

    actor_rollout_ref.actor.policy_loss._target_=stablerl.adapters.verl.StablePolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=m2po
    +actor_rollout_ref.actor.policy_loss.m2_threshold=0.05

Every added field defaults to ``None`` (= the algorithm's default). The class is generated from
the stablerl registry, so third-party stablerl plugins get their keys automatically.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Optional

_SIMPLE = (int, float, bool, str)


def _field_type(annotation: Any) -> Any:
    """``Optional[T]`` for a simple (optionally Optional) scalar type, else ``Optional[Any]``."""
    if annotation in _SIMPLE:
        return annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Union and len(args) == 1 and args[0] in _SIMPLE:
        return args[0]
    return Any


def hyperparameter_fields(specs, reserved: set[str]) -> tuple[list[tuple[str, Any, Any]], dict[str, list[str]]]:
    """``(fields, owners)``: one ``(name, Optional[type], field(default=None))`` per hyper-parameter
    name of ``specs`` not in ``reserved``; ``owners`` maps each name to the algorithms that use it."""
    types: dict[str, Any] = {}
    owners: dict[str, list[str]] = {}
    for spec in specs:
        try:
            hints = typing.get_type_hints(spec.params)
        except Exception:  # noqa: BLE001 - unresolvable annotation: accept any value
            hints = {}
        for f in dataclasses.fields(spec.params):
            if f.name in reserved or f.name.startswith("_"):
                continue
            t = _field_type(hints.get(f.name, Any))
            if f.name in types and types[f.name] != t:
                t = Any  # two algorithms disagree on the type of a same-named parameter
            types[f.name] = t
            owners.setdefault(f.name, []).append(spec.name)
    fields = [(n, Optional[t], dataclasses.field(default=None)) for n, t in sorted(types.items())]
    if "stablerl_params" not in reserved:
        # stablerl keys for any hyper-parameter, including names verl's PolicyLossConfig already has
        # (kl_cov_ratio, ...) whose verl field is verl's key: +...policy_loss.stablerl_params={kl_cov_ratio:0.002}
        fields.append(("stablerl_params", Optional[dict], dataclasses.field(default=None)))
        owners["stablerl_params"] = [spec.name for spec in specs]
    # a trainer hook (stablerl_trainer_hook=sfpo): read by the adapter's update_actor wrapper in the workers
    for name, typ in (("stablerl_trainer_hook", Optional[str]), ("stablerl_trainer_hook_params", Optional[dict])):
        if name not in reserved:
            fields.append((name, typ, dataclasses.field(default=None)))
            owners[name] = ["(trainer hook)"]
    # an entropy controller (stablerl_entropy_controller=adaptive_entropy): stepped by the same wrapper
    for name, typ in (("stablerl_entropy_controller", Optional[str]), ("stablerl_entropy_controller_params", Optional[dict])):
        if name not in reserved:
            fields.append((name, typ, dataclasses.field(default=None)))
            owners[name] = ["(entropy controller)"]
    return fields, owners


def build_policy_loss_config(base: type, specs, module: str, check=None) -> tuple[type, dict[str, list[str]]]:
    """Subclass ``base`` (verl's ``PolicyLossConfig``) with the hyper-parameters of ``specs``.

    ``check(config)``, if given, runs after construction (where verl builds the actor config:
    driver and workers), so a bad value fails before the first rollout, not after it.

    Names verl's config already has (``loss_mode``, ``kl_cov_ratio``, ...) are left to verl's field.
    The actor-level names (``clip_ratio_low/high/c``, ``tau_pos/neg``) are fields here too: set
    under ``policy_loss`` they are stablerl keys, which take precedence over the actor's keys
    (stablerl.frameworks.PRECEDENCE).
    """
    reserved = {f.name for f in dataclasses.fields(base)}
    fields, owners = hyperparameter_fields(specs, reserved)

    def __post_init__(self) -> None:
        parent = getattr(super(cls, self), "__post_init__", None)
        if parent is not None:
            parent()
        if check is not None:
            check(self)

    cls = dataclasses.make_dataclass(
        "StablePolicyLossConfig",
        fields,
        bases=(base,),
        namespace={
            "__post_init__": __post_init__,
            "__doc__": (
                "verl PolicyLossConfig with one optional field per stablerl policy-loss hyper-parameter "
                "(None = the algorithm's default). Fields: "
                + ", ".join(f"{n} ({'/'.join(owners[n])})" for n, _, _ in fields)
            ),
        },
    )
    # pickling (Ray) and Hydra's _locate find the class by its import path
    cls.__module__ = module
    cls.__qualname__ = "StablePolicyLossConfig"
    return cls, owners
