"""Guards and kernels of core's fast paths that the batch contracts use too, so they sit below
:mod:`stablerl.contracts` (:mod:`stablerl.ops` re-exports them): whether a tensor is wrapped by a
``torch.func`` transform, row sums of a product without a ``[B, T]`` temporary, and where the
installed torch's ``clamp`` passes the gradient."""

from __future__ import annotations

import functools

import torch

# torch.func (grad, vmap, jvp) wraps tensors; a wrapped tensor allows no data-dependent Python branch
is_functorch_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", lambda t: False)


@functools.lru_cache(maxsize=None)
def clamp_passes_at_bounds() -> bool:
    """Whether ``torch.clamp(x, lo, hi)`` with number bounds passes the gradient where ``x`` equals a
    bound: torch <= 2.13 does (its pass set is ``[lo, hi]``), torch >= 2.14 does not (``(lo, hi)``;
    likewise ``clamp(min=)`` / ``clamp(max=)`` at their bound, backward and forward mode). Probed once
    on the CPU, because stablerl's closed-form backwards (the fused losses, the clamp that keeps a
    1-byte mask) must equal the eager clamp of the torch the user runs, and so the frameworks' own
    losses, bit for bit."""
    x = torch.tensor([-1.0, 1.0], dtype=torch.float64, requires_grad=True)
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(torch.clamp(x, -1.0, 1.0).sum(), x)
    values = grad.tolist()
    if values not in ([1.0, 1.0], [0.0, 0.0]):  # one side only, or a split: refuse rather than guess
        raise RuntimeError(f"torch {torch.__version__}: clamp's gradient at its (lower, upper) bound is {values}, "
                           "neither (1, 1) (torch <= 2.13) nor (0, 0) (torch >= 2.14): stablerl's hand-written clamp "
                           "backwards do not know this rule (please report it with this torch version)")
    return values[0] == 1.0


def clamp_pass_mask(x: torch.Tensor, lo=None, hi=None) -> torch.Tensor:
    """``[x.shape]`` bool: where ``torch.clamp(x, lo, hi)`` passes the gradient in the installed
    torch (None: no bound on that side; NaN ``x``: False, as clamp's own backward)."""
    closed = clamp_passes_at_bounds()
    inside = torch.ones_like(x, dtype=torch.bool) if lo is None else (x >= lo if closed else x > lo)
    if hi is not None:
        inside = inside & (x <= hi if closed else x < hi)
    return inside


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
