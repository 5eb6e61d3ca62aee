"""Clipping redesigns and covariance losses: sapo, gppo, ce_gppo, bapo, pspo, clip_cov, kl_cov.

Every loss is checked in value AND gradient against an independent float64 computation written
here (closed-form gradients, not autograd of a copy), plus degenerate inputs and bf16.
"""

import math

import pytest
import torch

from conftest import make_batch
from stablerl import Context, StableRLError, compute_policy_loss, get_spec

NAMES = ("sapo", "gppo", "ce_gppo", "bapo", "pspo", "clip_cov", "kl_cov")
F64 = torch.float64


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def call(name, b, ctx=None, **kw):
    lp = leaf(b["log_prob"])
    loss, metrics = compute_policy_loss(
        name,
        log_prob=lp,
        old_log_prob=b["old_log_prob"],
        advantages=b["advantages"],
        response_mask=b["response_mask"],
        ctx=ctx,
        **kw,
    )
    loss.backward()
    return loss.detach(), lp.grad, metrics


def tokens(ratios, advs, dtype=F64):
    """A [1, n] batch with exact ratios and advantages (old log-prob -1)."""
    r = torch.tensor([ratios], dtype=dtype)
    old = torch.full_like(r, -1.0)
    return {
        "log_prob": (old + torch.log(r)).requires_grad_(True),
        "old_log_prob": old,
        "advantages": torch.tensor([advs], dtype=dtype),
        "response_mask": torch.ones_like(r, dtype=torch.bool),
    }


def f64_batch(B=6, T=9, seed=0, spread=0.5):
    return make_batch(B, T, seed=seed, dtype=F64, spread=spread)


def parts(b):
    lp = b["log_prob"].detach()
    old = b["old_log_prob"]
    A = b["advantages"]
    m = b["response_mask"].to(F64)
    return lp, old, A, m, torch.exp(lp - old)


def close(a, b, tol=1e-10):
    return torch.allclose(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- registration


def test_specs_status_and_papers():
    expect = {
        "sapo": ("2511.20347", "stable"),
        "gppo": ("2508.07629", "stable"),
        "ce_gppo": ("2509.20712", "stable"),
        "bapo": ("2510.18927", "stable"),
        "pspo": ("2509.21282", "experimental"),
        "clip_cov": ("2505.22617", "stable"),
        "kl_cov": ("2505.22617", "stable"),
    }
    for name, (paper, status) in expect.items():
        spec = get_spec("policy_loss", name)
        assert spec.paper == paper and spec.status == status
        assert spec.title and spec.formula and spec.reference and spec.notes
    assert get_spec("policy_loss", "sapo").output == "scalar"
    for name in NAMES:  # statistics over the call's batch: BAPO (all-reduced), Clip-/KL-Cov (per call)
        assert get_spec("policy_loss", name).batch_statistics == (name in ("bapo", "clip_cov", "kl_cov"))
    d = get_spec("policy_loss", "bapo").defaults()
    assert (d["adv_ratio_target"], d["ratio_lower_start"], d["ratio_lower_max"]) == (1.0, 0.6, 0.9)
    assert (d["ratio_upper_start"], d["ratio_upper_max"]) == (1.2, 3.0)
    assert get_spec("policy_loss", "ce_gppo").defaults()["beta1"] == 0.75


# ----------------------------------------------------------------------------- SAPO


@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (0.5, 3.0)])
def test_sapo_value_and_grad(tau_pos, tau_neg):
    b = f64_batch(seed=3, spread=0.8)
    loss, grad, metrics = call("sapo", b, tau_pos=tau_pos, tau_neg=tau_neg)
    lp, old, A, m, r = parts(b)
    tau = torch.where(A > 0, torch.full_like(A, tau_pos), torch.full_like(A, tau_neg))
    s = 1.0 / (1.0 + torch.exp(-tau * (r - 1.0)))
    per_tok = -(4.0 / tau) * s * A
    L = m.sum(-1)
    B = lp.shape[0]
    ref = ((per_tok * m).sum(-1) / L).sum() / B  # seq-mean-token-mean
    ref_grad = -4.0 * s * (1.0 - s) * r * A * m / L.unsqueeze(-1) / B
    assert close(loss, ref) and close(grad, ref_grad)
    assert metrics["pg_clipfrac"] == 0.0 and metrics["pg_clipfrac_lower"] == 0.0
    assert math.isclose(metrics["ppo_kl"], float(((old - lp) * m).sum() / m.sum()), rel_tol=1e-6)


