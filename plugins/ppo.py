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
