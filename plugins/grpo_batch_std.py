"""Group-mean baseline, batch-level std (Liu et al., "Tricks or Traps?", arXiv 2508.08221; TRL ``scale_rewards="batch"``).

    A_i = (S_i - mean_g) / (std_batch(S) + epsilon),   std_batch unbiased over every response of the batch

The group mean removes the prompt's difficulty; the batch std (instead of GRPO's per-group std) does not
inflate the advantages of near-unanimous groups. Defaults: ``epsilon=1e-4`` (TRL's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import STABLE, Params, hookimpl
from stablerl.ops import broadcast_to_tokens, group_stats
from stablerl.params import check
from stablerl.primitives import singleton_convention


@dataclass
class GRPOBatchStdParams(Params):
    """The constant added to the batch std (TRL: 1e-4)."""

    epsilon: float = 1e-4

    def validate(self) -> None:
        check(self.epsilon >= 0, f"epsilon must be >= 0, got {self.epsilon}")


def grpo_batch_std_advantage(b, p: GRPOBatchStdParams, ctx):
    scores = b.scores
    mean_g, std_g, count = group_stats(scores, b.index)
    mean_g, _ = singleton_convention(mean_g, std_g, count)
    n = torch.tensor(float(scores.numel()), dtype=scores.dtype, device=scores.device)
    sums = ctx.all_reduce(torch.stack([scores.sum(), n]), "sum")
    batch_mean = sums[0] / sums[1].clamp(min=1)
    sq = ctx.all_reduce(((scores - batch_mean) ** 2).sum().reshape(1), "sum")[0]
    std = torch.sqrt(sq / (sums[1] - 1).clamp(min=1))
    adv = broadcast_to_tokens((scores - mean_g) / (std + p.epsilon), b.response_mask)
    return adv, adv


@hookimpl
def register_advantage_estimators(register):
    register(
        name="grpo_batch_std",
        fn=grpo_batch_std_advantage,
        params=GRPOBatchStdParams,
        paper="2508.08221",
        title="Group-mean baseline with batch-level std (TRL scale_rewards='batch')",
        formula="A_i = (S_i - mean_g) / (std_batch(S) + epsilon), std_batch unbiased over the batch's responses",
        status=STABLE,
        batch_statistics=True,
        reference="TRL 1.16 GRPOTrainer._generate_and_score_completions (scale_rewards='batch', "
        "multi_objective_aggregation='sum_then_normalize')",
        notes="The batch std is over every response of the batch (all DP ranks, ctx.all_reduce; TRL gathers the "
        "rewards of all processes first), unbiased as torch.std. Group of one: baseline 0 (verl's convention; "
        "TRL always has groups of num_generations >= 2). S = sum of token rewards over response_mask. "
        "returns == advantages. In TRL select it with advantage_estimator='grpo_batch_std' (scale_rewards='batch' "
        "itself stays TRL's own switch for its built-in advantages).",
    )
