"""The stablerl keys of SkyRL's algorithm config, and the settings a selection runs with (framework-free: SkyRL's
``AlgorithmConfig`` is subclassed only in :func:`config_class`, SkyRL's own ``make_config`` way to extend its strict
config). ``trainer.algorithm`` also has: ``stablerl_params`` / ``stablerl_advantage_params`` (dicts: the stablerl
loss's / estimator's hyper-parameters and call options, ``trainer.algorithm.stablerl_params.clip_ratio_high=0.28``);
``stablerl_reward_shaper`` / ``stablerl_batch_filter`` with ``..._params``; ``stablerl_routing_replay`` (R2 / R3,
``_routing``); ``stablerl_reduction`` / ``stablerl_mini_batch_rows`` (set by the entry point, not by users: SkyRL's
advantage pre-scaling is taken over, ``_trainer``; the rows of one policy mini-batch).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from stablerl.contracts import ADVANTAGE_ESTIMATOR, BATCH_FILTER, POLICY_LOSS, REWARD_SHAPER
from stablerl.params import StableRLError
from stablerl.selection import as_params as params_of, name_or_none

from ._names import (ADV_PARAMS, ALGORITHM, FILTER, FILTER_PARAMS, LOSS_PARAMS, NAME, REDUCTIONS, REFUSED_REDUCTIONS,
                     SHAPER, SHAPER_PARAMS, SKYRL_ADV_ESTIMATORS, SKYRL_POLICY_LOSSES, stablerl_name)

#: the stablerl fields of the algorithm config: name -> (type, default factory)
STABLERL_FIELDS = {
    LOSS_PARAMS: (Dict[str, Any], dict), ADV_PARAMS: (Dict[str, Any], dict), SHAPER: (Optional[str], lambda: None),
    SHAPER_PARAMS: (Dict[str, Any], dict), FILTER: (Optional[str], lambda: None), FILTER_PARAMS: (Dict[str, Any], dict),
    "stablerl_reduction": (bool, lambda: False), "stablerl_mini_batch_rows": (Optional[int], lambda: None),
    "stablerl_routing_replay": (Optional[str], lambda: None)}
_CLASSES: dict = {}


def config_class():
    """SkyRL's ``SkyRLTrainConfig`` whose ``trainer.algorithm`` is SkyRL's ``AlgorithmConfig`` plus
    :data:`STABLERL_FIELDS` (built once)."""
    if "config" not in _CLASSES:
        from dataclasses import field, make_dataclass

        from skyrl.train.config import AlgorithmConfig, make_config

        algorithm = make_dataclass("StableAlgorithmConfig", [(name, kind, field(default_factory=default)) for name, (
            kind, default) in STABLERL_FIELDS.items()], bases=(AlgorithmConfig,), namespace={"__module__": __name__})
        _CLASSES["algorithm"], _CLASSES["config"] = algorithm, make_config(algorithm_cls=algorithm)
    return _CLASSES["config"]


def __getattr__(name: str):  # pickled configs name the class by this module (Ray ships them to workers)
    if name == "StableAlgorithmConfig":
        config_class()
        from stablerl.adapter import get_adapter

        get_adapter(NAME).arm_worker()  # a worker unpickling the config: routing replay and the loss state armed
        return _CLASSES["algorithm"]
    raise AttributeError(name)


def strip_plus(argv: list[str]) -> list[str]:
    """Hydra's ``+key=value`` for a stablerl key, as SkyRL's parser (which refuses ``+``) takes it."""
    return [a[1:] if a.startswith("+" + ALGORITHM + "stablerl_") else a for a in argv]


def _get(algorithm: Any, key: str, default: Any = None) -> Any:
    return getattr(algorithm, key, default) if not isinstance(algorithm, dict) else algorithm.get(key, default)


def selected(algorithm: Any, kind: str) -> Optional[str]:
    """The stablerl algorithm ``trainer.algorithm`` selects for ``kind`` (None: SkyRL's own, or none)."""
    if kind == POLICY_LOSS:
        return stablerl_name(str(_get(algorithm, "policy_loss_type")), SKYRL_POLICY_LOSSES)
    if kind == ADVANTAGE_ESTIMATOR:
        return stablerl_name(str(_get(algorithm, "advantage_estimator")), SKYRL_ADV_ESTIMATORS)
    key = SHAPER if kind == "reward_shaper" else FILTER
    return name_or_none(_get(algorithm, key))


def selection(algorithm: Any):
    """core's :class:`~stablerl.algorithm_selection.AlgorithmSelection` of the stablerl algorithms ``trainer.algorithm``
    selects (a name stablerl does not know: a SkyRL or user registration, left out)."""
    from stablerl import get_registry
    from stablerl.algorithm_selection import FIELDS, AlgorithmSelection

    names = {kind: selected(algorithm, kind) for kind in (POLICY_LOSS, ADVANTAGE_ESTIMATOR, REWARD_SHAPER, BATCH_FILTER)}
    return AlgorithmSelection(**{FIELDS[k][0]: n for k, n in names.items() if n in get_registry().names(k)})


def params(algorithm: Any, kind: str) -> dict:
    key = {POLICY_LOSS: LOSS_PARAMS, ADVANTAGE_ESTIMATOR: ADV_PARAMS, "reward_shaper": SHAPER_PARAMS,
           "batch_filter": FILTER_PARAMS}[kind]
    return params_of(_get(algorithm, key), ALGORITHM + key)


def framework_values(algorithm: Any, kind: str) -> dict:
    """stablerl hyper-parameter -> the value of SkyRL's own key for it (``FrameworkSpec.hyperparameter_keys``)."""
    if kind == POLICY_LOSS:
        sapo = _get(algorithm, "sapo")
        return {"clip_ratio_low": _get(algorithm, "eps_clip_low"), "clip_ratio_high": _get(algorithm, "eps_clip_high"),
                "clip_ratio_c": _get(algorithm, "clip_ratio_c"), "tau_pos": _get(sapo, "tau_pos"),
                "tau_neg": _get(sapo, "tau_neg")}
    return {"norm_adv_by_std_in_grpo": _get(algorithm, "grpo_norm_by_std")}


def settings(algorithm: Any, kind: str):
    """The effective hyper-parameters of the selected stablerl algorithm of ``kind`` (core's one precedence rule,
    :func:`stablerl.frameworks.effective_hyperparameters`), after refusing SkyRL knobs it would ignore."""
    from stablerl import get_spec
    from stablerl.frameworks import check_framework_keys_used, effective_hyperparameters

    spec = get_spec(kind, selected(algorithm, kind))
    values = framework_values(algorithm, kind)
    check_framework_keys_used(NAME, spec, values)
    return spec, effective_hyperparameters(NAME, spec, params(algorithm, kind), values)


def loss_agg_mode(algorithm: Any, options: dict) -> str:
    """stablerl's aggregation for SkyRL's ``trainer.algorithm.loss_reduction`` (same numbers), or the refusal."""
    reduction = str(_get(algorithm, "loss_reduction"))
    if reduction in REFUSED_REDUCTIONS:
        raise StableRLError(f"{NAME}: {ALGORITHM}loss_reduction={reduction} with a stablerl policy loss is refused: "
                            f"{REFUSED_REDUCTIONS[reduction]}")
    if reduction not in REDUCTIONS:
        raise StableRLError(f"{NAME}: unknown {ALGORITHM}loss_reduction={reduction!r}; one of {sorted(REDUCTIONS)}")
    if options.get("loss_agg_mode") not in (None, REDUCTIONS[reduction]) and options["loss_agg_mode"] in REDUCTIONS.values():
        raise StableRLError(f"{ALGORITHM}{LOSS_PARAMS}.loss_agg_mode={options['loss_agg_mode']} contradicts "
                            f"{ALGORITHM}loss_reduction={reduction}: set SkyRL's loss_reduction instead")
    return REDUCTIONS[reduction]
