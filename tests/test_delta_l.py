"""ΔL Normalization (loss aggregation ``delta_l``) and the registered-aggregation fallback of ops.aggregate.

Values and gradients are checked against an independent float64 computation written here, and
against the authors' recipe (advantage x_i-scaling + masked_mean_allavg), up to the documented
constant between the two normalisers.
"""

import numpy as np
import pytest
import torch

import stablerl
from conftest import make_batch
from stablerl import Context, StableRLError
from stablerl.ops import aggregate


def loss_and_grad(mode="delta_l", batch=None, ctx=None, name="vanilla", **kw):
    b = batch or make_batch(B=6, T=7, seed=1, dtype=torch.float64)
    lp = b["log_prob"].detach().clone().requires_grad_(True)
    loss, metrics = stablerl.compute_policy_loss(
        name, log_prob=lp, old_log_prob=b["old_log_prob"], advantages=b["advantages"],
        response_mask=b["response_mask"], loss_agg_mode=mode, ctx=ctx, **kw)
    (grad,) = torch.autograd.grad(loss, lp) if loss.requires_grad else (torch.zeros_like(lp),)
    return loss, grad


def per_token_vanilla(b, lp):
    """verl's vanilla PPO-clip per-token loss (clip 0.2 / 0.28, dual clip 3), written out."""
    ratio = torch.exp(torch.clamp(lp - b["old_log_prob"], -20, 20))
    a = b["advantages"]
    l = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 0.8, 1.28))
    return torch.where(a < 0, torch.minimum(l, -a * 3.0), l)


def reference(b, alpha):
    """sum_i x_i sum_t m l / N, x_i = L_i^-alpha / mean_j L_j^-alpha over rows with L > 0 (python loop)."""
    mask = b["response_mask"].double()
    L = [float(x) for x in mask.sum(-1)]
    raw = [l ** -alpha if l > 0 else 0.0 for l in L]
    n = sum(1 for l in L if l > 0)
    mean = sum(raw) / n
    lp = b["log_prob"].detach().clone().requires_grad_(True)
    lt = per_token_vanilla(b, lp)
    total = sum(raw[i] / mean * (lt[i] * mask[i]).sum() for i in range(len(L)))
    loss = total / mask.sum()
    (grad,) = torch.autograd.grad(loss, lp)
    return loss, grad


@pytest.mark.parametrize("alpha", [1.0, 0.75, 0.0, 2.0])
@pytest.mark.parametrize("seed", range(3))
def test_value_and_gradient_match_independent_computation(alpha, seed):
    b = make_batch(B=8, T=9, seed=seed, dtype=torch.float64)
    loss, grad = loss_and_grad(batch=b, loss_agg_params={"alpha": alpha})
    ref_loss, ref_grad = reference(b, alpha)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-14)
    mask = b["response_mask"].bool()
    assert bool((grad[~mask] == 0).all()), "masked tokens get exactly zero gradient"


