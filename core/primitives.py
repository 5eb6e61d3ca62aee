"""Primitives that several plugins share: the pieces of their formulas, not algorithms.

Plugins are leaves (no plugin imports another): what two of them use lives here, once. An algorithm
that is built on another algorithm calls it through the registry (:func:`stablerl.get_spec`).

* PPO clip (arXiv 2503.14476, 1912.09729): :class:`ClipParams`, :func:`ppo_clip_terms`, its fused
  form :func:`ppo_clip_fused` and :func:`ratio_backward`; GPPO's gradient-preserving clip
  (arXiv 2508.07629) :func:`gradient_preserving_terms`; GSPO's sequence-ratio bounds :class:`GSPOParams`.
* group baselines (GRPO, arXiv 2402.03300): :class:`GRPOParams`, :func:`singleton_convention`,
  :func:`baseline_std_advantage`, :func:`position_in_group`, :func:`group_sum`.
* sequence-level objectives: :func:`score_labels`, :func:`valid_rows`, :func:`sequence_mean_loss`,
  :func:`refuse_token_weights`.
* inputs: :func:`entropy_input` (entropy-aware losses), :func:`rollout_log_rho` and
  :func:`rollout_mismatch_metrics` (rollout correction), :func:`per_response`, :func:`refuse_param_typos`,
  :func:`draw_uniform` and :func:`draw_normal` (reward shapers and batch filters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .contracts import Params
from .fused import masked_count, sign_of_, stop_at_clamp_bounds_
from .ops import aggregate, clamped_log_ratio, masked_mean, masked_sum
from .params import StableRLError, check, nearest


# --------------------------------------------------------------------------------------- PPO clip


@dataclass
class ClipParams(Params):
    """Ratio-space PPO clip bounds ``[1 - clip_ratio_low, 1 + clip_ratio_high]`` and dual clip ``c``."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: Optional[float] = 3.0  # None disables the dual clip

    def validate(self) -> None:
        check(0 <= self.clip_ratio_low, f"clip_ratio_low must be >= 0, got {self.clip_ratio_low}")
        check(0 <= self.clip_ratio_high, f"clip_ratio_high must be >= 0, got {self.clip_ratio_high}")
        check(
            self.clip_ratio_c is None or self.clip_ratio_c > 1.0,
            f"clip_ratio_c (dual clip) must be > 1 or None, got {self.clip_ratio_c}",
        )


def ppo_clip_terms(ratio, advantages, mask, low: float, high: float, dual_c: Optional[float]):
    """The clipped per-token PPO loss and its verl-named metrics (shared by PPO-family losses)."""
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    with torch.no_grad():  # metrics: no autograd graph, one token count shared by all of them
        if pg_losses1.shape[-1] == 1 and mask.shape[-1] != 1:
            # row-constant terms ([B, 1] ratio and advantages: GSPO's sequence form): a condition counts
            # its rows' tokens, so per-row counts replace [B, T] products (integer sums, exact below 2**24 tokens)
            row_tokens = mask.sum(-1, keepdim=True)
            count = row_tokens.sum().clamp(min=1)

            def fraction(cond):
                return (cond.view(torch.uint8) * row_tokens).sum() / count
        else:
            count = mask.sum().clamp(min=1)

            def fraction(cond):
                # bool conditions enter the masked sums as uint8 views: the same 0/1 factors as a float
                # cast (same sums), several times faster on CPU
                return masked_sum(cond.view(torch.uint8), mask) / count

        neg = advantages < 0
        metrics = {
            "pg_clipfrac": fraction(pg_losses2 > pg_losses1),
            "clip_high": fraction((advantages > 0) & (ratio > 1.0 + high)),
            "clip_low": fraction(neg & (ratio < 1.0 - low)),
        }
    if dual_c is None:
        metrics["pg_clipfrac_lower"] = torch.zeros((), device=ratio.device)
        return clip_pg_losses1, metrics
    pg_losses3 = -advantages * dual_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    with torch.no_grad():
        metrics["pg_clipfrac_lower"] = fraction((clip_pg_losses1 > pg_losses3) & neg)
    return torch.where(neg, clip_pg_losses2, clip_pg_losses1), metrics