def test_sapo_forces_seq_mean_token_mean_and_onpolicy_grad():
    b = f64_batch(seed=4)
    b["log_prob"] = leaf(b["old_log_prob"])  # r = 1
    l_tm, g_tm, _ = call("sapo", b, loss_agg_mode="token-mean")
    l_sm, g_sm, _ = call("sapo", b, loss_agg_mode="seq-mean-token-mean")
    assert torch.equal(l_tm, l_sm) and torch.equal(g_tm, g_sm)
    _, _, A, m, _ = parts(b)
    # on-policy the gate's slope is 1: the gradient is REINFORCE's -A / (L_i B)
    assert close(g_sm, -A * m / m.sum(-1, keepdim=True) / A.shape[0])


def test_sapo_applies_is_weights_itself():
    b = f64_batch(seed=5)
    w = torch.rand(b["log_prob"].shape, generator=torch.Generator().manual_seed(0), dtype=F64) + 0.5
    l1, g1, _ = call("sapo", b)
    l2, g2, _ = call("sapo", b, is_weights=torch.ones_like(w))
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    _, g3, _ = call("sapo", b, is_weights=w)
    assert close(g3, g1 * w)


# ----------------------------------------------------------------------------- GPPO / CE-GPPO

# ratios and advantages covering every region (eps_l=0.2, eps_h=0.28, c=10)
R = [0.5, 0.9, 1.0, 1.1, 1.5, 0.5, 0.9, 1.5, 12.0, 0.81, 1.29]
ADV = [1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0, -0.7, 2.0]


def gppo_ref(r, A, low, high, c, b1=1.0, b2=1.0):
    """Independent per-token value and d/dlp (closed form)."""
    is_low = (A < 0) & (r < 1 - low)
    is_high = (A > 0) & (r > 1 + high)
    val = torch.where(is_low, -b1 * (1 - low) * A, torch.where(is_high, -b2 * (1 + high) * A, -A * r))
    grad = torch.where(is_low, -b1 * (1 - low) * A, torch.where(is_high, -b2 * (1 + high) * A, -A * r))
    dual = (A < 0) & (val > -A * c)
    val = torch.where(dual, -A * c, val)
    grad = torch.where(dual, torch.zeros_like(grad), grad)
    return val, grad


def test_gppo_value_and_grad_against_closed_form():
    b = tokens(R, ADV)
    loss, grad, metrics = call("gppo", b)
    _, _, A, m, r = parts(b)
    val, g = gppo_ref(r, A, 0.2, 0.28, 10.0)
    n = m.sum()
    assert close(loss, val.sum() / n) and close(grad, g / n)
    # beyond the band: GPPO keeps -A(1+eps_h) (upper) / -A(1-eps_l) (lower) where PPO's is 0
    assert close(grad[0, 4], -1.28 / n) and close(grad[0, 5], 0.8 / n) and close(grad[0, 10], -2 * 1.28 / n)
    assert grad[0, 8] == 0  # dual-clipped token
    _, g_ppo, _ = call("vanilla", b, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0)
    assert g_ppo[0, 4] == 0 and g_ppo[0, 5] == 0 and g_ppo[0, 10] == 0
    inside = torch.tensor([0, 1, 2, 3, 6, 7, 9])
    assert close(grad[0, inside], g_ppo[0, inside])
    assert metrics["clip_high"] == pytest.approx(2 / 11) and metrics["clip_low"] == pytest.approx(1 / 11)
    assert metrics["pg_clipfrac"] == pytest.approx(3 / 11) and metrics["pg_clipfrac_lower"] == pytest.approx(1 / 11)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gppo_value_equals_ppo_random(seed):
    b = f64_batch(seed=seed, spread=0.6)
    p = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0)
    l_g, g_g, m_g = call("gppo", b, **p)
    l_p, g_p, m_p = call("vanilla", b, **p)
    assert close(l_g, l_p)
    for k in ("pg_clipfrac", "pg_clipfrac_lower", "clip_high", "clip_low", "ppo_kl"):
        assert m_g[k] == pytest.approx(m_p[k])
    _, _, A, m, r = parts(b)
    _, g = gppo_ref(r, A, 0.2, 0.28, 10.0)
    assert close(g_g, g * m / m.sum())
    assert (g_g != g_p).any()  # some token is clipped, and keeps a gradient


