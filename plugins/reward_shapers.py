"""Reward shapers: transform per-response scalar rewards before the advantage estimator.

* ``redit`` — ReDit, reward dithering (Wei et al., arXiv 2506.18631):
  ``r~_i = r_i + eps_i``, eps_i i.i.d. zero-mean, drawn once per response (not per token) before the
  group statistics; ``distribution="uniform"`` U(-a, a) with ``scale`` a = 0.05 (default), or
  ``"gaussian"`` N(0, scale^2).
* ``grpo_lambda`` — GRPO-λ (Dai, Liu, Si, arXiv 2505.18086), experimental: the top-``lambda_ratio``
  fraction of groups by correctness ratio c_g = #correct / G get a Kimi-1.5 length reward
  ``len_i = 0.5 - (l_i - l_min)/(l_max - l_min)`` (r + len for correct, r + min(0, len) for incorrect).
* ``fapo`` — FAPO flawed-positive penalty (Ding et al., arXiv 2510.22543):
  ``R_FAPO = R - lambda`` for correct responses flagged flawed, ``lambda = 1.0`` on the ±1 scale.

Shapers run on the whole (gathered) batch in the trainer's driver, before the estimator, so
batch-wide choices (GRPO-λ's ranking of groups) see every group; they take no ctx reductions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from stablerl import EXPERIMENTAL, STABLE, Params, hookimpl
from stablerl.ops import group_stats
from stablerl.params import check
from stablerl.primitives import draw_normal, draw_uniform, per_response, refuse_param_typos


# ----------------------------------------------------------------------------- shared helpers


def _scalar(v: Any, device) -> torch.Tensor:
    return torch.as_tensor(float(v), dtype=torch.float32, device=device)


# ----------------------------------------------------------------------------- ReDit

REDIT_DISTRIBUTIONS = ("uniform", "gaussian")


@dataclass
class ReDitParams(Params):
    """Noise law and scale: U(-scale, scale) or N(0, scale^2), one draw per response."""

    distribution: str = "uniform"
    scale: float = 0.05

    def validate(self) -> None:
        check(self.distribution in REDIT_DISTRIBUTIONS,
              f"distribution must be one of {list(REDIT_DISTRIBUTIONS)}, got {self.distribution!r}")
        check(math.isfinite(self.scale) and self.scale >= 0, f"scale must be finite and >= 0, got {self.scale}")


def redit(b, p: ReDitParams, ctx):
    refuse_param_typos(b.extras, ReDitParams, "redit")
    n, device, dt = b.scores.shape[0], b.scores.device, b.scores.dtype
    if p.distribution == "uniform":
        noise = (draw_uniform(n, ctx.generator, device) * 2.0 - 1.0) * p.scale
    else:
        noise = draw_normal(n, ctx.generator, device) * p.scale
    shaped = b.scores + noise.to(dt)
    _, std_before, count = group_stats(b.scores, b.index)
    flat = (std_before == 0) & (count > 1)  # all-equal groups: their advantages become pure noise
    metrics = {
        "redit/noise_std": noise.std(unbiased=False).float() if n else _scalar(0.0, device),
        "redit/noise_abs_max": noise.abs().max().float() if n else _scalar(0.0, device),
        "redit/flat_group_response_frac": flat.float().mean() if n else _scalar(0.0, device),
    }
    return shaped, metrics


# ----------------------------------------------------------------------------- GRPO-lambda


@dataclass
class GRPOLambdaParams(Params):
    """Fraction of groups (ranked by correctness ratio) that get the length reward."""

    lambda_ratio: float = 0.5  # ASSUMED default: the paper's value was not retrieved

    def validate(self) -> None:
        check(0.0 <= self.lambda_ratio <= 1.0, f"lambda_ratio must be in [0, 1], got {self.lambda_ratio}")


def grpo_lambda(b, p: GRPOLambdaParams, ctx):
    refuse_param_typos(b.extras, GRPOLambdaParams, "grpo_lambda")
    n, device, dt = b.scores.shape[0], b.scores.device, b.scores.dtype
    correct = per_response(b.extras, "correct", n, device, kind="bool")
    lengths = per_response(b.extras, "lengths", n, device, nonnegative=True)
    gid = b.index
    n_groups = int(gid.max().item()) + 1 if n else 0
    ratio, _, _ = group_stats(correct.to(torch.float64), gid)  # c_g per response
    # rank groups by c_g (descending; ties: first-appearance order) and take the top floor(lambda * n_groups)
    group_ratio = torch.zeros(n_groups, dtype=torch.float64, device=device).scatter(0, gid, ratio)
    k = int(math.floor(p.lambda_ratio * n_groups + 1e-9))
    order = torch.sort(-group_ratio, stable=True).indices
    selected_group = torch.zeros(n_groups, dtype=torch.bool, device=device)
    selected_group[order[:k]] = True
    selected = selected_group[gid] if n else torch.zeros(0, dtype=torch.bool, device=device)

    # Kimi-1.5 length reward within the group: 0.5 - (l - l_min)/(l_max - l_min); 0 when l_max == l_min
    base = torch.zeros(n_groups, dtype=torch.float64, device=device)
    l_min = base.scatter_reduce(0, gid, lengths, "amin", include_self=False)
    l_max = base.scatter_reduce(0, gid, lengths, "amax", include_self=False)
    span = (l_max - l_min)[gid] if n else lengths
    lo = l_min[gid] if n else lengths
    len_reward = torch.where(span > 0, 0.5 - (lengths - lo) / span.clamp(min=1e-12), torch.zeros_like(lengths))
    bonus = torch.where(correct, len_reward, len_reward.clamp(max=0.0))
    bonus = torch.where(selected, bonus, torch.zeros_like(bonus))
    shaped = b.scores + bonus.to(dt)
    metrics = {
        "grpo_lambda/selected_group_frac": _scalar(k / n_groups if n_groups else 0.0, device),
        "grpo_lambda/selected_response_frac": selected.float().mean() if n else _scalar(0.0, device),
        "grpo_lambda/len_reward_mean": (bonus[selected].mean().float() if bool(selected.any())
                                        else _scalar(0.0, device)),
    }
    return shaped, metrics


# ----------------------------------------------------------------------------- FAPO


@dataclass
class FAPOParams(Params):
    """The flawed-positive penalty (``FLAWED_REWARD_PENALTY``): 1.0 on the ±1 reward scale."""

    flawed_reward_penalty: float = 1.0

    def validate(self) -> None:
        check(math.isfinite(self.flawed_reward_penalty) and self.flawed_reward_penalty >= 0,
              f"flawed_reward_penalty must be finite and >= 0, got {self.flawed_reward_penalty}")


def fapo(b, p: FAPOParams, ctx):
    refuse_param_typos(b.extras, FAPOParams, "fapo")
    n, device, dt = b.scores.shape[0], b.scores.device, b.scores.dtype
    flawed = per_response(b.extras, "flawed", n, device, kind="bool")
    if b.extras.get("correct") is not None:
        correct = per_response(b.extras, "correct", n, device, kind="bool")
    else:
        correct = b.scores > 0
    flawed_positive = flawed & correct
    shaped = b.scores - flawed_positive.to(dt) * p.flawed_reward_penalty
    n_correct = int(correct.sum())
    metrics = {
        "fapo/flawed_positive_frac": flawed_positive.float().mean() if n else _scalar(0.0, device),
        "fapo/flawed_of_correct_frac": _scalar(int(flawed_positive.sum()) / n_correct if n_correct else 0.0, device),
    }
    return shaped, metrics


@hookimpl
def register_reward_shapers(register):
    register(
        name="redit",
        fn=redit,
        params=ReDitParams,
        paper="2506.18631",
        title="ReDit: reward dithering (zero-mean noise on discrete rewards)",
        formula="r~_i = r_i + eps_i, eps_i ~ U(-a, a) (a = 0.05) or N(0, sigma^2), once per response",
        status=EXPERIMENTAL,
        metrics=("redit/noise_std", "redit/noise_abs_max", "redit/flat_group_response_frac"),
        reference="paper (official repo has no library function: 'modify the reward function'); catalogue §3.1",
        notes=(
            "Experimental: the default uniform a = 0.05 comes from a third-party reading of the paper's ablation "
            "(a in {0.01, 0.05, 0.5}, 0.05 best), not from code; the v2/v3 variance schedule is not implemented. "
            "Noise is drawn once per response from ctx.generator (seeded reproducibility; torch's global RNG when "
            "None), in float64 on the generator's device, then added; run it before the advantage estimator. "
            "Subtlety: with std-normalised GRPO an all-equal group (all right / all wrong) becomes pure noise "
            "with O(1) advantages (the paper's 'exploratory gradient' in flat regions), because the group std is "
            "then O(a) and divides the O(a) noise; with Dr.GRPO (no std division) the advantages are O(a). "
            "We reproduce the paper's setting (noise, then plain GRPO) and report the fraction of responses in "
            "such flat groups as redit/flat_group_response_frac."
        ),
    )
    register(
        name="grpo_lambda",
        fn=grpo_lambda,
        params=GRPOLambdaParams,
        paper="2505.18086",
        title="GRPO-λ: correctness-ratio-gated length penalty (Stable RL for Efficient Reasoning)",
        formula="top-λ groups by c_g: r + len (correct), r + min(0, len) (wrong); len = 0.5 - (l - l_min)/(l_max - l_min)",
        status=EXPERIMENTAL,
        requires=("correct", "lengths"),
        metrics=("grpo_lambda/selected_group_frac", "grpo_lambda/selected_response_frac", "grpo_lambda/len_reward_mean"),
        reference="none (no code found); catalogue §3.2 (mechanism from the abstract; details unverified)",
        notes=(
            "Experimental, every choice unverified against the paper: (1) batch-wise selection of the top "
            "floor(lambda_ratio * n_groups) groups ranked by correctness ratio c_g = #correct/G (descending, ties "
            "broken by first appearance), not a threshold on c_g; groups with c_g = 0 can be selected when they "
            "rank in the top fraction; (2) lambda_ratio = 0.5 is an assumed default; (3) the length reward is "
            "Kimi-1.5's, with l_min/l_max over all responses of the group (correct and incorrect), 0 when "
            "l_max == l_min; correct responses get r + len, incorrect r + min(0, len); unselected groups keep "
            "their reward. Name collisions: not arXiv 2510.00194 (eligibility traces) nor 2510.06870 (λ-GRPO)."
        ),
    )
    register(
        name="fapo",
        fn=fapo,
        params=FAPOParams,
        paper="2510.22543",
        title="FAPO: flawed-positive penalty on generative-reward-model-flagged correct responses",
        formula="R_FAPO = R - lambda * [correct and flawed], lambda = 1.0 on the ±1 scale",
        status=STABLE,
        requires=("flawed",),
        metrics=("fapo/flawed_positive_frac", "fapo/flawed_of_correct_frac"),
        reference="verl-recipe fapo/reward_fn_reasoning.py::compute_score_fapo (FLAWED_REWARD_PENALTY = 1.0)",
        notes=(
            "The flaw detection (a GenRM asked for the earliest erroneous step; -1 = no error; parse failure = "
            "not flawed; skipped for the test split and for incorrect answers) is the user's reward function: "
            "pass its result as flawed [B] bool. correct [B] bool is optional; when absent, correct = score > 0 "
            "(the ±1 convention). The penalty is only applied to correct responses, so flawed incorrect ones "
            "are unchanged. lambda = 1.0 is tied to the ±1 scale (a flawed positive gets 0, between right and "
            "wrong); with 0/1 rewards use flawed_reward_penalty=0.5."
        ),
    )
