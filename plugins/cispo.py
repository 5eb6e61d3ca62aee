"""CISPO: Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv 2506.13585, Sec. 3.1, Eq. 4-5).

    r = exp(clamp(lp - lp_old, -20, 20));  w = sg(clamp(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
    l = -w * A * lp                       (gradient only through lp, never through the weight)

Defaults (verl's CISPO example; the paper gives no number): ``clip_ratio_low=10`` (no lower bound,
since r > 0 > 1 - 10) and ``clip_ratio_high=0.2`` (cap 1.2). Aggregate with token-mean (paper).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import STABLE, Params, hookimpl
from stablerl.fused import FusedLoss, fused_log_ratio, masked_count, sign_of_
from stablerl.ops import clamped_log_ratio, masked_sum
from stablerl.params import check


@dataclass
class CISPOParams(Params):
    """Relative (verl) convention: the weight is clamped to ``[1 - clip_ratio_low, 1 + clip_ratio_high]``."""

    clip_ratio_low: float = 10.0
    clip_ratio_high: float = 0.2

    def validate(self) -> None:
        check(0 <= self.clip_ratio_low, f"clip_ratio_low must be >= 0 (>= 1 means no lower bound), got {self.clip_ratio_low}")
        check(0 <= self.clip_ratio_high, f"clip_ratio_high must be >= 0 (cap is 1 + clip_ratio_high), got {self.clip_ratio_high}")


def cispo_loss(b, p: CISPOParams, ctx):
    weighted_adv, metrics = _weighted_advantages(b, p)
    # = -weight * A * lp bit for bit (negation is exact); -A is [B, 1] for sequence-level advantages
    return weighted_adv * b.log_prob, metrics


def cispo_fused(b, p: CISPOParams, ctx):
    """:func:`cispo_loss` as a fused form: the gradient of ``(w * -A) * lp`` is ``g * (w * -A)``. The
    metrics' 0/1 counts from float passes and exact dot products (the same integer counts as the
    eager bool masks), in place on temporaries."""
    mask = b.response_mask
    adv = b.broadcast_advantages
    with torch.no_grad():
        log_ratio, _ = fused_log_ratio(b.log_prob, b.old_log_prob)
        count = mask.sum().clamp(min=1)
        ppo_kl = (0.0 - masked_sum(log_ratio, mask)) / count
        ratio = torch.exp(log_ratio, out=log_ratio)
        weight = torch.clamp(ratio, 1.0 - p.clip_ratio_low, 1.0 + p.clip_ratio_high)
        side = sign_of_(weight - ratio)  # -1: ratio above the cap, +1: below the lower bound, 0: kept
        # A > 0 above the cap (clip_high) and A < 0 below the lower bound (clip_low) are the -1s of
        # t = sign(A) * side; u = min(t, 0): sum(u) = -(high + low), sum(u * side) = high - low
        adv_sign = sign_of_(adv * 1.0)
        t = adv_sign.mul_(side) if adv_sign.shape == side.shape else side * adv_sign
        u = t.clamp_(max=0.0)
        s1 = masked_count(u, mask)
        s2 = masked_count(u.mul_(side), mask)
        zero = torch.zeros((), dtype=mask.dtype, device=mask.device)
        metrics = {
            "pg_clipfrac": masked_count(side.abs_(), mask) / count,  # the weight was truncated
            "pg_clipfrac_lower": zero,
            "clip_high": ((s2 - s1) * 0.5 + 0.0) / count,
            # never below a bound <= 0 (ratio > 0): eager's constant zero
            "clip_low": ((0.0 - s1 - s2) * 0.5 + 0.0) / count if 1.0 - p.clip_ratio_low > 0 else zero,
            "ppo_kl": ppo_kl,
        }
        weighted_adv = weight.mul_(adv).neg_()  # = weight * -A (negation is exact)
        pg_losses = weighted_adv * b.log_prob
    # [B, T] advantages are zero on padding (core cleans them): so are w * -A, the loss and its
    # gradient; [B, 1] ones are not, and the aggregation's mask product stops the gradient there
    return FusedLoss(pg_losses, metrics, torch.mul, (weighted_adv,), zero_padded=b.seq_advantages is None)


def _weighted_advantages(b, p: CISPOParams):
    """``sg(w) * -A`` and the metrics."""
    mask = b.response_mask
    # sequence-level advantages stay [B, 1] and broadcast (core's aggregation masks the padding)
    adv = b.broadcast_advantages
    with torch.no_grad():  # the weight and every metric are detached: record no autograd graph
        log_ratio = clamped_log_ratio(b.log_prob.detach(), b.old_log_prob)
        ratio = torch.exp(log_ratio)
        weight = torch.clamp(ratio, 1.0 - p.clip_ratio_low, 1.0 + p.clip_ratio_high)
        count = mask.sum().clamp(min=1)  # one token count shared by every metric
        zero = torch.zeros((), dtype=mask.dtype, device=mask.device)
        above_cap = ratio > 1.0 + p.clip_ratio_high
        if 1.0 - p.clip_ratio_low > 0:
            clip_low = masked_sum(((adv < 0) & (ratio < 1.0 - p.clip_ratio_low)).view(torch.uint8), mask) / count
            truncated = ratio != weight
        else:  # ratio = exp(clamped log-ratio) > 0 >= the lower bound: never clipped below, so the
            # weight is truncated exactly where the ratio is above the cap (for a finite ratio)
            clip_low = zero
            truncated = above_cap
        # bool conditions enter the masked sums as uint8 views: the same 0/1 factors as a float
        # cast (same sums), several times faster on CPU
        metrics = {
            # verl: any token whose weight was truncated
            "pg_clipfrac": masked_sum(truncated.view(torch.uint8), mask) / count,
            "pg_clipfrac_lower": zero,
            # TRL's cispo_clip_ratio is clip_high
            "clip_high": masked_sum(((adv > 0) & above_cap).view(torch.uint8), mask) / count,
            "clip_low": clip_low,
            # = masked_mean(-log_ratio, mask); 0.0 - s (not -s) so an empty sum stays +0.0
            "ppo_kl": (0.0 - masked_sum(log_ratio, mask)) / count,
        }
    return weight * -adv, metrics


@hookimpl
def register_policy_losses(register):
    register(
        name="cispo",
        fn=cispo_loss,
        fused=cispo_fused,
        params=CISPOParams,
        paper="2506.13585",
        title="CISPO: clipped, detached IS weight times the REINFORCE log-prob gradient (MiniMax-M1)",
        formula="l = -sg(clamp(r, 1-eps_low, 1+eps_high)) * A * lp",
        status=STABLE,
        seq_advantages=True,
        metrics=("pg_clipfrac", "pg_clipfrac_lower", "clip_high", "clip_low", "ppo_kl"),
        reference="verl core_algos.compute_policy_loss_cispo (loss_mode=cispo); TRL loss_type='cispo'",
        notes=(
            "verl convention: relative bounds, weight in [1-clip_ratio_low, 1+clip_ratio_high]. TRL's "
            "epsilon_high is an ABSOLUTE cap (clamp(r, max=epsilon_high), no lower bound): TRL epsilon_high=c "
            "equals ours with clip_ratio_high=c-1 and clip_ratio_low>=1 (e.g. ScaleRL's cap 5.0 -> "
            "clip_ratio_high=4.0). Loss value (-w A lp) is not comparable with PPO losses; only the gradient "
            "-w A grad lp matters. Honours loss_agg_mode (paper: token-mean). With r=1 (one update per batch) "
            "it is token-mean REINFORCE."
        ),
    )