def test_ce_gppo_beta_scaling():
    b = tokens(R, ADV)
    p = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0)
    loss, grad, _ = call("ce_gppo", b, beta1=0.5, beta2=1.5, **p)
    _, _, A, m, r = parts(b)
    val, g = gppo_ref(r, A, 0.2, 0.28, 10.0, b1=0.5, b2=1.5)
    n = m.sum()
    assert close(loss, val.sum() / n) and close(grad, g / n)
    _, g_gppo, _ = call("gppo", b, **p)
    assert close(grad[0, 5], 0.5 * g_gppo[0, 5])  # NA&LP side scaled by beta1
    assert close(grad[0, 4], 1.5 * g_gppo[0, 4]) and close(grad[0, 10], 1.5 * g_gppo[0, 10])  # PA side by beta2
    inside = torch.tensor([0, 1, 2, 3, 6, 7, 8, 9])
    assert close(grad[0, inside], g_gppo[0, inside])
    # beta1 = beta2 = 1 is GPPO exactly (value and gradient)
    l1, g1, _ = call("ce_gppo", b, beta1=1.0, beta2=1.0, **p)
    l2, g2, _ = call("gppo", b, **p)
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    # beta = 0 removes the out-of-band gradient (PPO's gradient)
    _, g0, _ = call("ce_gppo", b, beta1=0.0, beta2=0.0, **p)
    _, g_ppo, _ = call("vanilla", b, **p)
    assert close(g0, g_ppo)


def test_ce_gppo_random_batch_defaults():
    b = f64_batch(seed=7, spread=0.7)
    loss, grad, _ = call("ce_gppo", b)
    _, _, A, m, r = parts(b)
    val, g = gppo_ref(r, A, 0.2, 0.2, 10.0, b1=0.75, b2=1.0)
    assert close(loss, (val * m).sum() / m.sum()) and close(grad, g * m / m.sum())


# ----------------------------------------------------------------------------- BAPO


def bapo_ref(r, A, m, target, lo0, lo_max, lo_step, hi0, hi_max, hi_step, eps=1e-8):
    """Independent float64 transcription of the paper's/authors' greedy search."""

    def pos_neg(cl, ch):
        pos = sum(min(ri, ch) * ai for ri, ai, mi in zip(r, A, m) if mi and ai >= 0)
        neg = sum(max(ri, cl) * -ai for ri, ai, mi in zip(r, A, m) if mi and ai < 0)
        return math.inf if neg <= 0 else pos / (neg + eps)

    cl, ch = lo0, hi0
    q = pos_neg(cl, ch)
    while q < target and cl < lo_max and lo_step > 0:
        cl = min(cl + lo_step, lo_max)
        q = pos_neg(cl, ch)
    while q < target and ch < hi_max and hi_step > 0:
        ch = min(ch + hi_step, hi_max)
        q = pos_neg(cl, ch)
    return cl, ch, q


BAPO_DEFAULT = dict(target=1.0, lo0=0.6, lo_max=0.9, lo_step=0.05, hi0=1.2, hi_max=3.0, hi_step=0.05)


def bapo_loss_ref(r, A, m, cl, ch, c=3.0):
    l1 = -A * r
    l2 = -A * r.clamp(cl, ch)
    l = torch.maximum(l1, l2)
    in_band = (l1 >= l2)  # gradient flows through r only where the unclipped term wins
    g = torch.where(in_band, -A * r, torch.zeros_like(r))
    dual = (A < 0) & (l > -A * c)
    l = torch.where(dual, -A * c, l)
    g = torch.where(dual, torch.zeros_like(g), g)
    return l, g


