"""REINFORCE++ family: discounted returns whitened over the whole batch (Hu et al., arXiv 2501.03262).

verl 0.9.1 and OpenRLHF 0.11.2 each ship their own variants; each entry reproduces one framework's
numbers, so that a name means the same thing in every framework:

* ``reinforce_plus_plus`` (verl): ``G_t = sum_{k>=t, m_k=1} gamma^(#valid tokens between) r_k`` (rewards on
  masked tokens are dropped and the running return is carried across them, multi-turn observation
  spans), ``A = whiten(G)`` with the unbiased variance, ``(G - mu) / sqrt(var + 1e-8)``.
* ``reinforce_plus_plus_baseline`` (verl): ``A = whiten(S_i - mean_g)`` broadcast over the response,
  unbiased variance, ``+1e-8`` inside the square root; a group of one has baseline 0.
* ``reinforce`` (OpenRLHF): ``G_t = sum_{k>=t} gamma^(k-t) m_k r_k``,
  ``A = (G - mu) / sqrt(max(var, 1e-8))`` with the biased variance (``norm_adv_by_std_in_grpo=False``:
  ``A = G - mu``, OpenRLHF's ``--algo.advantage.no_std_norm``).
* ``reinforce_baseline`` (OpenRLHF): as ``reinforce`` with ``gamma = 1`` on the rewards minus the group
  mean score (placed on the last valid token, where OpenRLHF puts the outcome reward).
* ``flash_reinforce`` (OpenRLHF): ``A_t = sum_{k>=t} m_k r_k - mean over the batch of S``; no group, no
  whitening (the one-sample-per-prompt estimator).

mu and var are over every valid token of the batch, reduced over DP ranks with ``ctx.all_reduce``.
Defaults: ``gamma=1.0`` (verl's ``algorithm.gamma``, OpenRLHF's ``--algo.advantage.gamma``),
``norm_adv_by_std_in_grpo=True``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import STABLE, NoParams, Params, hookimpl
from stablerl.ops import group_stats, last_valid_index, masked_sum
from stablerl.params import check
from stablerl.primitives import singleton_convention

# verl adds 1e-8 to the variance (rsqrt(var + 1e-8)); OpenRLHF clamps it (var.clamp(min=1e-8).rsqrt())
WHITEN_EPS = 1e-8


@dataclass
class DiscountParams(Params):
    """The discount ``gamma`` of the per-token returns (verl ``algorithm.gamma``)."""

    gamma: float = 1.0

    def validate(self) -> None:
        check(0.0 <= self.gamma <= 1.0, f"gamma must be in [0, 1], got {self.gamma}")


@dataclass
class OpenRLHFReinforceParams(Params):
    """OpenRLHF's ``--algo.advantage.gamma`` and ``--algo.advantage.no_std_norm`` (as its negation)."""

    gamma: float = 1.0
    norm_adv_by_std_in_grpo: bool = True

    def validate(self) -> None:
        check(0.0 <= self.gamma <= 1.0, f"gamma must be in [0, 1], got {self.gamma}")


@dataclass
class ReinforceBaselineParams(Params):
    """OpenRLHF's ``--algo.advantage.no_std_norm`` (as its negation); gamma is 1 there by design."""

    norm_adv_by_std_in_grpo: bool = True


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, ctx, *, unbiased: bool, clamp: bool,
                  scale: bool = True) -> torch.Tensor:
    """``(x - mu) * rsqrt(var + 1e-8)`` (verl; ``clamp``: ``rsqrt(max(var, 1e-8))``, OpenRLHF) over the valid
    tokens of every DP rank, two passes (mean, then centred squares) as both frameworks; 0 on padding.
    ``scale=False`` only centres."""
    m = mask.to(values.dtype)
    valid = mask.bool()
    x = torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device))
    # the mean of the deviations from one valid value (the largest, the same on every rank), added back:
    # equal values then have mean == value and var == 0 exactly, where a plain sum's rounding, times
    # rsqrt(1e-8), gave equal rewards |A| ~ 6e-4
    top = torch.where(valid, values, torch.full((), -torch.inf, dtype=values.dtype, device=values.device))
    pivot = ctx.all_reduce((top.amax() if top.numel() else top.new_full((), -torch.inf)).reshape(1), "max")[0]
    pivot = torch.where(torch.isfinite(pivot), pivot, torch.zeros_like(pivot))
    sums = ctx.all_reduce(torch.stack([((x - pivot) * m).sum(), m.sum()]), "sum")
    n = sums[1]
    mean = pivot + sums[0] / n.clamp(min=1)
    centred = (x - mean) * m
    if not scale:
        return centred
    sq = ctx.all_reduce((centred * centred).sum().reshape(1), "sum")[0]
    var = sq / ((n - 1) if unbiased else n).clamp(min=1)
    rstd = torch.rsqrt(var.clamp(min=WHITEN_EPS) if clamp else var + WHITEN_EPS)
    return centred * rstd


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float, *, skip_masked: bool) -> torch.Tensor:
    """Per-token returns ``G_t = r_t + gamma G_{t+1}`` of the masked rewards, 0 on padding. ``skip_masked``
    (verl): a masked token neither adds its reward nor discounts (the return is carried across it)."""
    m = mask.to(rewards.dtype)
    r = torch.where(mask.bool(), rewards, torch.zeros((), dtype=rewards.dtype, device=rewards.device))
    if gamma == 1.0:  # one reversed cumulative sum (the same values as the loop below)
        return torch.flip(torch.cumsum(torch.flip(r, [-1]), -1), [-1]) * m
    returns = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[-1])):
        new = r[:, t] + gamma * running
        running = torch.where(mask[:, t].bool(), new, running) if skip_masked else new
        returns[:, t] = new * m[:, t]
    return returns


