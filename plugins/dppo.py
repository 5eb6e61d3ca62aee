"""DPPO: binary-divergence trust region with a truncated IS weight (arXiv 2602.04879), verl's two built-ins.

    l_t = -A_t sg(min(r_t, c)) log pi_t M_t,   r_t = pi_t / pi_old_t
    dppo_tv: M_t = [pi_t - pi_old_t <= eps_high] if A_t > 0 else [pi_t - pi_old_t >= -eps_low]
    dppo_kl: D_t = pi_old (log pi_old - log pi) + (1 - pi_old) log((1 - pi_old + 1e-8) / (1 - pi + 1e-8))
             M_t = [D_t <= eps_high or pi_t <= pi_old_t] if A_t > 0 else [D_t <= eps_low or pi_t >= pi_old_t]

The trust region is a divergence between the binary distributions (token, not token) of the two
policies: total variation |pi - pi_old| or the binary KL, one-sided by the sign of A. The gradient
of a kept token is ``-A sg(min(r, c)) grad log pi`` (the ratio-weighted policy gradient, truncated
at ``c``); a token outside the region gets none. Defaults (verl's effective ones):
``clip_ratio_low = clip_ratio_high = 0.2`` (divergence thresholds, not ratio bounds),
``clip_ratio_c = 3.0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import STABLE, Params, hookimpl
from stablerl.ops import clamped_log_ratio, masked_mean, masked_sum
from stablerl.params import check

# verl's guard inside the binary-KL logarithm
BINARY_KL_EPS = 1e-8


@dataclass
class DPPOParams(Params):
    """Divergence thresholds for A <= 0 / A > 0 and the truncation ``c`` of the IS weight."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0

    def validate(self) -> None:
        check(self.clip_ratio_low >= 0, f"clip_ratio_low must be >= 0, got {self.clip_ratio_low}")
        check(self.clip_ratio_high >= 0, f"clip_ratio_high must be >= 0, got {self.clip_ratio_high}")
        check(self.clip_ratio_c > 0, f"clip_ratio_c must be > 0, got {self.clip_ratio_c}")


def _dppo(b, p: DPPOParams, kept_fn):
    mask = b.response_mask
    with torch.no_grad():
        log_ratio = clamped_log_ratio(b.log_prob.detach(), b.old_log_prob)
        ratio = torch.exp(log_ratio)
        prob, old_prob = torch.exp(b.log_prob.detach()), torch.exp(b.old_log_prob)
        keep = kept_fn(b, p, prob, old_prob)
        weight = torch.clamp(ratio, max=p.clip_ratio_c) * keep.to(ratio.dtype)
    pg_losses = -b.advantages * weight * b.log_prob
    with torch.no_grad():
        count = mask.sum().clamp(min=1)
        metrics = {
            "pg_clipfrac": masked_sum((~keep).to(ratio.dtype), mask) / count,
            "pg_clipfrac_lower": masked_sum(((ratio > p.clip_ratio_c) & keep).to(ratio.dtype), mask) / count,
            "ppo_kl": masked_mean(-log_ratio, mask),
        }
    return pg_losses, metrics


def _tv_region(b, p, prob, old_prob):
    diff = prob - old_prob
    return torch.where(b.advantages > 0, diff <= p.clip_ratio_high, diff >= -p.clip_ratio_low)


def _kl_region(b, p, prob, old_prob):
    binary_kl = old_prob * (b.old_log_prob - b.log_prob.detach()) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + BINARY_KL_EPS) / (1.0 - prob + BINARY_KL_EPS))
    up = (binary_kl <= p.clip_ratio_high) | (prob <= old_prob)
    down = (binary_kl <= p.clip_ratio_low) | (prob >= old_prob)
    return torch.where(b.advantages > 0, up, down)


def dppo_tv_loss(b, p: DPPOParams, ctx):
    return _dppo(b, p, _tv_region)


def dppo_kl_loss(b, p: DPPOParams, ctx):
    return _dppo(b, p, _kl_region)


_NOTES = (
    "clip_ratio_low/high are divergence thresholds, not ratio bounds (verl reads them from actor.clip_ratio_low/high, "
    "falling back to actor.clip_ratio); clip_ratio_c truncates the detached IS weight (verl: actor.clip_ratio_c, 3.0 "
    "by default; the paper (Sec. 5.4) recommends a large cap, verl's fallback without the key is 20). The ratio's "
    "log is clamped at +-20 (verl). IS weights multiply the per-token loss (verl's rollout_is_weights). "
    "pg_clipfrac = share of valid tokens outside the region; pg_clipfrac_lower = share kept with r > c (verl)."
)


@hookimpl
def register_policy_losses(register):
    metrics = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")
    register(
        name="dppo_tv",
        fn=dppo_tv_loss,
        params=DPPOParams,
        paper="2602.04879",
        title="DPPO-Binary-TV: total-variation trust region on the sampled token's probability",
        formula="l = -A sg(min(r, c)) log pi M, M = [pi - pi_old <= eps_high] (A > 0) / [pi - pi_old >= -eps_low]",
        status=STABLE,
        metrics=metrics,
        reference="verl core_algos.compute_policy_loss_dppo_tv (loss_mode=dppo_tv)",
        notes=_NOTES,
    )
    register(
        name="dppo_kl",
        fn=dppo_kl_loss,
        params=DPPOParams,
        paper="2602.04879",
        title="DPPO-Binary-KL: binary-KL trust region on the sampled token's probability",
        formula="l = -A sg(min(r, c)) log pi M, M = [KL_bin(pi_old || pi) <= eps or the move is towards the "
        "region] by sign of A",
        status=STABLE,
        metrics=metrics,
        reference="verl core_algos.compute_policy_loss_dppo_kl (loss_mode=dppo_kl)",
        notes=_NOTES + " KL_bin = pi_old log(pi_old/pi) + (1-pi_old) log((1-pi_old+1e-8)/(1-pi+1e-8)) (verl's 1e-8).",
    )
