"""SAPO's cheaper path (and the core pieces it uses) give the same bits as the plain computation.

The plain computation is verl's order of operations in autograd: padding zeroed with
``torch.where``, ``-(sigmoid(tau (r - 1)) * (4 / tau)) * A``, then seq-mean-token-mean with a mask
product. stablerl's ``sapo`` skips the mask product (``aggregate(..., zero_padded=True)``),
recomputes ``4 / tau`` in backward instead of keeping it, and core zeroes padding through a bit
mask; loss and gradient must still agree bit for bit, signs of zeros included.
"""

import pytest
import torch

import stablerl.api as api
from stablerl import Context, compute_policy_loss
from stablerl.tools import bench
from stablerl.api import _zero_padding_bits
from stablerl.ops import aggregate

INT_OF = {torch.float32: torch.int32, torch.float64: torch.int64}


def bits(t):
    return t.contiguous().view(INT_OF[t.dtype])


def dirty_batch(dtype, pad, seed=0, B=5, T=19):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0], lengths[2] = T, 0  # a full row and an all-masked row
    mask = torch.arange(T)[None] < lengths[:, None]
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    lp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * torch.tensor([0.01, 0.5, 3.0, 30.0, 0.2])[:, None]
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
    adv[3] = 0.0
    adv[4, ::2] = -0.0
    for t in (lp, old, adv):
        t[~mask] = pad
    return lp.to(dtype), old.to(dtype), adv.to(dtype), mask