def reinforce_plus_plus_advantage(b, p: DiscountParams, ctx):
    returns = discounted_returns(b.token_level_rewards, b.response_mask, p.gamma, skip_masked=True)
    adv = masked_whiten(returns, b.response_mask, ctx, unbiased=True, clamp=False)
    return adv, returns


def reinforce_plus_plus_baseline_advantage(b, p, ctx):
    scores = b.scores
    mean, std, count = group_stats(scores, b.index)
    mean, _ = singleton_convention(mean, std, count)
    centred = (scores - mean).unsqueeze(-1) * b.response_mask.to(scores.dtype)
    adv = masked_whiten(centred, b.response_mask, ctx, unbiased=True, clamp=False)
    return adv, adv


def _with_outcome_shift(b, shift: torch.Tensor) -> torch.Tensor:
    """The masked token rewards with ``shift`` [B] added on each row's last valid token (OpenRLHF subtracts
    its baselines from the outcome reward, which it places there)."""
    r = torch.where(b.response_mask.bool(), b.token_level_rewards, torch.zeros_like(b.token_level_rewards))
    rows = torch.arange(r.shape[0], device=r.device)
    last = last_valid_index(b.response_mask)
    has_token = b.response_mask.bool().any(-1)
    return r.index_put((rows, last), torch.where(has_token, shift, torch.zeros_like(shift)), accumulate=True)


def reinforce_advantage(b, p: OpenRLHFReinforceParams, ctx):
    returns = discounted_returns(b.token_level_rewards, b.response_mask, p.gamma, skip_masked=False)
    adv = masked_whiten(returns, b.response_mask, ctx, unbiased=False, clamp=True, scale=p.norm_adv_by_std_in_grpo)
    return adv, returns


def reinforce_baseline_advantage(b, p: ReinforceBaselineParams, ctx):
    scores = b.scores
    mean, std, count = group_stats(scores, b.index)
    mean, _ = singleton_convention(mean, std, count)
    returns = discounted_returns(_with_outcome_shift(b, -mean), b.response_mask, 1.0, skip_masked=False)
    adv = masked_whiten(returns, b.response_mask, ctx, unbiased=False, clamp=True, scale=p.norm_adv_by_std_in_grpo)
    return adv, returns


def flash_reinforce_advantage(b, p, ctx):
    scores = b.scores
    sums = ctx.all_reduce(torch.stack([scores.sum(), torch.tensor(float(scores.numel()), dtype=scores.dtype,
                                                                   device=scores.device)]), "sum")
    batch_mean = (sums[0] / sums[1].clamp(min=1)).expand_as(scores)
    returns = discounted_returns(_with_outcome_shift(b, -batch_mean), b.response_mask, 1.0, skip_masked=False)
    return returns, returns


_WHOLE_BATCH = ("mu and var are over every valid token of the batch (all DP ranks, ctx.all_reduce); an empty batch "
                "gives 0. returns: the discounted returns before whitening (advantages for the baseline variant).")


