"""Unit tests of the issue-2 policy losses: gspo, gmpo, cispo, m2po, cpgd.

Each loss is checked in value and gradient against an independent float64 computation written
here (a different algebraic form where one exists: GSPO's sequence objective, GMPO's product form,
M2PO's greedy loop, CPGD's min-form), plus what carries gradient and the degenerate inputs.
"""

import math

import pytest
import torch
from conftest import make_batch

import stablerl
from stablerl import Context, StableRLError, compute_policy_loss

NAMES = ("gspo", "gmpo", "cispo", "m2po", "cpgd")
F64 = torch.float64


def _batch(seed=0, B=6, T=9, spread=0.3, dtype=F64):
    return make_batch(B=B, T=T, seed=seed, dtype=dtype, spread=spread)


def _grad(name, b, **kw):
    loss, metrics = compute_policy_loss(name, **b, **kw)
    (g,) = torch.autograd.grad(loss, b["log_prob"])
    return loss.detach(), g, metrics


def _leaf(b):
    return b["log_prob"].detach().clone().requires_grad_(True)


def _token_mean(l, m):
    m = m.to(l.dtype)
    return (l * m).sum() / m.sum()


def _seq_mean_token_mean(l, m):
    m = m.to(l.dtype)
    return ((l * m).sum(-1) / m.sum(-1)).mean()


# ----------------------------------------------------------------------------- registry


@pytest.mark.parametrize("name", NAMES)
def test_spec_documented_and_stable(name):
    spec = stablerl.get_spec("policy_loss", name)
    assert spec.paper and spec.title and spec.formula and spec.reference and spec.notes
    # cpgd: the authors' code was never compared, so its defaults are assumptions (issue 30): experimental
    assert spec.status == ("experimental" if name == "cpgd" else "stable")
    if name == "cpgd":
        assert "policy_drift_clip_eps = 2.0" in spec.notes and "never compared" in spec.notes
    assert spec.fn.__module__ == f"stablerl.plugins.{name}"


