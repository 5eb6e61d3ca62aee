"""Alternative objectives: RPG, PACS, GVPO and turn-level PPO.

* RPG (Zhang et al., arXiv 2505.17508), fully differentiable surrogates with the reference set to
  pi_old (the recipe's ``use_iterative_ref_model``): ``loss = agg(l_PPO) + beta * agg(k(w))``,
  ``w = exp(lp - lp_old)``, ``k`` one of fkl ``-log w``, rkl ``w log w``, ufkl ``w - log w - 1``,
  urkl ``w (log w - 1) + 1``, clamped to [-10, 10]. Defaults beta=1e-4, clip 0.2/0.28, c=10.
* PACS (Li et al., arXiv 2509.02522): ``s_i = beta sum_t m (lp - lp_old)``, RLOO within the group
  ``psi_i = s_i - mean_{j != i} s_j`` (gradient through the baseline), loss = mean_i w_i
  BCEWithLogits(psi_i, y_i) with the verifier outcome ``y_i in {0, 1}`` as label and "balanced"
  class weights per group. Default beta=1.
* GVPO (Zhang et al., arXiv 2504.19599): ``R_theta = beta (sum_t lp - sum_t lp_old)``,
  ``L = sum_g 1/(k-1) sum_i 1/2 [(R_theta_i - mean_g R_theta) - (R_i - mean_g R)]^2``. Default beta=0.1.
* Turn-PPO (ST-PPO/SORL turn-level IS, arXiv 2511.20718): GSPO-token with a turn id,
  ``log w_t = lp_t - sg(lp_t) + sg(mean_{t' in turn(t)} (lp - lp_old))`` inside the PPO clip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from stablerl import EXPERIMENTAL, STABLE, Params, hookimpl
from stablerl.ops import aggregate, clamped_log_ratio, mask_runs, masked_mean, masked_sum
from stablerl.params import StableRLError, check
from stablerl.primitives import (
    ClipParams, group_sum, ppo_clip_terms, refuse_token_weights, score_labels, sequence_mean_loss, valid_rows,
)

# ------------------------------------------------------------------------------------------- RPG

RPG_TERM_BOUND = 10.0
RPG_DIVERGENCES = ("fkl", "rkl", "ufkl", "urkl")


@dataclass
class RPGParams(ClipParams):
    clip_ratio_c: Optional[float] = 10.0  # recipe scripts
    kl_loss_coef: float = 1e-4  # beta
    divergence: str = "rkl"  # fkl | rkl (normalized) | ufkl | urkl (unnormalized)

    def validate(self) -> None:
        super().validate()
        check(self.kl_loss_coef >= 0, f"kl_loss_coef must be >= 0, got {self.kl_loss_coef}")
        check(self.divergence in RPG_DIVERGENCES, f"divergence must be one of {RPG_DIVERGENCES}, got {self.divergence!r}")


def rpg_divergence_term(log_w: torch.Tensor, divergence: str) -> torch.Tensor:
    w = torch.exp(log_w)
    if divergence == "fkl":
        term = -log_w
    elif divergence == "rkl":
        term = w * log_w
    elif divergence == "ufkl":
        term = w - log_w - 1.0
    else:  # urkl
        term = w * (log_w - 1.0) + 1.0
    return torch.clamp(term, -RPG_TERM_BOUND, RPG_TERM_BOUND)


def rpg_loss(b, p: RPGParams, ctx):
    mask = b.response_mask
    log_ratio = clamped_log_ratio(b.log_prob, b.old_log_prob)
    pg_losses, metrics = ppo_clip_terms(torch.exp(log_ratio), b.advantages, mask, p.clip_ratio_low, p.clip_ratio_high, p.clip_ratio_c)
    if b.is_weights is not None:
        pg_losses = pg_losses * b.is_weights
    term = rpg_divergence_term(log_ratio, p.divergence)
    kl_loss = aggregate(term, mask, b.loss_agg_mode, ctx, params=b.loss_agg_params)
    loss = aggregate(pg_losses, mask, b.loss_agg_mode, ctx, params=b.loss_agg_params) + p.kl_loss_coef * kl_loss
    metrics["ppo_kl"] = masked_mean(-log_ratio.detach(), mask)
    metrics["kl_loss"] = masked_mean(term.detach(), mask)
    return loss, metrics


# ------------------------------------------------------------------------------------------ groups


# ------------------------------------------------------------------------------------------ PACS


@dataclass
class PACSParams(Params):
    beta: float = 1.0
    reward_method: str = "1"  # "1": beta * sum_t (lp - lp_old);  "2": beta * mean_t lp
    adv_estimator: str = "rloo"  # rloo | grpo | naive
    use_weight: bool = True  # "balanced" class weights within each prompt group

    def validate(self) -> None:
        check(self.beta > 0, f"beta must be > 0, got {self.beta}")
        check(self.reward_method in ("1", "2"), f"reward_method must be '1' or '2', got {self.reward_method!r}")
        check(self.adv_estimator in ("rloo", "grpo", "naive"), f"adv_estimator must be rloo, grpo or naive, got {self.adv_estimator!r}")


def pacs_loss(b, p: PACSParams, ctx):
    refuse_token_weights(b, "pacs")
    mask = b.response_mask
    y = score_labels(b, "pacs")
    if not bool(((y == 0) | (y == 1)).all()):
        raise StableRLError("pacs: scores are used as labels and must be exactly 0 or 1")
    if p.reward_method == "1":
        s = p.beta * masked_sum(b.log_prob - b.old_log_prob, mask, dim=-1)  # masked: pad never leaks in
    else:
        s = p.beta * masked_mean(b.log_prob, mask, dim=-1)
    gid = b.index
    valid = valid_rows(b)
    n = group_sum(valid, gid)  # empty rows take no part in the group statistics
    if p.adv_estimator == "rloo":
        others = (group_sum(s, gid) - s) / (n - 1).clamp(min=1)
        psi = torch.where(n > 1, s - others, s)  # a group of one has no leave-one-out baseline
    elif p.adv_estimator == "grpo":
        mean = group_sum(s, gid) / n.clamp(min=1)
        var = group_sum(valid * (s - mean) ** 2, gid) / (n - 1).clamp(min=1)
        psi = (s - mean) / (var.sqrt() + 1e-6)
    else:
        psi = s
    if p.use_weight:
        pos = group_sum(y * valid, gid)
        neg = n - pos
        both = (pos > 0) & (neg > 0)
        count_own = torch.where(y > 0, pos, neg).clamp(min=1)
        weight = torch.where(both, n / (2.0 * count_own), torch.ones_like(n))
    else:
        weight = torch.ones_like(s)
    per_seq = weight * F.binary_cross_entropy_with_logits(psi, y, reduction="none")
    metrics = {
        "pacs/score_mean": s.detach().mean() if s.numel() else s.new_zeros(()),
        "pacs/psi_abs_mean": psi.detach().abs().mean() if psi.numel() else psi.new_zeros(()),
        "ppo_kl": masked_mean(b.old_log_prob - b.log_prob.detach(), mask),
    }
    return sequence_mean_loss(per_seq, valid, ctx), metrics


# ------------------------------------------------------------------------------------------ GVPO


@dataclass
class GVPOParams(Params):
    gvpo_beta: float = 0.1
    reduction: str = "sum"  # sum (reference: summed over sequences) | mean (divided by the sequence count)

    def validate(self) -> None:
        check(self.gvpo_beta > 0, f"gvpo_beta must be > 0, got {self.gvpo_beta}")
        check(self.reduction in ("sum", "mean"), f"reduction must be 'sum' or 'mean', got {self.reduction!r}")


def gvpo_loss(b, p: GVPOParams, ctx):
    refuse_token_weights(b, "gvpo")
    mask = b.response_mask
    rewards = score_labels(b, "gvpo")
    gid = b.index
    valid = valid_rows(b)
    k = group_sum(valid, gid)  # empty rows take no part in the group statistics
    contrastive = valid * (k >= 2).to(valid.dtype)  # a group of one has no residual to fit
    k = k.clamp(min=1)
    r_theta = p.gvpo_beta * masked_sum(b.log_prob - b.old_log_prob, mask, dim=-1)
    # the group mean of R_theta may be detached: the residuals sum to 0 within a group, so its
    # gradient contribution cancels exactly (and the value is unchanged)
    r_theta_centred = r_theta - group_sum(r_theta.detach() * valid, gid) / k
    reward_centred = rewards - group_sum(rewards * valid, gid) / k
    residual = (r_theta_centred - reward_centred) * contrastive
    per_seq = 0.5 * residual**2 / (k - 1).clamp(min=1)
    if p.reduction == "sum":
        loss = per_seq.sum() * ctx.dp_size
    else:
        loss = sequence_mean_loss(per_seq, valid, ctx)
    metrics = {
        "gvpo/residual_abs_mean": residual.detach().abs().mean() if residual.numel() else residual.new_zeros(()),
        "gvpo/singleton_fraction": masked_mean(valid - contrastive, valid),
        "ppo_kl": masked_mean(b.old_log_prob - b.log_prob.detach(), mask),
    }
    return loss, metrics


# -------------------------------------------------------------------------------------- Turn-PPO


def segment_mean(values: torch.Tensor, segment: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the tokens of each (row, segment id), broadcast back to the tokens."""
    B, T = values.shape
    valid = (mask > 0) & (segment >= 0)
    n_seg = int(segment.max().item()) + 1 if segment.numel() else 1
    key = (torch.arange(B, device=values.device).unsqueeze(-1) * max(n_seg, 1) + segment.clamp(min=0)).reshape(-1)
    weight = valid.reshape(-1).to(values.dtype)
    size = B * max(n_seg, 1)
    total = torch.zeros(size, dtype=values.dtype, device=values.device).index_add(0, key, values.reshape(-1) * weight)
    count = torch.zeros(size, dtype=values.dtype, device=values.device).index_add(0, key, weight)
    return (total / count.clamp(min=1))[key].reshape(B, T) * valid


