"""PPO clipped surrogate with clip-higher and dual clip (DAPO's loss; verl ``vanilla``).

DAPO: Yu et al., arXiv 2503.14476. Dual clip: Ye et al., arXiv 1912.09729.

    l = max(-A r, -A clip(r, 1-eps_low, 1+eps_high)),  l = min(l, -A c) where A < 0,
    r = exp(clamp(lp - lp_old, -20, 20))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from stablerl import STABLE, Params, hookimpl
from stablerl.fused import FusedLoss, fused_log_ratio, masked_count, sign_of_
from stablerl.ops import clamped_log_ratio, masked_mean, masked_sum
from stablerl.params import check


@dataclass
class ClipParams(Params):
    """Ratio-space PPO clip bounds ``[1 - clip_ratio_low, 1 + clip_ratio_high]`` and dual clip ``c``."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: Optional[float] = 3.0  # None disables the dual clip

    def validate(self) -> None:
        check(0 <= self.clip_ratio_low, f"clip_ratio_low must be >= 0, got {self.clip_ratio_low}")
        check(0 <= self.clip_ratio_high, f"clip_ratio_high must be >= 0, got {self.clip_ratio_high}")
        check(
            self.clip_ratio_c is None or self.clip_ratio_c > 1.0,
            f"clip_ratio_c (dual clip) must be > 1 or None, got {self.clip_ratio_c}",
        )


def ppo_clip_terms(ratio, advantages, mask, low: float, high: float, dual_c: Optional[float]):
    """The clipped per-token PPO loss and its verl-named metrics (shared by PPO-family losses)."""
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    with torch.no_grad():  # metrics: no autograd graph, one token count shared by all of them
        if pg_losses1.shape[-1] == 1 and mask.shape[-1] != 1:
            # row-constant terms ([B, 1] ratio and advantages: GSPO's sequence form): a condition counts
            # its rows' tokens, so per-row counts replace [B, T] products (integer sums, exact below 2**24 tokens)
            row_tokens = mask.sum(-1, keepdim=True)
            count = row_tokens.sum().clamp(min=1)

            def fraction(cond):
                return (cond.view(torch.uint8) * row_tokens).sum() / count
        else:
            count = mask.sum().clamp(min=1)

            def fraction(cond):
                # bool conditions enter the masked sums as uint8 views: the same 0/1 factors as a float
                # cast (same sums), several times faster on CPU
                return masked_sum(cond.view(torch.uint8), mask) / count

        neg = advantages < 0
        metrics = {
            "pg_clipfrac": fraction(pg_losses2 > pg_losses1),
            "clip_high": fraction((advantages > 0) & (ratio > 1.0 + high)),
            "clip_low": fraction(neg & (ratio < 1.0 - low)),
        }
    if dual_c is None:
        metrics["pg_clipfrac_lower"] = torch.zeros((), device=ratio.device)
        return clip_pg_losses1, metrics
    pg_losses3 = -advantages * dual_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    with torch.no_grad():
        metrics["pg_clipfrac_lower"] = fraction((clip_pg_losses1 > pg_losses3) & neg)
    return torch.where(neg, clip_pg_losses2, clip_pg_losses1), metrics