@pytest.mark.parametrize("seed,shift", [(0, 0.0), (1, 0.3), (2, 0.6), (3, 0.15), (4, 1.2), (5, -0.5)])
def test_bapo_search_value_and_grad(seed, shift):
    b = f64_batch(B=8, T=10, seed=seed, spread=0.7)
    b["advantages"] = b["advantages"] - shift
    loss, grad, metrics = call("bapo", b)
    _, _, A, m, r = parts(b)
    flat = [x.reshape(-1).tolist() for x in (r, A, m)]
    cl, ch, q = bapo_ref(*flat, **BAPO_DEFAULT)
    assert metrics["bapo/c_low"] == pytest.approx(cl) and metrics["bapo/c_high"] == pytest.approx(ch)
    assert metrics["bapo/pos_neg_ratio"] == pytest.approx(q, rel=1e-6)
    l, g = bapo_loss_ref(r, A, m, cl, ch)
    n = m.sum()
    assert close(loss, (l * m).sum() / n) and close(grad, g * m / n)


def test_bapo_search_stops_in_the_middle_and_saturates():
    # A=+1 at r=3; A=-1 at r=0.5 (twice); A=-0.5 at r=1:
    # pos/neg = min(3, c_high) / (2 max(0.5, c_low) + 0.5 max(1, c_low)) = 1.2 / 1.7 at the start bounds
    b = tokens([3.0, 0.5, 0.5, 1.0], [1.0, -1.0, -1.0, -0.5])
    _, _, met = call("bapo", b, adv_ratio_target=0.6)  # met at the start: no move
    assert (met["bapo/c_low"], met["bapo/c_high"]) == (pytest.approx(0.6), pytest.approx(1.2))
    assert met["bapo/pos_neg_ratio"] == pytest.approx(1.2 / 1.7, rel=1e-6)
    # target 0.95: the lower bound is raised first (to its max: in the reference statistic a higher c_low
    # never raises pos/neg), then the upper bound stops in the middle of its range at the first c_high
    # with c_high / 2.3 >= 0.95, i.e. 2.2
    loss, grad, met = call("bapo", b, adv_ratio_target=0.95)
    assert met["bapo/c_low"] == pytest.approx(0.9) and met["bapo/c_high"] == pytest.approx(2.2)
    assert met["bapo/pos_neg_ratio"] == pytest.approx(2.2 / 2.3, rel=1e-6)
    # ... and the loss uses the searched bounds: token 0 (r=3 > 2.2) and tokens 1, 2 (r=0.5 < 0.9) are
    # clipped (no gradient), token 3 is in band (-A r / N)
    assert close(loss, (-2.2 + 0.9 + 0.9 + 0.5) / 4)
    assert close(grad, torch.tensor([[0.0, 0.0, 0.0, 0.5 / 4]], dtype=F64))
    # target 1.5 is unreachable (needs c_high >= 3.45): both bounds saturate
    _, _, met = call("bapo", b, adv_ratio_target=1.5)
    assert met["bapo/c_low"] == pytest.approx(0.9) and met["bapo/c_high"] == pytest.approx(3.0)
    assert met["bapo/pos_neg_ratio"] == pytest.approx(3.0 / 2.3, rel=1e-6)
    # step 0 disables a side's search
    _, _, met = call("bapo", b, adv_ratio_target=1.5, ratio_lower_step=0.0, ratio_upper_step=0.0)
    assert (met["bapo/c_low"], met["bapo/c_high"]) == (pytest.approx(0.6), pytest.approx(1.2))
    _, _, met = call("bapo", b, adv_ratio_target=1.5, ratio_lower_step=0.0)  # c_high / 1.7 >= 1.5
    assert (met["bapo/c_low"], met["bapo/c_high"]) == (pytest.approx(0.6), pytest.approx(2.6))


