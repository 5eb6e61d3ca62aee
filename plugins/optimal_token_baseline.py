"""Optimal Token Baseline (verl's ``optimal_token_baseline``): a per-timestep, variance-weighted group baseline.

    G_t = sum_{k>=t} m_k r_k,   w_t = 1 - 2 pi_t + sum_v pi(v)^2   (pi: the old policy; ||grad log pi_t||^2 proxy)
    W_t = sum_{j<=t} m_j w_j,   B_t = sum_{i in g} G_it W_it m_it / (sum_{i in g} W_it m_it + epsilon)
    A_t = G_t - B_t      (a group of one: B = 0)

``handle_zero_tail``: where one response of a group is strictly the longest, its baseline is 0 from the
second-longest length on (no other response to estimate it from). Inputs: ``old_log_prob`` and
``sum_pi_squared``. Defaults (verl's): ``handle_zero_tail=True``, ``epsilon=1e-8``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import STABLE, Params, hookimpl
from stablerl.params import StableRLError, check


@dataclass
class OTBParams(Params):
    """verl's ``handle_zero_tail`` and ``epsilon``."""

    handle_zero_tail: bool = True
    epsilon: float = 1e-8

    def validate(self) -> None:
        check(self.epsilon >= 0, f"epsilon must be >= 0, got {self.epsilon}")


def _sum_pi_squared(b) -> torch.Tensor:
    value = torch.as_tensor(b.extras["sum_pi_squared"], device=b.token_level_rewards.device)
    if tuple(value.shape) != tuple(b.token_level_rewards.shape):
        raise StableRLError(f"optimal_token_baseline: sum_pi_squared has shape {tuple(value.shape)}, expected "
                            f"{tuple(b.token_level_rewards.shape)}")
    return value.to(b.token_level_rewards.dtype)


def otb_advantage(b, p: OTBParams, ctx):
    mask = b.response_mask
    valid = mask.bool()
    zero = torch.zeros((), dtype=b.token_level_rewards.dtype, device=mask.device)
    r = torch.where(valid, b.token_level_rewards, zero)
    returns = torch.flip(torch.cumsum(torch.flip(r, [-1]), -1), [-1]) * mask
    pi = torch.exp(torch.where(valid, b.old_log_prob.to(r.dtype), zero))
    w = torch.where(valid, 1 - 2 * pi + torch.where(valid, _sum_pi_squared(b), zero), zero)
    w_cum = torch.cumsum(w, -1) * mask
    gid = b.index
    n_groups = int(gid.max().item()) + 1 if gid.numel() else 0
    T = r.shape[-1]
    num = torch.zeros(n_groups, T, dtype=r.dtype, device=r.device).index_add_(0, gid, returns * w_cum)
    den = torch.zeros(n_groups, T, dtype=r.dtype, device=r.device).index_add_(0, gid, w_cum)
    count = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, gid, torch.ones_like(gid, dtype=r.dtype))
    baseline = (num / (den + p.epsilon))[gid]
    baseline = torch.where((count[gid] > 1).unsqueeze(-1), baseline, zero)
    if p.handle_zero_tail and n_groups:
        lengths = mask.sum(-1)
        longest = torch.full((n_groups,), -1.0, dtype=r.dtype, device=r.device).scatter_reduce(
            0, gid, lengths.to(r.dtype), "amax")
        at_max = lengths.to(r.dtype) == longest[gid]
        n_at_max = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, gid, at_max.to(r.dtype))
        others = torch.where(at_max, torch.full_like(lengths, -1.0, dtype=r.dtype), lengths.to(r.dtype))
        second = torch.full((n_groups,), -1.0, dtype=r.dtype, device=r.device).scatter_reduce(0, gid, others, "amax")
        # the unique strictly-longest response of a group of two or more: baseline 0 from the second length on
        tail = at_max & (n_at_max[gid] == 1) & (count[gid] > 1) & (longest[gid] > second[gid])
        t = torch.arange(T, device=r.device).unsqueeze(0)
        baseline = torch.where(tail.unsqueeze(-1) & (t >= second[gid].unsqueeze(-1)), zero, baseline)
    advantages = (returns - baseline) * mask
    return advantages, returns


@hookimpl
def register_advantage_estimators(register):
    register(
        name="optimal_token_baseline",
        fn=otb_advantage,
        params=OTBParams,
        paper="2310.10505",
        title="Optimal Token Baseline: per-timestep group baseline weighted by cumulative path variance (verl)",
        formula="A_t = G_t - sum_g G_t W_t / (sum_g W_t + eps), W_t = sum_{j<=t} (1 - 2 pi_j + sum_v pi(v)^2)",
        status=STABLE,
        requires=("old_log_prob", "sum_pi_squared"),
        reference="verl core_algos.compute_optimal_token_baseline_advantage (adv_estimator=optimal_token_baseline)",
        notes="verl's estimator has no paper of its own; the arXiv id is ReMax's (the REINFORCE-with-baseline "
        "family it refines). sum_pi_squared comes from verl's old-log-prob pass with "
        "actor_rollout_ref.actor.calculate_sum_pi_squared=True (legacy trainer). verl scales w_t by the squared "
        "rollout IS weight when rollout correction is on; stablerl's estimators receive no IS weights, so use it "
        "without algorithm.rollout_correction.rollout_is (or select verl's own). Group of one: baseline 0. "
        "returns: the undiscounted returns-to-go.",
    )