def ppo_clip_fused(ratio, advantages, mask, low: float, high: float, dual_c: Optional[float], bounds=None):
    """:func:`ppo_clip_terms` without autograd, for a fused form: the same per-token loss and metrics
    (the metrics' 0/1 counts are exact integer sums either way), ``-A``, and the factor ``F`` in
    {0, 1/4, 1/2, 1} such that autograd's gradient of the eager loss with respect to ``ratio`` is
    ``F * (g * -A)`` for an upstream gradient ``g``. Returns ``(loss, metrics, -A, F)``.

    Autograd's rules reproduced: ``maximum(x, y)`` gives x ``g`` where x > y, ``g/2`` where x == y,
    0 below (y alike); ``minimum`` mirrored; ``clamp`` passes the gradient on its closed range; the
    ``where(A < 0, ...)`` picks one branch (the range is open with torch >= 2.14:
    :func:`~stablerl.fast_paths.clamp_passes_at_bounds`). ``-A * clamp(r)`` equals ``-A * r`` when ``r`` is in
    range, so ``F_max = (1 + s + inr) / 2`` with ``s = sign(pg1 - pg2)`` and ``inr`` in {0, 1}. For
    A >= 0 the dual-clip bound ``|A| c`` is >= 0 >= ``max(pg1, pg2)``, so ``minimum(max(pg1, pg2),
    |A| c)`` is the eager ``where`` (one select fewer) and its factor ``(1 + sign(|A| c - max))/2``
    is 1 there (A = 0 has a zero gradient whatever the factor). Every step is a vectorised float
    pass, in place where the operand is a temporary (no ``torch.where``, no bool -> float casts, few
    fresh [B, T] allocations). ``bounds=(lower, upper)`` replaces ``(1 - low, 1 + high)`` (explicit
    ratio bounds, e.g. BAPO's searched ones; numbers, ``lower <= upper``: torch >= 2.14 splits a
    tensor-bound clamp's gradient at a tie, which no power-of-two factor reproduces)."""
    neg_adv = -advantages
    pg_losses1 = neg_adv * ratio
    clamped = torch.clamp(ratio, *bounds) if bounds is not None else torch.clamp(ratio, 1.0 - low, 1.0 + high)
    side = sign_of_(clamped - ratio)  # +1: ratio below the range, -1: above, 0: in range
    pg_losses2 = clamped.mul_(neg_adv) if clamped.shape == torch.broadcast_shapes(clamped.shape, neg_adv.shape) \
        else clamped * neg_adv
    s12 = sign_of_(pg_losses1 - pg_losses2)  # -1: the clipped branch is the larger loss
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2, out=pg_losses1)
    count = mask.sum().clamp(min=1)

    def negative_count(indicator):  # the number of -1 entries of a {-1, 0} tensor on valid tokens
        return 0.0 - masked_count(indicator, mask)  # 0.0 - x: a zero count is +0.0, as eager's

    adv_sign = sign_of_(advantages * 1.0)
    metrics = {
        "pg_clipfrac": negative_count(torch.clamp(s12, max=0.0)) / count,
        # A > 0 and ratio above the range: relu(sign A) * side == -1
        "clip_high": negative_count((torch.relu(adv_sign) * side).clamp_(max=0.0)) / count,
        # A < 0 and ratio below the range: min(sign A, 0) * side == -1
        "clip_low": negative_count((torch.clamp(adv_sign, max=0.0) * side).clamp_(max=0.0)) / count,
    }
    grad_factor = s12.add_(1.0).add_(1.0).sub_(side.abs_())
    # torch >= 2.14's clamp stops the gradient at its bounds too, where pg1 == pg2 (s12 = 0): maximum's half
    # through the clamp is lost, 2 F = 1 there
    stop_at_clamp_bounds_(grad_factor, ratio, *(bounds if bounds is not None else (1.0 - low, 1.0 + high)),
                          stopped=1.0)
    grad_factor.mul_(0.5)
    if dual_c is None:
        metrics["pg_clipfrac_lower"] = torch.zeros((), device=ratio.device)
        return clip_pg_losses1, metrics, neg_adv, grad_factor
    pg_losses3 = advantages.abs().mul_(dual_c)  # = -A c where A < 0
    s3 = sign_of_(pg_losses3 - clip_pg_losses1)  # -1: the dual clip is active (A < 0 only)
    metrics["pg_clipfrac_lower"] = negative_count(torch.clamp(s3, max=0.0)) / count
    grad_factor.mul_(s3.add_(1.0).mul_(0.5))
    out = pg_losses3 if pg_losses3.shape == clip_pg_losses1.shape else None
    return torch.minimum(clip_pg_losses1, pg_losses3, out=out), metrics, neg_adv, grad_factor