def test_bapo_no_negative_contribution_is_inf_and_keeps_start_bounds():
    b = tokens([1.5, 0.7], [1.0, 0.5])
    loss, grad, met = call("bapo", b, adv_ratio_target=5.0)
    # reference: pos/neg counts as inf when neg == 0, so the start bounds are kept even for target 5;
    # the logged ratio is pos / (neg + eps), finite
    assert (met["bapo/c_low"], met["bapo/c_high"]) == (pytest.approx(0.6), pytest.approx(1.2))
    assert met["bapo/pos_neg_ratio"] == pytest.approx((1.2 + 0.35) / 1e-8)
    assert grad[0, 0] == 0 and close(grad[0, 1], -0.5 * 0.7 / 2)


def test_bapo_statistics_go_through_ctx_all_reduce():
    b = f64_batch(seed=2)
    calls = []

    def fake_all_reduce(t, op):
        calls.append((tuple(t.shape), op))
        return t * 1.0

    call("bapo", b, ctx=Context(all_reduce_fn=fake_all_reduce))
    def n_candidates(cur, end, step):  # the reference loop's float arithmetic (0.6 + 6 x 0.05 < 0.9)
        n = 1
        while cur < end:
            cur, n = min(cur + step, end), n + 1
        return n

    assert calls == [((n_candidates(1.2, 3.0, 0.05) + n_candidates(0.6, 0.9, 0.05),), "sum")]
    # doubling every statistic (as a second identical rank would) does not change the bounds or the loss
    l1, g1, m1 = call("bapo", b)
    l2, g2, m2 = call("bapo", b, ctx=Context(all_reduce_fn=lambda t, op: 2 * t))
    assert (m1["bapo/c_low"], m1["bapo/c_high"]) == (m2["bapo/c_low"], m2["bapo/c_high"])
    assert close(l1, l2) and close(g1, g2)


# ----------------------------------------------------------------------------- PSPO


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.6])
def test_pspo_value_and_grad(alpha):
    b = f64_batch(seed=8, spread=0.9)
    loss, grad, metrics = call("pspo", b, smoothing_alpha=alpha)
    _, _, A, m, r = parts(b)
    n = m.sum()
    assert close(loss, (-((1 - alpha) * r + alpha) * A * m).sum() / n)
    unclipped_is_grad = -A * r * m / n  # gradient of the unclipped IS surrogate -A r
    assert close(grad, (1 - alpha) * unclipped_is_grad)
    assert metrics["pspo/smoothed_ratio_mean"] == pytest.approx(float((((1 - alpha) * r + alpha) * m).sum() / n))


# ----------------------------------------------------------------------------- Clip-Cov


def clip_cov_ref(b, ratio_sel, lb, ub, low, high, seed):
    lp, old, A, m, r = parts(b)
    valid = m > 0
    l1, l2 = -A * r, -A * r.clamp(1 - low, 1 + high)
    clipped = (l2 > l1) & valid
    mA = (A * m).sum() / m.sum()
    mlp = (lp * m).sum() / m.sum()
    cov = (A - mA) * (lp - mlp)
    eligible = valid & ~clipped & (cov > lb) & (cov < ub)
    idx = eligible.nonzero()
    k = min(max(int(ratio_sel * float(m.sum())), 1), idx.shape[0])
    perm = torch.randperm(idx.shape[0], generator=torch.Generator().manual_seed(seed))
    sel = torch.zeros_like(m)
    for i, j in idx[perm[:k]].tolist():
        sel[i, j] = 1.0
    val = torch.maximum(l1, l2) * (1 - sel)
    g = torch.where(l1 >= l2, -A * r, torch.zeros_like(r)) * (1 - sel)
    n = m.sum()
    return (val * m).sum() / n, g * m / n, sel, eligible


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_cov_value_and_grad_seeded(seed):
    b = f64_batch(B=8, T=12, seed=seed, spread=0.6)
    p = dict(clip_cov_ratio=0.1, clip_cov_lb=0.0, clip_cov_ub=5.0, clip_ratio_low=0.2, clip_ratio_high=0.28)
    ctx = Context(generator=torch.Generator().manual_seed(100 + seed))
    loss, grad, met = call("clip_cov", b, ctx=ctx, **p)
    ref_loss, ref_grad, sel, eligible = clip_cov_ref(b, 0.1, 0.0, 5.0, 0.2, 0.28, 100 + seed)
    m = parts(b)[3]
    assert 0 < sel.sum() < eligible.sum()  # a strict random subset was taken
    assert sel.sum() == max(int(0.1 * float(m.sum())), 1)
    assert close(loss, ref_loss) and close(grad, ref_grad)
    assert met["pg_clipfrac"] == pytest.approx(float(sel.sum() / m.sum()))
    assert (grad[sel.bool()] == 0).all()


