"""Guards and kernels of core's fast paths that the batch contracts use too, so they sit below
:mod:`stablerl.contracts` (:mod:`stablerl.ops` re-exports them): whether a tensor is wrapped by a
``torch.func`` transform, and row sums of a product without a ``[B, T]`` temporary."""

from __future__ import annotations

import torch

# torch.func (grad, vmap, jvp) wraps tensors; a wrapped tensor allows no data-dependent Python branch
is_functorch_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", lambda t: False)


# elements per slice of row_sums_of_product: 1 MiB of fp32, reused by the allocator from one slice
# to the next (a [B, T] temporary is a fresh multi-MiB mapping whose page faults cost more on CPU
# than the product itself)
_ROW_SLICE_ELEMENTS = 1 << 18


def row_sums_of_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(-1)`` for ``[B, T]`` tensors, bit for bit, without a ``[B, T]`` temporary: the
    product is formed a slice of rows at a time (each row's sum is reduced on its own, in the same
    order, whatever rows surround it)."""
    rows = max(_ROW_SLICE_ELEMENTS // max(a.shape[-1], 1), 1)
    if (a.dim() != 2 or a.shape != b.shape or rows >= a.shape[0] or a.device.type != "cpu" or a.requires_grad
            or b.requires_grad or is_functorch_wrapped(a) or is_functorch_wrapped(b)):
        return (a * b).sum(-1)
    out = torch.empty(a.shape[0], dtype=torch.result_type(a, b), device=a.device)
    for start in range(0, a.shape[0], rows):
        torch.sum(a[start:start + rows] * b[start:start + rows], -1, out=out[start:start + rows])
    return out
