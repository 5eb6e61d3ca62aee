"""GSPO: Group Sequence Policy Optimization, GSPO-token form (Zheng et al., arXiv 2507.18071).

    log s_it = clamp(lp - sg(lp) + sg(mean_t m*(lp - lp_old)), max=10);  s_it = exp(log s_it)
    l = max(-A s_it, -A clip(s_it, 1-eps_low, 1+eps_high))        (no dual clip)

The value of ``s_it`` is the length-normalised sequence ratio ``s_i`` (geometric mean of the token
ratios); the gradient of token t is ``sg(s_i) * grad lp_t``. With sequence-level advantages this
is exactly GSPO's sequence objective when aggregated with ``seq-mean-token-mean``.

When core hands sequence-level advantages (``seq_advantages``; e.g. TRL's ``[B]`` advantages), no
per-token IS weights are set and the aggregation is built in, the loss is computed in that
sequence form, ``l_i = max(-A_i s_i, -A_i clip(s_i))`` with ``s_i = exp(min(mean_t m (lp - lp_old),
10))``, broadcast over the row's tokens: the same loss value bit for bit and the same gradient up
to rounding, at the cost of per-row instead of per-token terms.
Defaults (paper): ``clip_ratio_low=3e-4``, ``clip_ratio_high=4e-4``.
"""

from __future__ import annotations

import torch

from stablerl import STABLE, hookimpl
from stablerl.ops import AGG_MODES, clamp_pass_mask, masked_mean, masked_sum
from stablerl.fused import FusedLoss
from stablerl.primitives import GSPOParams, ppo_clip_fused, ppo_clip_terms, ratio_backward

# verl clamps the log of the sequence ratio at 10 before exp (its gradient is 0 above it)
GSPO_LOG_RATIO_MAX = 10.0


def _sequence_form(b) -> bool:
    """GSPO's sequence objective computes the same loss and gradient as the token form exactly when
    every token of a row has the same advantage and the same weight in the loss: sequence-level
    advantages, no per-token IS weights, and a built-in aggregation (whose token weights are
    constant within a row)."""
    return b.seq_advantages is not None and b.is_weights is None and b.loss_agg_mode in AGG_MODES


def gspo_loss(b, p: GSPOParams, ctx):
    mask = b.response_mask
    row_tokens = mask.sum(-1)  # counted once for seq_mean and the valid rows
    if _sequence_form(b):
        # the paper's sequence ratio s_i = exp(mean_t(lp - lp_old)) with its gradient: per-row [B, 1]
        # terms instead of GSPO-token's [B, T] ones, the same loss values bit for bit (GSPO-token's
        # s_it has exactly the value s_i) and the same gradient up to rounding (as TRL's
        # importance_sampling_level="sequence"). The bool mask is the one core's aggregation keeps.
        row_log_ratio = masked_sum(b.log_prob - b.old_log_prob, b.bool_mask, dim=-1)
        seq_log_ratio = row_log_ratio / row_tokens.clamp(min=1)
        ratio = torch.exp(torch.clamp(seq_log_ratio, max=GSPO_LOG_RATIO_MAX))
        pg_losses, metrics = ppo_clip_terms(ratio.unsqueeze(-1), b.seq_advantages, mask,
                                            p.clip_ratio_low, p.clip_ratio_high, None)
        pg_losses = pg_losses.expand_as(mask)  # a view: core's aggregation masks the padding
        seq_log_ratio = seq_log_ratio.detach()
        with torch.no_grad():  # from the row sums (no second [B, T] pass; equal up to summation order)
            metrics["ppo_kl"] = (0.0 - row_log_ratio.sum()) / row_tokens.sum().clamp(min=1)
    else:
        with torch.no_grad():  # only the detached log-ratio is used: record no autograd graph for it
            log_ratio = b.log_prob.detach() - b.old_log_prob
            # = seq_mean(log_ratio, mask): [B], masked tokens excluded, 0 for empty rows
            seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / row_tokens.clamp(min=1)
        log_s = torch.clamp(b.log_prob - b.log_prob.detach() + seq_log_ratio.unsqueeze(-1), max=GSPO_LOG_RATIO_MAX)
        ratio = torch.exp(log_s)
        # sequence-level advantages with IS weights stay [B, 1] and broadcast (core's aggregation
        # masks the padding)
        pg_losses, metrics = ppo_clip_terms(ratio, b.broadcast_advantages, mask, p.clip_ratio_low,
                                            p.clip_ratio_high, None)
        with torch.no_grad():
            # = masked_mean(-log_ratio, mask); 0.0 - s (not -s) so an empty sum stays +0.0
            metrics["ppo_kl"] = (0.0 - masked_sum(log_ratio, mask)) / mask.sum().clamp(min=1)
    with torch.no_grad():
        valid_rows = row_tokens > 0
        s_i = torch.exp(torch.clamp(seq_log_ratio, max=GSPO_LOG_RATIO_MAX))
        metrics["gspo/seq_ratio_mean"] = masked_mean(s_i, valid_rows.to(s_i.dtype))
        # max over the valid rows, 0 when there is none (s_i = exp(.) >= 0, so a 0 in the empty rows
        # changes nothing); no boolean indexing, which costs a nonzero() and a device sync
        zero = s_i.new_zeros(1)  # also the answer for B = 0
        metrics["gspo/seq_ratio_max"] = torch.cat([torch.where(valid_rows, s_i, zero), zero]).max()
    return pg_losses, metrics


