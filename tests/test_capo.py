"""CAPO (arXiv 2510.00819): token-level curvature mask from the LM-head linear model of the update.

The reference quantities are recomputed here by brute force in float64: the per-token LM-head
gradient by autograd on the weight (checked against the explicit outer product A (e_a - pi) h^T),
the effective direction G from a real ``torch.optim.Adam`` step, the Fisher term as the
directional derivative <grad log pi_a, G>, and the Hessian term as the second derivative of
A * pi_a(W + alpha G) / pi_a(W) in alpha.
"""

from __future__ import annotations


import pytest
import torch

import stablerl
from stablerl import MissingInputError, StableRLError
from stablerl.context import Context
from stablerl.plugins.capo import capo_curvature, capo_moment_update, capo_token_mask

V, H, B, T = 11, 5, 3, 4


def _data(seed=0, dtype=torch.float64, V=V, H=H, B=B, T=T, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hs = scale * torch.randn(B, T, H, generator=g, dtype=torch.float64)
    W = torch.randn(V, H, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g, dtype=torch.float64).unsqueeze(-1).expand(B, T).clone()
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 2:] = False
    mask[2, 1:] = False
    exp_avg = 0.1 * torch.randn(V, H, generator=g, dtype=torch.float64)
    exp_avg_sq = 0.05 * torch.rand(V, H, generator=g, dtype=torch.float64) + 1e-3
    cast = lambda t: t.to(dtype)  # noqa: E731
    return dict(hidden_states=cast(hs), lm_head_weight=cast(W), token_ids=ids, advantages=cast(adv),
                response_mask=mask), cast(exp_avg), cast(exp_avg_sq)


def _brute(hs, W, ids, adv, mask, *, lr, top_k, optimizer="sgd", exp_avg=None, exp_avg_sq=None, step=0,
           betas=(0.9, 0.999), eps=1e-8):
    """Per-token s, kl, hessian, full update by autograd + a real torch Adam step (float64)."""
    out = {k: torch.zeros(mask.shape, dtype=torch.float64) for k in ("s", "kl", "hess", "full")}
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                continue
            h, a, A = hs[b, t], int(ids[b, t]), float(adv[b, t])
            z = W @ h
            support = torch.arange(W.shape[0]) if top_k == 0 else z.topk(top_k).indices
            assert bool((support == a).any()), "test data: the sampled token must be in the support"
            j = int((support == a).nonzero())

            def logp(Wp):
                return torch.log_softmax(Wp[support] @ h, dim=-1)[j]

            Wl = W.clone().requires_grad_(True)
            (grad_logp,) = torch.autograd.grad(logp(Wl), Wl)
            g = A * grad_logp  # [V, H], zero off the support
            # explicit outer product A (e_a - pi) h^T on the support rows
            pi = torch.softmax(z[support], -1)
            e = torch.zeros_like(pi)
            e[j] = 1.0
            explicit = torch.zeros_like(W)
            explicit[support] = A * torch.outer(e - pi, h)
            torch.testing.assert_close(g, explicit, rtol=1e-12, atol=1e-12)
            if optimizer == "sgd" or step == 0:
                G = g.clone()
            else:  # G = minus torch Adam's lr=1 step on the loss gradient -g, on the support rows
                P = torch.nn.Parameter(W.clone())
                opt = torch.optim.Adam([P], lr=1.0, betas=betas, eps=eps)
                opt.state[P] = {"step": torch.tensor(float(step)), "exp_avg": exp_avg.clone(),
                                "exp_avg_sq": exp_avg_sq.clone()}
                P.grad = -g
                opt.step()
                G = torch.zeros_like(W)
                G[support] = (P.detach() - W)[support]
            s = (grad_logp * G).sum()

            def ratio_obj(alpha):
                return A * torch.exp(logp(W + alpha * G) - logp(W))

            hess = torch.autograd.functional.hessian(ratio_obj, torch.zeros((), dtype=torch.float64))
            out["s"][b, t] = s
            out["kl"][b, t] = 0.5 * lr**2 * s**2
            out["hess"][b, t] = hess
            out["full"][b, t] = lr * (g * G).sum() + 0.5 * lr**2 * hess
    return out


def _support_ok(d, top_k):
    z = torch.einsum("bth,vh->btv", d["hidden_states"].double(), d["lm_head_weight"].double())
    top = z.topk(top_k, -1).indices
    return bool(((top == d["token_ids"][..., None]).any(-1) | ~d["response_mask"]).all())