def turn_ppo_loss(b, p: ClipParams, ctx):
    mask = b.response_mask
    # without explicit turn ids a turn is a contiguous run of trained tokens (tool/environment tokens are masked)
    turn_ids = mask_runs(mask) if b.turn_ids is None else b.turn_ids.to(torch.long)
    log_ratio = clamped_log_ratio(b.log_prob, b.old_log_prob)
    turn_log_ratio = segment_mean(log_ratio.detach(), turn_ids, mask)
    log_w = b.log_prob - b.log_prob.detach() + turn_log_ratio
    pg_losses, metrics = ppo_clip_terms(torch.exp(log_w), b.advantages, mask, p.clip_ratio_low, p.clip_ratio_high, p.clip_ratio_c)
    metrics["ppo_kl"] = masked_mean(-log_ratio.detach(), mask)
    metrics["turn_ppo/turn_ratio_mean"] = masked_mean(torch.exp(turn_log_ratio), mask * (turn_ids >= 0))
    return pg_losses, metrics


@dataclass
class TurnPPOParams(ClipParams):
    clip_ratio_high: float = 0.2  # the SORL experiments use eps = 0.2


@hookimpl
def register_policy_losses(register):
    register(
        name="rpg",
        fn=rpg_loss,
        params=RPGParams,
        output="scalar",
        paper="2505.17508",
        title="RPG: regularized policy gradient with a forward/reverse, normalized/unnormalized KL to pi_old",
        formula="loss = agg(l_PPO) + beta agg(clamp(k(w), -10, 10)), w = exp(lp - lp_old), k in fkl|rkl|ufkl|urkl",
        status=EXPERIMENTAL,
        metrics=("pg_clipfrac", "pg_clipfrac_lower", "clip_high", "clip_low", "ppo_kl", "kl_loss"),
        reference="complex-reasoning/RPG core_algos.py::kl_penalty (rpg_fkl/rkl/ufkl/urkl), iterative reference",
        notes=(
            "The differentiable ('fully differentiable surrogate') variants with the reference = pi_old, as the "
            "official scripts run them. The REINFORCE-style rpg_rf_* variants and JS variants are not included. "
            "Read from the authors' code, not executed against it."
        ),
    )
    register(
        name="pacs",
        aggregation="sequence mean (seq-mean-token-sum of the per-sequence loss)",
        fn=pacs_loss,
        params=PACSParams,
        output="scalar",
        paper="2509.02522",
        title="PACS: implicit actor-critic coupling as supervised learning (BCE on an RLOO-centred score)",
        formula="s_i = beta sum_t (lp - lp_old); psi_i = s_i - mean_{j!=i} s_j; loss = mean_i w_i BCE(psi_i, y_i)",
        status=STABLE,
        requires=("scores", "index"),
        metrics=("pacs/score_mean", "pacs/psi_abs_mean", "ppo_kl"),
        reference="ritzz-ai/PACS src/pacs/pacs_core_algos.py::compute_pacs_loss (reward_method='1', rloo)",
        notes=(
            "scores are the verifier outcomes used as labels (exactly 0/1). The response mask is applied to the "
            "log-ratio sum (the reference sums all positions, which leaks padding unless it carries 0). All "
            "responses of a prompt must be in the same call. A group of one has no RLOO baseline (psi = s). "
            "Sequence mean with global normalisers (seq_count)."
        ),
    )
    register(
        name="gvpo",
        aggregation=lambda p: "sequence sum (reduction='sum')" if p is None or p.reduction == "sum"
        else "sequence mean (seq-mean-token-sum of the per-sequence loss)",
        fn=gvpo_loss,
        params=GVPOParams,
        output="scalar",
        paper="2504.19599",
        title="GVPO: group variance policy optimization (KL-constrained analytic weights)",
        formula="L = sum_g 1/(k-1) sum_i 1/2 [(R_th_i - mean R_th) - (R_i - mean R)]^2, R_th = beta (sum lp - sum lp_old)",
        status=EXPERIMENTAL,
        requires=("scores", "index"),
        metrics=("gvpo/residual_abs_mean", "gvpo/singleton_fraction", "ppo_kl"),
        reference="jszkc/GVPO (= verl-recipe gvpo) gvpo_core_algos.py::compute_policy_loss_gvpo",
        notes=(
            "scores are the raw (un-normalised) rewards R. Groups must be whole within the call; a group with a "
            "single (non-empty) response contributes 0 (logged as gvpo/singleton_fraction; the reference requires "
            ">= 2). reduction='sum' is the reference (a sum over sequences, x dp_size); 'mean' divides by the "
            "global sequence count. Read from the reference code, not executed against it."
        ),
    )
    register(
        name="turn_ppo",
        fn=turn_ppo_loss,
        params=TurnPPOParams,
        paper="2511.20718",
        title="Turn-level importance sampling for multi-turn agents (ST-PPO/SORL Turn-PPO)",
        formula="log w_t = lp_t - sg(lp_t) + sg(mean_{turn(t)}(lp - lp_old)); l = max(-A w, -A clip(w, 1-eps_l, 1+eps_h))",
        status=EXPERIMENTAL,
        optional_inputs=("turn_ids",),
        metrics=("pg_clipfrac", "pg_clipfrac_lower", "clip_high", "clip_low", "ppo_kl", "turn_ppo/turn_ratio_mean"),
        reference="secondary descriptions of arXiv 2511.20718 (code not read)",
        notes=(
            "Assumes the geometric mean of token ratios per turn, as the secondary accounts of arXiv 2511.20718 "
            "state (among them emergentmind's 'turn-level importance sampling' page: 'geometric means of token-level "
            "ratios over conversation turns'); one wiki note claims an arithmetic mean, and a third-party "
            "reimplementation uses one ratio per transition. The paper's Eq. 4 itself could not be read (rechecked "
            "for issue 16: the stored copies stop at the abstract and the Fig. 1 caption, and the authors' code "
            "Cloud0723/SORL has no snapshot here), so the mean type stays unverified and the status experimental. "
            "Also assumed: the GSPO-token gradient (each token through its own log-prob); a form whose gradient "
            "flows through the turn mean, as a third-party fork has, gives the same value, and the same gradient "
            "while the advantage is constant within each turn, but not with per-token (GAE) advantages. A wiki "
            "rendering of the paper's Lemma 4.1, (1/|y|) sum_k w_k A_k / |y_k| grad log pi(y_k), would count each turn "
            "once instead of each token (a turn of n tokens weighs n times less than here); not adopted, unverified. "
            "turn_ids (optional): per-token turn index, < 0 on non-trained tokens; without it a turn is a contiguous "
            "run of trained tokens (ops.mask_runs: the loss mask leaves out tool/environment tokens in verl's agent "
            "loop, TRL's tool_mask and OpenRLHF's action_ranges, so the runs are the assistant turns; a token-level "
            "filter that masks tokens inside a turn splits it). The clipping-bias correction "
            "(CTN) of ST-PPO is not implemented (see st_ppo). With one turn per sequence this equals gspo at the "
            "same bounds (with dual clip)."
        ),
    )
