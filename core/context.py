"""The context an adapter fills: global normalisers, data-parallel reductions, step, state.

Plugins never talk to torch.distributed or to a framework directly. Anything they take over
the batch goes through :meth:`Context.all_reduce` / :meth:`Context.all_gather`, so that two
data-parallel ranks compute what one rank with the whole batch would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch


@dataclass
class Context:
    """Per-call context.

    * ``token_count``: valid tokens in the whole optimizer mini-batch across every DP rank and
      gradient-accumulation micro-batch (``None``: this call's own ``response_mask.sum()``).
    * ``seq_count``: sequences in that mini-batch, likewise (``None``: this call's ``B``), as the framework's
      own sequence mean counts them (verl, TRL: every row; OpenRLHF: rows with a valid token).
    * ``row_count``: rows in that mini-batch, fully masked ones included (``None``: take ``seq_count``); set
      where the two differ, for what weights a micro-batch by its share of the rows (EntroPIC's integral).
    * ``dp_size``: the gradient is averaged over this many ranks by the framework, so losses
      are multiplied by it (as verl and OpenRLHF do).
    * ``loss_scale_factor``: the constant of ``seq-mean-token-sum-norm`` (Dr. GRPO).
    * ``all_reduce(t, op)``: sums (or maxes/mins) ``t`` over DP ranks; identity by default.
    * ``all_gather(t)``: concatenates 1-D tensors of possibly different length over ranks.
    * ``step``/``total_steps``: training progress, for scheduled algorithms.
    * ``state``: persistent per-algorithm controller state, owned by the adapter.
    * ``generator``: for algorithms with random selection (seeded reproducibility).
    """

    token_count: Optional[float] = None
    seq_count: Optional[float] = None
    row_count: Optional[float] = None
    dp_size: int = 1
    loss_scale_factor: Optional[float] = None
    all_reduce_fn: Optional[Callable[[torch.Tensor, str], torch.Tensor]] = None
    all_gather_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    step: Optional[int] = None
    total_steps: Optional[int] = None
    state: dict[str, Any] = field(default_factory=dict)
    generator: Optional[torch.Generator] = None

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if op not in ("sum", "max", "min"):
            raise ValueError(f"all_reduce op must be sum, max or min, not {op!r}")
        if self.all_reduce_fn is None:
            return tensor
        return self.all_reduce_fn(tensor, op)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.all_gather_fn is None:
            return tensor
        return self.all_gather_fn(tensor)

    @property
    def distributed(self) -> bool:
        return self.all_reduce_fn is not None


def torch_distributed_context(group=None, **kwargs: Any) -> Context:
    """A :class:`Context` whose reductions run over a ``torch.distributed`` process group."""
    import torch.distributed as dist

    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}

    def all_reduce(t: torch.Tensor, op: str) -> torch.Tensor:
        out = t.detach().clone()
        dist.all_reduce(out, op=ops[op], group=group)
        return out

    def all_gather(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().reshape(-1)
        world = dist.get_world_size(group)
        n = torch.tensor([t.numel()], device=t.device)
        sizes = [torch.zeros_like(n) for _ in range(world)]
        dist.all_gather(sizes, n, group=group)
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=t.dtype, device=t.device)
        padded[: t.numel()] = t
        parts = [torch.zeros_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes)])

    kwargs.setdefault("dp_size", dist.get_world_size(group))
    return Context(all_reduce_fn=all_reduce, all_gather_fn=all_gather, **kwargs)
