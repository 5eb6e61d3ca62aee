"""A loss mask that carries the loss's normaliser: ``1 / D`` on every valid token of a span of rows (a mini-batch),
0 elsewhere. For a framework that sums ``loss * loss_mask`` over micro-batches and ranks and expects the loss mask
to hold the aggregation's weights (SkyRL): a stablerl loss reads ``D`` back and aggregates itself with it, and the
framework's sum of the micro-batches' shares completes the mini-batch mean. Framework-free."""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from .params import StableRLError


def span_weights(loss_mask: torch.Tensor, spans: Iterable[tuple[int, int]], per_token: bool) -> torch.Tensor:
    """``[N, T]`` float32: ``1 / D`` on the valid tokens (``loss_mask > 0``) of rows ``start:end`` of each span, ``D``
    the span's valid tokens (``per_token``) or its rows (at least 1)."""
    weights = torch.zeros(loss_mask.shape, dtype=torch.float32, device=loss_mask.device)
    for start, end in spans:
        mask = loss_mask[start:end] > 0
        d = mask.sum() if per_token else end - start
        weights[start:end] = mask.float() / max(float(d), 1.0)
    return weights


def read_weights(loss_mask: torch.Tensor, who: str = "") -> tuple[torch.Tensor, Optional[int]]:
    """``(0/1 float32 mask, D)`` from a loss mask made by :func:`span_weights` (``D`` None: no valid token); weights
    that differ on the valid tokens are refused (``who``: the caller, said in the error)."""
    valid = loss_mask > 0
    if not bool(valid.any()):
        return valid.to(torch.float32), None
    weight = loss_mask[valid]
    if not torch.allclose(weight, weight.max(), rtol=1e-5, atol=0.0):
        raise StableRLError(f"{who}the loss mask's weights differ within the mini-batch; stablerl's trainer puts one "
                            "1/D on every valid token (is another trainer pre-scaling the loss mask?)")
    return valid.to(torch.float32), max(1, round(float(1.0 / weight.max())))


__all__ = ["read_weights", "span_weights"]