def ratio_backward(grad, neg_adv, ratio_factor):
    """The backward of the fused PPO-clip forms (:func:`ppo_clip_fused`): ``(g * -A) * (F r)``."""
    # autograd's order: (g * -A) reaches the ratio, exp's backward multiplies by the ratio; the
    # factor F (a power of two or 0) is folded into the saved ratio, which is exact
    return (grad * neg_adv) * ratio_factor


def gradient_preserving_terms(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    low: float,
    high: float,
    dual_c: Optional[float],
    beta_low: float = 1.0,
    beta_high: float = 1.0,
):
    """Per-token GPPO / CE-GPPO loss and verl-named metrics (``log_ratio`` already clamped)."""
    ratio = torch.exp(log_ratio)
    rs = ratio / ratio.detach()  # value exactly 1, gradient rs * d lp
    adv = advantages
    is_low = (adv < 0) & (ratio < 1.0 - low)
    is_high = (adv > 0) & (ratio > 1.0 + high)
    loss = torch.where(
        is_low,
        -(beta_low * (1.0 - low)) * rs * adv,
        torch.where(is_high, -(beta_high * (1.0 + high)) * rs * adv, -ratio * adv),
    )
    dt = mask.dtype
    metrics = {
        "pg_clipfrac": masked_mean((is_low | is_high).to(dt), mask),
        "clip_high": masked_mean(is_high.to(dt), mask),
        "clip_low": masked_mean(is_low.to(dt), mask),
    }
    if dual_c is None:
        metrics["pg_clipfrac_lower"] = torch.zeros((), dtype=dt, device=mask.device)
    else:
        dual = -adv * dual_c
        metrics["pg_clipfrac_lower"] = masked_mean(((loss > dual) & (adv < 0)).to(dt), mask)
        loss = torch.where(adv < 0, torch.minimum(loss, dual), loss)
    metrics["ppo_kl"] = masked_mean(-log_ratio.detach(), mask)
    return loss, metrics


@dataclass
class GSPOParams(Params):
    """Ratio-space bounds on the sequence ratio ``[1 - clip_ratio_low, 1 + clip_ratio_high]``."""

    clip_ratio_low: float = 3e-4
    clip_ratio_high: float = 4e-4

    def validate(self) -> None:
        check(0 <= self.clip_ratio_low < 1, f"clip_ratio_low must be in [0, 1), got {self.clip_ratio_low}")
        check(0 <= self.clip_ratio_high, f"clip_ratio_high must be >= 0, got {self.clip_ratio_high}")


# ----------------------------------------------------------------------------------------- groups


@dataclass
class GRPOParams(Params):
    """verl's ``compute_grpo_outcome_advantage`` arguments: ``epsilon`` and ``norm_adv_by_std_in_grpo``."""

    epsilon: float = 1e-6
    norm_adv_by_std_in_grpo: bool = True

    def validate(self) -> None:
        check(self.epsilon >= 0, f"epsilon must be >= 0, got {self.epsilon}")


