"""ERC: Entropy Ratio Clipping (Su et al., Kuaishou Klear, arXiv 2512.05591).

A soft global trust region on the entropy: tokens whose current/old full-vocabulary entropy
ratio leaves the band keep their loss value but lose their gradient.

    l_base  = DAPO/PPO dual-clip loss (base="vanilla") or GPPO loss (base="gppo")
    ratio_H = (H + 1e-8) / (H_old + 1e-8)
    keep    = (ratio_H > entropy_mask_low) & (ratio_H < entropy_mask_high) & m     (strict)
    l       = where(keep, l_base, sg(l_base))

Defaults (authors' scripts): ``entropy_mask_low=0.95``, ``entropy_mask_high=1.05`` (bounds on the
entropy *ratio*, i.e. beta = 0.05), ``clip_ratio_low=0.2``, ``clip_ratio_high=0.28`` (grpo_erc;
their gppo_erc scripts use 0.2/0.2), ``clip_ratio_c=10``; token-mean. Detached tokens still count
in the denominator (the response mask is not changed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from stablerl import STABLE, hookimpl
from stablerl.ops import clamped_log_ratio, masked_mean
from stablerl.params import check
from stablerl.primitives import ClipParams, entropy_input, gradient_preserving_terms, ppo_clip_terms

ERC_BASES = ("vanilla", "gppo")


@dataclass
class ERCParams(ClipParams):
    """PPO/GPPO bounds of the base loss plus the entropy-ratio band ``(entropy_mask_low, entropy_mask_high)``."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: Optional[float] = 10.0
    entropy_mask_low: float = 0.95
    entropy_mask_high: float = 1.05
    base: str = "vanilla"

    def validate(self) -> None:
        super().validate()  # the clip bounds (ClipParams)
        check(
            0 <= self.entropy_mask_low <= 1.0,
            f"entropy_mask_low is a bound on the entropy ratio H/H_old and must be in [0, 1], got {self.entropy_mask_low}",
        )
        check(
            self.entropy_mask_high >= 1.0,
            f"entropy_mask_high is a bound on the entropy ratio H/H_old and must be >= 1, got {self.entropy_mask_high}",
        )
        check(self.base in ERC_BASES, f"base must be one of {list(ERC_BASES)}, got {self.base!r}")


def erc_loss(b, p: ERCParams, ctx):
    mask = b.response_mask
    log_ratio = clamped_log_ratio(b.log_prob, b.old_log_prob)
    if p.base == "gppo":
        l_base, metrics = gradient_preserving_terms(
            log_ratio, b.advantages, mask, p.clip_ratio_low, p.clip_ratio_high, p.clip_ratio_c
        )
    else:
        l_base, metrics = ppo_clip_terms(
            torch.exp(log_ratio), b.advantages, mask, p.clip_ratio_low, p.clip_ratio_high, p.clip_ratio_c
        )
        metrics["ppo_kl"] = masked_mean(-log_ratio.detach(), mask)
    H = entropy_input(b.entropy, mask, "entropy")
    H_old = entropy_input(b.old_entropy, mask, "old_entropy").to(H.dtype)
    ratio_h = (H + 1e-8) / (H_old + 1e-8)
    keep = (ratio_h > p.entropy_mask_low) & (ratio_h < p.entropy_mask_high) & b.bool_mask
    loss = torch.where(keep, l_base, l_base.detach())
    metrics["erc/entropy_frac"] = masked_mean(keep.to(mask.dtype), mask)
    metrics["erc/entropy_ratio_mean"] = masked_mean(ratio_h, mask)
    metrics["entropy"] = masked_mean(H, mask)
    return loss, metrics


@hookimpl
def register_policy_losses(register):
    register(
        name="erc",
        fn=erc_loss,
        params=ERCParams,
        paper="2512.05591",
        title="ERC: entropy-ratio clipping (tokens outside the H/H_old band keep value, lose gradient)",
        formula="l = where(e_low < (H+1e-8)/(H_old+1e-8) < e_high, l_base, sg(l_base)); l_base = DAPO or GPPO",
        status=STABLE,
        requires=("entropy", "old_entropy"),
        metrics=(
            "pg_clipfrac", "pg_clipfrac_lower", "clip_high", "clip_low", "ppo_kl",
            "erc/entropy_frac", "erc/entropy_ratio_mean", "entropy",
        ),
        reference="Kwai-Klear/ERC core_algos.py::compute_policy_loss_grpo_erc (base=vanilla) / gppo_erc (base=gppo)",
        notes=(
            "entropy = current-policy full-vocabulary entropy from the same forward pass as log_prob; "
            "old_entropy = from the old-log-prob pass. Both are used only for the mask (detached). "
            "entropy_mask_low/high are bounds on the ratio itself (0.95/1.05), strict inequalities. "
            "base='vanilla' is the DAPO/PPO dual-clip loss (grpo_erc); base='gppo' is GPPO's gradient-"
            "preserving clip (gppo_erc; its scripts use clip_ratio_high=0.2, set it explicitly). "
            "Out-of-band tokens are detached, not masked: they still count in the denominator. "
            "erc/entropy_frac is the fraction of valid tokens inside the band (the reference returns it "
            "in the pg_clipfrac_lower slot). Honours loss_agg_mode (paper: token-mean)."
        ),
    )
