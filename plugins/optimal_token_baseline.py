"""Optimal Token Baseline (verl's ``optimal_token_baseline``): a per-timestep, variance-weighted group baseline.

    G_t = sum_{k>=t} m_k r_k,   w_t = 1 - 2 pi_t + sum_v pi(v)^2   (pi: the old policy; ||grad log pi_t||^2 proxy)
    W_t = sum_{j<=t} m_j w_j,   B_t = sum_{i in g} G_it W_it m_it / (sum_{i in g} W_it m_it + epsilon)
    A_t = G_t - B_t      (a group of one: B = 0)

``handle_zero_tail``: where one response of a group is strictly the longest, its baseline is 0 from the
second-longest length on (no other response to estimate it from). Inputs: ``old_log_prob`` and
``sum_pi_squared``. Defaults (verl's): ``handle_zero_tail=True``, ``epsilon=1e-8``.

``tir_optimal_token_baseline`` (verl's multi-turn variant): the same with ``t`` counted in the response's own
tokens -- masked spans (tool outputs, observations) are removed before the per-position group baseline, so the
k-th generated token of each response of a group shares ``B_k``; responses without a token are no group members.
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


def _path_weights(b, r: torch.Tensor) -> torch.Tensor:
    """``W_t = sum_{j<=t} m_j (1 - 2 pi_j + sum_v pi(v)^2)``, the cumulative path-variance proxy."""
    valid = b.response_mask.bool()
    zero = torch.zeros((), dtype=r.dtype, device=r.device)
    pi = torch.exp(torch.where(valid, b.old_log_prob.to(r.dtype), zero))
    w = torch.where(valid, 1 - 2 * pi + torch.where(valid, _sum_pi_squared(b), zero), zero)
    return torch.cumsum(w, -1) * b.response_mask


def _returns_to_go(b) -> torch.Tensor:
    r = torch.where(b.response_mask.bool(), b.token_level_rewards, torch.zeros_like(b.token_level_rewards))
    return torch.flip(torch.cumsum(torch.flip(r, [-1]), -1), [-1]) * b.response_mask


def group_token_baseline(returns, w_cum, mask, gid, member, p: OTBParams) -> torch.Tensor:
    """``B_t = sum_g G_t W_t m_t / (sum_g W_t m_t + epsilon)`` per group and position, over the ``member`` rows
    (``[B]`` bool; a group of fewer than two members: 0), with ``handle_zero_tail``; ``[B, T]``."""
    r = returns
    zero = torch.zeros((), dtype=r.dtype, device=r.device)
    n_groups = int(gid.max().item()) + 1 if gid.numel() else 0
    T = r.shape[-1]
    keep = (mask * member.unsqueeze(-1)).to(r.dtype)
    num = torch.zeros(n_groups, T, dtype=r.dtype, device=r.device).index_add_(0, gid, returns * w_cum * keep)
    den = torch.zeros(n_groups, T, dtype=r.dtype, device=r.device).index_add_(0, gid, w_cum * keep)
    count = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, gid, member.to(r.dtype))
    baseline = (num / (den + p.epsilon))[gid]
    baseline = torch.where((count[gid] > 1).unsqueeze(-1), baseline, zero)
    if p.handle_zero_tail and n_groups:
        lengths = torch.where(member, mask.sum(-1).to(r.dtype), torch.full_like(count[gid], -1.0))
        longest = torch.full((n_groups,), -1.0, dtype=r.dtype, device=r.device).scatter_reduce(
            0, gid, lengths, "amax")
        at_max = member & (lengths == longest[gid])
        n_at_max = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, gid, at_max.to(r.dtype))
        others = torch.where(at_max, torch.full_like(lengths, -1.0), lengths)
        second = torch.full((n_groups,), -1.0, dtype=r.dtype, device=r.device).scatter_reduce(0, gid, others, "amax")
        # the unique strictly-longest response of a group of two or more: baseline 0 from the second length on
        tail = at_max & (n_at_max[gid] == 1) & (count[gid] > 1) & (longest[gid] > second[gid])
        t = torch.arange(T, device=r.device).unsqueeze(0)
        baseline = torch.where(tail.unsqueeze(-1) & (t >= second[gid].unsqueeze(-1)), zero, baseline)
    return baseline


def otb_advantage(b, p: OTBParams, ctx):
    mask = b.response_mask
    returns = _returns_to_go(b)
    w_cum = _path_weights(b, returns)
    member = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
    baseline = group_token_baseline(returns, w_cum, mask, b.index, member, p)
    return (returns - baseline) * mask, returns


def _compaction(mask: torch.Tensor):
    """Where each response token goes when the response's valid tokens are packed to the left: ``(rows, cols,
    ranks, packed_mask)``; ``packed[rows, ranks] = x[rows, cols]``."""
    valid = mask.bool()
    rank = torch.cumsum(valid.to(torch.long), -1) - 1
    rows, cols = valid.nonzero(as_tuple=True)
    lengths = valid.sum(-1)
    L = int(lengths.max().item()) if lengths.numel() else 0
    packed_mask = (torch.arange(L, device=mask.device).unsqueeze(0) < lengths.unsqueeze(-1)).to(mask.dtype)
    return rows, cols, rank[rows, cols], packed_mask


def tir_otb_advantage(b, p: OTBParams, ctx):
    mask = b.response_mask
    returns = _returns_to_go(b)
    w_cum = _path_weights(b, returns)
    rows, cols, ranks, packed_mask = _compaction(mask)

    def pack(x):
        out = x.new_zeros(packed_mask.shape)
        out[rows, ranks] = x[rows, cols]
        return out

    member = mask.bool().any(-1)  # verl leaves responses without a token out of their group
    baseline = group_token_baseline(pack(returns), pack(w_cum), packed_mask, b.index, member, p)
    adv = torch.zeros_like(returns)
    adv[rows, cols] = pack(returns)[rows, ranks] - baseline[rows, ranks]
    return adv * mask, returns


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
    register(
        name="tir_optimal_token_baseline",
        fn=tir_otb_advantage,
        params=OTBParams,
        paper="2310.10505",
        title="Optimal Token Baseline for multi-turn (tool-integrated) traces: positions counted in response tokens",
        formula="optimal_token_baseline with t = the index among the response's own tokens (observation spans "
        "removed), so the k-th generated token of every response of the group shares B_k",
        status=STABLE,
        requires=("old_log_prob", "sum_pi_squared"),
        reference="verl core_algos.compute_multi_turn_optimal_token_baseline_advantage "
        "(adv_estimator=tir_optimal_token_baseline)",
        notes="Same as optimal_token_baseline except that each response's valid tokens are packed to the left "
        "before the per-position group baseline (tool outputs and other masked spans take no position), and a "
        "response without a valid token is not a member of its group. Inputs and verl's rollout-IS caveat as "
        "for optimal_token_baseline. returns: the returns-to-go on response tokens (0 elsewhere; verl leaves "
        "them unmasked inside observation spans).",
    )