def test_clip_cov_reproducible_and_random():
    b = f64_batch(B=8, T=12, seed=4, spread=0.6)
    p = dict(clip_cov_ratio=0.1, clip_cov_lb=0.0)
    run = lambda s: call("clip_cov", b, ctx=Context(generator=torch.Generator().manual_seed(s)), **p)
    l1, g1, _ = run(11)
    l2, g2, _ = run(11)
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    grads = {tuple((run(s)[1] == 0).flatten().tolist()) for s in range(6)}
    assert len(grads) > 1  # different seeds select different tokens
    # without a generator the global CPU RNG is used (as verl's torch.randperm): same seed, same result
    torch.manual_seed(11)
    l3, g3, _ = call("clip_cov", b, **p)
    assert torch.equal(l1, l3) and torch.equal(g1, g3)


def test_clip_cov_defaults_select_at_least_one_token_and_keep_denominator():
    # r = 1 everywhere; only the last token has 1 < cov < 5: (5 - 0.32) * (-0.1 + 1.05) = 4.45
    lp = torch.linspace(-2.0, -0.1, 10, dtype=F64).unsqueeze(0)
    b = {
        "log_prob": lp.clone().requires_grad_(True),
        "old_log_prob": lp.clone(),
        "advantages": torch.tensor([[-0.2] * 9 + [5.0]], dtype=F64),
        "response_mask": torch.ones(1, 10, dtype=torch.bool),
    }
    loss, grad, met = call("clip_cov", b)  # defaults: ratio 2e-4 -> max(int(0.002), 1) = 1 token
    ref_loss, ref_grad, sel, eligible = clip_cov_ref(b, 2e-4, 1.0, 5.0, 1.0, 1.0, 0)
    assert eligible.sum() == 1 and sel[0, 9] == 1
    assert close(loss, 9 * 0.2 / 10) and close(loss, ref_loss)  # the denominator still counts it
    assert close(grad, torch.tensor([[0.02] * 9 + [0.0]], dtype=F64)) and close(grad, ref_grad)
    assert met["pg_clipfrac"] == pytest.approx(0.1)


# ----------------------------------------------------------------------------- KL-Cov


@pytest.mark.parametrize("ratio,coef", [(0.002, 1.0), (0.2, 0.5), (1.0, 2.0)])
def test_kl_cov_value_and_grad(ratio, coef):
    b = f64_batch(B=8, T=12, seed=9, spread=0.7)
    loss, grad, met = call("kl_cov", b, kl_cov_ratio=ratio, ppo_kl_coef=coef)
    lp, old, A, m, r = parts(b)
    valid = m > 0
    a_v, lp_v = A[valid], lp[valid]
    cov = (a_v - a_v.mean()) * (lp_v - lp_v.mean())
    k = max(1, int(ratio * valid.sum().item()))
    thresh = cov.sort(descending=True).values[k - 1]
    top = torch.zeros_like(m)
    top[valid] = (cov >= thresh).to(F64)
    d = lp - old
    n = m.sum()
    assert top.sum() == k
    assert close(loss, ((-A * r + coef * d.abs() * top) * m).sum() / n)
    assert close(grad, (-A * r + coef * torch.sign(d) * top) * m / n)
    assert met["kl_cov/penalized_frac"] == pytest.approx(k / float(n))
    assert met["ppo_kl"] == pytest.approx(float((d.abs() * m).sum() / n))  # absolute log-ratio (verl)


def test_kl_cov_has_no_ppo_clip():
    b = tokens([3.0, 0.2], [1.0, -1.0])
    _, grad, _ = call("kl_cov", b, kl_cov_ratio=1e-6, ppo_kl_coef=0.0)
    assert close(grad, torch.tensor([[-3.0 / 2, 0.2 / 2]], dtype=F64))