def singleton_convention(mean: torch.Tensor, std: torch.Tensor, count: torch.Tensor):
    """verl's group-of-one convention: baseline 0 and std 1 where the group has one response."""
    single = count < 2
    return torch.where(single, torch.zeros_like(mean), mean), torch.where(single, torch.ones_like(std), std)


def baseline_std_advantage(scores, baseline, std, p, b):
    """GRPO's normalisation (arXiv 2402.03300), shared by the estimators that only change its baseline or
    std (QAE, Reinforce-Ada): ``(S - b) / (std + epsilon)``, or ``S - b`` without ``norm_adv_by_std_in_grpo``
    (``p`` holds those two); on every response token of the batch ``b``."""
    adv = scores - baseline
    if p.norm_adv_by_std_in_grpo:
        adv = adv / (std + p.epsilon)
    adv = b.on_response_tokens(adv)
    return adv, adv


def position_in_group(gid: torch.Tensor) -> torch.Tensor:
    """0-based rank of each response among its group's responses, in row (rollout) order."""
    order = torch.argsort(gid, stable=True)
    count = torch.bincount(gid)
    start = torch.cumsum(count, 0) - count
    pos = torch.empty_like(gid)
    pos[order] = torch.arange(gid.numel(), device=gid.device) - start[gid[order]]
    return pos


def group_sum(values: torch.Tensor, gid: torch.Tensor) -> torch.Tensor:
    """Per-response sum over its group (differentiable), ``[B]``."""
    n_groups = int(gid.max().item()) + 1 if gid.numel() else 0
    return torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add(0, gid, values)[gid]


# ---------------------------------------------------------------------- sequence-level objectives


def score_labels(b, name: str) -> torch.Tensor:
    """``b.scores`` as ``[B]`` per-response targets in the log-probs' dtype; ``name`` (the loss) in the error."""
    scores = b.scores
    if scores.dim() != 1 or scores.shape[0] != b.log_prob.shape[0]:
        raise StableRLError(f"{name}: scores must be a [B] tensor of per-response rewards, got {tuple(scores.shape)}")
    return scores.to(b.log_prob.dtype)


def valid_rows(b) -> torch.Tensor:
    """``[B]`` 1.0 for responses with at least one trained token: empty rows are not responses."""
    return (b.response_mask.sum(-1) > 0).to(b.log_prob.dtype)


def sequence_mean_loss(per_seq: torch.Tensor, valid: torch.Tensor, ctx) -> torch.Tensor:
    """``sum_i loss_i / seq_count * dp_size`` over valid rows: a mean with global normalisers."""
    return aggregate(per_seq.unsqueeze(-1), valid.unsqueeze(-1), "seq-mean-token-sum", ctx)


def refuse_token_weights(b, name: str) -> None:
    """Refuse token-level IS weights for the sequence-level objective ``name``."""
    if b.is_weights is not None:
        raise StableRLError(
            f"{name} is a sequence-level objective and does not take token-level IS weights; "
            "turn the framework's rollout correction off (verl: algorithm.rollout_correction.rollout_is=null)"
        )


# ----------------------------------------------------------------------------------------- inputs


def entropy_input(t: Optional[torch.Tensor], mask: torch.Tensor, name: str) -> torch.Tensor:
    """A per-token entropy input, detached, in fp32 (fp64 kept), zero outside the mask.

    Raises :class:`StableRLError` if it has non-finite values on tokens where the mask is 1
    (shared by the entropy-aware losses: steer, erc, entropic, gtpo).
    """
    if t is None:  # pragma: no cover - core raises MissingInputError for declared inputs first
        raise StableRLError(f"input {name!r} is required")
    if tuple(t.shape) != tuple(mask.shape):
        raise StableRLError(f"{name} has shape {tuple(t.shape)} but log_prob has shape {tuple(mask.shape)}")
    t = t.detach()
    t = t if t.dtype == torch.float64 else t.float()
    valid = mask.bool()
    if not bool(torch.isfinite(t[valid]).all()):
        raise StableRLError(f"{name} has non-finite values (NaN or inf) on tokens where response_mask is 1")
    return torch.where(valid, t, torch.zeros((), dtype=t.dtype, device=t.device))


