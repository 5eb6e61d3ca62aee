"""BNPO: Beta Normalization Policy Optimization (Xiao, Zhang, Cao, arXiv 2506.02864).

    s_i = (S_i - min_value) / (max_value - min_value),   p(q) = mean_g(s)   (p = 0 for a group of one)
    mu, sigma^2 = mean and unbiased variance of {p(q)} over the prompts of the batch (all DP ranks)
    a = (mu(1-mu)/sigma^2 - 1) mu,  b = (mu(1-mu)/sigma^2 - 1)(1-mu)
    alpha = max(1 + a/3, 1),  beta = max(1 + b/3, 1)
    A_i = clamp(1 / BetaPDF(p(q); alpha, beta), 0, clamp) * (s_i - p(q))

Defaults: ``min_value=0``, ``max_value=1``, ``clamp=1e6``, ``decomposition=False``.

Advantage decomposition (paper §multi-reward; authors' ``use_advantage_decomposition``): with
``decomposition=True`` and ``extras["reward_components"]`` (a ``[B, K]`` tensor, or a dict of
``[B]`` per-response or ``[B, T]`` token-level tensors), BNPO runs on every component separately
(its own p, Beta fit and weights) and the K advantages are averaged: ``A = (1/K) sum_k A^(k)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import STABLE, Params, hookimpl
from stablerl.ops import reward_component_matrix
from stablerl.params import StableRLError, check

# variance of the per-prompt success rates below which the Beta fit is degenerate (all p equal)
_VAR_FLOOR = 1e-12
# p may leave [0, 1] by float rounding only
_P_TOL = 1e-9


@dataclass
class BNPOParams(Params):
    """Reward range mapped to [0, 1], the clamp on the weight 1/BetaPDF, and multi-reward decomposition."""

    min_value: float = 0.0
    max_value: float = 1.0
    clamp: float = 1e6
    decomposition: bool = False

    def validate(self) -> None:
        check(
            self.max_value > self.min_value,
            f"max_value must be > min_value, got min_value={self.min_value}, max_value={self.max_value}",
        )
        check(self.clamp > 0, f"clamp must be > 0, got {self.clamp}")


def _component_scores(b, p: BNPOParams) -> torch.Tensor:
    """Per-response scores ``[B, K]``: the outcome score (K=1), or the reward components."""
    if not p.decomposition:
        return b.scores.unsqueeze(-1)
    comps = b.extras.get("reward_components")
    if comps is None:
        raise StableRLError(
            "bnpo: decomposition=True needs extras['reward_components'] (a [B, K] tensor or a dict of [B] "
            "per-response / [B, T] token-level reward tensors)"
        )
    return reward_component_matrix(comps, b.response_mask, "bnpo")


def beta_log_pdf(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Closed-form log Beta density on [0, 1]; finite or -inf at the end points (never NaN)."""
    log_b = torch.lgamma(alpha) + torch.lgamma(beta) - torch.lgamma(alpha + beta)
    return torch.xlogy(alpha - 1, x) + torch.xlogy(beta - 1, 1 - x) - log_b


