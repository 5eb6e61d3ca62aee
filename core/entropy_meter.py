"""The mean training entropy of one optimizer step, what an entropy controller (``stablerl.Controller``) is stepped
with, for adapters whose framework runs several micro-batch forwards per optimizer step on several data-parallel
ranks: summed on the forwards' device (no host sync per micro-batch), reduced over the ranks once, at the step."""

from __future__ import annotations

from typing import Any, Optional

import torch


class EntropyMeter:
    """Entropy sum and token count of the forwards since the last :meth:`take`."""

    def __init__(self) -> None:
        self.total: Any = 0.0
        self.count: Any = 0.0

    def add(self, entropy: torch.Tensor, mask: torch.Tensor) -> None:
        """One forward's per-token ``entropy`` ``[B, >=T]`` (its last ``T`` positions) on the ``[B, T]`` ``mask``."""
        mask = mask.to(torch.float64)
        self.total = self.total + (entropy[:, -mask.shape[1]:].detach().to(torch.float64) * mask).sum()
        self.count = self.count + mask.sum()

    def take(self, group: Any = None) -> Optional[float]:
        """The token-mean entropy over every rank of ``group`` (when torch.distributed runs), then empty; None for a
        step without tokens (an all-masked step)."""
        both = torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in (self.total, self.count)])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
            both = both.to(device)
            torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.SUM, group=group)
        self.total = self.count = 0.0
        total, count = float(both[0]), float(both[1])
        return total / count if count > 0 else None


__all__ = ["EntropyMeter"]
