"""Policy losses compose with torch.func (grad, jvp) and forward-mode AD, including the paths that use
stablerl's own autograd Functions: the log-ratio clamp (every ratio loss), CPU padding zeroing by bit
mask (>= 32768 tokens) and sapo's gate scaling. Each transform's result equals reverse-mode autograd's."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import stablerl
from conftest import make_batch


@pytest.mark.parametrize("name", ["vanilla", "sapo", "cispo", "gspo", "m2po"])
@pytest.mark.parametrize("B,T", [(4, 6), (8, 4608)], ids=["small", "bit-mask-path"])
def test_torch_func_grad_and_jvp_equal_autograd(name, B, T):
    b = make_batch(B=B, T=T, seed=2, dtype=torch.float64, spread=0.6)
    lp0 = b.pop("log_prob").detach()
    mask = b["response_mask"].bool()
    lp0 = torch.where(mask, lp0, torch.full_like(lp0, float("nan")))  # garbage on padding

    def loss_of(lp):
        return stablerl.compute_policy_loss(name, log_prob=lp, **b)[0]

    leaf = lp0.clone().requires_grad_(True)
    (reference,) = torch.autograd.grad(loss_of(leaf), leaf)
    assert torch.isfinite(reference).all() and reference[mask].abs().sum() > 0

    torch.testing.assert_close(torch.func.grad(loss_of)(lp0), reference, rtol=1e-12, atol=0)

    direction = torch.randn(lp0.shape, generator=torch.Generator().manual_seed(3), dtype=lp0.dtype)
    _, tangent = torch.func.jvp(loss_of, (lp0,), (direction,))
    expected = (reference * direction).sum()
    torch.testing.assert_close(tangent, expected, rtol=1e-9, atol=1e-12)

    with fwAD.dual_level():
        out = loss_of(fwAD.make_dual(lp0, direction))
        torch.testing.assert_close(fwAD.unpack_dual(out).tangent, expected, rtol=1e-9, atol=1e-12)
