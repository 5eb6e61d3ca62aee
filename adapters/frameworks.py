"""The built-in framework declarations (verl, TRL, OpenRLHF): stablerl's ``register_frameworks`` plugin.

Framework-free: importing this module imports no framework. Core reaches these declarations only
through the plugin manager (entry-point group ``stablerl.builtin``), the way a third party would
declare a fourth framework. Each adapter reads its own declaration back with
``stablerl.frameworks.get_framework(NAME)``, so a fact about a framework is written once.
"""

from __future__ import annotations

from stablerl.contracts import ADVANTAGE_ESTIMATOR, BATCH_FILTER, POLICY_LOSS, REWARD_SHAPER
from stablerl.frameworks import FrameworkSpec
from stablerl.hookspecs import hookimpl

from .config_keys import (
    FEEDABLE_INPUTS,
    OPENRLHF_BUILTIN_ADV_ESTIMATORS,
    OPENRLHF_BUILTIN_POLICY_LOSSES,
    TRL_BUILTIN_LOSS_TYPES,
    VERL_BUILTIN_ADV_ESTIMATORS,
    VERL_BUILTIN_POLICY_LOSSES,
)

VERL = FrameworkSpec(
    name="verl",
    distribution="verl",
    supported=">=0.9.1,<0.10",
    adapter="stablerl.adapters.verl",
    builtin_names={POLICY_LOSS: VERL_BUILTIN_POLICY_LOSSES, ADVANTAGE_ESTIMATOR: VERL_BUILTIN_ADV_ESTIMATORS},
    feedable=FEEDABLE_INPUTS["verl"],
    selection_keys={
        POLICY_LOSS: "actor_rollout_ref.actor.policy_loss.loss_mode",
        ADVANTAGE_ESTIMATOR: "algorithm.adv_estimator",
        REWARD_SHAPER: "+algorithm.stablerl_reward_shaper",
        BATCH_FILTER: "+algorithm.stablerl_batch_filter",
    },
)

TRL = FrameworkSpec(
    name="trl",
    distribution="trl",
    supported=">=1.16,<1.17",
    adapter="stablerl.adapters.trl",
    builtin_names={POLICY_LOSS: TRL_BUILTIN_LOSS_TYPES},
    feedable=FEEDABLE_INPUTS["trl"],
    selection_keys={
        POLICY_LOSS: "loss_type",
        ADVANTAGE_ESTIMATOR: "advantage_estimator",
        REWARD_SHAPER: "reward_shaper",
        BATCH_FILTER: "batch_filter",
    },
)

OPENRLHF = FrameworkSpec(
    name="openrlhf",
    distribution="openrlhf",
    supported=">=0.11.2,<0.11.3",
    adapter="stablerl.adapters.openrlhf",
    builtin_names={
        POLICY_LOSS: frozenset(OPENRLHF_BUILTIN_POLICY_LOSSES),
        ADVANTAGE_ESTIMATOR: frozenset(OPENRLHF_BUILTIN_ADV_ESTIMATORS),
    },
    feedable=FEEDABLE_INPUTS["openrlhf"],
    selection_keys={
        POLICY_LOSS: "--actor.policy_loss_type",
        ADVANTAGE_ESTIMATOR: "--algo.advantage.estimator",
        REWARD_SHAPER: "--algo.advantage.stablerl_reward_shaper",
        BATCH_FILTER: "--algo.advantage.stablerl_batch_filter",
    },
)


@hookimpl
def register_frameworks(register):
    for framework in (VERL, TRL, OPENRLHF):
        register(framework)