def test_paper_defaults():
    assert stablerl.get_spec("policy_loss", "gspo").defaults() == {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}
    assert stablerl.get_spec("policy_loss", "gmpo").defaults() == {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}
    assert stablerl.get_spec("policy_loss", "cispo").defaults() == {"clip_ratio_low": 10.0, "clip_ratio_high": 0.2}
    assert stablerl.get_spec("policy_loss", "cpgd").defaults() == {
        "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "policy_drift_coef": 0.01, "policy_drift_clip_eps": 2.0}
    d = stablerl.get_spec("policy_loss", "m2po").defaults()
    assert d["m2_threshold"] == 0.04 and d["variant"] == "mask"


@pytest.mark.parametrize(
    "name,bad,match",
    [
        ("gspo", {"clip_ratio_low": -1e-4}, "clip_ratio_low"),
        ("gmpo", {"clip_ratio_high": -0.1}, "clip_ratio_high"),
        ("cispo", {"clip_ratio_high": -0.1}, "clip_ratio_high"),
        ("cpgd", {"clip_ratio_low": 1.0}, "clip_ratio_low"),
        ("cpgd", {"policy_drift_clip_eps": 0.0}, "policy_drift_clip_eps"),
        ("m2po", {"m2_threshold": 0.0}, "m2_threshold"),
        ("m2po", {"variant": "clip"}, "variant"),
        ("m2po", {"m2_treshold": 0.04}, "m2_threshold"),  # unknown key -> nearest match
    ],
)
def test_bad_hyper_parameters_raise(name, bad, match):
    with pytest.raises(StableRLError, match=match):
        compute_policy_loss(name, **_batch(), **bad)


# ----------------------------------------------------------------------------- GSPO


def _gspo_sequence_reference(lp, old, adv, mask, lo, hi):
    """GSPO's sequence objective: l_i = max(-A s_i, -A clip(s_i)), s_i = exp(mean_t d), sequence mean."""
    m = mask.to(lp.dtype)
    s = torch.exp(((lp - old) * m).sum(-1) / m.sum(-1))
    a = adv[:, 0]
    li = torch.maximum(-a * s, -a * torch.clamp(s, 1 - lo, 1 + hi))
    return li.mean()


@pytest.mark.parametrize("spread,lo,hi", [(1e-3, 3e-4, 4e-4), (0.3, 0.02, 0.03)])
def test_gspo_equals_sequence_objective(spread, lo, hi):
    b = _batch(seed=3, spread=spread)
    loss, g, m = _grad("gspo", b, loss_agg_mode="seq-mean-token-mean", clip_ratio_low=lo, clip_ratio_high=hi)
    lp = _leaf(b)
    ref = _gspo_sequence_reference(lp, b["old_log_prob"], b["advantages"], b["response_mask"], lo, hi)
    (g_ref,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12)
    assert 0 < m["pg_clipfrac"] < 1  # the case exercises both clipped and unclipped sequences


def test_gspo_token_mean_and_metrics():
    b = _batch(seed=4, spread=0.3)
    loss, g, m = _grad("gspo", b, clip_ratio_low=0.1, clip_ratio_high=0.1)
    lp = _leaf(b)
    mask = b["response_mask"].to(F64)
    old, adv = b["old_log_prob"], b["advantages"]
    s = torch.exp(((lp - old) * mask).sum(-1) / mask.sum(-1)).detach().unsqueeze(-1)
    ratio = s * torch.exp(lp - lp.detach())
    l = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.9, 1.1))
    ref = _token_mean(l, mask)
    (g_ref,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(g, g_ref)
    clipped = ((adv > 0) & (s > 1.1)) | ((adv < 0) & (s < 0.9))
    assert m["pg_clipfrac"] == pytest.approx(float(_token_mean(clipped.to(F64), mask)), abs=1e-6)
    assert m["pg_clipfrac_lower"] == 0.0
    assert m["ppo_kl"] == pytest.approx(float(_token_mean(old - lp.detach(), mask)), abs=1e-6)


def test_gspo_log_ratio_clamped_at_10():
    b = _batch(seed=5)
    with torch.no_grad():
        b["old_log_prob"][0] = b["log_prob"][0] - 12.0  # sequence log-ratio 12 > 10
    loss, g, m = _grad("gspo", b, clip_ratio_low=0.2, clip_ratio_high=1e6)
    assert torch.isfinite(loss)
    assert torch.all(g[0] == 0)  # clamp(max=10) stops the gradient
    assert m["gspo/seq_ratio_max"] == pytest.approx(math.exp(10.0), rel=1e-6)


# ----------------------------------------------------------------------------- GMPO


def _gmpo_product_reference(lp, old, adv, mask, lo, hi):
    """Paper product form: A_i * (prod_t min(rho^sA, clip(rho, e^-lo, e^hi)^sA))^(sA/L_i), sequence mean."""
    out = []
    for i in range(lp.shape[0]):
        valid = mask[i].bool()
        a = float(adv[i, 0])
        if a == 0:
            out.append(lp.sum() * 0)
            continue
        sa = 1.0 if a > 0 else -1.0
        rho = torch.exp(lp[i, valid] - old[i, valid])
        c = torch.clamp(rho, math.exp(-lo), math.exp(hi))
        prod = torch.prod(torch.minimum(rho**sa, c**sa))
        out.append(-a * prod ** (sa / int(valid.sum())))
    return torch.stack(out).mean()


@pytest.mark.parametrize("lo,hi", [(0.4, 0.4), (0.1, 0.25)])
def test_gmpo_equals_product_form(lo, hi):
    b = _batch(seed=7, spread=0.4)
    b["advantages"][2] = 0.0  # A = 0 contributes nothing
    loss, g, m = _grad("gmpo", b, clip_ratio_low=lo, clip_ratio_high=hi)
    lp = _leaf(b)
    ref = _gmpo_product_reference(lp, b["old_log_prob"], b["advantages"], b["response_mask"], lo, hi)
    (g_ref,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-12)
    assert torch.all(g[2] == 0)
    d = (b["log_prob"] - b["old_log_prob"]).detach()
    adv, mask = b["advantages"], b["response_mask"].to(F64)
    active_hi = (adv > 0) & (d > hi) & mask.bool()
    assert active_hi.any()  # the case exercises the log-space clip
    assert torch.all(g[active_hi] == 0)  # a clipped token stops contributing gradient
    assert m["clip_high"] == pytest.approx(float(_token_mean(active_hi.to(F64), mask)), abs=1e-6)
    outside = (d < -lo) | (d > hi)
    assert m["pg_clipfrac"] == pytest.approx(float(_token_mean((outside & (adv > 0)).to(F64), mask)), abs=1e-6)


def test_gmpo_bounds_are_log_space():
    # a token with log r = 0.35 (r = 1.42) is inside the (0.4, 0.4) log band but outside a ratio band [0.6, 1.4]
    b = make_batch(B=1, T=3, seed=8, dtype=F64, padded=False)
    with torch.no_grad():
        b["log_prob"].copy_(b["old_log_prob"] + 0.35)
    b["advantages"].fill_(1.0)
    loss, g, m = _grad("gmpo", b)
    assert m["clip_high"] == 0.0
    assert loss.item() == pytest.approx(-math.exp(0.35))
    torch.testing.assert_close(g, torch.full_like(g, -math.exp(0.35) / 3))


def test_gmpo_sequence_normaliser_and_is_weights():
    b = _batch(seed=9)
    loss1, _, _ = _grad("gmpo", b)
    loss2, _, _ = _grad("gmpo", b, ctx=Context(seq_count=12, dp_size=2))  # sum_i l_i / 12 * 2
    torch.testing.assert_close(loss2, loss1 * 6 / 12 * 2)
    # loss_agg_mode is ignored (sequence objective)
    loss3, _, _ = _grad("gmpo", b, loss_agg_mode="seq-mean-token-sum")
    torch.testing.assert_close(loss3, loss1)
    w = torch.full_like(b["old_log_prob"], 0.5)
    loss4, _, _ = _grad("gmpo", b, is_weights=w)  # geometric mean of constant 0.5 is 0.5
    torch.testing.assert_close(loss4, loss1 * 0.5, rtol=1e-6, atol=1e-9)


# ----------------------------------------------------------------------------- CISPO


@pytest.mark.parametrize("lo,hi", [(10.0, 0.2), (0.2, 0.28)])
def test_cispo_gradient_is_clipped_weight_times_reinforce(lo, hi):
    b = _batch(seed=11, spread=0.4)
    loss, g, m = _grad("cispo", b, clip_ratio_low=lo, clip_ratio_high=hi)
    lp = b["log_prob"].detach()
    old, adv, mask = b["old_log_prob"], b["advantages"], b["response_mask"].to(F64)
    r = torch.exp(lp - old)
    w = torch.clamp(r, 1 - lo, 1 + hi)
    n = mask.sum()
    torch.testing.assert_close(loss, (-(w * adv * lp) * mask).sum() / n)
    torch.testing.assert_close(g, -w * adv * mask / n)  # weight detached: no d(w)/d(lp) term
    assert m["pg_clipfrac"] == pytest.approx(float(_token_mean((r != w).to(F64), mask)), abs=1e-6)
    assert m["pg_clipfrac"] > 0
    assert m["clip_high"] == pytest.approx(float(_token_mean(((adv > 0) & (r > 1 + hi)).to(F64), mask)), abs=1e-6)
    if lo >= 1:
        assert m["clip_low"] == 0.0  # no lower bound


def test_cispo_on_policy_is_reinforce():
    b = _batch(seed=12)
    with torch.no_grad():
        b["old_log_prob"] = b["log_prob"].detach().clone()
    loss, g, _ = _grad("cispo", b)
    mask = b["response_mask"].to(F64)
    torch.testing.assert_close(g, -b["advantages"] * mask / mask.sum())


# ----------------------------------------------------------------------------- CPGD


def _cpgd_reference(lp, old, adv, mask, eps=0.2, coef=0.01, c=2.0):
    """min-form: l_pg = -min(A d, A clip(d, ln(1-eps), ln(1+eps))) - A lp_old, drift grad min(r-1, c)."""
    d = lp - old
    l_pg = -torch.minimum(adv * d, adv * torch.clamp(d, math.log(1 - eps), math.log(1 + eps))) - adv * old
    drift = torch.clamp(torch.exp(d.detach()) - 1, max=c) * lp
    return _token_mean(l_pg, mask) + coef * _token_mean(drift, mask)


def test_cpgd_matches_min_form_and_gradient():
    b = _batch(seed=13, spread=0.5)
    loss, g, m = _grad("cpgd", b)
    lp = _leaf(b)
    ref = _cpgd_reference(lp, b["old_log_prob"], b["advantages"], b["response_mask"])
    (g_ref,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(g, g_ref)
    # closed form: -A * 1{inside the band} + coef * min(r-1, 2), over N
    d = (b["log_prob"] - b["old_log_prob"]).detach()
    adv, mask = b["advantages"], b["response_mask"].to(F64)
    beyond = ((adv > 0) & (d > math.log(1.2))) | ((adv < 0) & (d < math.log(0.8)))
    assert beyond.any() and (~beyond & mask.bool()).any()
    closed = (-adv * (~beyond) + 0.01 * torch.clamp(torch.exp(d) - 1, max=2.0)) * mask / mask.sum()
    torch.testing.assert_close(g, closed)
    assert m["pg_clipfrac"] == pytest.approx(float(_token_mean(beyond.to(F64), mask)), abs=1e-6)


def test_cpgd_zero_pg_gradient_beyond_band_and_drift_clip():
    b = _batch(seed=14, spread=1.5)
    loss, g, _ = _grad("cpgd", b, policy_drift_coef=0.0)
    d = (b["log_prob"] - b["old_log_prob"]).detach()
    adv = b["advantages"]
    beyond = ((adv > 0) & (d > math.log(1.2))) | ((adv < 0) & (d < math.log(0.8)))
    assert beyond.any()
    assert torch.all(g[beyond] == 0)
    # drift only: gradient min(r-1, c) / N, clipped at c
    b2 = _batch(seed=14, spread=1.5)
    b2["advantages"] = torch.zeros_like(b2["advantages"])
    _, g2, _ = _grad("cpgd", b2, policy_drift_coef=1.0, policy_drift_clip_eps=0.5)
    mask = b2["response_mask"].to(F64)
    torch.testing.assert_close(g2, torch.clamp(torch.exp(d) - 1, max=0.5) * mask / mask.sum())


def test_cpgd_aggregates_both_terms_with_the_mode():
    b = _batch(seed=15, spread=0.4)
    loss, _, _ = _grad("cpgd", b, loss_agg_mode="seq-mean-token-mean")
    lp = b["log_prob"].detach()
    old, adv, mask = b["old_log_prob"], b["advantages"], b["response_mask"]
    clp = torch.where(adv > 0, torch.minimum(lp, old + math.log(1.2)), torch.maximum(lp, old + math.log(0.8)))
    drift = torch.clamp(torch.exp(lp - old) - 1, max=2.0) * lp
    ref = _seq_mean_token_mean(-adv * clp, mask) + 0.01 * _seq_mean_token_mean(drift, mask)
    torch.testing.assert_close(loss, ref)


# ----------------------------------------------------------------------------- M2PO


def _greedy_m2po_mask(lp, old, adv, mask, tau):
    """The paper's Algorithm 1, literally: drop argmax M2 from T while mean_T M2 > tau."""
    d = (lp - old).detach()
    tr = mask.bool() & (((adv > 0) & (d > 0)) | ((adv < 0) & (d < 0)))
    m2 = d**2
    keep = torch.ones_like(d, dtype=torch.bool)
    idx = [tuple(i) for i in torch.nonzero(tr).tolist()]
    while idx and sum(float(m2[i]) for i in idx) / len(idx) > tau:
        worst = max(idx, key=lambda i: float(m2[i]))
        idx.remove(worst)
        keep[worst] = False
    kept_m2 = sum(float(m2[i]) for i in idx) / max(len(idx), 1)
    return keep, tr, kept_m2


@pytest.mark.parametrize("seed,spread,tau", [(21, 0.4, 0.04), (22, 0.2, 0.01), (23, 0.6, 0.04)])
def test_m2po_mask_equals_greedy_loop(seed, spread, tau):
    b = _batch(seed=seed, B=8, T=12, spread=spread)
    loss, g, m = _grad("m2po", b, m2_threshold=tau)
    lp = _leaf(b)
    old, adv, mask = b["old_log_prob"], b["advantages"], b["response_mask"]
    keep, tr, kept_m2 = _greedy_m2po_mask(lp, old, adv, mask, tau)
    assert (~keep).any()  # the case masks something
    ref = _token_mean(-adv * torch.exp(lp - old) * keep, mask)  # denominator: ALL valid tokens
    (g_ref,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(g, g_ref)
    assert torch.all(g[~keep] == 0)
    d = (b["log_prob"] - old).detach()
    n_valid = float(mask.sum())
    assert m["m2po/m2_before"] == pytest.approx(float((d[tr] ** 2).mean()), rel=1e-6)
    assert m["m2po/m2_after"] == pytest.approx(kept_m2, rel=1e-6)
    assert m["m2po/m2_after"] <= tau
    assert m["m2po/masked_fraction"] == pytest.approx(float((~keep).sum()) / n_valid, rel=1e-6)
    assert m["m2po/trust_region_fraction"] == pytest.approx(float(tr.sum()) / n_valid, rel=1e-6)
    assert m["pg_clipfrac"] == pytest.approx(m["m2po/masked_fraction"], rel=1e-6)


def test_m2po_within_budget_is_plain_token_mean_surrogate():
    b = _batch(seed=24, spread=0.01)
    loss, g, m = _grad("m2po", b)
    lp = _leaf(b)
    ref = _token_mean(-b["advantages"] * torch.exp(lp - b["old_log_prob"]), b["response_mask"])
    (g_ref,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(g, g_ref)
    assert m["m2po/masked_fraction"] == 0.0
    assert m["m2po/m2_after"] == pytest.approx(m["m2po/m2_before"])


def test_m2po_ties_at_the_cut_are_all_masked():
    # trust-region M2 = 1/64, 1/16, 1/16 (exact in binary), tau = (1/64 + 1/16) / 2: the greedy loop drops
    # ONE of the two equal values (which one is arbitrary) and stops at mean == tau; we drop every value
    # >= the cut, so the result does not depend on the order of tokens (or ranks)
    lp = torch.tensor([[0.125, 0.25, 0.25]], dtype=F64, requires_grad=True)
    b = dict(log_prob=lp, old_log_prob=torch.zeros(1, 3, dtype=F64), advantages=torch.ones(1, 3, dtype=F64),
             response_mask=torch.ones(1, 3, dtype=torch.bool))
    tau = (1 / 64 + 1 / 16) / 2
    keep, _, _ = _greedy_m2po_mask(lp, b["old_log_prob"], b["advantages"], b["response_mask"], tau)
    assert int((~keep).sum()) == 1
    loss, g, m = _grad("m2po", b, m2_threshold=tau)
    assert m["m2po/masked_fraction"] == pytest.approx(2 / 3)
    assert m["m2po/m2_after"] == pytest.approx(1 / 64)
    assert g[0, 0] != 0 and torch.all(g[0, 1:] == 0)


def test_m2po_mask_carries_no_gradient_and_quadrants():
    b = _batch(seed=25, spread=0.5)
    b["advantages"][1] = 0.0  # A = 0: never in the trust region, contributes 0
    _, g, m = _grad("m2po", b)
    assert torch.all(g[1] == 0)
    d = (b["log_prob"] - b["old_log_prob"]).detach()
    adv, mask = b["advantages"], b["response_mask"].bool()
    outside = mask & ~(((adv > 0) & (d > 0)) | ((adv < 0) & (d < 0))) & (adv != 0)
    # tokens outside the trust region are never masked: their gradient is the plain -A r / N
    expected = (-adv * torch.exp(d) / mask.sum())[outside]
    torch.testing.assert_close(g[outside], expected)


def _authors_bounds_reference(values, budget):
    """Independent loop over sorted breakpoints (authors' rule): tau^2 = last breakpoint before the crossing."""
    v = sorted(values)
    n = len(v)
    if n == 0 or sum(v) / n <= budget + 1e-12:
        return 1.0, 1e5 - 1.0
    target, left = budget * n, 0.0
    for k, vk in enumerate(v):
        left += vk
        if (vk - 1e-12) * (n - k - 1) + left >= target - 1e-12:
            tau = 0.0 if k == 0 else math.sqrt(max(v[k - 1] - 1e-12, 0.0))
            break
    return 1 - math.exp(-tau), math.exp(tau) - 1


@pytest.mark.parametrize("seed,spread,tau", [(31, 0.4, 0.04), (32, 0.2, 0.01), (33, 0.05, 0.04), (34, 0.8, 1e-4)])
def test_m2po_clip_bounds_variant(seed, spread, tau):
    b = _batch(seed=seed, B=8, T=12, spread=spread)
    loss, g, m = _grad("m2po", b, variant="clip_bounds", m2_threshold=tau)
    old, adv, mask = b["old_log_prob"], b["advantages"], b["response_mask"]
    d = (b["log_prob"] - old).detach()
    tr = mask & (((adv > 0) & (d > 0)) | ((adv < 0) & (d < 0)))
    lo, hi = _authors_bounds_reference((d[tr] ** 2).tolist(), tau)
    assert m["m2po/clip_low"] == pytest.approx(lo, rel=1e-6, abs=1e-7)
    assert m["m2po/clip_high"] == pytest.approx(hi, rel=1e-6, abs=1e-7)
    lo, hi = m["m2po/clip_low"], m["m2po/clip_high"]  # exact bounds used (fp32 exp, as the authors)
    lp = _leaf(b)
    r = torch.exp(lp - old)
    ref = _token_mean(torch.maximum(-adv * r, -adv * torch.clamp(r, 1 - lo, 1 + hi)), mask)  # no dual clip
    (g_ref,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(g, g_ref)
    assert m["m2po/masked_fraction"] == 0.0
    if spread == 0.05:
        assert (lo, hi) == (1.0, 1e5 - 1.0)  # within budget: ratio bounds (0, 1e5), no clipping
    if tau == 1e-4:
        assert lo == 0.0 and hi == 0.0  # the first breakpoint already crosses: tau = 0
        assert m["pg_clipfrac"] > 0


# ----------------------------------------------------------------------------- shared properties


@pytest.mark.parametrize("name", NAMES)
def test_masked_tokens_get_zero_gradient(name):
    b = _batch(seed=41, spread=0.3)
    _, g, _ = _grad(name, b)
    assert torch.all(g[~b["response_mask"]] == 0)
    assert torch.count_nonzero(g[b["response_mask"]]) > 0


@pytest.mark.parametrize("name", NAMES)
def test_padding_values_do_not_matter(name):
    b1 = _batch(seed=42)
    b2 = _batch(seed=42)
    with torch.no_grad():
        pad = ~b2["response_mask"]
        b2["log_prob"][pad] = -50.0
        b2["old_log_prob"][pad] = 3.0
        b2["advantages"][pad] = 7.0
    l1, g1, m1 = _grad(name, b1)
    l2, g2, m2 = _grad(name, b2)
    torch.testing.assert_close(l1, l2)
    torch.testing.assert_close(g1, g2)
    assert m1 == pytest.approx(m2)


@pytest.mark.parametrize("name", NAMES)
def test_all_masked_row_and_empty_batches(name):
    b = _batch(seed=43)
    b["response_mask"][2] = False
    loss, g, m = _grad(name, b)
    assert torch.isfinite(loss) and torch.all(g[2] == 0)
    assert all(math.isfinite(v) for v in m.values())
    # all-masked batch -> finite 0 loss, zero gradient, finite metrics
    b = _batch(seed=43)
    b["response_mask"][:] = False
    loss, g, m = _grad(name, b)
    assert loss.item() == 0.0 and torch.all(g == 0)
    assert all(math.isfinite(v) for v in m.values())
    # B = 0
    b = {k: v.detach()[:0] for k, v in _batch().items()}
    b["log_prob"].requires_grad_(True)
    loss, m = compute_policy_loss(name, **b)
    assert loss.item() == 0.0 and all(math.isfinite(v) for v in m.values())


@pytest.mark.parametrize("name", NAMES)
def test_same_metric_keys_every_call(name):
    keys = {tuple(compute_policy_loss(name, **_batch(seed=s, spread=sp))[1]) for s, sp in [(1, 0.01), (2, 0.6), (3, 0.3)]}
    assert len(keys) == 1
    b = _batch(seed=4)
    b["response_mask"][:] = False
    assert tuple(compute_policy_loss(name, **b)[1]) in keys


@pytest.mark.parametrize("name", NAMES)
def test_non_finite_input_raises(name):
    b = _batch(seed=44)
    with torch.no_grad():
        b["log_prob"][0, 0] = float("nan")
    with pytest.raises(StableRLError, match="log_prob"):
        compute_policy_loss(name, **b)
    b = _batch(seed=44)
    b["old_log_prob"][0, 0] = float("inf")
    with pytest.raises(StableRLError, match="old_log_prob"):
        compute_policy_loss(name, **b)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_inputs_close_to_fp32(name):
    kw = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28} if name == "gspo" else {}
    b32 = _batch(seed=45, B=8, T=16, spread=0.2, dtype=torch.float32)
    l32, _ = compute_policy_loss(name, **b32, **kw)
    b16 = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v) for k, v in b32.items()}
    b16["log_prob"].requires_grad_(True)
    l16, m16 = compute_policy_loss(name, **b16, **kw)
    (g16,) = torch.autograd.grad(l16, b16["log_prob"])
    assert l16.dtype == torch.float32 and torch.isfinite(l16)
    assert torch.isfinite(g16.float()).all()
    assert all(math.isfinite(v) for v in m16.values())
    assert abs(l16.item() - l32.item()) < 5e-3 * max(1.0, abs(l32.item()))


@pytest.mark.parametrize("name", ["gspo", "cispo", "m2po"])
def test_per_token_losses_take_framework_is_weights(name):
    b = _batch(seed=46)
    w = torch.rand(b["log_prob"].shape, dtype=F64, generator=torch.Generator().manual_seed(0)) + 0.5
    l1, g1, _ = _grad(name, b, is_weights=w)
    l0, g0, _ = _grad(name, b, is_weights=torch.ones_like(w))
    assert not torch.allclose(l1, l0)
    torch.testing.assert_close(g1, g0 * w.float().to(F64), rtol=1e-6, atol=1e-9)


def test_cpgd_is_weights_only_on_policy_gradient_term():
    b = _batch(seed=47)
    b["advantages"] = torch.zeros_like(b["advantages"])  # only the drift term is left
    w = torch.full(b["log_prob"].shape, 3.0, dtype=F64)
    _, g1, _ = _grad("cpgd", b, is_weights=w)
    _, g0, _ = _grad("cpgd", b)
    torch.testing.assert_close(g1, g0)


@pytest.mark.parametrize("variant", ["mask", "clip_bounds"])
def test_m2po_row_order_does_not_matter(variant):
    b = _batch(seed=48, B=8, T=12, spread=0.4)
    perm = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])
    bp = {k: v.detach()[perm] for k, v in b.items()}
    bp["log_prob"].requires_grad_(True)
    l1, g1, m1 = _grad("m2po", b, variant=variant)
    l2, g2, m2 = _grad("m2po", bp, variant=variant)
    torch.testing.assert_close(l1, l2)
    torch.testing.assert_close(g1[perm], g2)
    assert m1 == pytest.approx(m2, rel=1e-6)
    assert m1["m2po/masked_fraction"] > 0 or m1.get("m2po/clip_high", 1e5) < 1.0
