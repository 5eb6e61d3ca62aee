"""GiGPO: group-in-group policy optimisation for multi-step agents (Feng et al., arXiv 2505.10978).

One batch row per agent step (its response is the step's action). Two relative advantages, added:

    episode (Eq. 3):  A_ep   = (S - mean_g S) [/ (std_g S + epsilon)]          g: the episode group (index)
    step    (Eq. 7):  A_step = (G - mean_a G) [/ (std_a G + epsilon)]          a: rows of g with the same anchor state
    joint   (Eq. 8):  A = A_ep + step_advantage_w * A_step, on every response token

S is the row's episode score (the sum of its token-level rewards; every step row of a trajectory carries the
episode's outcome), G the step's discounted return ``step_returns`` (Eq. 5, from the agent loop), and the anchor
groups are the rows of an episode group with equal ``anchor_ids`` (Eq. 6: identical observed states). The
bracketed std division is ``mode="mean_std_norm"``; the default ``mode="mean_norm"`` only centres. The episode
statistics are over all step rows of the group (the reference's ``compute_mean_std_cross_steps=True``).
Conventions (the reference's): an episode group of one row has mean 0, std 1; an anchor group of one has its own
value as mean (A_step = 0), std 1. Defaults: ``mode="mean_norm"``, ``step_advantage_w=1.0``, ``epsilon=1e-6``.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import torch

from stablerl import EXPERIMENTAL, Params, hookimpl
from stablerl.ops import group_stats
from stablerl.params import StableRLError, check
from stablerl.primitives import singleton_convention

MODES = ("mean_norm", "mean_std_norm")


@dataclass
class GiGPOParams(Params):
    """verl-agent's ``algorithm.gigpo.mode``, ``step_advantage_w`` and the std ``epsilon``."""

    mode: str = "mean_norm"
    step_advantage_w: float = 1.0
    epsilon: float = 1e-6

    def validate(self) -> None:
        check(self.mode in MODES, f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        check(self.epsilon >= 0, f"epsilon must be >= 0, got {self.epsilon}")
        # a negative weight would train against the step-level signal (Eq. 8 adds it): not a setting of the paper
        check(math.isfinite(self.step_advantage_w) and self.step_advantage_w >= 0,
              f"step_advantage_w must be a finite value >= 0 (the weight of the step-level advantage), "
              f"got {self.step_advantage_w}")


def _per_row(b, name: str, dtype) -> torch.Tensor:
    value = torch.as_tensor(b.extras[name], device=b.token_level_rewards.device)
    B = b.token_level_rewards.shape[0]
    if tuple(value.shape) != (B,):
        raise StableRLError(f"gigpo: {name} has shape {tuple(value.shape)}, expected [{B}] (one value per agent step)")
    if dtype is torch.long:
        if value.is_floating_point() and not bool((value == value.round()).all()):
            raise StableRLError("gigpo: anchor_ids must be integers (ids of identical observed states)")
        return value.to(torch.long)
    value = value.to(dtype)
    if not bool(torch.isfinite(value).all()):
        raise StableRLError(f"gigpo: {name} has non-finite values (NaN or inf)")
    return value


def _normalise(values, mean, std, p: GiGPOParams):
    centred = values - mean
    return centred / (std + p.epsilon) if p.mode == "mean_std_norm" else centred


def gigpo_advantage(b, p: GiGPOParams, ctx):
    scores = b.scores
    mean, std, count = group_stats(scores, b.index)
    mean, std = singleton_convention(mean, std, count)
    episode = _normalise(scores, mean, std, p)
    returns = _per_row(b, "step_returns", scores.dtype)
    anchors = _per_row(b, "anchor_ids", torch.long)
    # anchor groups live inside episode groups: the same state in two episode groups is two groups
    _, step_gid = torch.unique(torch.stack([b.index, anchors]), dim=1, return_inverse=True)
    s_mean, s_std, s_count = group_stats(returns, step_gid)
    s_std = torch.where(s_count < 2, torch.ones_like(s_std), s_std)  # a lone step: own mean (A_step = 0), std 1
    step = _normalise(returns, s_mean, s_std, p)
    adv = b.on_response_tokens(episode + p.step_advantage_w * step)
    return adv, adv


@hookimpl
def register_advantage_estimators(register):
    register(
        name="gigpo",
        fn=gigpo_advantage,
        params=GiGPOParams,
        paper="2505.10978",
        title="GiGPO: episode-level group advantage plus step-level advantage over anchor-state groups (agents)",
        formula="A = (S - mean_g S) + w (G - mean_{g, anchor} G) (mode=mean_norm; mean_std_norm divides each by "
        "std + eps)",
        status=EXPERIMENTAL,
        requires=("index", "anchor_ids", "step_returns"),
        reference="langfengQ/verl-agent gigpo/core_gigpo.py compute_gigpo_outcome_advantage (episode_norm_reward, "
        "build_step_group with exact matching, step_norm_reward); read, not executed against",
        notes="One batch row per agent step: index = the episode group (same task / environment seed), "
        "anchor_ids = ids of identical observed states (the reference hashes the observation; its optional "
        "similarity-threshold clustering is not offered), step_returns = the discounted return from the step "
        "(Eq. 5, gamma is the agent loop's; the reference's default 0.95). Experimental until run against the "
        "reference's function. No stock trainer of verl, TRL or OpenRLHF produces one row per agent step with "
        "anchor ids: verl takes both as batch fields from a customised agent loop "
        "(+algorithm.stablerl_batch_field_estimators=true); elsewhere use stablerl.compute_advantage. "
        "returns == advantages.",
    )
