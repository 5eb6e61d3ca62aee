"""core.ops.clamped_log_ratio keeps 1 byte per token for backward instead of the 4-8 of torch.clamp,
with torch.clamp's value and gradient bit for bit (boundaries, NaN, +-inf, every float dtype)."""

import pytest
import torch

from stablerl.ops import LOG_RATIO_BOUND, clamped_log_ratio


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = (torch.randn(6, 50, generator=g, dtype=torch.float64) * 15).to(dtype)
    old = (torch.randn(6, 50, generator=g, dtype=torch.float64) * 15).to(dtype)
    lp[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), LOG_RATIO_BOUND, -LOG_RATIO_BOUND, 0.0],
                             dtype=dtype)
    old[0, :6] = 0.0
    old[1, :2] = torch.tensor([float("inf"), float("nan")], dtype=dtype)
    return lp, old


def _run(fn, lp, old, upstream):
    x = lp.clone().requires_grad_(True)
    y = fn(x, old)
    (g,) = torch.autograd.grad(y, x, upstream)
    return y.detach(), g


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_value_and_gradient_equal_torch_clamp_bit_for_bit(dtype):
    lp, old = _inputs(dtype)
    upstream = torch.randn(lp.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    upstream[2, :3] = torch.tensor([float("nan"), float("inf"), -0.0], dtype=dtype)

    def reference(x, o):
        return torch.clamp(x - o, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)

    y_ref, g_ref = _run(reference, lp, old, upstream)
    y, g = _run(clamped_log_ratio, lp, old, upstream)
    int_type = {8: torch.int64, 4: torch.int32, 2: torch.int16}[lp.element_size()]
    assert torch.equal(y.view(int_type), y_ref.view(int_type))
    assert torch.equal(g.view(int_type), g_ref.view(int_type))
    assert int((g_ref == 0).sum()) > 0 and int((g_ref != 0).sum()) > 0  # both branches exercised


def test_keeps_one_byte_per_token_for_backward():
    lp, old = _inputs(torch.float32)
    x = lp.clone().requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        clamped_log_ratio(x, old)
    assert [t.dtype for t in saved] == [torch.bool]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        saved.clear()
        torch.clamp(x - old, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    assert [t.dtype for t in saved] == [torch.float32]  # what torch.clamp keeps


def test_without_grad_it_is_a_plain_clamp():
    lp, old = _inputs(torch.float32)
    with torch.no_grad():
        y = clamped_log_ratio(lp.requires_grad_(True), old)
    assert not y.requires_grad
    assert torch.equal(torch.nan_to_num(y), torch.nan_to_num(torch.clamp(lp.detach() - old, -20.0, 20.0)))
