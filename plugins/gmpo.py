"""GMPO: Geometric-Mean Policy Optimization (Zhao et al., arXiv 2507.20673); verl ``geo_mean``.

    d = clamp(lp - lp_old, -20, 20),  sA = sign(A)
    d_eff = sA * min(sA * d, sA * clamp(d, -eps_low, eps_high))      (token clip IN LOG SPACE, pessimistic side)
    ratio_i = exp(sum_t m d_eff / L_i),  A_i = mean_t(m A)
    loss = -(1/B) sum_i A_i ratio_i                                     (sequence mean of a sequence loss)

Defaults (paper): ``clip_ratio_low = clip_ratio_high = 0.4`` as **log-space** bounds, i.e. the
token ratio band ``(e^-0.4, e^0.4) = (0.67, 1.49)``. A=0 sequences contribute 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import STABLE, Params, hookimpl
from stablerl.fused import FusedLoss, clamp_pass_factor, masked_count, sign_of_, stop_at_clamp_bounds_
from stablerl.ops import LOG_RATIO_BOUND, aggregate, masked_sum, seq_mean, within_clamp_pass
from stablerl.params import check


@dataclass
class GMPOParams(Params):
    """Log-space token clip ``-clip_ratio_low <= log r <= clip_ratio_high`` (NOT ratio space)."""

    clip_ratio_low: float = 0.4
    clip_ratio_high: float = 0.4

    def validate(self) -> None:
        check(0 <= self.clip_ratio_low, f"clip_ratio_low (log-space) must be >= 0, got {self.clip_ratio_low}")
        check(0 <= self.clip_ratio_high, f"clip_ratio_high (log-space) must be >= 0, got {self.clip_ratio_high}")


def gmpo_loss(b, p: GMPOParams, ctx):
    log_ratio = b.log_prob - b.old_log_prob
    # = clamped_log_ratio(lp, lp_old); within the bound the clamp is the identity (value and gradient) and
    # is skipped, which also spares its backward (two comparisons and a select over [B, T])
    within = within_clamp_pass(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    d = log_ratio if within else torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    sign = torch.sign(b.advantages)
    # with bounds inside +-20, clamping the raw log-ratio gives the same values and gradient as
    # clamping d, and autograd then keeps one saved log-ratio for both clamps instead of two
    inner = log_ratio if max(p.clip_ratio_low, p.clip_ratio_high) <= LOG_RATIO_BOUND else d
    d_clamped = torch.clamp(inner, -p.clip_ratio_low, p.clip_ratio_high)
    d_eff = sign * torch.minimum(sign * d, sign * d_clamped)
    return _sequence_loss(b, d_eff, ctx), _gmpo_metrics(b, p, d.detach(), d_clamped.detach())


def _sequence_loss(b, d_eff, ctx):
    """From the clipped token log-ratios ``d_eff`` to the loss (with autograd through ``d_eff``)."""
    # a bool mask gives the same sums (x * True = x), and autograd keeps 1 byte per token for
    # backward instead of a 4-byte float mask
    return _loss_from_row_sums(b, masked_sum(d_eff, b.bool_mask, dim=-1), ctx)


def _loss_from_row_sums(b, row_sums, ctx):
    """From the row sums ``sum_t m d_eff`` ([B]) to the loss."""
    mask = b.response_mask
    # seq_mean(x, valid) with the row lengths counted once (same values)
    lengths = mask.sum(-1).clamp(min=1)
    ratio = torch.exp(row_sums / lengths)  # [B] geometric mean of the clipped token ratios
    # sequence-level advantage (0 for an all-masked row); no gradient, so the float mask: the same
    # products as the bool mask's, without its conversion to float inside the product
    seq_adv = masked_sum(b.advantages, mask, dim=-1) / lengths
    seq_loss = -seq_adv * ratio
    if b.is_weights is not None:
        # per-sequence geometric mean of the framework's token IS weights (verl's convention)
        seq_loss = seq_loss * torch.exp(seq_mean(torch.log(b.is_weights + 1e-10), b.bool_mask))
    # sequence mean over the (global) number of sequences (seq_count from ctx; by default the rows
    # with a valid token): the per-sequence loss aggregated as a one-token "sequence" each
    has_tokens = (mask.sum(-1, keepdim=True) > 0).to(seq_loss.dtype)
    return aggregate(seq_loss.unsqueeze(-1), has_tokens, "seq-mean-token-sum", ctx)


def _gmpo_metrics(b, p: GMPOParams, d_det, d_clamped):
    mask, adv = b.response_mask, b.advantages
    with torch.no_grad():
        count = mask.sum().clamp(min=1)  # one token count shared by every metric
        clipped = d_det != d_clamped
        pos, neg = adv > 0, adv < 0
        # bool conditions enter the masked sums as uint8 views: the same 0/1 factors as a float
        # cast (same sums), several times faster on CPU
        return {
            # verl's definitions: any token outside the log band, split by the sign of A
            "pg_clipfrac": masked_sum((clipped & pos).view(torch.uint8), mask) / count,
            "pg_clipfrac_lower": masked_sum((clipped & neg).view(torch.uint8), mask) / count,
            # the tokens whose clip is active (gradient stopped)
            "clip_high": masked_sum((pos & (d_det > p.clip_ratio_high)).view(torch.uint8), mask) / count,
            "clip_low": masked_sum((neg & (d_det < -p.clip_ratio_low)).view(torch.uint8), mask) / count,
            # = masked_mean(-d, mask); 0.0 - s (not -s) so an empty sum stays +0.0
            "ppo_kl": (0.0 - masked_sum(d_det, mask)) / count,
        }


def _gmpo_metrics_from_side(b, side, sign, d):
    """:func:`_gmpo_metrics`'s values from float passes, when the band clamp reads ``d``: ``side``
    (sign of ``clamp(d) - d``) and ``sign`` (of A) in {-1, 0, 1}. Counts of the four conditions from
    four exact dot products: with ``u = min(sign * side, 0)``, ``sum(u) = -(high + low)`` and
    ``sum(u * side) = high - low``; with ``v = sign * |side|``, ``sum(v) = pos - neg`` and
    ``sum(|v|) = pos + neg`` (0/1 integer sums, exact below 2**24 tokens)."""
    mask = b.response_mask
    count = mask.sum().clamp(min=1)
    u = (sign * side).clamp_(max=0.0)
    s1, s2 = masked_count(u, mask), masked_count(u.mul_(side), mask)
    v = torch.abs(side, out=u).mul_(sign)  # u's buffer, no longer needed
    pv, qv = masked_count(v, mask), masked_count(v.abs_(), mask)
    return {
        "pg_clipfrac": ((pv + qv) * 0.5 + 0.0) / count,  # clipped, A > 0
        "pg_clipfrac_lower": ((qv - pv) * 0.5 + 0.0) / count,  # clipped, A < 0
        "clip_high": ((s2 - s1) * 0.5 + 0.0) / count,  # A > 0 above the band
        "clip_low": ((0.0 - s1 - s2) * 0.5 + 0.0) / count,  # A < 0 below the band
        # = masked_mean(-d, mask); 0.0 - s (not -s) so an empty sum stays +0.0
        "ppo_kl": (0.0 - masked_sum(d, mask)) / count,
    }


def gmpo_fused(b, p: GMPOParams, ctx):
    """:func:`gmpo_loss` as a fused form up to the row sums of the clipped token log-ratio ``d_eff =
    sA min(sA d, sA clamp(d))`` (exp and aggregation after them stay autograd, on [B] tensors).
    Autograd gives ``d`` the gradient of ``d_eff`` times ``F = sA^2 (M_a + M_c inr)``: ``M`` are
    ``minimum``'s shares (1, 1/2 on a tie, 0) and ``inr`` the clamp's pass factor, all exact, so the
    backward is one product with the saved ``F`` (4 bytes a token)."""
    with torch.no_grad():
        log_ratio = b.log_prob - b.old_log_prob
        within = within_clamp_pass(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        if within:
            return _gmpo_fused_within(b, p, ctx, log_ratio)
        d = torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        sign = sign_of_(b.advantages * 1.0)  # torch.sign's values (a zero's sign aside), faster
        inner_is_d = max(p.clip_ratio_low, p.clip_ratio_high) > LOG_RATIO_BOUND
        inner = d if inner_is_d else log_ratio
        d_clamped = torch.clamp(inner, -p.clip_ratio_low, p.clip_ratio_high)
        a, c = sign * d, sign * d_clamped
        d_eff = sign * torch.minimum(a, c)
        share_a = sign_of_(c - a).add_(1.0).mul_(0.5)  # minimum's share for a: 1 where a < c, 1/2 on a tie
        share_c = 1.0 - share_a
        factor = share_c.mul_(clamp_pass_factor(inner, d_clamped, -p.clip_ratio_low, p.clip_ratio_high))
        # the +-20 clamp's pass factor, on both paths when the inner clamp reads d
        in20 = clamp_pass_factor(log_ratio, d, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        share_a.mul_(in20)
        if inner_is_d:
            factor.mul_(in20)
        factor.add_(share_a).mul_(sign.mul_(sign))
        metrics = _gmpo_metrics(b, p, d, d_clamped)
        # the row sums of the masked d_eff (the float mask: the same products as eager's bool mask);
        # their backward, expand(g) * m, is folded into the token gradient g_row * F (padding: core)
        row_sums = masked_sum(d_eff, b.response_mask, dim=-1)
    return FusedLoss(row_sums, metrics, _row_backward, (factor,), then=lambda out: _loss_from_row_sums(b, out, ctx))


def _gmpo_fused_within(b, p: GMPOParams, ctx, d):
    """:func:`gmpo_fused` when every log-ratio ``d`` is within +-20 (the clamp is skipped): the same
    values, in place on temporaries (each fresh [B, T] tensor costs its page faults on CPU). With
    ``inr`` in {0, 1}, ``F = sA^2 (M_a + (1 - M_a) inr) = sA^2 max(M_a, inr)``."""
    mask = b.response_mask
    d_clamped = torch.clamp(d, -p.clip_ratio_low, p.clip_ratio_high)
    side = sign_of_(d_clamped - d)  # -1: above the band, +1: below, 0: inside
    sign = sign_of_(b.advantages * 1.0)  # torch.sign's values (a zero's sign aside), faster
    metrics = _gmpo_metrics_from_side(b, side, sign, d)
    # the band clamp's pass factor, from side's buffer (read before d is overwritten)
    in_range = stop_at_clamp_bounds_(side.abs_().neg_().add_(1.0), d, -p.clip_ratio_low, p.clip_ratio_high)
    a, c = d.mul_(sign), d_clamped.mul_(sign)  # d is ours (a fresh difference): no longer needed
    d_eff = torch.minimum(a, c)
    share_a = sign_of_(c.sub_(a)).add_(1.0).mul_(0.5)  # minimum's share for a: 1 where a < c, 1/2 on a tie
    d_eff.mul_(sign)
    factor = torch.maximum(share_a, in_range, out=share_a).mul_(sign.mul_(sign))
    row_sums = masked_sum(d_eff, mask, dim=-1)
    return FusedLoss(row_sums, metrics, _row_backward, (factor,), then=lambda out: _loss_from_row_sums(b, out, ctx))


def _row_backward(grad_rows, factor):
    return grad_rows.unsqueeze(-1) * factor


@hookimpl
def register_policy_losses(register):
    register(
        name="gmpo",
        aggregation="sequence mean (seq-mean-token-sum of the per-sequence loss)",
        fn=gmpo_loss,
        fused=gmpo_fused,
        params=GMPOParams,
        paper="2507.20673",
        title="GMPO: Geometric-Mean Policy Optimization (token clip in log space, sequence objective)",
        formula="loss = -(1/B) sum_i A_i exp(mean_t sA min(sA d, sA clamp(d, -eps_low, eps_high))), d = lp - lp_old",
        status=STABLE,
        output="scalar",
        metrics=("pg_clipfrac", "pg_clipfrac_lower", "clip_high", "clip_low", "ppo_kl"),
        reference="verl core_algos.compute_policy_loss_geo_mean (loss_mode=geo_mean); callsys/GMPO train_zero_math_gmpo.py",
        notes=(
            "clip_ratio_low/high are LOG-space bounds (0.4 means |log r| <= 0.4). Sequence-level objective: "
            "loss_agg_mode is ignored (as in verl); the sequence mean divides by ctx.seq_count (global number of "
            "sequences over DP ranks and micro-batches, times dp_size) or by this call's B when unset, counting "
            "all-masked rows (which contribute 0), like verl's torch.mean. verl's geo_mean always divides by the "
            "local micro-batch size, so it equals ours only with ctx.seq_count unset. A_i is the masked mean of "
            "the token advantages; sign(A) is taken per token; A=0 contributes 0. Token log-ratios are clamped "
            "to +-20 (verl does not clamp; identical unless |log r| > 20). IS weights enter as their per-sequence "
            "geometric mean. pg_clipfrac/pg_clipfrac_lower follow verl (token outside the log band, A>0 / A<0); "
            "clip_high/clip_low count only tokens whose clip is active."
        ),
    )