# ----------------------------------------------------------------------------- common behaviour

PARAMS = {"clip_cov": dict(clip_cov_ratio=0.2, clip_cov_lb=-10.0)}


def ctx_for(name):
    return Context(generator=torch.Generator().manual_seed(0)) if name == "clip_cov" else None


@pytest.mark.parametrize("name", NAMES)
def test_masked_tokens_get_zero_grad_and_row_all_masked(name):
    b = f64_batch(B=5, T=7, seed=12, spread=0.6)
    b["response_mask"] = b["response_mask"].clone()
    b["response_mask"][2] = False
    loss, grad, met = call(name, b, ctx=ctx_for(name), **PARAMS.get(name, {}))
    assert torch.isfinite(loss)
    assert (grad[~b["response_mask"]] == 0).all()
    assert grad[b["response_mask"]].abs().sum() > 0


@pytest.mark.parametrize("name", NAMES)
def test_all_masked_and_empty_batches(name):
    b = f64_batch(B=3, T=5, seed=1)
    b["response_mask"] = torch.zeros_like(b["response_mask"])
    loss, grad, met = call(name, b, ctx=ctx_for(name))
    assert loss.item() == 0.0 and (grad == 0).all()
    keys = set(call(name, f64_batch(seed=1), ctx=ctx_for(name))[2])
    assert set(met) == keys  # same metric keys on every call
    for k, v in met.items():
        assert math.isfinite(v), (k, v)
    empty = {
        "log_prob": torch.zeros(0, 5, dtype=F64, requires_grad=True),
        "old_log_prob": torch.zeros(0, 5, dtype=F64),
        "advantages": torch.zeros(0, 5, dtype=F64),
        "response_mask": torch.zeros(0, 5, dtype=torch.bool),
    }
    loss, grad, met = call(name, empty, ctx=ctx_for(name))
    assert loss.item() == 0.0 and set(met) == keys


@pytest.mark.parametrize("name", NAMES)
def test_on_policy_single_token_and_all_equal_advantages(name):
    # a group of one token, r = 1, all advantages equal: finite, no NaN anywhere
    b = tokens([1.0], [0.7])
    loss, grad, met = call(name, b, ctx=ctx_for(name))
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    b = f64_batch(seed=2)
    b["advantages"] = torch.full_like(b["advantages"], 0.5)
    loss, grad, _ = call(name, b, ctx=ctx_for(name))
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


@pytest.mark.parametrize("name", NAMES)
def test_non_finite_input_raises(name):
    b = f64_batch(seed=0)
    old = b["old_log_prob"].clone()
    old[0, 0] = float("nan")
    b["old_log_prob"] = old
    with pytest.raises(StableRLError, match="non-finite"):
        call(name, b)
    b = f64_batch(seed=0)
    adv = b["advantages"].clone()
    adv[0, 0] = float("inf")
    b["advantages"] = adv
    with pytest.raises(StableRLError, match="non-finite"):
        call(name, b)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_inputs(name):
    b32 = make_batch(8, 16, seed=21, dtype=torch.float32, spread=0.3)
    b16 = {k: (v.detach().to(torch.bfloat16) if v.dtype.is_floating_point else v) for k, v in b32.items()}
    b16r = {k: (v.to(torch.float32) if v.dtype.is_floating_point else v) for k, v in b16.items()}
    p = PARAMS.get(name, {})
    l16, g16, m16 = call(name, b16, ctx=ctx_for(name), **p)
    l16r, g16r, _ = call(name, b16r, ctx=ctx_for(name), **p)
    l32, g32, _ = call(name, b32, ctx=ctx_for(name), **p)
    assert l16.dtype == torch.float32 and g16.dtype == torch.bfloat16
    assert torch.isfinite(l16) and torch.isfinite(g16.float()).all()
    assert torch.allclose(l16, l16r, atol=1e-6)  # computed in fp32 from the bf16 values
    assert torch.allclose(g16.float(), g16r, atol=1e-2, rtol=1e-2)
    if name != "clip_cov":  # clip_cov's random choice may differ with the rounded inputs
        assert abs(l16.item() - l32.item()) < 5e-2


