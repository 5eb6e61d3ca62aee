"""S-GRPO: noise-aware advantage reweighting (Shen, Shen, Zhao, Zhu, arXiv 2508.05928).

"Mitigating Think-Answer Mismatch in LLM Reasoning Through Noise-Aware Advantage Reweighting"
(not the early-exit "Serial-Group" S-GRPO, arXiv 2505.07686). Binary rewards are modelled as
flipped with a symmetric probability p; each group's GRPO advantage is multiplied by the
variance-optimal weight w*(n, k, p):

    r_bar = k / n,   k = #{r_i > 0} in the group of n responses
    t     = clip((r_bar - p) / (1 - 2p), 0, 1)                          (de-noised success rate)
    w*    = (1 - 2p) t (1 - t) / (sqrt(r_bar (1 - r_bar) + 1e-8) * sqrt(t (1 - t) + 1e-8))
    A_i   = w* * (S_i - mean_g) / (std_g + epsilon)                       (std unbiased)

Defaults: ``drgrpo_p=0.10`` (the noise probability p; the reference's name, its Qwen2.5-Math-7B
script; 0.15 in its 1.5B / Llama-3.2-3B scripts), ``epsilon=1e-8`` (oat's). A group with
k/n <= p or >= 1 - p gets weight 0: S-GRPO also drops rare-success groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import STABLE, Params, hookimpl
from stablerl.ops import group_stats
from stablerl.params import check
from stablerl.primitives import singleton_convention

# the reference's fixed stabiliser inside both square roots of w*
WEIGHT_EPS = 1e-8


@dataclass
class SGRPOParams(Params):
    """``drgrpo_p``: symmetric reward-flip probability p in [0, 0.5); ``epsilon``: added to the group std."""

    drgrpo_p: float = 0.10
    epsilon: float = 1e-8

    def validate(self) -> None:
        check(0.0 <= self.drgrpo_p < 0.5, f"drgrpo_p (noise probability p) must be in [0, 0.5), got {self.drgrpo_p}")
        check(self.epsilon >= 0, f"epsilon must be >= 0, got {self.epsilon}")


def noise_weight(n: torch.Tensor, k: torch.Tensor, p: float) -> torch.Tensor:
    """S-GRPO's w*(n, k, p) for tensors of group sizes ``n`` and success counts ``k`` (0 where n = 0)."""
    n = n.to(torch.float64)
    r_bar = k.to(torch.float64) / n.clamp(min=1)
    t = ((r_bar - p) / (1 - 2 * p)).clamp(0.0, 1.0)
    num = (1 - 2 * p) * t * (1 - t)
    den = torch.sqrt(r_bar * (1 - r_bar) + WEIGHT_EPS) * torch.sqrt(t * (1 - t) + WEIGHT_EPS)
    return torch.where(n > 0, num / den, torch.zeros_like(num))


def s_grpo_advantage(b, p: SGRPOParams, ctx):
    scores = b.scores
    gid = b.index
    mean, std, count = group_stats(scores, gid)
    _, std = singleton_convention(mean, std, count)  # a group of one has weight 0 (and S - mean = 0)
    n_groups = int(gid.max().item()) + 1 if gid.numel() else 0
    k = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, gid, (scores > 0).to(scores.dtype))
    w = noise_weight(count, k[gid], p.drgrpo_p).to(scores.dtype)
    adv = w * (scores - mean) / (std + p.epsilon)
    adv = b.on_response_tokens(adv)
    return adv, adv


@hookimpl
def register_advantage_estimators(register):
    register(
        name="s_grpo",
        fn=s_grpo_advantage,
        params=SGRPOParams,
        paper="2508.05928",
        title="S-GRPO: noise-aware advantage reweighting (think-answer mismatch)",
        formula="A_i = w*(n,k,p) (S_i - mean_g)/(std_g + epsilon), w* = (1-2p) t(1-t) / (sqrt(rbar(1-rbar)+1e-8) "
        "sqrt(t(1-t)+1e-8)), rbar = k/n, t = clip((rbar-p)/(1-2p), 0, 1)",
        status=STABLE,
        reference="authors' code shenpeijun0212/S-GRPO 75c3540, train/train_S-GRPO.py::group_weight and "
        "compute_monte_carlo_advantages(critic_type='drgrpo') (the 'recover to grpo' branch)",
        notes="k = #{S_i > 0} in the group (the paper assumes binary 0/1 rewards; with other rewards only the "
        "sign counts for k while S_i - mean_g uses the raw scores, as the reference). The weight multiplies the "
        "std-normalised GRPO advantage (std unbiased, + epsilon = 1e-8 as oat), not the Dr. GRPO one. "
        "w = 0 when k/n <= p or >= 1 - p: all-equal groups and, with p = 0.15 and n = 8, 1/8 and 7/8 groups "
        "get A = 0. Groups may have different sizes (n is each group's own size; the reference assumes a fixed "
        "num_samples). Group of one: w = 0, A = 0 (std taken as 1 instead of the reference's NaN). The paper "
        "pairs it with Dr. GRPO's constant-normaliser loss (loss_agg_mode='seq-mean-token-sum-norm', "
        "loss_scale_factor = generate_max_length). The reference's resampling loop (max_tries) is off in the "
        "released scripts and not provided. S = sum of token rewards over response_mask. returns == advantages.",
    )
