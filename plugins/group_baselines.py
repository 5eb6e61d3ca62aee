"""Group-baseline outcome advantages: GRPO, Dr. GRPO, RLOO and OPO (verl's built-ins).

S_i is the outcome score of response i (sum of its token-level rewards over ``response_mask``),
g(i) its prompt group, G_g the group size; the scalar advantage is broadcast over the response.

* GRPO (Shao et al., arXiv 2402.03300): ``A_i = (S_i - mean_g) / (std_g + epsilon)``, std unbiased;
  defaults ``epsilon=1e-6``, ``norm_adv_by_std_in_grpo=True`` (False: ``A_i = S_i - mean_g``).
* Dr. GRPO (Liu et al., arXiv 2503.20783): ``A_i = S_i - mean_g`` (no std division); no parameters.
* RLOO (Ahmadian et al., arXiv 2402.14740): ``A_i = S_i - mean_{j != i} S_j = G/(G-1) (S_i - mean_g)``.
* OPO (Hao et al., arXiv 2505.23585): ``A_i = S_i - sum_j l_j S_j / sum_j l_j`` with ``l_j`` the
  response length (number of tokens where ``response_mask`` is 1).

Conventions (verl's, kept so that these equal verl's built-ins): a group of one response has
baseline 0 (and std 1), so its advantage is its raw score (GRPO: ``S / (1 + epsilon)``);
returns == advantages. Groups are whole within a call, so no reduction over ranks is needed.
"""

from __future__ import annotations

import torch

from stablerl import STABLE, NoParams, hookimpl
from stablerl.ops import group_stats
from stablerl.primitives import GRPOParams, baseline_std_advantage, singleton_convention


def _out(per_seq: torch.Tensor, b):
    adv = b.on_response_tokens(per_seq)
    return adv, adv


def grpo_advantage(b, p: GRPOParams, ctx):
    scores = b.scores
    mean, std, count = group_stats(scores, b.index)
    mean, std = singleton_convention(mean, std, count)
    return baseline_std_advantage(scores, mean, std, p, b)


def dr_grpo_advantage(b, p, ctx):
    scores = b.scores
    mean, std, count = group_stats(scores, b.index)
    mean, _ = singleton_convention(mean, std, count)
    return _out(scores - mean, b)


def rloo_advantage(b, p, ctx):
    scores = b.scores
    mean, _, count = group_stats(scores, b.index)
    # leave-one-out: S_i - (sum_g - S_i)/(G-1) = G (S_i - mean_g) / (G-1); G = 1 keeps S_i
    loo = (count * scores - count * mean) / (count - 1).clamp(min=1)
    return _out(torch.where(count > 1, loo, scores), b)


def opo_advantage(b, p, ctx):
    scores = b.scores
    lengths = b.response_mask.sum(-1)
    gid = b.index
    n_groups = int(gid.max().item()) + 1 if gid.numel() else 0
    zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    mean, _, count = group_stats(scores, gid)
    # the weighted mean of the deviations from the group mean, added back: equal scores give a
    # baseline equal to the score exactly (a plain weighted sum rounds, leaving |A| ~ 1e-7)
    weighted = zeros.index_add(0, gid, lengths * (scores - mean))
    total_len = zeros.index_add(0, gid, lengths)
    baseline = mean + (weighted / total_len.clamp(min=1))[gid]
    # a group of one, or with no valid token: baseline 0
    baseline = torch.where((count > 1) & (total_len[gid] > 0), baseline, torch.zeros_like(baseline))
    return _out(scores - baseline, b)


_VERL_CONVENTIONS = (
    "Score S_i = sum of token_level_rewards over response_mask (verl sums the unmasked row; equal "
    "when rewards are 0 outside the mask). Group of one: baseline 0 (std 1), so A = raw score. "
    "returns == advantages."
)


@hookimpl
def register_advantage_estimators(register):
    register(
        name="grpo",
        fn=grpo_advantage,
        params=GRPOParams,
        paper="2402.03300",
        title="GRPO: group-normalised outcome advantage",
        formula="A_i = (S_i - mean_g) / (std_g + epsilon), std unbiased; norm_adv_by_std_in_grpo=False: A_i = S_i - mean_g",
        status=STABLE,
        reference="verl core_algos.compute_grpo_outcome_advantage (and grpo_vectorized)",
        notes="Equal to verl 'grpo' with the same epsilon and norm_adv_by_std_in_grpo. " + _VERL_CONVENTIONS
        + " TRL uses epsilon 1e-4 and OpenRLHF group_norm 1e-9: set epsilon to match those.",
    )
    register(
        name="dr_grpo",
        fn=dr_grpo_advantage,
        params=NoParams,
        paper="2503.20783",
        title="Dr. GRPO: group mean-centred outcome advantage, no std division",
        formula="A_i = S_i - mean_g",
        status=STABLE,
        reference="verl 'grpo' with algorithm.norm_adv_by_std_in_grpo=False; OpenRLHF 'dr_grpo'",
        notes="Dr. GRPO's loss side is loss_agg_mode='seq-mean-token-sum-norm' with a constant "
        "loss_scale_factor (generation budget); this entry is the advantage only. " + _VERL_CONVENTIONS,
    )
    register(
        name="rloo",
        fn=rloo_advantage,
        params=NoParams,
        paper="2402.14740",
        title="RLOO: leave-one-out group baseline",
        formula="A_i = S_i - mean_{j != i} S_j = G/(G-1) (S_i - mean_g); G = 1: A_i = S_i",
        status=STABLE,
        reference="verl core_algos.compute_rloo_outcome_advantage (and rloo_vectorized); OpenRLHF 'rloo'",
        notes=_VERL_CONVENTIONS + " verl's unused epsilon argument is not a parameter here.",
    )
    register(
        name="opo",
        fn=opo_advantage,
        params=NoParams,
        paper="2505.23585",
        title="OPO: length-weighted optimal baseline",
        formula="A_i = S_i - sum_j l_j S_j / sum_j l_j, l_j = response length (sum of response_mask)",
        status=STABLE,
        reference="verl core_algos.compute_opo_outcome_advantage",
        notes=_VERL_CONVENTIONS + " A group whose responses have no valid token gets baseline 0 (verl: NaN). "
        "The paper assumes strictly on-policy updates (one optimizer step per batch).",
    )
