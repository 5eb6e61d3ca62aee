"""PSPO: Probability Smoothing Policy Optimisation (Dwyer et al., arXiv 2509.21282).

"It's Not You, It's Clipping: A Soft Trust-Region via Probability Smoothing for LLM RL".
The current policy is smoothed towards the old one, pi~ = (1 - alpha) pi + alpha pi_old, so

    r~ = (1 - alpha) r + alpha,   r = exp(clamp(lp - lp_old, -20, 20))
    l  = -r~ A                              (no min, no clip)

Default: ``smoothing_alpha = 0.1`` (TRL PR branch ``add-pspo-to-grpo``).
Note: grad l = -(1 - alpha) A r grad lp, i.e. exactly the unclipped IS surrogate's gradient
scaled by (1 - alpha).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import EXPERIMENTAL, POLICY_LOSS, Params, hookimpl
from stablerl.ops import clamped_log_ratio, masked_mean
from stablerl.params import check


@dataclass
class PSPOParams(Params):
    """Smoothing weight ``alpha`` of the old policy in the smoothed policy."""

    smoothing_alpha: float = 0.1

    def validate(self) -> None:
        check(
            0 <= self.smoothing_alpha < 1,
            f"smoothing_alpha must be in [0, 1) (1 leaves no gradient), got {self.smoothing_alpha}",
        )


def pspo_loss(b, p: PSPOParams, ctx):
    mask = b.response_mask
    log_ratio = clamped_log_ratio(b.log_prob, b.old_log_prob)
    ratio = torch.exp(log_ratio)
    smoothed = (1.0 - p.smoothing_alpha) * ratio + p.smoothing_alpha
    pg_losses = -smoothed * b.advantages
    metrics = {
        "ppo_kl": masked_mean(-log_ratio.detach(), mask),
        "pspo/smoothed_ratio_mean": masked_mean(smoothed.detach(), mask),
    }
    return pg_losses, metrics


@hookimpl
def register_policy_losses(register):
    register(
        name="pspo",
        kind=POLICY_LOSS,
        fn=pspo_loss,
        params=PSPOParams,
        paper="2509.21282",
        title="PSPO: probability smoothing, a soft trust region replacing the ratio clip",
        formula="l = -((1 - alpha) r + alpha) A",
        status=EXPERIMENTAL,
        metrics=("ppo_kl", "pspo/smoothed_ratio_mean"),
        reference="TRL PR branch add-pspo-to-grpo (commit 9d490c31), trust_region_method='pspo' (not in TRL main)",
        notes=(
            "Experimental: implemented as coded in the TRL PR branch (algebraic identity checked: gradient == "
            "(1-alpha) x the unclipped IS surrogate gradient); any additional constraint in the paper is "
            "unverified. Because Adam is scale-invariant, this behaves almost like unclipped PPO apart from "
            "gradient-clipping interactions. smoothing_alpha=0.1 is the TRL branch default (paper's tuned values "
            "unverified). Log-ratio clamped to +-20 before exp. Honours loss_agg_mode (TRL: per loss_type)."
        ),
    )