@hookimpl
def register_advantage_estimators(register):
    register(
        name="reinforce_plus_plus",
        fn=reinforce_plus_plus_advantage,
        params=DiscountParams,
        paper="2501.03262",
        title="REINFORCE++: batch-whitened discounted returns (verl's form)",
        formula="G_t = r_t + gamma G_{t+1} over valid tokens; A = (G - mu) / sqrt(var + 1e-8), unbiased var over "
        "the batch's valid tokens",
        status=STABLE,
        batch_statistics=True,
        reference="verl core_algos.compute_reinforce_plus_plus_outcome_advantage (adv_estimator=reinforce_plus_plus)",
        notes="A masked token (an observation span of a multi-turn trace) adds no reward and does not discount: "
        "the running return is carried across it (verl). verl's masked_mean divides by (n + 1e-8), stablerl by n: "
        "equal in float32, 1e-10 relative in float64. " + _WHOLE_BATCH + " The KL-in-reward of the paper is "
        "the framework's reward penalty (verl use_kl_in_reward), not part of the estimator. OpenRLHF's "
        "'reinforce' is the same estimator with the biased variance and no skip over masked tokens.",
    )
    register(
        name="reinforce_plus_plus_baseline",
        fn=reinforce_plus_plus_baseline_advantage,
        params=NoParams,
        paper="2501.03262",
        title="REINFORCE++-baseline: group-mean baseline, then batch whitening (verl's form)",
        formula="A_i = whiten(S_i - mean_g) over the batch's valid tokens, (x - mu) / sqrt(var + 1e-8), unbiased var",
        status=STABLE,
        batch_statistics=True,
        reference="verl core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage",
        notes="Group of one: baseline 0 (verl). S = sum of token rewards over response_mask (verl sums the whole "
        "row; equal when rewards are 0 on padding). Every response token carries its response's centred score "
        "before whitening (the token-weighted batch statistics verl takes). " + _WHOLE_BATCH
        + " OpenRLHF's 'reinforce_baseline' differs only in the variance (biased, clamped): stablerl "
        "'reinforce_baseline'.",
    )
    register(
        name="reinforce",
        fn=reinforce_advantage,
        params=OpenRLHFReinforceParams,
        paper="2501.03262",
        title="REINFORCE (OpenRLHF's form): batch-whitened discounted returns, biased variance",
        formula="G_t = sum_{k>=t} gamma^(k-t) m_k r_k; A = (G - mu) / sqrt(max(var, 1e-8)), biased var over the "
        "batch's valid tokens",
        status=STABLE,
        batch_statistics=True,
        reference="OpenRLHF 0.11.2 experience_maker.compute_advantages_and_returns (estimator=reinforce)",
        notes="OpenRLHF's --algo.advantage.no_std_norm is norm_adv_by_std_in_grpo=False (centring only). Masked "
        "tokens discount (OpenRLHF's loop runs over every position); rewards there are dropped. The reward "
        "penalties OpenRLHF adds before (KL, length penalties, reward clipping) are the framework's. "
        + _WHOLE_BATCH,
    )
    register(
        name="reinforce_baseline",
        fn=reinforce_baseline_advantage,
        params=ReinforceBaselineParams,
        paper="2501.03262",
        title="REINFORCE++-baseline (OpenRLHF's form): group-mean baseline, batch whitening with the biased variance",
        formula="G_t = sum_{k>=t} m_k r_k - mean_g S (on the response's tokens); A = (G - mu) / sqrt(max(var, 1e-8)), "
        "biased var",
        status=STABLE,
        batch_statistics=True,
        reference="OpenRLHF 0.11.2 experience_maker.compute_advantages_and_returns (estimator=reinforce_baseline)",
        notes="gamma is 1 (OpenRLHF forces it). Group of one: baseline 0 (OpenRLHF needs equal groups of "
        "n_samples_per_prompt > 1). The group mean is subtracted on each response's last valid token, where "
        "OpenRLHF places the outcome reward, so with outcome rewards every token carries S_i - mean_g. "
        "norm_adv_by_std_in_grpo=False is --algo.advantage.no_std_norm (centring only). " + _WHOLE_BATCH,
    )
    register(
        name="flash_reinforce",
        fn=flash_reinforce_advantage,
        params=NoParams,
        paper="2501.03262",
        title="FlashREINFORCE (OpenRLHF): reward minus the batch mean, no group, no whitening",
        formula="A_t = sum_{k>=t} m_k r_k - mean_batch S",
        status=STABLE,
        batch_statistics=True,
        reference="OpenRLHF 0.11.2 experience_maker.compute_advantages_and_returns (estimator=flash_reinforce)",
        notes="The single-rollout estimator (n_samples_per_prompt=1): the baseline is the mean score over the whole "
        "rollout batch (all DP ranks, ctx.all_reduce), subtracted on each response's last valid token; returns == "
        "advantages. OpenRLHF's flash_reinforce recipe also gates tokens by a binary-KL / TV importance-sampling "
        "rule in its loss (its rollout correction), which is not part of this estimator.",
    )
