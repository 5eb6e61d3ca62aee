"""Framework batches meeting stablerl algorithms: machinery every adapter shares.

* :func:`apply_filter_result`: verl, TRL and OpenRLHF have split the batch over workers / micro-batches by
  the time a filter runs, so rows cannot be removed or duplicated there: a dropped row or token keeps its
  place with loss mask 0 and advantage 0. The adapter only reads its batch into ``[N, T]`` tensors and
  writes the result back.
* :func:`loss_inputs` / :func:`pending_loss_inputs`: a framework calls its loss with its own arguments
  only; the inputs a stablerl loss declares beyond them (entropy, token ids, group ids...) are gathered
  at the call site and handed to the loss through this scoped channel.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from .contracts import FilterResult
from .params import StableRLError


@dataclass(frozen=True)
class FilteredBatch:
    """The fixed-size batch after a filter: ``response_mask`` [N, T] (input dtype) is 1 only on tokens the
    filter kept, ``advantages`` [N, T] (input dtype) is 0 outside it, ``dropped`` [N] marks rows left without
    a token, ``metrics`` are the filter's own plus ``filter/kept_row_frac`` and ``filter/kept_token_frac``."""

    response_mask: torch.Tensor
    advantages: torch.Tensor
    dropped: torch.Tensor
    metrics: dict


def apply_filter_result(result: FilterResult, response_mask: torch.Tensor, advantages: torch.Tensor, *,
                        selected_by: str, why_no_resampling: str) -> FilteredBatch:
    """Apply ``result`` (rows into the batch, their masks, optionally new advantages) to the ``[N, T]`` batch.

    Kept rows go back to their own places (a filter may return them in any order); a row returned twice is
    refused, naming ``selected_by`` (the config key that chose the filter) and ``why_no_resampling`` (why this
    framework cannot duplicate rows). A filter only removes tokens: the new mask is the filter's mask AND the
    old one. Advantages are the filter's where it gave some, else the old ones, and 0 on every removed token.
    """
    mask, adv = response_mask, advantages
    kept = result.rows.to(mask.device).long().reshape(-1)
    if kept.numel() != torch.unique(kept).numel():
        raise StableRLError(f"{selected_by} returned repeated rows (a resampling sampler); {why_no_resampling}")
    new_mask = torch.zeros_like(mask)
    new_mask[kept] = result.response_mask.to(mask.device, mask.dtype)
    new_mask = ((new_mask * mask) > 0).to(mask.dtype)  # a filter only removes tokens
    new_adv = torch.zeros_like(adv)
    new_adv[kept] = adv[kept] if result.advantages is None else result.advantages.to(adv.device, adv.dtype)
    new_adv = new_adv * new_mask.to(adv.dtype)
    row_kept = new_mask.sum(-1) > 0  # rows left without a token (e.g. simpletir's void rows) count as dropped
    had = mask.sum(-1) > 0
    metrics = dict(result.metrics)
    metrics["filter/kept_row_frac"] = float((row_kept & had).sum() / had.sum().clamp(min=1))
    metrics["filter/kept_token_frac"] = float(new_mask.sum() / mask.sum().clamp(min=1))
    return FilteredBatch(response_mask=new_mask, advantages=new_adv, dropped=~row_kept, metrics=metrics)


# (loss name, inputs) of the innermost active loss_inputs block
_PENDING: contextvars.ContextVar[Optional[tuple]] = contextvars.ContextVar("stablerl_loss_inputs", default=None)


@contextlib.contextmanager
def loss_inputs(name: str, inputs: dict) -> Iterator[dict]:
    """Hand ``inputs`` to the calls of stablerl loss ``name`` made inside the block (the adapter wraps the
    framework's call site in it; the loss reads :func:`pending_loss_inputs`).

    Reset when the block exits or raises, so nothing leaks into the next call; nested blocks (a loss called
    inside another's call) each see their own. ``inputs`` is shared, not copied: code inside the block may
    still add to it (a forward pass that computes the entropy the loss asked for)."""
    token = _PENDING.set((name, inputs))
    try:
        yield inputs
    finally:
        _PENDING.reset(token)


def pending_loss_inputs(name: Optional[str] = None) -> Optional[dict]:
    """The inputs of the innermost active :func:`loss_inputs` block if it is loss ``name``'s (any loss's when
    ``name`` is None); None outside one."""
    got = _PENDING.get()
    if got is None or (name is not None and got[0] != name):
        return None
    return got[1]


__all__ = ["FilteredBatch", "apply_filter_result", "loss_inputs", "pending_loss_inputs"]
