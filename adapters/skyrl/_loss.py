"""The policy-loss function registered in SkyRL's ``PolicyLossRegistry`` for a stablerl loss (runs in SkyRL's policy
workers, where ``PolicyWorkerBase._forward_backward_micro`` calls it with SkyRL's six arguments).

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
from stablerl.frameworks import log_effective_settings, split_call_options
from stablerl.frameworks import as_params as settings_params
from stablerl.params import StableRLError

from ._config import loss_agg_mode, settings
from ._names import ALGORITHM, NAME, Registered

NOT_TAKEN_OVER = (
    "SkyRL's trainer pre-scales the advantages for a masked sum (apply_loss_reduction_to_advantages_minibatch), "
    "which gives other numbers than verl/TRL/OpenRLHF for a loss that is not linear in the advantage or aggregates "
    "itself; run `python -m stablerl.adapters.skyrl.main` (its trainer takes that step over), or "
    "trainer.override_entrypoint=stablerl.adapters.skyrl.main"
)

CALL_INPUTS = frozenset({"log_prob", "old_log_prob", "advantages", "response_mask", "rollout_log_prob"})


def normaliser(loss_mask: torch.Tensor) -> tuple[torch.Tensor, Optional[int]]:
    """``(0/1 mask, D)`` from a loss mask carrying ``1 / D`` on valid tokens (``D`` None: no valid token)."""
    valid = loss_mask > 0
    if not bool(valid.any()):
        return valid.to(torch.float32), None
    weight = loss_mask[valid]
    d = float(1.0 / weight.max())
    if not torch.allclose(weight, weight.max(), rtol=1e-5, atol=0.0):
        raise StableRLError(f"{NAME}: the loss mask's weights differ within the mini-batch; stablerl's trainer puts "
                            "one 1/D on every valid token (is another trainer pre-scaling the loss mask?)")
    return valid.to(torch.float32), max(1, round(d))


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
        mask, d = normaliser(loss_mask)
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


def runnable() -> list[str]:
    """The stablerl policy losses SkyRL can run (selectable or partial in its declaration)."""
    from stablerl.frameworks import REFUSED, get_framework, reach

    framework = get_framework(NAME)
    return [spec.name for spec in stablerl.list_algorithms(stablerl.POLICY_LOSS) if reach(framework, spec)[0] != REFUSED]


def restore(name: str) -> StableSkyRLLoss:
    """Unpickling in a SkyRL worker: the loss, with the loss state armed in that worker's checkpoints."""
    get_adapter(NAME).arm_worker()
    return StableSkyRLLoss(name)
