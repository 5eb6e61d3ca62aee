"""Reinforce-Ada: global-statistics group baseline (Xiong et al., arXiv 2510.04996).

Reinforce-Ada samples each prompt adaptively over several rounds and keeps a balanced subset of
n responses; the baseline is taken over ALL samples generated for the prompt, kept or not. With
pos / neg the numbers of those samples whose reward is above / not above ``positive_threshold``
(0.7 in the released scripts) and N = pos + neg:

    p_hat = pos / N,   sigma_hat = max(unbiased std of [1]*pos + [0]*neg, epsilon)
    A_i = (S_i - p_hat) / (sigma_hat + epsilon)     (norm_adv_by_std_in_grpo=True)
    A_i =  S_i - p_hat                               (norm_adv_by_std_in_grpo=False, the released script)
    N <= 1: p_hat = 0, sigma_hat = 1

Inputs: ``extras={"pos_count": [B], "neg_count": [B]}``: for each response, the counts of its
prompt (the same value on every response of a group). Defaults: ``norm_adv_by_std_in_grpo=False``,
``epsilon=1e-6``, ``global_stat_est=True`` (``False``: in-batch group mean/std instead, the
reference's fallback). The multi-round adaptive sampler itself is a trainer feature and is not
provided here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import EXPERIMENTAL, Params, PromptStats, TrainerHook, hookimpl
from stablerl.ops import group_stats
from stablerl.params import MissingInputError, StableRLError, check
from stablerl.primitives import baseline_std_advantage, singleton_convention


@dataclass
class ReinforceAdaParams(Params):
    """verl's ``epsilon`` / ``norm_adv_by_std_in_grpo`` and the reference's ``global_stat_est``."""

    epsilon: float = 1e-6
    norm_adv_by_std_in_grpo: bool = False
    global_stat_est: bool = True

    def validate(self) -> None:
        check(self.epsilon >= 0, f"epsilon must be >= 0, got {self.epsilon}")


def _count(b, key: str) -> torch.Tensor:
    value = b.extras.get(key)
    if value is None:
        raise MissingInputError(
            f"advantage estimator 'reinforce_ada' needs extras[{key!r}] (per-response count of the prompt's "
            "positive / negative samples over ALL adaptive-sampling rounds: compute_advantage(..., extras="
            "{'pos_count': ..., 'neg_count': ...})); pass global_stat_est=False for in-batch statistics"
        )
    t = torch.as_tensor(value, device=b.token_level_rewards.device)
    B = b.token_level_rewards.shape[0]
    if tuple(t.shape) != (B,):
        raise StableRLError(f"reinforce_ada: extras[{key!r}] has shape {tuple(t.shape)}, expected [{B}]")
    t = t.to(torch.float64)
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()) or bool((t != torch.round(t)).any()):
        raise StableRLError(f"reinforce_ada: extras[{key!r}] must hold non-negative integer counts")
    return t


def _per_group_constant(t: torch.Tensor, gid: torch.Tensor, key: str) -> None:
    if not t.numel():
        return
    n_groups = int(gid.max().item()) + 1
    hi = torch.full((n_groups,), -float("inf"), dtype=t.dtype, device=t.device).scatter_reduce(0, gid, t, "amax")
    lo = torch.full((n_groups,), float("inf"), dtype=t.dtype, device=t.device).scatter_reduce(0, gid, t, "amin")
    if bool((hi != lo).any()):
        raise StableRLError(f"reinforce_ada: extras[{key!r}] differs between responses of the same prompt")


def reinforce_ada_advantage(b, p: ReinforceAdaParams, ctx):
    scores = b.scores
    if p.global_stat_est:
        pos, neg = _count(b, "pos_count"), _count(b, "neg_count")
        _per_group_constant(pos, b.index, "pos_count")
        _per_group_constant(neg, b.index, "neg_count")
        total = pos + neg
        p_hat = pos / total.clamp(min=1)
        # unbiased std of pos ones and neg zeros: sqrt(N p (1-p) / (N-1))
        std = torch.sqrt((total * p_hat * (1 - p_hat) / (total - 1).clamp(min=1)).clamp(min=0)).clamp(min=p.epsilon)
        few = total <= 1
        mean = torch.where(few, torch.zeros_like(p_hat), p_hat).to(scores.dtype)
        std = torch.where(few, torch.ones_like(std), std).to(scores.dtype)
    else:
        mean, std, count = group_stats(scores, b.index)
        mean, std = singleton_convention(mean, std, count)
    return baseline_std_advantage(scores, mean, std, p, b)


@hookimpl
def register_advantage_estimators(register):
    register(
        name="reinforce_ada",
        fn=reinforce_ada_advantage,
        params=ReinforceAdaParams,
        paper="2510.04996",
        title="Reinforce-Ada: global-statistics baseline over all adaptively generated samples",
        formula="A_i = S_i - p_hat (norm_adv_by_std_in_grpo: /(max(std_hat, eps) + eps)), p_hat = pos/(pos+neg), "
        "std_hat = unbiased std of [1]*pos + [0]*neg; pos+neg <= 1: p_hat = 0, std_hat = 1",
        status=EXPERIMENTAL,
        requires_unless={"pos_count": "global_stat_est=False (in-batch statistics: dr_grpo's / grpo's advantages)",
                         "neg_count": "global_stat_est=False"},
        reference="authors' verl fork RLHFlow/Reinforce-Ada 05be605, core_algos.compute_grpo_outcome_advantage "
        "(_compute_with_global_stats, global_stat_est=True)",
        notes="Experimental: the paper's core, the multi-round adaptive sampler, is not provided, and no adapter "
        "(verl, TRL, OpenRLHF) feeds the per-prompt counts its default needs: with global_stat_est=True (default) it "
        "raises MissingInputError in every stock trainer; with global_stat_est=False it computes the in-batch group "
        "statistics, which are dr_grpo's advantages (norm_adv_by_std_in_grpo=False, the default) or grpo's (True), "
        "not Reinforce-Ada's. Needs extras['pos_count'] / extras['neg_count'] ([B], the prompt's counts on each of its responses, "
        "equal within a group; a mismatch raises): the numbers of samples with reward > positive_threshold "
        "(0.7 in the released scripts) / <= it over ALL rounds generated for the prompt, kept or not. Missing "
        "counts raise MissingInputError unless global_stat_est=False (then the in-batch group mean/std with "
        "verl's group-of-one convention, the reference's fallback). Default norm_adv_by_std_in_grpo=False as "
        "the released script. p_hat is on thresholded rewards while S_i is the raw score (the reference's "
        "convention; with non-binary rewards they are on different scales). Not provided: the multi-round "
        "adaptive sampler (round_repeat=8, max_rounds=4, 'balanced' / 'positive_focused' selection of the kept "
        "n responses), which is a trainer feature; groups may be smaller than n after it. "
        "S = sum of token rewards over response_mask. returns == advantages.",
    )


# ----------------------------------------------------------------------------- the adaptive sampler

SAMPLER_MODES = ("balanced", "positive_focused")


@dataclass
class ReinforceAdaSamplerParams(Params):
    """The released scripts' multi-round sampler: n kept, round_repeat new samples per round, max_rounds."""

    n: int = 4  # responses kept per prompt (rollout.n)
    round_repeat: int = 8
    max_rounds: int = 4
    positive_threshold: float = 0.7
    mode: str = "balanced"

    def validate(self) -> None:
        check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n}")
        check(isinstance(self.round_repeat, int) and self.round_repeat >= 1,
              f"round_repeat must be an integer >= 1, got {self.round_repeat}")
        check(isinstance(self.max_rounds, int) and self.max_rounds >= 1,
              f"max_rounds must be an integer >= 1, got {self.max_rounds}")
        check(self.mode in SAMPLER_MODES, f"mode must be one of {list(SAMPLER_MODES)}, got {self.mode!r}")


