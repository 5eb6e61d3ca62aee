"""RSPO: router-shift reweighting of importance ratios for MoE (Zhang et al., arXiv 2510.23027).

    D_t     = sum_l sum_{e in TopK_old(l,t)} | log g_theta^l(e) - log g_old^l(e) |
    gamma_t = exp(-D_t / (L K)),   w_t = max(sg(gamma_t), gamma_min)
    log r_t <- log r_t + log w_t   (before the clip and the aggregation of the base loss)

Base loss ``gmpo`` (the paper's best variant, GMPO+RS) or ``vanilla`` (GRPO+RS), called through the
registry with its own params class. Defaults: ``gamma_min = 0.8`` (unverified), base ``gmpo`` with its
defaults.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from stablerl import EXPERIMENTAL, POLICY_LOSS, Params, get_spec, hookimpl
from stablerl.ops import aggregate, clamped_log_ratio, masked_mean
from stablerl.params import StableRLError, check

BASES = ("gmpo", "vanilla")


@dataclass
class RSPOParams(Params):
    base: str = "gmpo"
    gamma_min: float = 0.8
    # bounds of the base loss: log-space for gmpo (0.4), ratio-space for vanilla (0.2 / 0.28)
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: Optional[float] = 3.0  # vanilla base only

    def validate(self) -> None:
        check(self.base in BASES, f"base must be one of {BASES}, got {self.base!r}")
        check(0 < self.gamma_min <= 1, f"gamma_min must be in (0, 1], got {self.gamma_min}")
        # checked whatever the base: a dual clip that could never apply is refused, not kept silently
        check(self.clip_ratio_c is None or self.clip_ratio_c > 1.0,
              f"clip_ratio_c (dual clip of the vanilla base) must be > 1 or None, got {self.clip_ratio_c}")
        self.base_params().validate()

    def base_params(self):
        """The base loss's params (its registered params class): the bounds given here, else its defaults."""
        overrides = {k: v for k, v in (("clip_ratio_low", self.clip_ratio_low), ("clip_ratio_high", self.clip_ratio_high)) if v is not None}
        if self.base == "vanilla":
            overrides["clip_ratio_c"] = self.clip_ratio_c
        return get_spec(POLICY_LOSS, self.base).params(**overrides)


def router_shift_weight(router_log_prob: torch.Tensor, old_router_log_prob: torch.Tensor, gamma_min: float):
    """``(w, gamma)``: the floored, detached router-shift weight and the raw gamma, ``[B, T]``."""
    if router_log_prob.shape != old_router_log_prob.shape or router_log_prob.dim() != 4:
        raise StableRLError(
            "rspo: router_log_prob and old_router_log_prob must both be [B, T, layers, k], got "
            f"{tuple(router_log_prob.shape)} and {tuple(old_router_log_prob.shape)}"
        )
    layers, k = router_log_prob.shape[-2:]
    shift = (router_log_prob.detach().float() - old_router_log_prob.detach().float()).abs().sum((-2, -1))
    gamma = torch.exp(-shift / (layers * k))
    return gamma.clamp(min=gamma_min), gamma


def rspo_loss(b, p: RSPOParams, ctx):
    if b.router_log_prob.shape[:2] != b.log_prob.shape:
        raise StableRLError(f"rspo: router log-probs cover {tuple(b.router_log_prob.shape[:2])} tokens, log_prob {tuple(b.log_prob.shape)}")
    w, gamma = router_shift_weight(b.router_log_prob, b.old_router_log_prob, p.gamma_min)
    w = w.to(b.log_prob.dtype)
    # r * w == exp(lp - (lp_old - log w)): the base loss sees a shifted (detached) old log-prob
    shifted = dataclasses.replace(b, old_log_prob=b.old_log_prob - torch.log(w))
    out, metrics = get_spec(POLICY_LOSS, p.base).fn(shifted, p.base_params(), ctx)
    mask = b.response_mask
    if p.base == "vanilla":  # a per-token base: weight and aggregate it here (gmpo already did)
        if b.is_weights is not None:
            out = out * b.is_weights
        out = aggregate(out, mask, b.loss_agg_mode, ctx, params=b.loss_agg_params)
    metrics["ppo_kl"] = masked_mean(-clamped_log_ratio(b.log_prob, b.old_log_prob).detach(), mask)  # raw ratio
    metrics["rspo/gamma_mean"] = masked_mean(gamma.to(mask.dtype), mask)
    metrics["rspo/floor_fraction"] = masked_mean((gamma < p.gamma_min).to(mask.dtype), mask)
    return out, metrics


@hookimpl
def register_policy_losses(register):
    register(
        name="rspo",
        aggregation=lambda p: "sequence mean (the gmpo base's)" if p is None or p.base == "gmpo" else "",
        fn=rspo_loss,
        params=RSPOParams,
        output="scalar",
        paper="2510.23027",
        title="RSPO: router-shift-aware importance ratios for MoE RL (GMPO + RS by default)",
        formula="r_t <- r_t * max(sg(exp(-mean_{l,k in TopK_old} |log g_theta - log g_old|)), gamma_min), before clip",
        status=EXPERIMENTAL,
        requires=("router_log_prob", "old_router_log_prob"),
        metrics=("pg_clipfrac", "pg_clipfrac_lower", "clip_high", "clip_low", "ppo_kl", "rspo/gamma_mean", "rspo/floor_fraction"),
        reference="a third-party verl fork's router_shift_weighting.adjust_log_ratio_with_router_shift (not the authors')",
        notes=(
            "Unverified against the paper: the mapping exp(-mean |d log g|), the floor gamma_min=0.8, and whether gamma "
            "is taken at the current theta (assumed here: the router log-probs passed in). For base='gmpo' the weight "
            "is added to the token log-ratio before the log-space clip and the geometric mean (a reading of 'rescale "
            "before clipping and aggregation'). ppo_kl is logged from the raw ratio. TRL: needs "
            "GRPOConfig(routing_replay='R3' or 'R2'), which records the router log-probs at the replayed experts."
        ),
    )
