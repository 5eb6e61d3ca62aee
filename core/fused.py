"""Fused policy losses: the forward computed without an autograd graph, and a closed-form backward.

A policy loss may register a ``fused`` form next to its eager function (``AlgorithmSpec.fused``).
It receives the same batch, with ``log_prob`` already cleaned but detached, computes under
``torch.no_grad`` the same value and metrics as the eager function (the same operations in the same
order, so the same bits) and returns a :class:`FusedLoss`: the value, the metrics, the tensors its
backward needs, and the backward itself, the per-token derivative of the loss written out in the
plugin next to the formula. Core attaches the value to ``log_prob`` through :class:`_Fused`, so the
rest (IS weights, aggregation) stays ordinary autograd.

Why: an eager PPO-family loss records a graph whose backward is dominated by ``torch.where`` and
``masked_fill`` (the subgradient bookkeeping of ``maximum``/``minimum``/``clamp``), which are not
vectorised on CPU, and keeps several fp32 intermediates for backward (for bf16 inputs, fp32 copies
the caller never asked for). The fused form reads the inputs once in forward, keeps one or two fp32
per-token factors, and backward is one or two multiplications.

Exactness: each fused backward reproduces autograd's arithmetic on the eager formula, rounding step
by rounding step: products by a per-token factor in {0, 1/4, 1/2, 1} (autograd's tie splitting in
``maximum``/``minimum``, the pass/stop of ``clamp``) are exact, so they can be moved to the saved
factor. The loss, the metrics and the gradient are the eager path's values (tests/test_fused.py);
on padding the gradient is exactly +0.0 as eager's; on a valid token the sign of a zero may
differ, and a gradient below the smallest normal float may differ in its last bits (a halving is
then not exact).

``STABLERL_FUSED=0`` (or ``compute_policy_loss(..., fused=False)``) switches it off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.autograd.function import once_differentiable

from .ops import LOG_RATIO_BOUND, clamp_passes_at_bounds, is_functorch_wrapped, within_clamp_pass

FUSED_ENV = "STABLERL_FUSED"


@dataclass
class FusedLoss:
    """What a fused form returns.

    ``value``: the eager loss, bit for bit (the per-token ``[B, T]`` loss for a per-token loss, the
    scalar for a scalar one). ``backward(grad, *saved)``: the gradient with respect to the cleaned,
    compute-dtype ``log_prob`` (zero or ``-0.0`` on padding) given the gradient of ``value``.
    ``saved``: the tensors ``backward`` reads (kept by autograd until backward, and counted as such).
    ``zero_padded``: ``value`` is finite and exactly zero on padding, so core's aggregation may skip
    the mask product (``stablerl.ops.aggregate(zero_padded=True)``: the same sums bit for bit).
    ``then``: for a scalar-output loss, the rest of its computation (e.g. its aggregation) from the
    attached per-token value, run with autograd."""

    value: torch.Tensor
    metrics: dict
    backward: Callable[..., torch.Tensor]
    saved: tuple = field(default_factory=tuple)
    zero_padded: bool = False
    # scalar-output losses: the rest of the loss (its own aggregation), applied by core to the
    # attached value with ordinary autograd
    then: Optional[Callable[[torch.Tensor], torch.Tensor]] = None


def fused_requested(fused: Optional[bool]) -> bool:
    """The switch: the keyword when given, else ``STABLERL_FUSED`` (on unless ``0``/``false``)."""
    if fused is None:
        return os.environ.get(FUSED_ENV, "1") not in ("0", "false", "False", "off")
    return bool(fused)


def has_forward_tangent(t: torch.Tensor) -> bool:
    """Whether ``t`` carries a forward-mode AD tangent (``torch.autograd.forward_ad``)."""
    try:
        from torch.autograd import forward_ad

        return forward_ad.unpack_dual(t).tangent is not None
    except Exception:  # noqa: BLE001 - no dual level active
        return False


def fusable(log_prob: torch.Tensor) -> bool:
    """Where a fused form is safe: reverse-mode autograd on a plain tensor (no ``torch.func``
    transform, no forward-mode tangent; the fused backward is not differentiable again, and says
    so if asked)."""
    return (
        log_prob.requires_grad
        and torch.is_grad_enabled()
        and not is_functorch_wrapped(log_prob)
        and not has_forward_tangent(log_prob)
    )


class _Fused(torch.autograd.Function):
    """``value`` as a function of ``log_prob`` with the fused form's backward; the gradient is cast
    to ``log_prob``'s dtype (what autograd does for the eager path's upcast)."""

    @staticmethod
    def forward(fctx, log_prob: torch.Tensor, fused: FusedLoss, valid: torch.Tensor) -> torch.Tensor:
        fctx.backward_fn = fused.backward
        fctx.dtype = log_prob.dtype
        fctx.save_for_backward(valid, *fused.saved)
        return fused.value

    @staticmethod
    @once_differentiable
    def backward(fctx, grad: torch.Tensor):
        valid, *saved = fctx.saved_tensors
        # +0.0 on padding whatever the formula gives there, as core's eager clean-up (_ZeroPadding)
        g = clean_input(fctx.backward_fn(grad, *saved), valid)
        return (g if g.dtype == fctx.dtype else g.to(fctx.dtype)), None, None


def attach(log_prob: torch.Tensor, fused: FusedLoss, valid: torch.Tensor) -> torch.Tensor:
    """``fused.value`` with gradient flowing to ``log_prob`` through ``fused.backward`` (and +0.0 on
    the padding, ``valid`` False)."""
    return _Fused.apply(log_prob, fused, valid)


def sign_of(x: torch.Tensor) -> torch.Tensor:
    """``torch.sign(x)`` for float ``x`` (-1, 0 or 1; NaN stays NaN; ``-0.0`` stays ``-0.0``) in three
    vectorised passes: the smallest subnormal times two factors of the largest power of two reaches
    1, and the clamp saturates. ``torch.sign`` itself is several times slower on CPU."""
    big = 2.0**127 if x.dtype == torch.float32 else 2.0**1023 if x.dtype == torch.float64 else None
    if big is None:
        return torch.sign(x)
    return torch.clamp(x * big * big, -1.0, 1.0)


def sign_of_(x: torch.Tensor) -> torch.Tensor:
    """:func:`sign_of` in place (for a temporary): no new [B, T] allocation."""
    big = 2.0**127 if x.dtype == torch.float32 else 2.0**1023 if x.dtype == torch.float64 else None
    if big is None:
        return torch.sign(x, out=x)
    return x.mul_(big).mul_(big).clamp_(-1.0, 1.0)


@dataclass
class FusedInputs:
    """The caller's tensors, for a fused form whose backward recomputes a factor from them instead of
    keeping it (they are alive anyway: nothing is added to what backward holds). ``clean(t)`` is
    core's clean-up of an input (fp32 for half precision, +0.0 on padding), value for value."""

    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    valid: torch.Tensor  # bool [B, T]

    def clean(self, t: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        return clean_input(t, self.valid if valid is None else valid)


def clean_input(t: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``torch.where(valid, t, +0.0)`` in the compute dtype (fp32 for half precision), as core's
    clean-up computes it (through the integer bit pattern on CPU, which gives the same bits)."""
    t = t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
    int_type = {torch.float32: torch.int32, torch.float64: torch.int64}.get(t.dtype)
    if int_type is None or t.device.type != "cpu":
        return torch.where(valid, t, torch.zeros((), dtype=t.dtype, device=t.device))
    bits = (-valid.view(torch.int8)).to(int_type)
    return (t.view(int_type) & bits).view(t.dtype)


def masked_count(indicator: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(indicator * mask)`` for an indicator of 0/1 (or 0/-1) values broadcastable to the float
    ``mask``, as one dot product: an integer sum, exact below 2**24 tokens, so equal to the eager
    metrics' ``masked_sum(cond.view(uint8), mask)``."""
    if indicator.shape != mask.shape:
        indicator = indicator.expand_as(mask)
    return torch.dot(indicator.reshape(-1).to(mask.dtype), mask.reshape(-1))


def stop_at_clamp_bounds_(factor: torch.Tensor, x: torch.Tensor, lo=None, hi=None, stopped: float = 0.0):
    """``factor``, built on the closed-range rule (a clamp of ``x`` passing the gradient on ``[lo, hi]``),
    set in place to ``stopped`` where ``x`` equals ``lo`` or ``hi`` when the installed torch's clamp stops
    the gradient there too (torch >= 2.14: :func:`~stablerl.fast_paths.clamp_passes_at_bounds`; with
    2.13 nothing changes). None: no bound on that side. ``stopped``: the factor's value where the clamp's
    share is 0 (0 for a bare pass factor)."""
    if not clamp_passes_at_bounds():
        for bound in (lo, hi):
            if bound is not None:
                factor.masked_fill_(x == bound, stopped)
    return factor


def clamp_pass_factor(x: torch.Tensor, clamped: torch.Tensor, lo=None, hi=None) -> torch.Tensor:
    """The 0/1 factor of ``clamped = torch.clamp(x, lo, hi)``'s backward, as a float tensor: 1 where
    the installed torch's clamp passes the gradient. ``1 - |sign(clamped - x)|`` in three in-place
    passes, then :func:`stop_at_clamp_bounds_` (None: no bound on that side)."""
    return stop_at_clamp_bounds_(sign_of_(clamped - x).abs_().neg_().add_(1.0), x, lo, hi)


def fused_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor):
    """:func:`stablerl.ops.clamped_log_ratio`'s value, and the 0/1 factor of its backward
    (:func:`clamp_pass_factor`); None when the clamp is skipped (every log-ratio within the bound,
    the usual case)."""
    raw = log_prob - old_log_prob
    if within_clamp_pass(raw, -LOG_RATIO_BOUND, LOG_RATIO_BOUND):
        return raw, None
    clamped = torch.clamp(raw, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return clamped, clamp_pass_factor(raw, clamped, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
