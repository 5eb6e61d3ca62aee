"""PPO clipped surrogate with clip-higher and dual clip (DAPO's loss; verl ``vanilla``).

DAPO: Yu et al., arXiv 2503.14476. Dual clip: Ye et al., arXiv 1912.09729.

    l = max(-A r, -A clip(r, 1-eps_low, 1+eps_high)),  l = min(l, -A c) where A < 0,
    r = exp(clamp(lp - lp_old, -20, 20))
"""

from __future__ import annotations

import torch

from stablerl import STABLE, hookimpl
from stablerl.fused import FusedLoss, fused_log_ratio
from stablerl.ops import clamped_log_ratio, masked_mean
from stablerl.primitives import ClipParams, ppo_clip_fused, ppo_clip_terms, ratio_backward


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