@pytest.mark.parametrize(
    "name,bad,param",
    [
        ("sapo", dict(tau_pos=0.0), "tau_pos"),
        ("sapo", dict(tau_neg=-1.0), "tau_neg"),
        ("gppo", dict(clip_ratio_c=0.5), "clip_ratio_c"),
        ("gppo", dict(clip_ratio_high=-0.1), "clip_ratio_high"),
        ("ce_gppo", dict(beta1=-0.1), "beta1"),
        ("ce_gppo", dict(beta2=-1.0), "beta2"),
        ("bapo", dict(ratio_lower_max=0.5), "ratio_lower_max"),
        ("bapo", dict(ratio_upper_max=1.0), "ratio_upper_max"),
        ("bapo", dict(ratio_lower_step=-0.1), "ratio_lower_step"),
        ("bapo", dict(ratio_upper_step=1e-6), "ratio_upper_step"),
        ("bapo", dict(adv_ratio_target=-1.0), "adv_ratio_target"),
        ("bapo", dict(eps=0.0), "eps"),
        ("pspo", dict(smoothing_alpha=1.0), "smoothing_alpha"),
        ("clip_cov", dict(clip_cov_ratio=0.0), "clip_cov_ratio"),
        ("clip_cov", dict(clip_cov_lb=6.0), "clip_cov_lb"),
        ("kl_cov", dict(kl_cov_ratio=0.0), "kl_cov_ratio"),
        ("kl_cov", dict(ppo_kl_coef=-1.0), "ppo_kl_coef"),
    ],
)
def test_bad_hyper_parameters(name, bad, param):
    with pytest.raises(StableRLError, match=param):
        call(name, f64_batch(), **bad)


def test_unknown_hyper_parameter_names_nearest():
    with pytest.raises(StableRLError, match="tau_pos"):
        call("sapo", f64_batch(), tau_po=1.0)
    with pytest.raises(StableRLError, match="smoothing_alpha"):
        call("pspo", f64_batch(), smoothing_alpa=0.2)


@pytest.mark.parametrize("name,agg", [("gppo", "token-mean"), ("ce_gppo", "token-mean"), ("pspo", "token-mean"),
                                      ("kl_cov", "seq-mean-token-sum"), ("sapo", "seq-mean-token-mean")])
def test_micro_batches_sum_to_the_whole_batch_gradient(name, agg):
    b = f64_batch(B=6, T=8, seed=13, spread=0.6)
    kw = {"kl_cov_ratio": 1e-6, "ppo_kl_coef": 0.0} if name == "kl_cov" else {}
    l_all, g_all, _ = call(name, b, loss_agg_mode=agg, **kw)
    n_tok, n_seq = float(b["response_mask"].sum()), 6
    total, grads = 0.0, []
    for rows in (slice(0, 2), slice(2, 6)):
        part = {k: v[rows] for k, v in b.items()}
        l, g, _ = call(name, part, ctx=Context(token_count=n_tok, seq_count=n_seq), loss_agg_mode=agg, **kw)
        total += l.item()
        grads.append(g)
    assert close(total, l_all) and close(torch.cat(grads), g_all)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", NAMES)
def test_cuda_equals_cpu(name):
    b = make_batch(16, 64, seed=31, dtype=torch.float32, spread=0.5)
    p = PARAMS.get(name, {})
    l_cpu, g_cpu, m_cpu = call(name, b, ctx=ctx_for(name), **p)
    bc = {k: v.detach().cuda() for k, v in b.items()}
    l_gpu, g_gpu, m_gpu = call(name, bc, ctx=ctx_for(name), **p)  # a CPU generator with CUDA tensors
    assert torch.allclose(l_gpu.cpu(), l_cpu, atol=1e-5, rtol=1e-5)
    assert torch.allclose(g_gpu.cpu(), g_cpu, atol=1e-6, rtol=1e-5)
    assert set(m_gpu) == set(m_cpu)