def rollout_log_rho(b) -> torch.Tensor:
    """``log(pi_old / pi_rollout)`` per token, clamped to +-20 (the training/rollout mismatch)."""
    return clamped_log_ratio(b.old_log_prob, b.rollout_log_prob)


def rollout_mismatch_metrics(log_rho: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> dict:
    """The ``rollout_corr/*`` metrics of rollout weights ``weights`` given the log-ratio ``log_rho``."""
    rho = torch.exp(log_rho)
    return {
        "rollout_corr/weight_mean": masked_mean(weights, mask),
        "rollout_corr/masked_fraction": masked_mean((weights == 0).float(), mask),
        "rollout_corr/kl": masked_mean(-log_rho, mask),
        "rollout_corr/k3_kl": masked_mean(rho - log_rho - 1.0, mask),
    }


def per_response(extras: dict, name: str, n: int, device, kind: str = "float", nonnegative: bool = False) -> torch.Tensor:
    """The per-response extra ``name`` as a ``[n]`` tensor (bool for ``kind="bool"``, float64 otherwise).

    Accepts tensors, numpy arrays and lists; raises a :class:`StableRLError` naming the input on a
    wrong shape, non-finite values, or (bool) values other than 0/1.
    """
    value = extras[name]
    if not isinstance(value, torch.Tensor):
        arr = np.asarray(value)
        if arr.dtype == object or kind == "float":  # e.g. verl's non_tensor_batch object arrays
            try:
                arr = arr.astype(np.float64)
            except (TypeError, ValueError) as e:
                raise StableRLError(f"{name} must hold numbers / booleans per response: {e}") from None
        value = torch.from_numpy(np.ascontiguousarray(arr))
    value = value.detach().to(device).reshape(-1) if value.dim() <= 1 else value.detach().to(device)
    if tuple(value.shape) != (n,):
        raise StableRLError(f"{name} must have one entry per response, shape ({n},), got {tuple(value.shape)}")
    if kind == "bool":
        if value.dtype != torch.bool:
            if n and not bool(((value == 0) | (value == 1)).all()):
                raise StableRLError(f"{name} must be boolean (0/1) per response")
            value = value != 0
        return value
    value = value.to(torch.float64)
    if not bool(torch.isfinite(value).all()):
        raise StableRLError(f"{name} has non-finite values (NaN or inf)")
    if nonnegative and n and float(value.min()) < 0:
        raise StableRLError(f"{name} must be >= 0 per response (a count), got {float(value.min()):g}")
    return value


def refuse_param_typos(extras: dict, params_cls: type, name: str) -> None:
    """Extras are every keyword that is not a hyper-parameter, so a misspelt hyper-parameter would be
    silently ignored: refuse an extra whose name is close to a hyper-parameter's."""
    fields = params_cls.field_names()
    for key in extras:
        hint = nearest(key, fields)
        if hint:
            raise StableRLError(f"{name}: {key!r} is not a hyper-parameter nor an input it uses{hint}; "
                                f"hyper-parameters: {', '.join(fields)}")


def draw_uniform(n: int, generator: Optional[torch.Generator], device, dtype=torch.float64) -> torch.Tensor:
    """``n`` U(0, 1) draws from ``generator`` (on the generator's own device), moved to ``device``."""
    gen_device = generator.device if generator is not None else "cpu"
    return torch.rand(n, generator=generator, device=gen_device, dtype=dtype).to(device)


def draw_normal(n: int, generator: Optional[torch.Generator], device, dtype=torch.float64) -> torch.Tensor:
    """``n`` N(0, 1) draws from ``generator`` (on the generator's own device), moved to ``device``."""
    gen_device = generator.device if generator is not None else "cpu"
    return torch.randn(n, generator=generator, device=gen_device, dtype=dtype).to(device)