def test_alpha_zero_is_token_mean_and_default_alpha_is_one():
    b = make_batch(B=6, T=8, seed=4, dtype=torch.float64)
    l0, g0 = loss_and_grad(batch=b, loss_agg_params={"alpha": 0.0})
    lt, gt = loss_and_grad("token-mean", batch=b)
    torch.testing.assert_close(l0, lt, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(g0, gt, rtol=1e-14, atol=1e-15)
    l1, _ = loss_and_grad(batch=b, loss_agg_params={"alpha": 1.0})
    ld, _ = loss_and_grad(batch=b)
    assert float(l1.detach()) == float(ld.detach())
    assert stablerl.get_registry().get("aggregation", "delta_l").defaults() == {"alpha": 1.0}


def test_hand_weights_alpha_one():
    # lengths 1, 2, 4: 1/L = [1, .5, .25], mean 7/12 -> x = [12/7, 6/7, 3/7]; loss = sum_i x_i sum_t l / 7
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
    loss_mat = torch.tensor([[2.0, 9, 9, 9], [1.0, 3, 9, 9], [1.0, 1, 1, 1]], dtype=torch.float64)
    out = aggregate(loss_mat, mask, "delta_l")
    want = (12 / 7 * 2 + 6 / 7 * 4 + 3 / 7 * 4) / 7
    assert abs(float(out) - want) < 1e-14
    out = aggregate(loss_mat, mask, "delta_l", params={"alpha": 0.5})
    x = np.array([1, 2, 4.0]) ** -0.5
    x = x / x.mean()
    assert abs(float(out) - (x[0] * 2 + x[1] * 4 + x[2] * 4) / 7) < 1e-14


def test_matches_authors_recipe_up_to_the_normaliser_constant():
    """Authors: A_i <- A_i x_i (x over the batch, via mean L), loss = sum(m l) / (B * T_pad)."""
    g = torch.Generator().manual_seed(7)
    B, T = 12, 9
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    scores = torch.randint(0, 2, (B,), generator=g).double()
    rewards = torch.zeros(B, T, dtype=torch.float64)
    rewards[torch.arange(B), lengths - 1] = scores
    index = [i // 4 for i in range(B)]
    a, _ = stablerl.compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask, index=index)
    for alpha in (1.0, 0.75):
        L = [float(x) for x in lengths]
        mean_l = sum(L) / B
        recip = [1 / (l / mean_l) ** alpha for l in L]
        x = torch.tensor([r / (sum(recip) / B) for r in recip], dtype=torch.float64)
        old = -torch.rand(B, T, generator=g, dtype=torch.float64) - 0.1
        lp0 = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
        b_ref = {"old_log_prob": old, "advantages": a * x[:, None]}
        lp = lp0.clone().requires_grad_(True)
        ref = (per_token_vanilla(b_ref, lp) * mask).mean()  # masked_mean_allavg
        (g_ref,) = torch.autograd.grad(ref, lp)
        b = {"log_prob": lp0, "old_log_prob": old, "advantages": a, "response_mask": mask}
        ours, g_ours = loss_and_grad(batch=b, loss_agg_params={"alpha": alpha})
        c = B * T / mask.sum()  # T_pad / mean L: the only difference (global token count vs padded size)
        torch.testing.assert_close(ours, ref * c, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(g_ours, g_ref * c, rtol=1e-12, atol=1e-14)


def test_degenerate_rows_and_batches():
    b = make_batch(B=5, T=6, seed=2, dtype=torch.float64)
    b["response_mask"] = b["response_mask"].clone()
    b["response_mask"][2] = False  # an all-masked row: weight 0, no NaN
    loss, grad = loss_and_grad(batch=b)
    assert bool(torch.isfinite(loss)) and bool(torch.isfinite(grad).all()) and bool((grad[2] == 0).all())
    ref_loss, ref_grad = reference(b, 1.0)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-14)
    b["response_mask"] = torch.zeros_like(b["response_mask"])
    loss, grad = loss_and_grad(batch=b)
    assert float(loss.detach()) == 0.0 and bool((grad == 0).all())
    empty = aggregate(torch.zeros(0, 6, dtype=torch.float64), torch.zeros(0, 6), "delta_l")
    assert float(empty) == 0.0


def test_bf16_close_to_fp32_and_is_weights_applied():
    b32 = make_batch(B=8, T=7, seed=5, dtype=torch.float32)
    b16 = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in b32.items()}
    l16, g16 = loss_and_grad(batch=b16)
    rounded = {k: (v.float() if v.is_floating_point() else v) for k, v in b16.items()}
    l32, _ = loss_and_grad(batch=rounded)
    assert l16.dtype == torch.float32 and bool(torch.isfinite(g16.float()).all())
    torch.testing.assert_close(l16, l32, rtol=1e-2, atol=1e-3)
    b = make_batch(B=6, T=7, seed=1, dtype=torch.float64)
    half, _ = loss_and_grad(batch=b, is_weights=torch.full_like(b["old_log_prob"], 0.5))
    full, _ = loss_and_grad(batch=b)
    torch.testing.assert_close(half, full * 0.5, rtol=1e-12, atol=1e-15)


def test_weights_are_global_through_ctx_and_token_count():
    b = make_batch(B=6, T=7, seed=3, dtype=torch.float64)
    calls = []

    def reduce(t, op):
        calls.append(op)
        return t

    loss, _ = loss_and_grad(batch=b, ctx=Context(all_reduce_fn=reduce))
    assert calls == ["sum"]
    torch.testing.assert_close(loss, loss_and_grad(batch=b)[0])
    # the normaliser is ctx.token_count when given
    n = float(b["response_mask"].sum())
    l2, _ = loss_and_grad(batch=b, ctx=Context(token_count=2 * n))
    torch.testing.assert_close(l2, loss / 2)
    with pytest.raises(StableRLError, match="dp_size > 1 needs the global token_count"):
        loss_and_grad(batch=b, ctx=Context(dp_size=2))
    assert stablerl.get_registry().get("aggregation", "delta_l").batch_statistics


def test_unknown_modes_and_params_errors():
    b = make_batch(B=4, T=5, seed=0, dtype=torch.float64)
    with pytest.raises(StableRLError, match=r"unknown loss_agg_mode 'delta-l' \(did you mean 'delta_l'\?\).*token-mean"):
        loss_and_grad("delta-l", batch=b)
    with pytest.raises(StableRLError, match="takes no parameters"):
        loss_and_grad("token-mean", batch=b, loss_agg_params={"alpha": 1.0})
    with pytest.raises(StableRLError, match="alpha must be >= 0"):
        loss_and_grad(batch=b, loss_agg_params={"alpha": -1.0})
    with pytest.raises(stablerl.UnknownNameError, match="did you mean 'alpha'"):
        loss_and_grad(batch=b, loss_agg_params={"alphaa": 1.0})
