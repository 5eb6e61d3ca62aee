"""CPGD: Clipped Policy Gradient Optimization with Policy Drift (Liu et al., arXiv 2505.12504).

    up = lp_old + ln(1 + eps_high);  lo = lp_old + ln(1 - eps_low)
    l_pg = -A * where(A > 0, min(lp, up), max(lp, lo))          (clip the log-prob itself; no ratio factor)
    drift = clamp(exp(sg(lp) - lp_old) - 1, max=c) * lp          (gradient min(r-1, c) grad lp = k3-KL(old||theta) grad)
    loss = agg(l_pg) + policy_drift_coef * agg(drift)

Defaults (assumed, not checked against the authors' code; see the spec's notes): ``eps = 0.2``
(``clip_ratio_low = clip_ratio_high = 0.2``), ``policy_drift_coef = 0.01``, ``policy_drift_clip_eps = 2.0``;
token-mean aggregation. Status experimental until the authors' code is compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stablerl import EXPERIMENTAL, Params, hookimpl
from stablerl.ops import aggregate, clamped_log_ratio, masked_mean
from stablerl.params import check


@dataclass
class CPGDParams(Params):
    """The log-prob band ``[lp_old + ln(1-clip_ratio_low), lp_old + ln(1+clip_ratio_high)]`` and the drift term."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    policy_drift_coef: float = 0.01
    policy_drift_clip_eps: float = 2.0

    def validate(self) -> None:
        check(0 <= self.clip_ratio_low < 1, f"clip_ratio_low must be in [0, 1) (bound ln(1 - eps)), got {self.clip_ratio_low}")
        check(0 <= self.clip_ratio_high, f"clip_ratio_high must be >= 0, got {self.clip_ratio_high}")
        check(0 <= self.policy_drift_coef, f"policy_drift_coef must be >= 0, got {self.policy_drift_coef}")
        check(0 < self.policy_drift_clip_eps, f"policy_drift_clip_eps must be > 0, got {self.policy_drift_clip_eps}")


def cpgd_loss(b, p: CPGDParams, ctx):
    mask = b.response_mask
    adv = b.advantages
    lp = b.log_prob
    upper = b.old_log_prob + math.log1p(p.clip_ratio_high)
    lower = b.old_log_prob + math.log1p(-p.clip_ratio_low)
    clipped_lp = torch.where(adv > 0, torch.minimum(lp, upper), torch.maximum(lp, lower))
    pg_losses = -adv * clipped_lp
    if b.is_weights is not None:  # framework IS correction weights the policy-gradient term only
        pg_losses = pg_losses * b.is_weights

    log_ratio = clamped_log_ratio(lp.detach(), b.old_log_prob)
    ratio = torch.exp(log_ratio)
    drift_weight = torch.clamp(ratio - 1.0, max=p.policy_drift_clip_eps)
    drift = drift_weight * lp

    mode = b.loss_agg_mode
    agg = b.loss_agg_params
    loss = aggregate(pg_losses, mask, mode, ctx, params=agg) + p.policy_drift_coef * aggregate(drift, mask, mode, ctx, params=agg)

    d = (lp.detach() - b.old_log_prob)
    clip_high = (adv > 0) & (lp.detach() > upper)
    clip_low = (adv < 0) & (lp.detach() < lower)
    metrics = {
        "pg_clipfrac": masked_mean((clip_high | clip_low).to(mask.dtype), mask),
        "pg_clipfrac_lower": torch.zeros((), dtype=mask.dtype, device=mask.device),
        "clip_high": masked_mean(clip_high.to(mask.dtype), mask),
        "clip_low": masked_mean(clip_low.to(mask.dtype), mask),
        "ppo_kl": masked_mean(-d, mask),
        "cpgd/drift_weight_mean": masked_mean(drift_weight, mask),
        "cpgd/k3_kl": masked_mean(ratio - 1.0 - log_ratio, mask),
    }
    return loss, metrics


@hookimpl
def register_policy_losses(register):
    register(
        name="cpgd",
        fn=cpgd_loss,
        params=CPGDParams,
        paper="2505.12504",
        title="CPGD: clipped log-prob policy gradient with a clipped policy-drift regularizer",
        formula="loss = agg(-A where(A>0, min(lp, lp_old+ln(1+eps)), max(lp, lp_old+ln(1-eps)))) "
        "+ alpha agg(clamp(exp(sg(lp)-lp_old)-1, max=c) lp)",
        status=EXPERIMENTAL,
        output="scalar",
        metrics=("pg_clipfrac", "pg_clipfrac_lower", "clip_high", "clip_low", "ppo_kl",
                 "cpgd/drift_weight_mean", "cpgd/k3_kl"),
        reference="none compared: the formula is the paper's (Eq. for the clipped log-prob PG and the policy drift)",
        notes=(
            "Experimental: the authors' code was never compared (the public MM-EUREKA history read here has no CPGD "
            "loss). Assumed, unconfirmed: policy_drift_clip_eps = 2.0 (a summary of the authors' repository states "
            "0.2), policy_drift_coef = 0.01 (a recipe elsewhere uses a drift coefficient of 0.001), one eps (0.2) "
            "for both sides; clip_ratio_low/high follow verl naming and default to it. One-sided pessimistic clip of the LOG-PROB (A>0 from above, A<0 from below): beyond the band "
            "the PG gradient is exactly 0, inside it is -A grad lp (no ratio factor). Both terms are aggregated "
            "with the caller's loss_agg_mode (reference: token-mean); framework IS weights multiply the PG term "
            "only. The loss value is not comparable with PPO losses. The paper's clip-filter-like advantage "
            "weight is not offered (an advantage-stage option, not part of this loss)."
        ),
    )
