"""stablerl-example-plugin: a template for third-party stablerl algorithms.

Registers, through the same hooks as stablerl's built-ins:

* policy loss ``example_reinforce``: token-level REINFORCE with a truncated, detached
  importance-sampling weight (Williams 1992; truncation as in TIS / CISPO, arXiv 2506.13585)::

      w = min(exp(lp - lp_old), is_cap)        (detached)
      l = -sg(w) * A * lp                       per token, aggregated with loss_agg_mode

  Default ``is_cap = 2.0``. The gradient is ``-w A grad(lp)``: every token keeps its gradient,
  off-policy tokens are down-weighted but never dropped.

* advantage estimator ``example_mean_baseline``: outcome score minus (a fraction of) its
  prompt group's mean, broadcast over the response::

      A_i = s_i - baseline_weight * mean_{j in group(i)} s_j

  Default ``baseline_weight = 1.0`` (0 gives plain REINFORCE on raw scores).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import EXPERIMENTAL, POLICY_LOSS, AlgorithmSpec, Params, hookimpl
from stablerl.ops import broadcast_to_tokens, clamped_log_ratio, group_stats, masked_mean
from stablerl.params import check

__version__ = "0.1.0"


# --------------------------------------------------------------------------- policy loss


@dataclass
class ReinforceParams(Params):
    """``is_cap``: upper truncation of the (detached) importance weight ``pi/pi_old``."""

    is_cap: float = 2.0

    def validate(self) -> None:
        check(self.is_cap > 0, f"is_cap must be > 0, got {self.is_cap}")


def example_reinforce(b, p: ReinforceParams, ctx):
    """``l = -sg(min(r, is_cap)) * A * lp`` per token (``b`` is a stablerl.PolicyLossBatch)."""
    log_ratio = clamped_log_ratio(b.log_prob, b.old_log_prob).detach()
    ratio = torch.exp(log_ratio)
    is_weight = torch.clamp(ratio, max=p.is_cap)  # detached: the weight carries no gradient
    pg_losses = -is_weight * b.advantages * b.log_prob
    metrics = {
        "example/is_weight_mean": masked_mean(is_weight, b.response_mask),
        "example/is_capped_frac": masked_mean((ratio > p.is_cap).to(ratio.dtype), b.response_mask),
        "ppo_kl": masked_mean(-log_ratio, b.response_mask),
    }
    return pg_losses, metrics  # per-token: stablerl applies IS weights and loss_agg_mode


@hookimpl
def register_policy_losses(register):
    register(
        AlgorithmSpec(
            name="example_reinforce",
            kind=POLICY_LOSS,
            fn=example_reinforce,
            params=ReinforceParams,
            paper="2506.13585",
            title="Example: token-level REINFORCE with a truncated, detached IS weight",
            formula="l = -sg(min(exp(lp - lp_old), is_cap)) * A * lp",
            status=EXPERIMENTAL,
            metrics=("example/is_weight_mean", "example/is_capped_frac", "ppo_kl"),
            notes="Template algorithm (stablerl-example-plugin). The loss value is a surrogate whose "
            "gradient is -w A grad(lp); its value itself is not an objective estimate.",
        )
    )


# --------------------------------------------------------------------------- advantage estimator


@dataclass
class MeanBaselineParams(Params):
    """``baseline_weight``: how much of the group mean to subtract (1 = mean baseline)."""

    baseline_weight: float = 1.0

    def validate(self) -> None:
        check(0.0 <= self.baseline_weight <= 1.0, f"baseline_weight must be in [0, 1], got {self.baseline_weight}")


def example_mean_baseline(b, p: MeanBaselineParams, ctx):
    """``A_i = s_i - w * mean_group(s)`` on every valid token (``b`` is a stablerl.AdvantageBatch)."""
    scores = b.scores  # sum of the token-level rewards over the valid tokens
    mean, _, _ = group_stats(scores, b.index)
    advantages = broadcast_to_tokens(scores - p.baseline_weight * mean, b.response_mask)
    return advantages, advantages  # (advantages, returns)


@hookimpl
def register_advantage_estimators(register):
    # the keyword form: the kind is the hook's
    register(
        name="example_mean_baseline",
        fn=example_mean_baseline,
        params=MeanBaselineParams,
        title="Example: outcome score minus its prompt group's mean",
        formula="A_i = s_i - baseline_weight * mean_{group(i)} s",
        status=EXPERIMENTAL,
        notes="Template algorithm (stablerl-example-plugin). Groups of one get A_i = (1 - w) s_i.",
    )
