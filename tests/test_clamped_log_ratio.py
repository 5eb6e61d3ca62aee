"""core.ops.clamped_log_ratio keeps 1 byte per token for backward instead of the 4-8 of torch.clamp,
with torch.clamp's value and gradient bit for bit (boundaries, NaN, +-inf, every float dtype)."""

import pytest
import torch

from stablerl.ops import LOG_RATIO_BOUND, clamp_passes_at_bounds, clamped_log_ratio


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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_within_the_bound_the_clamp_is_skipped_with_the_same_bits(dtype):
    # every log-ratio inside (-bound, bound), -0.0 included: clamp is the identity in value and gradient
    # there, so nothing is clamped and nothing is kept for backward (the bounds themselves: next test)
    g = torch.Generator().manual_seed(3)
    lp = -torch.rand(4, 40, generator=g, dtype=torch.float64).to(dtype) * 5
    old = lp + (torch.rand(4, 40, generator=g, dtype=torch.float64).to(dtype) - 0.5)
    lp[0, :3] = torch.tensor([LOG_RATIO_BOUND * 0.999, -LOG_RATIO_BOUND * 0.999, -0.0], dtype=dtype)
    old[0, :3] = 0.0
    upstream = torch.randn(lp.shape, generator=g, dtype=dtype)
    y_ref, g_ref = _run(lambda x, o: torch.clamp(x - o, -LOG_RATIO_BOUND, LOG_RATIO_BOUND), lp, old, upstream)
    y, g_ours = _run(clamped_log_ratio, lp, old, upstream)
    int_type = {8: torch.int64, 4: torch.int32}[lp.element_size()]
    assert torch.equal(y.view(int_type), y_ref.view(int_type))
    assert torch.equal(g_ours.view(int_type), g_ref.view(int_type))
    saved = []
    x = lp.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        clamped_log_ratio(x, old)
    assert saved == []
    # one token past the bound: the clamp (with its 1-byte mask) is back
    lp[1, 5] = old[1, 5] + LOG_RATIO_BOUND * 1.01
    x = lp.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = clamped_log_ratio(x, old)
    assert [t.dtype for t in saved] == [torch.bool] and float(y[1, 5].detach()) == LOG_RATIO_BOUND


@pytest.mark.parametrize("bound", [LOG_RATIO_BOUND, -LOG_RATIO_BOUND])
def test_at_the_bound_it_follows_the_installed_torch_clamp(bound):
    # torch <= 2.13's clamp passes the gradient at a bound (so the clamp is skipped there), torch >= 2.14's
    # stops it (so the clamp is kept, with its 1-byte mask): both equal torch.clamp bit for bit
    lp = torch.tensor([[bound, 0.5, -1.0]], dtype=torch.float64)
    old = torch.zeros_like(lp)
    upstream = torch.tensor([[0.75, -1.5, 2.0]], dtype=torch.float64)
    y_ref, g_ref = _run(lambda x, o: torch.clamp(x - o, -LOG_RATIO_BOUND, LOG_RATIO_BOUND), lp, old, upstream)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y, g_ours = _run(clamped_log_ratio, lp, old, upstream)
    assert torch.equal(y, y_ref) and torch.equal(g_ours.view(torch.int64), g_ref.view(torch.int64))
    passes = clamp_passes_at_bounds()
    assert float(g_ours[0, 0]) == (0.75 if passes else 0.0)
    assert [t.dtype for t in saved] == ([] if passes else [torch.bool])


def test_the_clamp_convention_probe_reads_the_installed_torch():
    x = torch.tensor([-2.0, 3.0], requires_grad=True)
    (grad,) = torch.autograd.grad(torch.clamp(x, -2.0, 3.0).sum(), x)
    assert clamp_passes_at_bounds() is bool(grad[0] == 1.0) is bool(grad[1] == 1.0)
    # torch 2.14 changed it (CI's unit session pins 2.13.0, the unit_newest_torch session 2.14.1)
    major_minor = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
    assert clamp_passes_at_bounds() is (major_minor <= (2, 13))


def test_an_unknown_clamp_rule_is_refused_not_guessed(monkeypatch):
    from stablerl import fast_paths

    def splitting_clamp(x, lo, hi):  # a rule no release has: the gradient split in half at a bound
        return torch.maximum(torch.minimum(x, torch.full_like(x, hi)), torch.full_like(x, lo))

    fast_paths.clamp_passes_at_bounds.cache_clear()
    monkeypatch.setattr(torch, "clamp", splitting_clamp)
    try:
        with pytest.raises(RuntimeError, match=r"clamp's gradient at its \(lower, upper\) bound is \[0.5, 0.5\]"):
            fast_paths.clamp_passes_at_bounds()
    finally:
        monkeypatch.undo()
        fast_paths.clamp_passes_at_bounds.cache_clear()
    assert isinstance(fast_paths.clamp_passes_at_bounds(), bool)


def test_the_skip_is_not_taken_under_torch_func():
    # torch.func's wrapped tensors allow no data-dependent branch: the general path gives the same gradient
    lp = -torch.rand(3, 5, dtype=torch.float64)
    old = lp - 0.1
    grad = torch.func.grad(lambda x: clamped_log_ratio(x, old).exp().sum())(lp)
    assert torch.allclose(grad, (lp - old).exp(), rtol=0, atol=1e-15)
