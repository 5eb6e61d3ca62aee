"""Decoupled PPO and A-3PO: off-policy losses with a proximal policy between behaviour and current.

Decoupled PPO (Hilton et al., arXiv 2110.00641; AReaL, arXiv 2505.24298):

    w = exp(lp_prox - lp_behav) (detached; rejection by a band on w),  r = exp(lp - lp_prox)
    l = w * max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))   (optional dual clip c)
    loss = sum(m' * l) / count(m)     -- rejected tokens keep their place in the denominator

``lp_behav`` is ``rollout_log_prob`` (the inference engine's), ``lp_prox`` is ``old_log_prob``
(the trainer's recompute at the start of the step).

A-3PO (Li, Wu, Shen, arXiv 2512.06547) replaces the proximal forward pass by an interpolation
between behaviour and current policy, using each token's generating policy version:

    alpha = (v_prox - v_behav) / (v_theta - v_behav) if v_theta > v_behav and v_behav >= 0 else 0,
    v_prox = v_theta - 1,  lp_prox = lp_behav + alpha * (sg(lp) - lp_behav)     (loglinear)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from stablerl import EXPERIMENTAL, Params, hookimpl
from stablerl.fused import FusedLoss, fused_log_ratio
from stablerl.ops import clamped_log_ratio, masked_mean, seq_mean
from stablerl.params import StableRLError, check
from stablerl.primitives import ppo_clip_fused, ppo_clip_terms, ratio_backward


@dataclass
class DecoupledParams(Params):
    clip_ratio_low: float = 0.2  # AReaL eps_clip (one eps in its examples)
    clip_ratio_high: float = 0.2
    clip_ratio_c: Optional[float] = None  # AReaL's optional dual clip
    behave_imp_weight_cap: Optional[float] = 5.0  # AReaL rejection_sampling.upper
    behave_imp_weight_floor: Optional[float] = None  # rejection_sampling.lower
    behave_imp_weight_mode: str = "mask"  # mask (reject outside the band) | clamp
    behave_imp_weight_level: str = "token"  # token | sequence (geometric mean over the sequence)

    def validate(self) -> None:
        check(self.clip_ratio_low >= 0 and self.clip_ratio_high >= 0, "clip_ratio_low and clip_ratio_high must be "
              f">= 0, got clip_ratio_low={self.clip_ratio_low}, clip_ratio_high={self.clip_ratio_high}")
        check(self.clip_ratio_c is None or self.clip_ratio_c > 1, f"clip_ratio_c must be > 1 or None, got {self.clip_ratio_c}")
        check(self.behave_imp_weight_cap is None or self.behave_imp_weight_cap > 0, "behave_imp_weight_cap must be > 0 or None")
        check(self.behave_imp_weight_floor is None or self.behave_imp_weight_floor >= 0,
              f"behave_imp_weight_floor must be >= 0 (an importance-weight bound) or None, got {self.behave_imp_weight_floor}")
        check(self.behave_imp_weight_floor is None or self.behave_imp_weight_cap is None
              or self.behave_imp_weight_floor < self.behave_imp_weight_cap,
              "behave_imp_weight_floor must be below behave_imp_weight_cap")
        check(self.behave_imp_weight_mode in ("mask", "clamp"), f"behave_imp_weight_mode must be mask or clamp, got {self.behave_imp_weight_mode!r}")
        check(self.behave_imp_weight_level in ("token", "sequence"), "behave_imp_weight_level must be token or sequence")


def decoupled_terms(lp, lp_prox, lp_behav, b, p: DecoupledParams):
    """The decoupled PPO per-token loss given a proximal log-prob (shared by decoupled_ppo and a3po)."""
    _refuse_is_weights(b)
    log_w, w, keep = _behaviour_weight(lp_prox, lp_behav, b, p)
    mask = b.response_mask
    log_ratio = clamped_log_ratio(lp, lp_prox)
    ratio = torch.exp(log_ratio)
    pg_losses, metrics = ppo_clip_terms(ratio, b.advantages, mask, p.clip_ratio_low, p.clip_ratio_high, p.clip_ratio_c)
    metrics.update(_weight_metrics(log_ratio.detach(), ratio.detach(), log_w, w, keep, mask))
    return pg_losses * (w * keep).detach(), metrics


def decoupled_fused(lp, lp_prox, lp_behav, b, p: DecoupledParams):
    """:func:`decoupled_terms` as a fused form (``lp`` detached, as every input here): the fused PPO
    clip (``ppo_clip_fused``) times the detached behaviour weight ``c = w * keep``; autograd's order
    gives ``((g * c) * -A) * (F r)``."""
    _refuse_is_weights(b)
    mask = b.response_mask
    with torch.no_grad():
        log_w, w, keep = _behaviour_weight(lp_prox, lp_behav, b, p)
        log_ratio, in_range = fused_log_ratio(lp, lp_prox)
        ratio = torch.exp(log_ratio)
        pg_losses, metrics, neg_adv, factor = ppo_clip_fused(
            ratio, b.advantages, mask, p.clip_ratio_low, p.clip_ratio_high, p.clip_ratio_c)
        metrics.update(_weight_metrics(log_ratio, ratio, log_w, w, keep, mask))
        weight = w * keep
        ratio_factor = factor.mul_(ratio)
        if in_range is not None:
            ratio_factor.mul_(in_range)
        pg_losses = pg_losses * weight
    # core's cleaned [B, T] advantages are zero on padding and the weight finite: so is the loss
    return FusedLoss(pg_losses, metrics, _weighted_ratio_backward, (weight, neg_adv, ratio_factor), zero_padded=True)


def _weighted_ratio_backward(grad, weight, neg_adv, ratio_factor):
    return ratio_backward(grad * weight, neg_adv, ratio_factor)


def _weight_metrics(log_ratio, ratio, log_w, w, keep, mask):
    return {
        "ppo_kl": masked_mean(-log_ratio, mask),
        "importance_weight": masked_mean(ratio, mask),
        "behave_imp_weight": masked_mean(w, mask * keep),
        "behave_approx_kl": masked_mean(-log_w, mask),
        "rs_filtered_fraction": masked_mean(1.0 - keep, mask),
    }


def _refuse_is_weights(b):
    if b.is_weights is not None:
        # the behaviour IS weight is this loss's own; a framework correction on top would apply it twice
        raise StableRLError(
            "decoupled_ppo/a3po apply their own behaviour-policy IS weight from rollout_log_prob: do not also pass "
            "is_weights (a framework's rollout-correction weights; the TRL and OpenRLHF adapters leave theirs out "
            "for these losses; in verl set algorithm.rollout_correction.rollout_is=null)"
        )


def _behaviour_weight(lp_prox, lp_behav, b, p: DecoupledParams):
    """``(log w, w, keep)``: the behaviour IS weight (clamped, or masked to its band by ``keep``)."""
    mask = b.response_mask
    log_w = clamped_log_ratio(lp_prox, lp_behav)
    if p.behave_imp_weight_level == "sequence":
        log_w = seq_mean(log_w, mask).unsqueeze(-1).expand_as(log_w)
    w = torch.exp(log_w)
    low = 0.0 if p.behave_imp_weight_floor is None else p.behave_imp_weight_floor
    high = float("inf") if p.behave_imp_weight_cap is None else p.behave_imp_weight_cap
    if p.behave_imp_weight_mode == "mask":
        keep = ((w >= low) & (w <= high)).to(w.dtype)
    else:
        w = w.clamp(min=low, max=high)
        keep = torch.ones_like(w)
    return log_w, w, keep


def decoupled_ppo_loss(b, p: DecoupledParams, ctx):
    return decoupled_terms(b.log_prob, b.old_log_prob, b.rollout_log_prob, b, p)


def decoupled_ppo_fused(b, p: DecoupledParams, ctx):
    return decoupled_fused(b.log_prob, b.old_log_prob, b.rollout_log_prob, b, p)


@dataclass
class A3POParams(DecoupledParams):
    prox_logp_method: str = "loglinear"  # loglinear (recommended) | linear | recompute (= decoupled PPO)

    def validate(self) -> None:
        super().validate()
        check(
            self.prox_logp_method in ("loglinear", "linear", "recompute"),
            f"prox_logp_method must be loglinear, linear or recompute, got {self.prox_logp_method!r}",
        )


def a3po_alpha(versions: torch.Tensor, policy_version: int) -> torch.Tensor:
    """Interpolation weight of each token: 0 for the previous and the current version, and for prompts."""
    v_behav = versions.to(torch.float64)
    v_theta = float(policy_version)
    diff = v_theta - v_behav
    alpha = torch.where((diff > 0) & (v_behav >= 0), (v_theta - 1.0 - v_behav) / diff.clamp(min=1.0), torch.zeros_like(v_behav))
    return alpha.clamp(0.0, 1.0)


# integer versions spanning at most this many values take the per-value table (below)
_ALPHA_TABLE_MAX = 1 << 12


def a3po_alpha_as(versions: torch.Tensor, policy_version: int, dtype) -> torch.Tensor:
    """``a3po_alpha(versions, policy_version).to(dtype)``, value for value. For integer versions
    (a few distinct values), the per-token float64 formula is evaluated once per value in their
    range and gathered (one index pass instead of about ten float64 [B, T] passes); the same
    function of the same values, so the same bits."""
    if versions.dtype.is_floating_point or versions.dtype == torch.bool or versions.numel() == 0:
        return a3po_alpha(versions, policy_version).to(dtype)
    lo, hi = (int(x) for x in torch.aminmax(versions))
    if hi - lo >= _ALPHA_TABLE_MAX:
        return a3po_alpha(versions, policy_version).to(dtype)
    table = a3po_alpha(torch.arange(lo, hi + 1, device=versions.device), policy_version).to(dtype)
    index = (versions - lo).reshape(-1)
    return torch.index_select(table, 0, index).view(versions.shape)


def a3po_loss(b, p: A3POParams, ctx, terms=decoupled_terms):
    lp_behav = b.rollout_log_prob
    if p.prox_logp_method == "recompute":
        lp_prox = b.old_log_prob
        alpha = torch.zeros_like(lp_behav)
    else:
        alpha = a3po_alpha_as(b.versions, b.policy_version, lp_behav.dtype)
        current = b.log_prob.detach()  # sg(lp): the gradient must stay the plain r * grad lp
        if p.prox_logp_method == "loglinear":
            lp_prox = lp_behav + alpha * (current - lp_behav)
        else:
            lp_prox = torch.log((1 - alpha) * torch.exp(lp_behav) + alpha * torch.exp(current) + 1e-10)
    out = terms(b.log_prob, lp_prox, lp_behav, b, p)
    metrics = out.metrics if isinstance(out, FusedLoss) else out[1]
    metrics["a3po/alpha_mean"] = masked_mean(alpha, b.response_mask)
    metrics["a3po/approx_logp"] = masked_mean(lp_prox, b.response_mask)
    return out


def a3po_fused(b, p: A3POParams, ctx):
    """:func:`a3po_loss` as a fused form (the proximal log-prob reads ``sg(lp)``: no gradient)."""
    with torch.no_grad():
        return a3po_loss(b, p, ctx, terms=decoupled_fused)


_METRICS = ("pg_clipfrac", "pg_clipfrac_lower", "clip_high", "clip_low", "ppo_kl", "importance_weight",
            "behave_imp_weight", "behave_approx_kl", "rs_filtered_fraction")


@hookimpl
def register_policy_losses(register):
    register(
        name="decoupled_ppo",
        fn=decoupled_ppo_loss,
        fused=decoupled_ppo_fused,
        params=DecoupledParams,
        paper="2110.00641",
        title="Decoupled PPO: behaviour-policy IS weight + proximal-policy trust region",
        formula="l = sg(w) * max(-A r, -A clip(r, 1-eps_l, 1+eps_h)),  w = exp(lp_old - lp_roll), r = exp(lp - lp_old)",
        status=EXPERIMENTAL,
        requires=("rollout_log_prob",),
        metrics=_METRICS,
        reference="AReaL areal/utils/functional/functional.py::ppo_actor_loss_fn (use_decoupled_loss=True); verl decoupled mode",
        notes=(
            "old_log_prob is the proximal (trainer-recomputed) log-prob, rollout_log_prob the behaviour (engine) one. "
            "Rejected tokens keep their place in the token-mean denominator (AReaL). Formula read from AReaL's code, not "
            "executed against it, hence experimental. AReaL replaces the advantage by its sequence mean only at "
            "sequence-level IS; stablerl never changes the advantage."
        ),
    )
    register(
        name="a3po",
        fn=a3po_loss,
        fused=a3po_fused,
        params=A3POParams,
        paper="2512.06547",
        title="A-3PO: staleness-aware approximation of the proximal policy (no extra forward pass)",
        formula="lp_prox = lp_behav + alpha (sg(lp) - lp_behav), alpha = (v-1-v_b)/(v-v_b); then decoupled PPO",
        status=EXPERIMENTAL,
        requires=("rollout_log_prob", "versions", "policy_version"),
        metrics=_METRICS + ("a3po/alpha_mean", "a3po/approx_logp"),
        reference="AReaL areal/trainer/ppo/actor.py::compute_prox_logp_approximations (prox_logp_method=loglinear)",
        notes=(
            "versions: per-token policy version that generated each token (-1 for non-generated), policy_version: "
            "the current version. Tokens of the previous and of the current version get alpha=0 (AReaL's guard; its "
            "comment saying alpha=1 for the current version is wrong). old_log_prob is used only with "
            "prox_logp_method='recompute'. The alpha cases match AReaL; the loss was not executed against AReaL."
        ),
    )