class ReinforceAdaSampler(TrainerHook):
    """``samples_per_prompt(PromptStats) -> round_repeat`` while the prompt is unfinished and rounds remain,
    else 0. Finished: ``balanced``: >= n/2 positives and >= n/2 negatives (of all samples drawn);
    ``positive_focused``: >= 1 positive. A sample is positive iff its reward > positive_threshold.
    :meth:`keep` picks the n responses to train on; the counts over all rounds are the estimator's
    pos_count / neg_count."""

    def finished(self, stats: PromptStats) -> bool:
        p = self.params
        if stats.positive < 0 or stats.positive > stats.drawn:
            raise StableRLError(f"PromptStats: positive={stats.positive} must be in [0, drawn={stats.drawn}]")
        negative = stats.drawn - stats.positive
        if p.mode == "positive_focused":
            return stats.positive >= 1
        half = p.n / 2
        return stats.positive >= half and negative >= half

    def samples_per_prompt(self, stats: PromptStats) -> int:
        if self.finished(stats) or stats.rounds >= self.params.max_rounds:
            return 0
        return self.params.round_repeat

    def keep(self, rewards: torch.Tensor) -> torch.Tensor:
        """Indices of the kept responses of one prompt (all its samples' rewards in draw order): balanced: the
        first floor(n/2) positives then negatives, topped up from the other side when one is short; at most n."""
        r = torch.as_tensor(rewards).reshape(-1)
        positive = torch.nonzero(r > self.params.positive_threshold).reshape(-1)
        negative = torch.nonzero(r <= self.params.positive_threshold).reshape(-1)
        n = self.params.n
        want_pos = n // 2 if self.params.mode == "balanced" else n
        take_pos = min(want_pos, positive.numel())
        take_neg = min(n - take_pos, negative.numel())
        take_pos = min(n - take_neg, positive.numel())  # top up from the positives when negatives are short
        return torch.cat([positive[:take_pos], negative[:take_neg]])


@hookimpl
def register_trainer_hooks(register):
    register(
        name="reinforce_ada_sampler",
        fn=ReinforceAdaSampler,
        params=ReinforceAdaSamplerParams,
        paper="2510.04996",
        title="Reinforce-Ada's adaptive sampler: more rounds for a prompt until it has positives and negatives",
        formula="draw round_repeat (8) more for a prompt while not finished and rounds < max_rounds (4); balanced: "
        "finished at >= n/2 positives and >= n/2 negatives (reward > 0.7); keep n (4), floor(n/2) positives first",
        status=EXPERIMENTAL,
        requires=("sampling_rounds",),
        reference="RLHFlow/Reinforce-Ada 05be605 verl/trainer/ppo/ray_trainer.py multi-round sampler (read through "
        "the catalogue, ADVANTAGES_AND_MOE.md 2.7)",
        notes=(
            "Experimental: the decision rule and the kept subset as the catalogue describes the reference; not run "
            "against it. Runs only in a trainer whose rollout loop draws more responses per prompt on request; "
            "none of verl 0.9.1, TRL 1.16 and OpenRLHF 0.11.2 has one (each generates a fixed number of responses "
            "per prompt per batch), so every adapter refuses it saying so. A custom loop calls "
            "samples_per_prompt(PromptStats(drawn, positive, rounds)) after each round, keep(rewards) at the end, "
            "and passes the counts over all rounds to the reinforce_ada estimator as pos_count / neg_count."
        ),
    )