def _with_tokens_in_topk(seed, top_k, **kw):
    """Data whose sampled tokens lie in the top-k (as when generation used the same top-k)."""
    d, m, s = _data(seed, **kw)
    z = torch.einsum("bth,vh->btv", d["hidden_states"], d["lm_head_weight"])
    top = z.topk(top_k, -1).indices
    pick = torch.randint(0, top_k, d["token_ids"].shape, generator=torch.Generator().manual_seed(seed + 7))
    d["token_ids"] = top.gather(-1, pick[..., None]).squeeze(-1)
    assert _support_ok(d, top_k)
    return d, m, s


@pytest.mark.parametrize("top_k", [0, 4])
@pytest.mark.parametrize("optimizer,step", [("sgd", 0), ("adam", 0), ("adam", 3)])
def test_curvature_matches_brute_force(top_k, optimizer, step):
    d, m, s = _with_tokens_in_topk(1, top_k or V)
    lr = 0.3
    got = capo_curvature(**d, lr=lr, top_k=top_k, optimizer=optimizer, exp_avg=m, exp_avg_sq=s, adam_step=step,
                         chunk_elements=7)  # tiny chunks: several token and vocabulary slices
    ref = _brute(d["hidden_states"], d["lm_head_weight"], d["token_ids"], d["advantages"], d["response_mask"],
                 lr=lr, top_k=top_k, optimizer=optimizer, exp_avg=m, exp_avg_sq=s, step=step)
    torch.testing.assert_close(got["fisher_s"], ref["s"], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got["approx_kl"], ref["kl"], rtol=1e-9, atol=1e-14)
    torch.testing.assert_close(got["hessian"], ref["hess"], rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(got["full_update"], ref["full"], rtol=1e-7, atol=1e-10)
    assert float(ref["s"].abs().max()) > 1e-3  # the check is not vacuous
    assert bool((got["approx_kl"][~d["response_mask"]] == 0).all())


def test_sgd_closed_form_and_chunk_invariance():
    d, m, s = _with_tokens_in_topk(2, 4)
    big = capo_curvature(**d, lr=0.1, top_k=4, optimizer="adam", exp_avg=m, exp_avg_sq=s, adam_step=2)
    small = capo_curvature(**d, lr=0.1, top_k=4, optimizer="adam", exp_avg=m, exp_avg_sq=s, adam_step=2,
                           chunk_elements=1)
    for k in big:
        torch.testing.assert_close(small[k], big[k], rtol=1e-12, atol=1e-15)
    # sgd, full vocabulary: s = A |h|^2 sum_k (e_a - pi)_k^2
    sgd = capo_curvature(**d, lr=0.1, top_k=0, optimizer="sgd")
    hs, W = d["hidden_states"], d["lm_head_weight"]
    pi = torch.softmax(hs @ W.T, -1)
    v = torch.nn.functional.one_hot(d["token_ids"], V).double() - pi
    expect = d["advantages"] * (hs * hs).sum(-1) * (v * v).sum(-1) * d["response_mask"]
    torch.testing.assert_close(sgd["fisher_s"], expect, rtol=1e-10, atol=1e-13)


def test_sampled_token_outside_topk_uses_zero_one_hot():
    d, _, _ = _data(3)
    z = torch.einsum("bth,vh->btv", d["hidden_states"], d["lm_head_weight"])
    d["token_ids"] = z.argmin(-1)  # never in the top-2
    got = capo_curvature(**d, lr=0.5, top_k=2, optimizer="sgd")
    pi = torch.softmax(z.topk(2, -1).values, -1)
    expect = d["advantages"] * (d["hidden_states"] ** 2).sum(-1) * (pi * pi).sum(-1) * d["response_mask"]
    torch.testing.assert_close(got["fisher_s"], expect, rtol=1e-10, atol=1e-13)


def test_mask_thresholds():
    d, _, _ = _with_tokens_in_topk(4, V, B=6, T=8)
    lr = 0.2
    kw = dict(lr=lr, top_k=0, optimizer="sgd")
    valid = d["response_mask"]
    keep, terms = capo_token_mask(**d, fisher_token_mask_tau=float("inf"), hessian_token_mask_tau=float("inf"),
                                  hessian_symmetric_clipping=True, **kw)
    assert torch.equal(keep, valid)  # tau -> inf masks nothing
    keep0, _ = capo_token_mask(**d, fisher_token_mask_tau=0.0, hessian_token_mask_tau=0.0, **kw)
    assert torch.equal(keep0, valid)  # tau = 0 disables both tests (reference convention)
    kl = terms["approx_kl"][valid]
    order = kl.sort(descending=True).values
    prev = -1
    for i in range(1, len(order)):  # shrinking tau masks the highest-curvature tokens first
        tau = float(0.5 * (order[i - 1] + order[i]))
        keep_f, _ = capo_token_mask(**d, fisher_token_mask_tau=tau, hessian_token_mask_tau=0.0, **kw)
        masked = valid & ~keep_f
        assert int(masked.sum()) == i > prev
        assert float(terms["approx_kl"][masked].min()) > float(terms["approx_kl"][valid & keep_f].max())
        prev = i
    # Hessian test: symmetric keeps |full| < tau, one-sided keeps 0 <= full < tau (a large lr makes the
    # second-order term dominate, so that some predicted changes are negative)
    kw = dict(kw, lr=5.0)
    _, terms = capo_token_mask(**d, **kw)
    full = terms["full_update"]
    tau_h = float(full[valid].abs().median())
    keep_s, _ = capo_token_mask(**d, fisher_token_mask_tau=0.0, hessian_token_mask_tau=tau_h,
                                hessian_symmetric_clipping=True, **kw)
    keep_o, _ = capo_token_mask(**d, fisher_token_mask_tau=0.0, hessian_token_mask_tau=tau_h,
                                hessian_symmetric_clipping=False, **kw)
    assert torch.equal(keep_s, valid & (full.abs() < tau_h))
    assert torch.equal(keep_o, valid & (full >= 0) & (full < tau_h))
    assert bool((full[valid] < 0).any()) and bool((keep_s & ~keep_o).any())


def _loss_inputs(d, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -(torch.rand(d["response_mask"].shape, generator=g, dtype=torch.float64) * 2 + 0.05)
    lp = (old + 0.2 * torch.randn(old.shape, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    return lp, old


def test_loss_value_and_gradient():
    d, _, _ = _with_tokens_in_topk(5, V, B=4, T=6)
    lp, old = _loss_inputs(d)
    lr = 0.2
    keep, terms = capo_token_mask(**d, lr=lr, top_k=0, optimizer="sgd", fisher_token_mask_tau=1e9,
                                  hessian_token_mask_tau=0.0)
    valid = d["response_mask"]
    tau = float(terms["approx_kl"][valid].median())
    keep, terms = capo_token_mask(**d, lr=lr, top_k=0, optimizer="sgd", fisher_token_mask_tau=tau,
                                  hessian_token_mask_tau=0.0)
    assert 0 < int((valid & ~keep).sum()) < int(valid.sum())
    lpg = lp.clone().requires_grad_(True)
    hs = d["hidden_states"].clone().requires_grad_(True)
    loss, metrics = stablerl.compute_policy_loss(
        "capo", log_prob=lpg, old_log_prob=old, advantages=d["advantages"], response_mask=valid,
        hidden_states=hs, lm_head_weight=d["lm_head_weight"], token_ids=d["token_ids"],
        loss_agg_mode="seq-mean-token-mean", lr=lr, top_k=0, optimizer="sgd",
        fisher_token_mask_tau=tau, hessian_token_mask_tau=0.0,
    )
    loss.backward()
    # by hand: -min(rA, clip(r, 0.8, 1.2)A), mean over kept tokens per row, mean over rows with valid tokens
    lph = lp.clone().requires_grad_(True)
    r = torch.exp(lph - old)
    A = d["advantages"]
    per = -torch.minimum(r * A, r.clamp(0.8, 1.2) * A)
    k = keep.double()
    rows = (per * k).sum(-1) / k.sum(-1).clamp(min=1)
    expect = rows.sum() / (valid.sum(-1) > 0).sum()
    expect.backward()
    torch.testing.assert_close(loss, expect, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(lpg.grad, lph.grad, rtol=1e-12, atol=1e-14)
    assert bool((lpg.grad[valid & ~keep] == 0).all())  # masked tokens: exactly zero gradient
    assert bool((lpg.grad[~valid] == 0).all())
    assert bool((lpg.grad[keep] != 0).any())
    assert hs.grad is None  # no gradient through the mask's inputs
    n_masked = int((valid & ~keep).sum())
    assert metrics["capo/mask_fraction"] == pytest.approx(n_masked / int(valid.sum()))
    assert metrics["capo/fisher_mask_fraction"] == pytest.approx(n_masked / int(valid.sum()))
    assert metrics["capo/hessian_mask_fraction"] == 0.0
    assert metrics["capo/fisher_kl_mean"] == pytest.approx(float(terms["approx_kl"][valid].mean()))
    # the mask itself carries no gradient, even when computed from inputs that require it
    keep2, terms2 = capo_token_mask(hs, d["lm_head_weight"].clone().requires_grad_(True), d["token_ids"],
                                    d["advantages"], valid, lr=lr, top_k=0, optimizer="sgd")
    assert not keep2.requires_grad and not terms2["approx_kl"].requires_grad


def test_dr_capo_aggregation_and_is_weights():
    d, _, _ = _with_tokens_in_topk(6, V, B=4, T=6)
    lp, old = _loss_inputs(d, 1)
    valid = d["response_mask"]
    common = dict(old_log_prob=old, advantages=d["advantages"], response_mask=valid,
                  hidden_states=d["hidden_states"], lm_head_weight=d["lm_head_weight"], token_ids=d["token_ids"],
                  lr=0.2, top_k=0, optimizer="sgd", fisher_token_mask_tau=1e-3, hessian_token_mask_tau=0.0)
    keep, _ = capo_token_mask(**d, lr=0.2, top_k=0, optimizer="sgd", fisher_token_mask_tau=1e-3,
                              hessian_token_mask_tau=0.0)
    ctx = Context(loss_scale_factor=10.0)
    w = torch.full_like(lp, 0.5)
    loss, _ = stablerl.compute_policy_loss("capo", log_prob=lp, loss_agg_mode="seq-mean-token-sum-norm",
                                           ctx=ctx, is_weights=w, **common)
    r = torch.exp(lp - old)
    A = d["advantages"]
    per = -torch.minimum(r * A, r.clamp(0.8, 1.2) * A) * 0.5
    expect = (per * keep).sum() / ((valid.sum(-1) > 0).sum() * 10.0)
    torch.testing.assert_close(loss, expect, rtol=1e-12, atol=1e-14)


def test_adam_real_optimizer_state_through_api():
    d, m, s = _with_tokens_in_topk(7, 4)
    lp, old = _loss_inputs(d, 2)
    _, metrics = stablerl.compute_policy_loss(
        "capo", log_prob=lp, old_log_prob=old, advantages=d["advantages"], response_mask=d["response_mask"],
        hidden_states=d["hidden_states"], lm_head_weight=d["lm_head_weight"], token_ids=d["token_ids"],
        lm_head_exp_avg=m, lm_head_exp_avg_sq=s, moments="input", adam_step=3, top_k=4, lr=0.3,
        fisher_token_mask_tau=1e9, hessian_token_mask_tau=0.0,
    )
    ref = _brute(d["hidden_states"], d["lm_head_weight"], d["token_ids"], d["advantages"], d["response_mask"],
                 lr=0.3, top_k=4, optimizer="adam", exp_avg=m, exp_avg_sq=s, step=3)
    assert metrics["capo/fisher_kl_mean"] == pytest.approx(float(ref["kl"][d["response_mask"]].mean()), rel=1e-6)
    # adam after the first step without the moments: a clear error
    with pytest.raises(MissingInputError, match="lm_head_exp_avg"):
        stablerl.compute_policy_loss(
            "capo", log_prob=lp, old_log_prob=old, advantages=d["advantages"], response_mask=d["response_mask"],
            hidden_states=d["hidden_states"], lm_head_weight=d["lm_head_weight"], token_ids=d["token_ids"],
            moments="input", adam_step=1,
        )


def _api(d, lp, old, **kw):
    return stablerl.compute_policy_loss(
        "capo", log_prob=lp, old_log_prob=old, advantages=d["advantages"], response_mask=d["response_mask"],
        hidden_states=d["hidden_states"], lm_head_weight=d["lm_head_weight"], token_ids=d["token_ids"], **kw)


def test_degenerate_inputs():
    d, _, _ = _with_tokens_in_topk(8, V)
    lp, old = _loss_inputs(d)
    # all masked batch: loss 0, finite metrics
    e = dict(d, response_mask=torch.zeros_like(d["response_mask"]))
    lpg = lp.clone().requires_grad_(True)
    loss, metrics = _api(e, lpg, old, lr=0.1)
    assert float(loss.detach()) == 0.0 and all(v == v for v in metrics.values())
    # B = 0
    z = {k: (v[:0] if k != "lm_head_weight" else v) for k, v in d.items()}
    loss, metrics = _api(z, lp[:0], old[:0], lr=0.1)
    assert float(loss) == 0.0 and metrics["capo/mask_fraction"] == 0.0
    # garbage (even NaN) hidden states on padding are ignored; on a valid token they are an error
    hs = d["hidden_states"].clone()
    hs[~d["response_mask"]] = float("nan")
    loss_nan, _ = _api(dict(d, hidden_states=hs), lp, old, lr=0.1)
    loss_ref, _ = _api(d, lp, old, lr=0.1)
    assert torch.isfinite(loss_nan) and float(loss_nan) == float(loss_ref)
    hs[0, 0] = float("inf")
    with pytest.raises(StableRLError, match="hidden_states"):
        _api(dict(d, hidden_states=hs), lp, old, lr=0.1)
    w = d["lm_head_weight"].clone()
    w[0, 0] = float("nan")
    with pytest.raises(StableRLError, match="lm_head_weight"):
        _api(dict(d, lm_head_weight=w), lp, old, lr=0.1)
    with pytest.raises(MissingInputError, match="hidden_states"):
        stablerl.compute_policy_loss("capo", log_prob=lp, old_log_prob=old, advantages=d["advantages"],
                                     response_mask=d["response_mask"], lm_head_weight=d["lm_head_weight"],
                                     token_ids=d["token_ids"])
    with pytest.raises(StableRLError, match="lr"):
        _api(d, lp, old, lr=0.0)
    with pytest.raises(StableRLError, match="optimizer"):
        _api(d, lp, old, optimizer="lion")
    with pytest.raises(StableRLError, match="token_ids"):
        _api(dict(d, token_ids=d["token_ids"] + V), lp, old)
    # zero advantages: nothing moves, nothing is masked
    zero = dict(d, advantages=torch.zeros_like(d["advantages"]))
    keep, terms = capo_token_mask(**zero, lr=0.1, top_k=0, optimizer="sgd", fisher_token_mask_tau=1e-12,
                                  hessian_token_mask_tau=1e-12)
    assert torch.equal(keep, d["response_mask"]) and float(terms["approx_kl"].abs().max()) == 0.0


def test_bf16_close_to_fp32():
    d, m, s = _with_tokens_in_topk(9, 4, B=6, T=8)
    d32 = {k: (v.float() if v.is_floating_point() else v) for k, v in d.items()}
    dbf = {k: (v.bfloat16() if v.is_floating_point() else v) for k, v in d.items()}
    kw = dict(lr=0.05, top_k=4, optimizer="adam", exp_avg=m.float(), exp_avg_sq=s.float(), adam_step=2)
    t32 = capo_curvature(**d32, **kw)
    tbf = capo_curvature(**dbf, **dict(kw, exp_avg=m.bfloat16(), exp_avg_sq=s.bfloat16()))
    assert tbf["approx_kl"].dtype == torch.float32 and bool(torch.isfinite(tbf["approx_kl"]).all())
    scale = float(t32["approx_kl"].abs().max())
    assert float((tbf["approx_kl"] - t32["approx_kl"]).abs().max()) < 0.1 * scale
    lp, old = _loss_inputs(d)
    kw_loss = dict(lr=0.05, top_k=4, moments="input", adam_step=2, fisher_token_mask_tau=float(t32["approx_kl"].max()) * 10,
                   hessian_token_mask_tau=0.0)
    l32, m32 = _api(d32, lp.float(), old.float(), lm_head_exp_avg=m.float(), lm_head_exp_avg_sq=s.float(), **kw_loss)
    lbf, mbf = _api(dbf, lp.bfloat16(), old.bfloat16(), lm_head_exp_avg=m.bfloat16(),
                    lm_head_exp_avg_sq=s.bfloat16(), **kw_loss)
    assert lbf.dtype == torch.float32 and torch.isfinite(lbf)
    scale = abs(float(l32)) + float(d["advantages"][d["response_mask"]].abs().mean())
    assert abs(float(lbf) - float(l32)) < 0.05 * scale  # bf16 log-probs: ratio rounding
    assert mbf["capo/mask_fraction"] == m32["capo/mask_fraction"] == 0.0
    # a mid-range tau: the bf16 mask agrees with the fp32 one on (almost) every token
    tau = float(t32["approx_kl"][d["response_mask"]].median())
    k32, _ = capo_token_mask(**d32, fisher_token_mask_tau=tau, hessian_token_mask_tau=0.0, **kw)
    kbf, _ = capo_token_mask(**dbf, fisher_token_mask_tau=tau, hessian_token_mask_tau=0.0,
                             **dict(kw, exp_avg=m.bfloat16(), exp_avg_sq=s.bfloat16()))
    valid = d["response_mask"]
    assert 0 < int((valid & ~k32).sum()) < int(valid.sum())
    assert float((k32 != kbf)[valid].double().mean()) <= 0.1


def test_spec_registered_experimental():
    spec = stablerl.get_registry().get(stablerl.POLICY_LOSS, "capo")
    assert spec.status == stablerl.EXPERIMENTAL and spec.paper == "2510.00819"
    assert set(spec.requires) == {"hidden_states", "lm_head_weight", "token_ids"}
    assert "capo/mask_fraction" in spec.metrics and "capo/fisher_kl_mean" in spec.metrics


def _brute_moments(exp_avg, exp_avg_sq, d, mask, top_k, betas=(0.9, 0.999)):
    """The reference's per-key dict: mean of A v_k h over the masked tokens whose support holds k."""
    acc = {}
    hs, W = d["hidden_states"], d["lm_head_weight"]
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                continue
            h, a, A = hs[b, t], int(d["token_ids"][b, t]), float(d["advantages"][b, t])
            z = W @ h
            support = torch.arange(W.shape[0]) if top_k == 0 else z.topk(top_k).indices
            pi = torch.softmax(z[support], -1)
            for j, k in enumerate(support.tolist()):
                g = A * ((1.0 if k == a else 0.0) - pi[j]) * h
                s_, c_ = acc.get(k, (torch.zeros_like(h), 0))
                acc[k] = (s_ + g, c_ + 1)
    m, v = exp_avg.clone(), exp_avg_sq.clone()
    for k, (s_, c_) in acc.items():
        gbar = -(s_ / c_)  # torch convention: moments of the loss gradient
        m[k] = betas[0] * m[k] + (1 - betas[0]) * gbar
        v[k] = betas[1] * v[k] + (1 - betas[1]) * gbar * gbar
    return m, v, len(acc)


@pytest.mark.parametrize("top_k", [0, 3])
def test_moment_update_matches_reference_dict(top_k):
    d, m, s = _data(10)
    mask = d["response_mask"].clone()
    mask[0, 1] = False
    m_ref, v_ref, n_ref = _brute_moments(m, s, d, mask, top_k)
    m_got, v_got = m.clone(), s.clone()
    n = capo_moment_update(m_got, v_got, d["hidden_states"], d["lm_head_weight"], d["token_ids"], d["advantages"],
                           mask, top_k=top_k, chunk_elements=5)
    assert n == n_ref and (top_k == 0 or n < V)  # with top-k some rows are untouched
    torch.testing.assert_close(m_got, m_ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(v_got, v_ref, rtol=1e-12, atol=1e-14)
    untouched = (m_got == m).all(-1)
    assert int(untouched.sum()) == V - n  # untouched rows keep their moments: no decay


def test_tracked_moments_across_calls():
    d, _, _ = _with_tokens_in_topk(11, 4, B=4, T=6)
    lp, old = _loss_inputs(d, 3)
    ctx = Context()
    kw = dict(lr=0.3, top_k=4, fisher_token_mask_tau=0.0, hessian_token_mask_tau=0.0)
    steps = []
    for call in range(3):
        before = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in ctx.state.get("capo", {}).items()}
        tau = 1e9 if call == 0 else None
        if call > 0:  # mask about half of the tokens, so the update must use the kept ones only
            t = capo_curvature(**d, lr=0.3, top_k=4, optimizer="adam", exp_avg=before["exp_avg"],
                               exp_avg_sq=before["exp_avg_sq"], adam_step=before["step"])
            tau = float(t["approx_kl"][d["response_mask"]].median())
            # the mask of this call is computed from the moments as they were before it
            keep, _ = capo_token_mask(**d, lr=0.3, top_k=4, fisher_token_mask_tau=tau, hessian_token_mask_tau=0.0,
                                      optimizer="adam", exp_avg=before["exp_avg"], exp_avg_sq=before["exp_avg_sq"],
                                      adam_step=before["step"])
        _, metrics = _api(d, lp, old, ctx=ctx, **dict(kw, fisher_token_mask_tau=tau))
        steps.append(metrics["capo/adam_step"])
        st = ctx.state["capo"]
        assert st["step"] == call + 1
        if call > 0:
            assert 0 < metrics["capo/mask_fraction"] < 1
            m_ref, v_ref = before["exp_avg"].clone(), before["exp_avg_sq"].clone()
            capo_moment_update(m_ref, v_ref, d["hidden_states"], d["lm_head_weight"], d["token_ids"],
                               d["advantages"], keep, top_k=4)
            torch.testing.assert_close(st["exp_avg"], m_ref, rtol=1e-12, atol=1e-15)
            torch.testing.assert_close(st["exp_avg_sq"], v_ref, rtol=1e-12, atol=1e-15)
    assert steps == [0.0, 1.0, 2.0]
    assert float(ctx.state["capo"]["exp_avg"].abs().max()) > 0
    # sgd and moments="input" keep no state
    ctx2 = Context()
    _api(d, lp, old, ctx=ctx2, optimizer="sgd", **kw)
    _api(d, lp, old, ctx=ctx2, moments="input", **kw)
    assert "capo" not in ctx2.state


def test_moment_update_reuses_the_masks_top_k():
    # capo_curvature fills `support` (top-k ids and v of every valid token); the moment update of a subset of
    # them reuses it: equal to the reference dict even when handed a zeroed LM head (nothing is recomputed)
    d, m, s = _data(12)
    mask = d["response_mask"].clone()
    mask[0, 1] = False
    support = {}
    capo_curvature(**d, lr=0.3, top_k=3, optimizer="sgd", support=support, chunk_elements=7)
    valid = int(d["response_mask"].sum())
    assert support["top_idx"].shape == (valid, 3) and support["v"].shape == (valid, 3)
    m_ref, v_ref, n_ref = _brute_moments(m, s, d, mask, 3)
    m_got, v_got = m.clone(), s.clone()
    n = capo_moment_update(m_got, v_got, d["hidden_states"], torch.zeros_like(d["lm_head_weight"]), d["token_ids"],
                           d["advantages"], mask, top_k=3, chunk_elements=5, support=support)
    assert n == n_ref
    torch.testing.assert_close(m_got, m_ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(v_got, v_ref, rtol=1e-12, atol=1e-14)
    # the full vocabulary keeps no support ([N, V] would be too large): the update recomputes
    full = {}
    capo_curvature(**d, lr=0.3, top_k=0, optimizer="sgd", support=full)
    assert "top_idx" not in full


def test_restored_moments_move_to_the_compute_device_and_dtype_not_reset():
    # a checkpoint may hand the tracked moments back on another device or dtype (OpenRLHF's DeepSpeed
    # client_state loads onto the CPU): they are moved, keeping their values and step, not started afresh
    d, _, _ = _with_tokens_in_topk(13, 4, B=4, T=6)
    lp, old = _loss_inputs(d, 5)
    kw = dict(lr=0.3, top_k=4, fisher_token_mask_tau=0.0, hessian_token_mask_tau=0.0)
    ctx = Context()
    _api(d, lp, old, ctx=ctx, **kw)
    _api(d, lp, old, ctx=ctx, **kw)
    saved = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in ctx.state["capo"].items()}
    restored = Context(state={"capo": {**saved, "exp_avg": saved["exp_avg"].float(),
                                       "exp_avg_sq": saved["exp_avg_sq"].float()}})
    _, metrics = _api(d, lp, old, ctx=restored, **kw)
    assert metrics["capo/adam_step"] == 2.0  # the restored step, not a fresh state
    st = restored.state["capo"]
    assert st["exp_avg"].dtype == torch.float64 and st["step"] == 3
    torch.testing.assert_close(st["exp_avg"], _step_from(saved, d, lp, old, kw)["exp_avg"], rtol=1e-6, atol=1e-9)


def _step_from(saved, d, lp, old, kw):
    ctx = Context(state={"capo": {k: (v.clone() if torch.is_tensor(v) else v) for k, v in saved.items()}})
    _api(d, lp, old, ctx=ctx, **kw)
    return ctx.state["capo"]
