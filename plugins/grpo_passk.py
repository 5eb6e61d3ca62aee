"""GRPO pass@k: only each group's best response gets an advantage (verl's ``grpo_passk``).

verl cites arXiv 2503.19595. Per group g with scores S (G >= 2):

    A_{argmax S} = (S_max - S_2nd) / (std_g + epsilon)     (norm_adv_by_std_in_grpo=True; std unbiased)
    A_{argmax S} =  S_max - S_2nd                           (norm_adv_by_std_in_grpo=False)
    A_j = 0 for every other response

Defaults: ``epsilon=1e-6``, ``norm_adv_by_std_in_grpo=True`` (verl's). A group with fewer than
two responses raises (as verl). When the maximum is tied, S_max - S_2nd = 0 and every response
of the group gets 0, so which tied response is "the" argmax does not matter.
"""

from __future__ import annotations


import torch

from stablerl import STABLE, hookimpl
from stablerl.ops import group_stats
from stablerl.params import StableRLError
from stablerl.primitives import GRPOParams


def grpo_passk_advantage(b, p: GRPOParams, ctx):
    scores = b.scores
    gid = b.index
    adv = torch.zeros_like(scores)
    if scores.numel():
        _, std, count = group_stats(scores, gid)
        if bool((count < 2).any()):
            i = int(torch.nonzero(count < 2)[0])
            raise StableRLError(
                f"grpo_passk needs at least 2 responses per group; response {i} is alone in its group "
                "(verl raises the same; use n >= 2 rollouts per prompt)"
            )
        # one stable sort by score then one by group: each group is an ascending contiguous run
        by_score = torch.argsort(scores, stable=True)
        order = by_score[torch.argsort(gid[by_score], stable=True)]
        n = torch.bincount(gid)
        last = torch.cumsum(n, 0) - 1  # position of each group's maximum in `order`
        best = order[last]
        gap = scores[best] - scores[order[last - 1]]
        if p.norm_adv_by_std_in_grpo:
            gap = gap / (std[best] + p.epsilon)
        adv[best] = gap
    adv = b.on_response_tokens(adv)
    return adv, adv


@hookimpl
def register_advantage_estimators(register):
    register(
        name="grpo_passk",
        fn=grpo_passk_advantage,
        params=GRPOParams,
        paper="2503.19595",
        title="GRPO pass@k: only the best response of each group is credited",
        formula="A_{argmax_g S} = (S_max - S_2nd)/(std_g + epsilon) (or S_max - S_2nd without std); all others 0; G < 2 raises",
        status=STABLE,
        reference="verl 0.9.1 core_algos.compute_grpo_passk_outcome_advantage",
        notes="Equal to verl's 'grpo_passk' (verl ships this name, so in verl stablerl's is 'stablerl_grpo_passk'). "
        "std unbiased (torch.std); a group of one raises a StableRLError (verl: ValueError). Ties at the maximum "
        "give 0 to the whole group. Score S_i = sum of token_level_rewards over response_mask (verl sums the "
        "unmasked row; equal when rewards are 0 outside the mask). returns == advantages.",
    )
