"""The callables registered in SkyRL's registries: :class:`StableSkyRLLoss` in ``PolicyLossRegistry`` (runs in SkyRL's
policy workers, where ``PolicyWorkerBase._forward_backward_micro`` calls it with SkyRL's six arguments) and
:class:`StableSkyRLEstimator` in ``AdvantageEstimatorRegistry`` (where ``ppo_utils.compute_advantages_and_returns``
calls it: core's ``AdvantageStep`` estimator on SkyRL's ``token_level_rewards``, ``response_mask`` and ``uids``;
under the entry point's trainer the record's host is the whole ``TrainingInputBatch``, and that trainer runs the
reward shaper and batch filter around it).

SkyRL's trainer pre-scales the advantages per mini-batch and expects a masked *sum*
(``apply_loss_reduction_to_advantages_minibatch``); that is right only for a loss linear in the advantage that
aggregates per token. The entry point's trainer takes that step over (``_trainer``): the advantages stay unscaled
and the loss mask carries ``1 / D`` on valid tokens, ``D`` the mini-batch's valid tokens (``token_mean``) or
sequences (``sequence_mean``, ``seq_mean_token_sum_norm``), the same across the mini-batch. The loss reads ``D``
back and aggregates with stablerl's mode of the same numbers, ``Context(token_count=D)`` / ``seq_count=D`` (under a
token mean ``seq_count`` is the mini-batch's rows, ``stablerl_mini_batch_rows``, set at start-up): each
micro-batch returns its share of the mini-batch mean, which SkyRL's sum over micro-batches and DP ranks completes.
SkyRL's own masked means (entropy, KL) are invariant to a constant weight. Called by a trainer that did not take
the step over (``stablerl_reduction`` false), it refuses instead of returning wrong numbers.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import stablerl
from stablerl.adapter import get_adapter
from stablerl.frameworks import as_params as settings_params
from stablerl.frameworks import log_effective_settings, split_call_options
from stablerl.mask_weights import read_weights
from stablerl.params import StableRLError
from stablerl.steps import AdvantageSelection, AdvantageStep, BatchRecord

from ._config import loss_agg_mode, settings
from ._names import ALGORITHM, NAME, Registered

NOT_TAKEN_OVER = (
    "SkyRL's trainer pre-scales the advantages for a masked sum (apply_loss_reduction_to_advantages_minibatch), "
    "which gives other numbers than verl/TRL/OpenRLHF for a loss that is not linear in the advantage or aggregates "
    "itself; run `python -m stablerl.adapters.skyrl.main` (its trainer takes that step over), or "
    "trainer.override_entrypoint=stablerl.adapters.skyrl.main"
)

CALL_INPUTS = frozenset({"log_prob", "old_log_prob", "advantages", "response_mask", "rollout_log_prob"})


class StableSkyRLLoss(Registered):
    """SkyRL's ``(log_probs, old_log_probs, advantages, config, loss_mask, rollout_logprobs) -> (loss, metrics)`` for
    stablerl policy loss :attr:`name`; pickled by reference (Ray ships it to the workers)."""

    label = "policy loss"

    def __reduce__(self):
        return (restore, (self.name,))

    def __call__(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, config: Any,
                 loss_mask: Optional[torch.Tensor] = None, rollout_logprobs: Optional[torch.Tensor] = None):
        if not getattr(config, "stablerl_reduction", False):
            raise StableRLError(f"{NAME}: stablerl policy loss {self.name!r} refused: {NOT_TAKEN_OVER}")
        spec, effective = settings(config, stablerl.POLICY_LOSS)
        if spec.name != self.name:
            raise StableRLError(f"{NAME}: {ALGORITHM}policy_loss_type selects {spec.name!r}, called as {self.name!r}")
        log_effective_settings(NAME, spec, effective)
        hyper, options = split_call_options(settings_params(effective))
        mode = loss_agg_mode(config, options)  # SkyRL's loss_reduction; a registered aggregation (delta_l) replaces it
        if loss_mask is None:
            loss_mask = torch.ones_like(log_probs)
        mask, d = read_weights(loss_mask, f"{NAME}: ")
        if d is None:  # a padding micro-batch: no valid token, no gradient
            return (log_probs * 0.0).sum(), {}
        adapter = get_adapter(NAME)
        # the mini-batch's rows (token mean: for losses that average over sequences themselves, e.g. GMPO)
        rows = d if mode != "token-mean" else getattr(config, "stablerl_mini_batch_rows", None)
        ctx = stablerl.Context(token_count=d if mode == "token-mean" else None, seq_count=rows, dp_size=1,
                               loss_scale_factor=getattr(config, "max_seq_len", None),
                               state=adapter.loss_state.slot(stablerl.POLICY_LOSS, self.name))
        rollout = rollout_logprobs if ("rollout_log_prob" in spec.requires or "rollout_correction" in options) else None
        micro = adapter.micro  # the update micro-batch's token_ids / entropy (``_micro``)
        fed = micro.declared(spec, skip=CALL_INPUTS) if micro is not None else {}
        loss, metrics = stablerl.compute_policy_loss(
            self.name, log_prob=log_probs, old_log_prob=old_log_probs, advantages=advantages, response_mask=mask,
            rollout_log_prob=rollout, **fed, loss_agg_mode=options.pop("loss_agg_mode", None) or mode, ctx=ctx, **options, **hyper)
        adapter.last_metrics = metrics
        return loss, {f"stablerl/{k}": float(v) for k, v in metrics.items()}


def restore(name: str) -> StableSkyRLLoss:
    """Unpickling in a SkyRL worker: the loss, with the loss state armed in that worker's checkpoints."""
    get_adapter(NAME).arm_worker()
    return StableSkyRLLoss(name)


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