def bnpo_components(s: torch.Tensor, gid: torch.Tensor, p: BNPOParams, ctx) -> torch.Tensor:
    """BNPO advantages ``[B, K]`` of the normalised scores ``s`` ``[B, K]`` (float64).

    The batch moments of the per-prompt p are summed over data-parallel ranks through
    ``ctx.all_reduce`` (prompts may be split over ranks; every group must be whole on one rank).
    Input errors are reduced too, so every rank raises together instead of one hanging.
    """
    K = s.shape[1]
    n_groups = int(gid.max().item()) + 1 if gid.numel() else 0
    count = torch.bincount(gid, minlength=n_groups).to(s.dtype)
    group_p = torch.zeros(n_groups, K, dtype=s.dtype, device=s.device).index_add_(0, gid, s)
    group_p = group_p / count.clamp(min=1).unsqueeze(-1)
    group_p = torch.where(count.unsqueeze(-1) > 1, group_p, torch.zeros_like(group_p))  # group of one: p = 0

    nonfinite = ~torch.isfinite(s).all()
    outside = ((group_p < -_P_TOL) | (group_p > 1 + _P_TOL)).any()
    local_bad = torch.stack([nonfinite, outside]).to(s.dtype)
    stats = torch.cat([
        group_p.sum(0),
        (group_p * group_p).sum(0),
        torch.tensor([float(n_groups)], dtype=s.dtype, device=s.device),
        local_bad,
    ])
    stats = ctx.all_reduce(stats, "sum")
    sum_p, sum_p2, n, bad = stats[:K], stats[K : 2 * K], stats[2 * K], stats[2 * K + 1 :]
    if bool(bad[0] > 0):
        raise StableRLError("bnpo: reward components have non-finite values (NaN or inf)"
                            + ("" if bool(nonfinite) else " on another rank"))
    if bool(bad[1] > 0):
        where = "" if bool(outside) else " (on another rank)"
        raise StableRLError(
            f"bnpo: a group's mean normalised reward p is outside [0, 1]{where}; set min_value/max_value "
            f"(now {p.min_value}/{p.max_value}) to the reward range"
        )
    group_p = group_p.clamp(0.0, 1.0)

    if bool(n > 1):
        mu = sum_p / n
        var = ((sum_p2 - n * mu * mu) / (n - 1)).clamp(min=0)
    else:  # a single prompt in the whole batch: the authors' convention
        mu = torch.zeros_like(sum_p)
        var = torch.ones_like(sum_p)
    degenerate = var <= _VAR_FLOOR  # every prompt has the same p: uniform Beta, w = 1
    ratio = mu * (1 - mu) / torch.where(degenerate, torch.ones_like(var), var) - 1
    alpha = torch.clamp(1 + ratio * mu / 3, min=1.0)
    beta = torch.clamp(1 + ratio * (1 - mu) / 3, min=1.0)
    alpha = torch.where(degenerate, torch.ones_like(alpha), alpha)
    beta = torch.where(degenerate, torch.ones_like(beta), beta)

    weight = torch.exp(-beta_log_pdf(group_p, alpha, beta)).clamp(0.0, p.clamp)  # [G, K]
    return weight[gid] * (s - group_p[gid])


def bnpo_advantage(b, p: BNPOParams, ctx):
    scores = _component_scores(b, p).to(torch.float64)
    s = (scores - p.min_value) / (p.max_value - p.min_value)
    adv = bnpo_components(s, b.index, p, ctx).mean(-1)
    adv = b.on_response_tokens(adv.to(b.token_level_rewards.dtype))
    return adv, adv


@hookimpl
def register_advantage_estimators(register):
    register(
        name="bnpo",
        fn=bnpo_advantage,
        params=BNPOParams,
        paper="2506.02864",
        title="BNPO: Beta Normalization Policy Optimization",
        formula="A_i = clamp(1/Beta(p_q; 1+a/3, 1+b/3), 0, clamp) (s_i - p_q), a, b = method-of-moments Beta fit of {p_q} over the batch",
        status=STABLE,
        batch_statistics=True,
        reference="authors' recipe/bnpo compute_bnpo_outcome_advantage (changyi7231/BNPO a9c51b9)",
        notes="s = (S - min_value)/(max_value - min_value); p_q = group mean of s, 0 for a group of one "
        "(authors' convention; so such a response gets A = w*s, up to clamp*s when alpha > 1). mu and the "
        "unbiased variance of {p_q} are taken over the prompts of the whole batch, summed over DP ranks "
        "with ctx.all_reduce (sum p, sum p^2, count); a batch with one prompt uses mu=0, var=1. "
        "var(P) <= 1e-12 (all p equal) falls back to alpha=beta=1 (w = 1; the authors' torch Beta "
        "raises there). Beta pdf in closed form with lgamma/xlogy (no NaN at p = 0 or 1). p outside "
        "[0, 1] raises (set min_value/max_value). decomposition=True with extras['reward_components'] "
        "runs BNPO per component and averages (authors' use_advantage_decomposition). "
        "S = sum of token rewards over response_mask. returns == advantages.",
    )