def ppo_clip_fused(ratio, advantages, mask, low: float, high: float, dual_c: Optional[float], bounds=None):
    """:func:`ppo_clip_terms` without autograd, for a fused form: the same per-token loss and metrics
    (the metrics' 0/1 counts are exact integer sums either way), ``-A``, and the factor ``F`` in
    {0, 1/4, 1/2, 1} such that autograd's gradient of the eager loss with respect to ``ratio`` is
    ``F * (g * -A)`` for an upstream gradient ``g``. Returns ``(loss, metrics, -A, F)``.

    Autograd's rules reproduced: ``maximum(x, y)`` gives x ``g`` where x > y, ``g/2`` where x == y,
    0 below (y alike); ``minimum`` mirrored; ``clamp`` passes the gradient on its closed range; the
    ``where(A < 0, ...)`` picks one branch. ``-A * clamp(r)`` equals ``-A * r`` when ``r`` is in
    range, so ``F_max = (1 + s + inr) / 2`` with ``s = sign(pg1 - pg2)`` and ``inr`` in {0, 1}. For
    A >= 0 the dual-clip bound ``|A| c`` is >= 0 >= ``max(pg1, pg2)``, so ``minimum(max(pg1, pg2),
    |A| c)`` is the eager ``where`` (one select fewer) and its factor ``(1 + sign(|A| c - max))/2``
    is 1 there (A = 0 has a zero gradient whatever the factor). Every step is a vectorised float
    pass, in place where the operand is a temporary (no ``torch.where``, no bool -> float casts, few
    fresh [B, T] allocations). ``bounds=(lower, upper)`` replaces ``(1 - low, 1 + high)`` (explicit
    ratio bounds, e.g. BAPO's searched 0-dim tensors; ``lower <= upper``)."""
    neg_adv = -advantages
    pg_losses1 = neg_adv * ratio
    clamped = torch.clamp(ratio, *bounds) if bounds is not None else torch.clamp(ratio, 1.0 - low, 1.0 + high)
    side = sign_of_(clamped - ratio)  # +1: ratio below the range, -1: above, 0: in range
    pg_losses2 = clamped.mul_(neg_adv) if clamped.shape == torch.broadcast_shapes(clamped.shape, neg_adv.shape) \
        else clamped * neg_adv
    s12 = sign_of_(pg_losses1 - pg_losses2)  # -1: the clipped branch is the larger loss
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2, out=pg_losses1)
    count = mask.sum().clamp(min=1)

    def negative_count(indicator):  # the number of -1 entries of a {-1, 0} tensor on valid tokens
        return 0.0 - masked_count(indicator, mask)  # 0.0 - x: a zero count is +0.0, as eager's

    adv_sign = sign_of_(advantages * 1.0)
    metrics = {
        "pg_clipfrac": negative_count(torch.clamp(s12, max=0.0)) / count,
        # A > 0 and ratio above the range: relu(sign A) * side == -1
        "clip_high": negative_count((torch.relu(adv_sign) * side).clamp_(max=0.0)) / count,
        # A < 0 and ratio below the range: min(sign A, 0) * side == -1
        "clip_low": negative_count((torch.clamp(adv_sign, max=0.0) * side).clamp_(max=0.0)) / count,
    }
    grad_factor = s12.add_(1.0).add_(1.0).sub_(side.abs_()).mul_(0.5)
    if dual_c is None:
        metrics["pg_clipfrac_lower"] = torch.zeros((), device=ratio.device)
        return clip_pg_losses1, metrics, neg_adv, grad_factor
    pg_losses3 = advantages.abs().mul_(dual_c)  # = -A c where A < 0
    s3 = sign_of_(pg_losses3 - clip_pg_losses1)  # -1: the dual clip is active (A < 0 only)
    metrics["pg_clipfrac_lower"] = negative_count(torch.clamp(s3, max=0.0)) / count
    grad_factor.mul_(s3.add_(1.0).mul_(0.5))
    out = pg_losses3 if pg_losses3.shape == clip_pg_losses1.shape else None
    return torch.minimum(clip_pg_losses1, pg_losses3, out=out), metrics, neg_adv, grad_factor


def ratio_backward(grad, neg_adv, ratio_factor):
    # autograd's order: (g * -A) reaches the ratio, exp's backward multiplies by the ratio; the
    # factor F (a power of two or 0) is folded into the saved ratio, which is exact
    return (grad * neg_adv) * ratio_factor


def vanilla_fused(b, p: ClipParams, ctx) -> FusedLoss:
    """:func:`vanilla_loss` as a fused form: gradient ``(g * -A) * (F r)``, saving ``-A`` and ``F r``."""
    with torch.no_grad():
        log_ratio, in_range = fused_log_ratio(b.log_prob, b.old_log_prob)
        ratio = torch.exp(log_ratio)
        adv = b.broadcast_advantages
        pg_losses, metrics, neg_adv, factor = ppo_clip_fused(
            ratio, adv, b.response_mask, p.clip_ratio_low, p.clip_ratio_high, p.clip_ratio_c)
        metrics["ppo_kl"] = masked_mean(-log_ratio, b.response_mask)
        ratio_factor = factor.mul_(ratio)
        if in_range is not None:
            ratio_factor.mul_(in_range)
    # [B, T] advantages are zero on padding (core cleans them), so is the loss
    return FusedLoss(pg_losses, metrics, ratio_backward, (neg_adv, ratio_factor),
                     zero_padded=b.seq_advantages is None)


def vanilla_loss(b, p: ClipParams, ctx):
    log_ratio = clamped_log_ratio(b.log_prob, b.old_log_prob)
    ratio = torch.exp(log_ratio)
    # sequence-level advantages stay [B, 1]: the products with A, -A c and the A < 0 mask broadcast,
    # and autograd keeps no [B, T] copies of them (core's aggregation masks the padding)
    adv = b.broadcast_advantages
    pg_losses, metrics = ppo_clip_terms(
        ratio, adv, b.response_mask, p.clip_ratio_low, p.clip_ratio_high, p.clip_ratio_c
    )
    metrics["ppo_kl"] = masked_mean(-log_ratio.detach(), b.response_mask)
    return pg_losses, metrics


@hookimpl
def register_policy_losses(register):
    register(
        name="vanilla",
        fn=vanilla_loss,
        fused=vanilla_fused,
        params=ClipParams,
        paper="2503.14476",
        title="DAPO: PPO clip with clip-higher (decoupled bounds) and dual clip",
        formula="l = max(-A r, -A clip(r, 1-eps_low, 1+eps_high)); l = min(l, -A c) if A < 0",
        status=STABLE,
        seq_advantages=True,
        metrics=("pg_clipfrac", "pg_clipfrac_lower", "clip_high", "clip_low", "ppo_kl"),
        reference="verl core_algos.compute_policy_loss_vanilla; TRL loss_type='dapo'; OpenRLHF PolicyLoss('ppo')",
        notes="Defaults are DAPO's (0.2/0.28); verl's actor clip_ratio_low/high/c override them in verl.",
    )