def plain_sapo(lp, old, adv, mask, tau_pos, tau_neg, is_weights=None, seq_count=None):
    zero = torch.zeros((), dtype=lp.dtype)
    lp, old, adv = (torch.where(mask, t, zero) for t in (lp, old, adv))
    ratio = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
    tau = torch.where(adv > 0, torch.tensor(tau_pos, dtype=lp.dtype), torch.tensor(tau_neg, dtype=lp.dtype))
    pg = -(torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)) * adv
    if is_weights is not None:
        pg = pg * is_weights
    m = mask.to(lp.dtype)
    rows = m.sum(-1)
    total = ((pg * m).sum(-1) / rows.clamp(min=1)).sum()
    n_seq = (rows > 0).sum() if seq_count is None else seq_count
    return total / (n_seq.clamp(min=1) if isinstance(n_seq, torch.Tensor) else max(float(n_seq), 1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("pad", [0.0, -1.5, float("nan"), float("inf")])
@pytest.mark.parametrize("weights", [None, "rand"])
@pytest.mark.parametrize("taus,seq_count", [((1.0, 1.05), None), ((0.3, 2.0), 7)])
@pytest.mark.parametrize("bit_path", [False, True])
def test_sapo_is_bit_identical_to_the_plain_computation(dtype, pad, weights, taus, seq_count, bit_path, monkeypatch):
    # bit_path: core zeroes padding through the bit mask (used on CPU from 32768 elements) or torch.where
    monkeypatch.setattr(api, "_BIT_PATH_MIN_NUMEL", 0 if bit_path else 1 << 62)
    lp, old, adv, mask = dirty_batch(dtype, pad)
    w = None
    if weights:
        w = (torch.rand(lp.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.5).to(dtype)
    leaf_ref = lp.clone().requires_grad_(True)
    ref = plain_sapo(leaf_ref, old, adv, mask, *taus, is_weights=w, seq_count=seq_count)
    (g_ref,) = torch.autograd.grad(ref, leaf_ref)
    leaf = lp.clone().requires_grad_(True)
    loss, _ = compute_policy_loss("sapo", log_prob=leaf, old_log_prob=old, advantages=adv, response_mask=mask,
                                  is_weights=w, tau_pos=taus[0], tau_neg=taus[1],
                                  ctx=Context(seq_count=seq_count) if seq_count else None)
    (g,) = torch.autograd.grad(loss, leaf)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert torch.equal(bits(loss.detach()), bits(ref.detach()))
    assert torch.equal(bits(g), bits(g_ref))  # padding: +0.0 exactly, whatever it held
    assert torch.equal(bits(g[~mask]), torch.zeros_like(bits(g[~mask])))


def test_sapo_keeps_four_token_tensors_for_backward(monkeypatch):
    # verl's compute_policy_loss_sapo keeps five new [B, T] float tensors (clamp input, ratio, tau,
    # sigmoid, 4/tau) plus the caller's advantages; stablerl's eager path keeps four (ratio, tau,
    # sigmoid, its zero-padded advantages). Every log-ratio is within +-20 here, so the clamp is
    # skipped and keeps nothing (beyond the bound it keeps a 1-byte in-range mask:
    # tests/test_clamped_log_ratio.py)
    monkeypatch.setenv("STABLERL_FUSED", "0")
    B, T = 4, 32
    inputs = bench.make_inputs(B, T, torch.float32)
    saved = bench.saved_bytes(bench.ours_fn("sapo", inputs), inputs)
    # + the row token counts [B] (fp32), the sequence count (int64) and the scalar loss (fp32)
    assert saved == 4 * B * T * 4 + B * 4 + 8 + 4


@pytest.mark.parametrize("dtype,tensors", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_sapo_fused_keeps_four_fp32_token_tensors_or_two_for_half_inputs(dtype, tensors):
    # the fused path keeps the sigmoid, the ratio, -A and tau (fp32 in: verl keeps 20 bytes a token,
    # this 16); for bf16 in, -A and tau are rebuilt in backward from the caller's advantages (verl's
    # bf16 sapo keeps 10 bytes a token, this 8)
    B, T = 4, 32
    inputs = bench.make_inputs(B, T, dtype)
    saved = bench.saved_bytes(bench.ours_fn("sapo", inputs), inputs)
    assert saved == tensors * B * T * 4 + B * 4 + 8 + 4


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_aggregate_zero_padded_equals_the_mask_product(mode, mask_kind):
    g = torch.Generator().manual_seed(0)
    mask = torch.arange(23)[None] < torch.tensor([23, 5, 0, 11])[:, None]
    x = torch.randn(4, 23, generator=g) * mask  # +-0 on padding
    x[1, 7:] = -0.0
    m = mask if mask_kind == "bool" else mask.float()
    ctx = Context(loss_scale_factor=23.0)
    out = []
    for zero_padded in (False, True):
        leaf = x.clone().requires_grad_(True)
        loss = aggregate(leaf * 1.7, m, mode, ctx, zero_padded=zero_padded)
        (grad,) = torch.autograd.grad(loss, leaf)
        out.append((bits(loss.detach()), grad))
    assert torch.equal(out[0][0], out[1][0])
    assert torch.equal(bits(out[0][1][mask]), bits(out[1][1][mask]))
    # on padding the gradient is no longer stopped by a mask product: core's zeroing of log_prob
    # (torch.where's backward) is what gives it +0.0 there
    assert torch.equal(out[0][1][~mask], torch.zeros(int((~mask).sum())))
    assert (out[1][1][~mask] != 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zero_padding_bits_equals_where(dtype):
    valid = torch.tensor([[True, True, False, False, True, False, True, False]])
    t = torch.tensor([[-0.0, float("nan"), float("nan"), float("-inf"), float("inf"), -2.5, 3.0, -0.0]], dtype=dtype)
    pattern = valid.view(torch.uint8).to(INT_OF[dtype]).neg_()
    got = _zero_padding_bits(t, pattern)
    want = torch.where(valid, t, torch.zeros((), dtype=dtype))
    assert got.dtype == dtype
    assert torch.equal(bits(got), bits(want))  # -0.0 and the NaN payload kept on valid tokens, +0.0 on padding
    assert bits(got)[0, 0] != 0 and bits(got)[0, 7] == 0


@pytest.mark.parametrize("name", ["vanilla", "gspo", "gmpo", "cispo", "kl_cov", "sapo", "m2po"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_core_bit_path_gives_the_bits_of_torch_where(name, dtype, monkeypatch):
    inputs = bench.make_inputs(6, 40, dtype, seed=2)
    pad = ~inputs["response_mask"]
    for key in ("log_prob", "old_log_prob", "advantages"):
        t = inputs[key].clone()
        t[pad] = float("nan")
        t[0, :3] = -0.0
        inputs[key] = t
    out = []
    for threshold in (1 << 62, 0):  # torch.where everywhere, then the bit path everywhere
        monkeypatch.setattr(api, "_BIT_PATH_MIN_NUMEL", threshold)
        leaf = inputs["log_prob"].clone().requires_grad_(True)
        loss, metrics = bench.ours_fn(name, inputs)(leaf)
        (grad,) = torch.autograd.grad(loss, leaf)
        out.append((loss.detach().float(), grad.float(), metrics))
    (l1, g1, m1), (l2, g2, m2) = out
    assert torch.isfinite(l1) and torch.equal(bits(l1), bits(l2))
    assert torch.equal(bits(g1), bits(g2)) and not bits(g2[pad]).any()
    assert m1 == m2
