"""STEER: Stabilizing Token-level Entropy-changE via Reweighting (Hao et al., arXiv 2510.10150).

Each token's first-order entropy change is estimated (all detached) and tokens that would move
the entropy most are down-weighted in the PPO (dual-clip) loss:

    p = clamp(exp(lp), 1e-8, 1-1e-8),  p_old = clamp(exp(lp_old), 1e-8, 1)
    Omega = (A / p_old) * p (1 - p) (log p + H)                       (non-finite -> 0)
    lambda = clamp(exp(-k |Omega|), w_min, 1),  k = -ln(w_min) / max(max_valid |Omega|, 0.02)
    l = sg(lambda) * l_PPO_dualclip

Linear alternative (``linear=True``): ``|Omega|`` min -> max is mapped onto ``[w_max -> w_min]``
(both ends over valid tokens; the midpoint when max == min), clamped to ``[w_min, w_max]``.

Defaults are the authors' run script (``run/run_exp.sh``): ``token_weight_min=0.8``,
``token_weight_max=1.0``, ``linear=False``, ``clip_ratio_low=0.2``, ``clip_ratio_high=0.28``,
``clip_ratio_c=10``; token-mean.

The entropy ``H`` is the reference's batch ``entropys`` (computed in the old-log-prob pass):
``old_entropy`` is used when it is given, otherwise the current-policy ``entropy`` (identical on
the first, on-policy mini-batch). The min/max of ``|Omega|`` are taken over the whole batch
(``ctx.all_reduce`` max/min over DP ranks), not per micro-batch as in the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from stablerl import STABLE, hookimpl
from stablerl.ops import clamped_log_ratio, masked_extreme, masked_mean
from stablerl.params import check
from stablerl.primitives import ClipParams, entropy_input, ppo_clip_terms

OMEGA_FLOOR = 0.02  # the reference's floor on max |Omega| in the adaptive k


@dataclass
class STEERParams(ClipParams):
    """STEER token weights and the PPO dual-clip bounds it multiplies."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: Optional[float] = 10.0
    token_weight_min: float = 0.8
    token_weight_max: float = 1.0
    linear: bool = False

    def validate(self) -> None:
        super().validate()  # the clip bounds (ClipParams)
        check(
            0 < self.token_weight_min <= 1.0,
            f"token_weight_min must be in (0, 1], got {self.token_weight_min}",
        )
        check(
            self.token_weight_max >= self.token_weight_min,
            f"token_weight_max must be >= token_weight_min ({self.token_weight_min}), got {self.token_weight_max}",
        )
        check(isinstance(self.linear, bool), f"linear must be True or False, got {self.linear!r}")


def steer_weights(b, p: STEERParams, ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """The detached STEER weights ``[B, T]`` (0 outside the mask) and the global max ``|Omega|``."""
    mask = b.response_mask
    valid = b.bool_mask
    source, name = (b.old_entropy, "old_entropy") if b.old_entropy is not None else (b.entropy, "entropy")
    with torch.no_grad():
        lp = b.log_prob.detach()
        H = entropy_input(source, mask, name).to(lp.dtype)
        x = torch.exp(lp).clamp(1e-8, 1.0 - 1e-8)
        f = x * (1.0 - x) * (torch.log(x) + H)
        p_old = torch.exp(b.old_log_prob).clamp(1e-8, 1.0)
        omega = b.advantages / p_old * f
        zero = torch.zeros((), dtype=omega.dtype, device=omega.device)
        omega = torch.where(torch.isfinite(omega) & valid, omega, zero).abs()
        omega_max = ctx.all_reduce(masked_extreme(omega, mask, "max"), "max")
        w_min, w_max = p.token_weight_min, p.token_weight_max
        if p.linear:
            local_min = masked_extreme(omega, mask, "min", empty=math.inf)
            omega_min = ctx.all_reduce(local_min, "min")
            span = omega_max - omega_min
            ok = torch.isfinite(span) & (span > 0)
            scale = (w_max - w_min) / torch.where(ok, span, torch.ones_like(span))
            lin = w_max - (omega - torch.where(ok, omega_min, zero)) * scale
            weights = torch.where(ok, lin, torch.full_like(omega, 0.5 * (w_min + w_max))).clamp(w_min, w_max)
        else:
            k = -math.log(w_min) / torch.clamp(omega_max, min=OMEGA_FLOOR)
            weights = torch.exp(-k * omega).clamp(w_min, 1.0)
        weights = weights * mask.to(weights.dtype)
    return weights, omega_max


def steer_loss(b, p: STEERParams, ctx):
    mask = b.response_mask
    weights, omega_max = steer_weights(b, p, ctx)
    log_ratio = clamped_log_ratio(b.log_prob, b.old_log_prob)
    ratio = torch.exp(log_ratio)
    pg_losses, metrics = ppo_clip_terms(ratio, b.advantages, mask, p.clip_ratio_low, p.clip_ratio_high, p.clip_ratio_c)
    metrics["ppo_kl"] = masked_mean(-log_ratio.detach(), mask)
    metrics["steer/weight_mean"] = masked_mean(weights, mask)
    metrics["steer/weight_min"] = masked_extreme(weights, mask, "min")
    metrics["steer/weight_max"] = masked_extreme(weights, mask, "max")
    metrics["steer/omega_max"] = omega_max
    return pg_losses * weights, metrics


@hookimpl
def register_policy_losses(register):
    register(
        name="steer",
        fn=steer_loss,
        params=STEERParams,
        paper="2510.10150",
        title="STEER: PPO dual-clip loss reweighted by each token's estimated entropy change",
        formula="l = sg(clamp(exp(-k|Omega|), w_min, 1)) * l_PPO; Omega = A/p_old * p(1-p)(log p + H)",
        status=STABLE,
        requires=("entropy",),
        optional_inputs=("old_entropy",),
        metrics=(
            "pg_clipfrac", "pg_clipfrac_lower", "clip_high", "clip_low", "ppo_kl",
            "steer/weight_mean", "steer/weight_min", "steer/weight_max", "steer/omega_max",
        ),
        reference="zz-haooo/STEER verl/trainer/ppo/core_algos.py::compute_token_weights + compute_policy_loss_with_entropy",
        notes=(
            "H is old_entropy when given (the reference uses the old-log-prob pass entropys), else the "
            "current-policy entropy (declared input; equal on the first on-policy mini-batch). "
            "k = -ln(token_weight_min)/max(max|Omega|, 0.02); max/min of |Omega| are batch-global "
            "(ctx.all_reduce max/min over DP ranks) where the reference takes them per micro-batch, so "
            "results equal the reference when the batch is one micro-batch on one rank. Weights are "
            "detached and multiply the dual-clip PPO loss; every valid token still counts in the "
            "denominator. Honours loss_agg_mode (paper: token-mean). Defaults from run/run_exp.sh "
            "(w_min 0.8, w_max 1.0, exponential, eps 0.2/0.28, c=10)."
        ),
        batch_statistics=True,
    )
