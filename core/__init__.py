"""stablerl: 2025-generation LLM-RL algorithms as plugins for verl, TRL and OpenRLHF.

Framework-free API::

    import stablerl
    loss, metrics = stablerl.compute_policy_loss("m2po", log_prob=..., old_log_prob=...,
                                                 advantages=..., response_mask=...)
    adv, ret = stablerl.compute_advantage("qae", token_level_rewards=..., response_mask=..., index=uids)
    stablerl.list_algorithms("policy_loss")
"""

from .api import (
    compute_advantage,
    compute_policy_loss,
    filter_batch,
    get_spec,
    list_algorithms,
    make_controller,
    make_trainer_hook,
    shape_rewards,
)
from .context import Context, torch_distributed_context
from .contracts import (
    ADVANTAGE_ESTIMATOR,
    AGGREGATION,
    BATCH_FILTER,
    CONTROLLER,
    EXPERIMENTAL,
    POLICY_LOSS,
    REWARD_SHAPER,
    ROUTER_FAMILY,
    STABLE,
    UNAVAILABLE,
    ROLLOUT_CORRECTION,
    TRAINER_HOOK,
    AdvantageBatch,
    AlgorithmSpec,
    Controller,
    FilterBatch,
    FilterResult,
    RewardBatch,
    NoParams,
    Params,
    PolicyLossBatch,
    ParamsView,
    PromptStats,
    TrainerHook,
)
from .hookspecs import hookimpl
from .params import MissingInputError, StableRLError, UnknownNameError
from .registry import get_registry, reload_registry

__version__ = "0.1.0"

__all__ = [
    "compute_policy_loss", "compute_advantage", "shape_rewards", "filter_batch", "make_controller",
    "list_algorithms", "get_spec", "Context", "Controller", "RewardBatch", "FilterBatch", "FilterResult",
    "ROLLOUT_CORRECTION", "TRAINER_HOOK", "TrainerHook", "ParamsView", "PromptStats", "make_trainer_hook",
    "torch_distributed_context", "AlgorithmSpec", "Params", "NoParams", "PolicyLossBatch", "AdvantageBatch",
    "hookimpl", "StableRLError", "UnknownNameError", "MissingInputError", "get_registry", "reload_registry",
    "POLICY_LOSS", "ADVANTAGE_ESTIMATOR", "AGGREGATION", "REWARD_SHAPER", "BATCH_FILTER", "CONTROLLER",
    "ROUTER_FAMILY", "STABLE", "EXPERIMENTAL", "UNAVAILABLE", "__version__",
]