def gspo_fused(b, p: GSPOParams, ctx):
    """:func:`gspo_loss`'s GSPO-token form as a fused form (None for the sequence form, which stays
    eager). The token ratio's value is the row's ``s_i = exp(min(mean_t m (lp - lp_old), 10))``
    (``lp - sg(lp)`` is exactly 0), so the per-row ratio broadcasts; its gradient is PPO-clip's
    factor (no dual clip) times ``s_i``, zero where the clamp at 10 is active: ``(g * -A) * (F s_i)``."""
    if _sequence_form(b):
        return None
    with torch.no_grad():
        mask = b.response_mask
        row_tokens = mask.sum(-1)
        log_ratio = b.log_prob - b.old_log_prob
        seq_log_ratio = masked_sum(log_ratio, mask, dim=-1) / row_tokens.clamp(min=1)
        log_s = torch.clamp(seq_log_ratio, max=GSPO_LOG_RATIO_MAX).unsqueeze(-1)
        ratio = torch.exp(log_s)
        pg_losses, metrics, neg_adv, factor = ppo_clip_fused(
            ratio, b.broadcast_advantages, mask, p.clip_ratio_low, p.clip_ratio_high, None)
        metrics["ppo_kl"] = (0.0 - masked_sum(log_ratio, mask)) / mask.sum().clamp(min=1)
        # clamp(max=10)'s backward passes the gradient where log s <= 10 (< 10 with torch >= 2.14)
        passes = clamp_pass_mask(seq_log_ratio.unsqueeze(-1), hi=GSPO_LOG_RATIO_MAX)
        ratio_factor = factor.mul_(ratio * passes.to(ratio.dtype))
        valid_rows = row_tokens > 0
        s_i = torch.exp(torch.clamp(seq_log_ratio, max=GSPO_LOG_RATIO_MAX))
        metrics["gspo/seq_ratio_mean"] = masked_mean(s_i, valid_rows.to(s_i.dtype))
        zero = s_i.new_zeros(1)
        metrics["gspo/seq_ratio_max"] = torch.cat([torch.where(valid_rows, s_i, zero), zero]).max()
    # per-token, as the eager token form: [B, 1] advantages with the [B, 1] ratio give one value a row,
    # and the gradient must reach every token (with IS weights it differs token by token)
    pg_losses = pg_losses.expand_as(mask)
    return FusedLoss(pg_losses, metrics, ratio_backward, (neg_adv, ratio_factor), zero_padded=b.seq_advantages is None)


@hookimpl
def register_policy_losses(register):
    register(
        name="gspo",
        fn=gspo_loss,
        fused=gspo_fused,
        params=GSPOParams,
        paper="2507.18071",
        title="GSPO: Group Sequence Policy Optimization (GSPO-token form)",
        formula="s_it = sg(s_i) exp(lp - sg(lp)), s_i = exp(mean_t(lp - lp_old)); "
        "l = max(-A s_it, -A clip(s_it, 1-eps_low, 1+eps_high))",
        status=STABLE,
        seq_advantages=True,
        metrics=("pg_clipfrac", "pg_clipfrac_lower", "clip_high", "clip_low", "ppo_kl",
                 "gspo/seq_ratio_mean", "gspo/seq_ratio_max"),
        reference="verl core_algos.compute_policy_loss_gspo (loss_mode=gspo)",
        notes=(
            "Honours loss_agg_mode; the paper's sequence objective is loss_agg_mode='seq-mean-token-mean' "
            "(recommended; verl 0.9.1 also passes the actor's loss_agg_mode through, so verl parity holds in "
            "every mode). The log of the sequence ratio is clamped at max 10 as in verl (no +-20 token clamp, "
            "no dual clip). Bounds are ratio-space and ~1000x tighter than PPO's: do not reuse a PPO eps. "
            "IS weights multiply the per-token loss (as verl's rollout_is_weights). pg_clipfrac is token-weighted. "
            "With sequence-level advantages (TRL's [B]; core's seq_advantages), no IS weights and a built-in "
            "aggregation it runs GSPO's sequence form (as TRL's importance_sampling_level='sequence'): the same "
            "loss bits as the token form, the gradient and ppo_kl equal up to summation order."
        ),
    )
