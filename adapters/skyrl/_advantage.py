"""The advantage-estimator function registered in SkyRL's ``AdvantageEstimatorRegistry`` for a stablerl estimator
(runs where SkyRL's trainer runs: ``ppo_utils.compute_advantages_and_returns`` calls it with SkyRL's keywords).

It runs core's :class:`~stablerl.steps.AdvantageStep` estimator on one :class:`~stablerl.steps.BatchRecord`: SkyRL's
per-token ``token_level_rewards`` (verl's layout), ``response_mask`` and ``index`` (the ``uids``). Under the entry
point's trainer the record's ``host`` is the whole ``TrainingInputBatch`` (old and rollout log-probs for estimators
that declare them) and the trainer runs the reward shaper and batch filter around it; called by SkyRL's own trainer,
the inputs are those of SkyRL's call.
"""

from __future__ import annotations

from typing import Any

import torch

import stablerl
from stablerl.adapter import get_adapter
from stablerl.frameworks import log_effective_settings
from stablerl.frameworks import as_params as settings_params
from stablerl.steps import AdvantageSelection, AdvantageStep, BatchRecord

from ._config import settings
from ._names import NAME, Registered


class StableSkyRLEstimator(Registered):
    """SkyRL's ``(token_level_rewards, response_mask, index, **kwargs) -> (advantages, returns)`` for stablerl
    estimator :attr:`name`; pickled by reference."""

    label = "advantage estimator"

    def __call__(self, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any,
                 config: Any = None, **kwargs: Any):
        adapter = get_adapter(NAME)
        spec, effective = settings(config, stablerl.ADVANTAGE_ESTIMATOR)
        log_effective_settings(NAME, spec, effective)
        step = AdvantageStep(AdvantageSelection(estimator=self.name, estimator_params=settings_params(effective)),
                             ctx=adapter.context)
        host = adapter.pending  # the entry point's trainer: the whole batch, and it advances the state itself
        record = BatchRecord(adapter=adapter, response_mask=response_mask, index=list(index),
                             token_level_rewards=token_level_rewards, host=host)
        advantages, returns, metrics = step.estimate(record)
        adapter.last_metrics = dict(metrics)
        if host is None:
            adapter.driver_state.advance()
        returns = advantages if returns is None else returns
        return advantages.to(token_level_rewards.dtype), returns.to(token_level_rewards.dtype)


def runnable() -> list[str]:
    """The stablerl estimators SkyRL can run (selectable or partial in its declaration)."""
    from stablerl.frameworks import REFUSED, get_framework, reach

    framework = get_framework(NAME)
    return [spec.name for spec in stablerl.list_algorithms(stablerl.ADVANTAGE_ESTIMATOR)
            if reach(framework, spec)[0] != REFUSED]
