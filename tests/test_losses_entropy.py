"""Entropy-aware policy losses: steer, erc, entropic, gtpo (+ the unavailable listings).

Every reference below is an independent per-token float64 computation written from the formulas
in LOSSES.md (E3, C7, E6, E7); the plugins are compared with it in value and gradient.
"""

import math
import threading

import pytest
import torch
from conftest import make_batch

import stablerl
from stablerl import Context, MissingInputError, StableRLError
from stablerl.contracts import PolicyLossBatch
from stablerl.plugins.entropic import EntroPICController
from stablerl.plugins.gtpo import GTPOParams, gtpo_terms

F64 = torch.float64


def _entropy(B, T, seed, scale=2.0, dtype=F64):
    g = torch.Generator().manual_seed(1000 + seed)
    return (torch.rand(B, T, generator=g, dtype=F64) * scale).to(dtype)


def _grad(loss, lp):
    (g,) = torch.autograd.grad(loss, lp)
    return g


def _valid(mask):
    B, T = mask.shape
    return [(i, t) for i in range(B) for t in range(T) if bool(mask[i, t])]


def _ppo_token(lp, old, a, eps_l, eps_h, c):
    """Dual-clip PPO loss of one token (torch scalars, float64)."""
    r = torch.exp(torch.clamp(lp - old, -20, 20))
    l1 = -a * r
    l2 = -a * torch.clamp(r, 1 - eps_l, 1 + eps_h)
    l = torch.maximum(l1, l2)
    if a < 0 and c is not None:
        l = torch.clamp(l, max=-a * c)
    return l


class FakeDP:
    """n data-parallel 'ranks' as threads sharing an in-process all_reduce."""

    def __init__(self, n):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.buf = [None] * n

    def context(self, rank, **kw):
        def all_reduce(t, op):
            self.buf[rank] = t.detach().clone()
            self.barrier.wait()
            stacked = torch.stack(self.buf)
            out = {"sum": stacked.sum(0), "max": stacked.amax(0), "min": stacked.amin(0)}[op]
            self.barrier.wait()
            return out

        return Context(all_reduce_fn=all_reduce, dp_size=self.n, **kw)

    def run(self, fn):
        results, errors = [None] * self.n, []

        def target(r):
            try:
                results[r] = fn(r)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        return results


def _split(d, rows):
    out = {}
    for k, v in d.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.detach()[rows].clone().requires_grad_(v.requires_grad)
        elif isinstance(v, list):
            out[k] = [v[i] for i in rows]
        else:
            out[k] = v
    return out


# ============================================================================ STEER


def ref_steer(b, H, wmin=0.8, wmax=1.0, linear=False, eps_l=0.2, eps_h=0.28, c=10.0):
    lp, old, A, mask = b["log_prob"], b["old_log_prob"], b["advantages"], b["response_mask"]
    cells = _valid(mask)
    omega = {}
    for i, t in cells:
        x = min(max(math.exp(lp[i, t].item()), 1e-8), 1 - 1e-8)
        po = min(max(math.exp(old[i, t].item()), 1e-8), 1.0)
        omega[i, t] = abs(A[i, t].item() / po * x * (1 - x) * (math.log(x) + H[i, t].item()))
    mx, mn = max(omega.values()), min(omega.values())
    w = {}
    for key, om in omega.items():
        if linear:
            v = wmax - (om - mn) * (wmax - wmin) / (mx - mn) if mx > mn else 0.5 * (wmin + wmax)
            w[key] = min(max(v, wmin), wmax)
        else:
            k = -math.log(wmin) / max(mx, 0.02)
            w[key] = min(max(math.exp(-k * om), wmin), 1.0)
    total = sum(w[i, t] * _ppo_token(lp[i, t], old[i, t], A[i, t].item(), eps_l, eps_h, c) for i, t in cells)
    return total / len(cells), w


@pytest.mark.parametrize("linear", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_steer_value_and_grad_match_reference(seed, linear):
    b = make_batch(B=5, T=7, seed=seed, dtype=F64, spread=0.4)
    H = _entropy(5, 7, seed)
    loss, m = stablerl.compute_policy_loss("steer", **b, entropy=H, linear=linear)
    ref, w = ref_steer(b, H, linear=linear)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-10, abs=1e-12)
    g = _grad(loss, b["log_prob"])
    g_ref = _grad(ref, b["log_prob"])
    torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-12)
    mask = b["response_mask"]
    assert torch.all(g[~mask] == 0)
    assert m["steer/weight_min"] == pytest.approx(min(w.values()))
    assert m["steer/weight_max"] == pytest.approx(max(w.values()))
    assert m["steer/weight_mean"] == pytest.approx(sum(w.values()) / len(w))
    if not linear:  # the largest |Omega| gets exactly w_min (max |Omega| > 0.02 here)
        assert m["steer/omega_max"] > 0.02
        assert m["steer/weight_min"] == pytest.approx(0.8)
    assert len(set(round(v, 9) for v in w.values())) > 3  # weights are not trivially constant


def test_steer_prefers_old_entropy():
    b = make_batch(B=4, T=6, seed=3, dtype=F64)
    H, H_old = _entropy(4, 6, 3), _entropy(4, 6, 4)
    loss, _ = stablerl.compute_policy_loss("steer", **b, entropy=H, old_entropy=H_old)
    ref_old, _ = ref_steer(b, H_old)
    ref_cur, _ = ref_steer(b, H)
    assert loss.item() == pytest.approx(ref_old.item(), rel=1e-10)
    assert abs(ref_old.item() - ref_cur.item()) > 1e-4


def test_steer_weights_are_batch_global_over_dp():
    b = make_batch(B=6, T=5, seed=5, dtype=F64, spread=0.5)
    H = _entropy(6, 5, 5)
    N = float(b["response_mask"].sum())
    full, m_full = stablerl.compute_policy_loss("steer", **b, entropy=H, ctx=Context(token_count=N))
    g_full = _grad(full, b["log_prob"])
    halves = [[0, 1, 2], [3, 4, 5]]
    parts = [_split({**b, "entropy": H}, rows) for rows in halves]
    dp = FakeDP(2)

    def rank(r):
        loss, met = stablerl.compute_policy_loss("steer", **parts[r], ctx=dp.context(r, token_count=N))
        return loss, met, _grad(loss, parts[r]["log_prob"])

    out = dp.run(rank)
    assert (out[0][0] + out[1][0]).item() / 2 == pytest.approx(full.item(), rel=1e-10)
    g_dp = torch.cat([out[0][2], out[1][2]]) / 2  # the framework averages gradients over ranks
    torch.testing.assert_close(g_dp, g_full, rtol=1e-9, atol=1e-12)
    assert out[0][1]["steer/omega_max"] == out[1][1]["steer/omega_max"] == pytest.approx(m_full["steer/omega_max"])
    # without the reduction each half would use its own max |Omega| -> a different loss
    local = [stablerl.compute_policy_loss("steer", **_split({**b, "entropy": H}, rows), ctx=Context(token_count=N, dp_size=2))[0] for rows in halves]
    assert abs((local[0] + local[1]).item() / 2 - full.item()) > 1e-6


# ============================================================================ ERC


def _gppo_token(lp, old, a, eps_l, eps_h, c):
    r = torch.exp(torch.clamp(lp - old, -20, 20))
    rs = r / r.detach()
    if a < 0 and r.item() < 1 - eps_l:
        l = -a * (1 - eps_l) * rs
    elif a > 0 and r.item() > 1 + eps_h:
        l = -a * (1 + eps_h) * rs
    else:
        l = -a * r
    if a < 0 and c is not None:
        l = torch.clamp(l, max=-a * c)
    return l


def ref_erc(b, H, H_old, low=0.95, high=1.05, base="vanilla", eps_l=0.2, eps_h=0.28, c=10.0):
    lp, old, A, mask = b["log_prob"], b["old_log_prob"], b["advantages"], b["response_mask"]
    token = _ppo_token if base == "vanilla" else _gppo_token
    total, kept = 0.0, 0
    cells = _valid(mask)
    for i, t in cells:
        l = token(lp[i, t], old[i, t], A[i, t].item(), eps_l, eps_h, c)
        ratio = (H[i, t].item() + 1e-8) / (H_old[i, t].item() + 1e-8)
        keep = low < ratio < high
        kept += keep
        total = total + (l if keep else l.detach())
    return total / len(cells), kept / len(cells)


@pytest.mark.parametrize("base", ["vanilla", "gppo"])
def test_erc_value_and_grad_match_reference(base):
    b = make_batch(B=5, T=8, seed=2, dtype=F64, spread=0.5)
    H_old = _entropy(5, 8, 2) + 0.05
    g = torch.Generator().manual_seed(7)
    H = H_old * (1 + 0.1 * (torch.rand(5, 8, generator=g, dtype=F64) - 0.5) * 2)  # ratios in [0.9, 1.1]
    loss, m = stablerl.compute_policy_loss("erc", **b, entropy=H, old_entropy=H_old, base=base)
    ref, frac = ref_erc(b, H, H_old, base=base)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-10)
    grad = _grad(loss, b["log_prob"])
    torch.testing.assert_close(grad, _grad(ref, b["log_prob"]), rtol=1e-9, atol=1e-12)
    assert m["erc/entropy_frac"] == pytest.approx(frac)
    assert 0.2 < frac < 0.9  # both kept and detached tokens exist
    # out-of-band tokens: no gradient; value identical to the base loss (they count in the denominator)
    ratio = (H + 1e-8) / (H_old + 1e-8)
    out = b["response_mask"] & ~((ratio > 0.95) & (ratio < 1.05))
    assert out.any() and torch.all(grad[out] == 0)
    base_loss, _ = stablerl.compute_policy_loss(
        "vanilla" if base == "vanilla" else "gppo", **b, clip_ratio_c=10.0,
        **({"clip_ratio_high": 0.28} if base == "vanilla" else {}),
    )
    assert loss.item() == pytest.approx(base_loss.item(), rel=1e-12)


def test_erc_gppo_differs_from_vanilla_in_gradient():
    b = make_batch(B=5, T=8, seed=2, dtype=F64, spread=0.8)
    H = _entropy(5, 8, 2) + 0.05
    gv = _grad(stablerl.compute_policy_loss("erc", **b, entropy=H, old_entropy=H)[0], b["log_prob"])
    gg = _grad(stablerl.compute_policy_loss("erc", **b, entropy=H, old_entropy=H, base="gppo")[0], b["log_prob"])
    assert (gv - gg).abs().max() > 1e-3  # clipped tokens keep a gradient under gppo


# ============================================================================ EntroPIC


def ref_entropic(b, H, alpha, thresh=0.95, eps_l=0.2, eps_h=0.2, c=3.0):
    lp, old, A, mask = b["log_prob"], b["old_log_prob"], b["advantages"], b["response_mask"]
    cells = _valid(mask)
    ppo = sum(_ppo_token(lp[i, t], old[i, t], A[i, t].item(), eps_l, eps_h, c) for i, t in cells) / len(cells)
    hp = [(i, t) for i, t in cells if lp[i, t].item() > math.log(thresh)]
    adj = sum(-torch.exp(lp[i, t] - old[i, t]) * abs(A[i, t].item()) for i, t in hp) / max(len(hp), 1)
    h_mean = sum(H[i, t].item() for i, t in cells) / len(cells)
    return ppo + alpha * adj, h_mean, len(hp) / len(cells)


def _entropic_batch(seed=0, B=5, T=7):
    b = make_batch(B=B, T=T, seed=seed, dtype=F64, spread=0.3)
    with torch.no_grad():  # a few high-probability tokens (p > 0.95)
        b["log_prob"][:, :2] = -0.01 - 0.01 * torch.arange(B, dtype=F64).unsqueeze(-1)
        b["old_log_prob"][:, :2] = b["log_prob"][:, :2] - 0.1
    return b


def test_entropic_value_grad_and_alpha_match_reference():
    b = _entropic_batch()
    H = _entropy(5, 7, 0, scale=0.6)
    ctx = Context()
    loss, m = stablerl.compute_policy_loss("entropic", **b, entropy=H, ctx=ctx)
    _, h_mean, hp_frac = ref_entropic(b, H, 0.0)
    alpha = max(min(1.0 * (h_mean - 0.1), 1.0), -1.0)  # first call: integral 0
    ref, _, _ = ref_entropic(b, H, alpha)
    assert 0.05 < abs(alpha) < 1  # not clipped, not zero
    assert loss.item() == pytest.approx(ref.item(), rel=1e-10)
    torch.testing.assert_close(_grad(loss, b["log_prob"]), _grad(ref, b["log_prob"]), rtol=1e-9, atol=1e-12)
    assert m["entropic/alpha"] == pytest.approx(alpha)
    assert m["entropic/integral"] == pytest.approx(h_mean - 0.1)
    assert m["entropy"] == pytest.approx(h_mean)
    assert m["entropic/high_prob_fraction"] == pytest.approx(hp_frac) and hp_frac > 0
    assert ctx.state["entropic"]["integral"] == pytest.approx(h_mean - 0.1)


def test_entropic_integral_accumulates_across_calls():
    ctx = Context()
    integral, alphas = 0.0, []
    for seed in range(4):
        b = _entropic_batch(seed)
        H = _entropy(5, 7, seed, scale=0.6)
        _, m = stablerl.compute_policy_loss("entropic", **b, entropy=H, ctx=ctx, entropy_control_i=0.5)
        e = sum(H[i, t].item() for i, t in _valid(b["response_mask"])) / len(_valid(b["response_mask"])) - 0.1
        expected_alpha = max(min(e + 0.5 * integral, 1.0), -1.0)
        integral += e
        assert m["entropic/alpha"] == pytest.approx(expected_alpha)
        assert m["entropic/integral"] == pytest.approx(integral)
        alphas.append(m["entropic/alpha"])
    assert ctx.state["entropic"]["updates"] == 4
    assert len(set(round(a, 9) for a in alphas)) == 4


def test_entropic_integral_weight_is_the_calls_share_of_the_rows():
    """The error is weighted by rows-in-call / rows-in-mini-batch: ctx.row_count where the framework's seq_count
    counts only non-empty rows (OpenRLHF), else seq_count; the 5 rows here are a quarter of 20."""
    b = _entropic_batch(0)
    H = _entropy(5, 7, 0, scale=0.6)
    e = sum(H[i, t].item() for i, t in _valid(b["response_mask"])) / len(_valid(b["response_mask"])) - 0.1
    for ctx in (Context(seq_count=20), Context(seq_count=3, row_count=20)):
        _, m = stablerl.compute_policy_loss("entropic", **b, entropy=H, ctx=ctx)
        assert m["entropic/integral"] == pytest.approx(e / 4)


def test_entropic_state_resume_reproduces_alpha():
    c1 = EntroPICController(target_entropy=0.2, k_p=0.5, k_i=0.1)
    for h in (0.9, 0.4, 0.05, 0.3):
        c1.update(h, weight=0.5)
    c2 = EntroPICController(target_entropy=0.2, k_p=0.5, k_i=0.1)
    c2.load_state_dict(c1.state_dict())
    assert c2.update(0.7) == c1.update(0.7)
    assert c2.state_dict() == c1.state_dict()
    # through ctx.state: a checkpointed state dict resumes the same controller
    ctx = Context()
    b, H = _entropic_batch(1), _entropy(5, 7, 1, scale=0.6)
    stablerl.compute_policy_loss("entropic", **b, entropy=H, ctx=ctx)
    saved = dict(ctx.state["entropic"])
    _, m_cont = stablerl.compute_policy_loss("entropic", **b, entropy=H, ctx=ctx)
    _, m_resumed = stablerl.compute_policy_loss("entropic", **b, entropy=H, ctx=Context(state={"entropic": saved}))
    _, m_fresh = stablerl.compute_policy_loss("entropic", **b, entropy=H, ctx=Context())
    assert m_resumed["entropic/alpha"] == m_cont["entropic/alpha"]
    assert m_resumed["entropic/integral"] == m_cont["entropic/integral"]
    assert m_fresh["entropic/alpha"] != m_cont["entropic/alpha"]


def test_entropic_alpha_clipped_and_disabled():
    c = EntroPICController(target_entropy=0.1, k_p=1.0, k_i=0.01)
    assert c.update(50.0) == 1.0
    c = EntroPICController(target_entropy=5.0)
    assert c.update(0.0) == -1.0
    b = _entropic_batch()
    H = _entropy(5, 7, 0, scale=20.0)
    _, m = stablerl.compute_policy_loss("entropic", **b, entropy=H)
    assert m["entropic/alpha"] == 1.0
    # target_entropy < 0: plain PPO (verl vanilla with the same bounds), no state change
    ctx = Context()
    loss, m = stablerl.compute_policy_loss("entropic", **b, entropy=H, target_entropy=-1.0, ctx=ctx)
    van, _ = stablerl.compute_policy_loss("vanilla", **b, clip_ratio_high=0.2, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(van.item(), rel=1e-12)
    assert m["entropic/alpha"] == 0.0 and ctx.state["entropic"]["integral"] == 0.0


def test_entropic_same_alpha_on_every_dp_rank():
    b = _entropic_batch(2, B=6)
    H = _entropy(6, 7, 2, scale=0.6)
    N = float(b["response_mask"].sum())
    full, m_full = stablerl.compute_policy_loss("entropic", **b, entropy=H, ctx=Context(token_count=N, seq_count=6))
    g_full = _grad(full, b["log_prob"])
    halves = [[0, 2, 4], [1, 3, 5]]
    parts = [_split({**b, "entropy": H}, rows) for rows in halves]
    dp = FakeDP(2)

    def rank(r):
        loss, met = stablerl.compute_policy_loss("entropic", **parts[r], ctx=dp.context(r, token_count=N, seq_count=6))
        return loss, met, _grad(loss, parts[r]["log_prob"])

    out = dp.run(rank)
    assert out[0][1]["entropic/alpha"] == out[1][1]["entropic/alpha"] == pytest.approx(m_full["entropic/alpha"])
    assert out[0][1]["entropic/integral"] == pytest.approx(m_full["entropic/integral"])
    assert (out[0][0] + out[1][0]).item() / 2 == pytest.approx(full.item(), rel=1e-10)
    g_dp = torch.zeros_like(g_full)
    for r, rows in enumerate(halves):
        g_dp[rows] = out[r][2] / 2
    torch.testing.assert_close(g_dp, g_full, rtol=1e-9, atol=1e-12)


# ============================================================================ GTPO


def ref_gtpo_terms(ids, mask, index, A, H, thr=0.7, scale=0.1, w=2.0, count="union"):
    """Brute force: per completion, per position, look for an opposite-sign completion of the group."""
    B, T = mask.shape
    L = [int(mask[i].sum()) for i in range(B)]
    a = [sum(A[i, t].item() for t in range(T) if mask[i, t]) / max(L[i], 1) for i in range(B)]
    sign = [(1 if a[i] > 0 else -1 if a[i] < 0 else 0) if L[i] else 0 for i in range(B)]

    def conflict_at(i, t, j_pos):
        return any(index[j] == index[i] and sign[j] == -sign[i] and j_pos(j) is not None
                   and ids[j, j_pos(j)] == ids[i, t] for j in range(B))

    delta = torch.ones(B, T, dtype=F64)
    n_conf, a_mod = [], []
    for i in range(B):
        fwd, bwd = set(), set()
        if sign[i] != 0:
            for t in range(L[i]):  # leading run
                if conflict_at(i, t, lambda j: t if t < L[j] else None):
                    fwd.add(t)
                else:
                    break
            for s in range(L[i]):  # trailing run, aligned on the end
                t = L[i] - 1 - s
                if conflict_at(i, t, lambda j: L[j] - 1 - s if s < L[j] else None):
                    bwd.add(t)
                else:
                    break
        cw = w if sign[i] > 0 else 0.0
        for t in range(T):
            delta[i, t] = (cw if t in fwd else 1.0) * (cw if t in bwd else 1.0)
        n = len(fwd | bwd) if count == "union" else max(len(fwd), len(bwd))
        n_conf.append(max(n, 1))
        h_bar = sum(H[i, t].item() for t in range(T) if mask[i, t]) / max(L[i], 1)
        a_mod.append(0.0 if h_bar > thr else a[i] - scale * h_bar)
    return a_mod, delta, n_conf, L


def ref_gtpo_loss(b, ids, index, H, **kw):
    lp, mask = b["log_prob"], b["response_mask"]
    a_mod, delta, n_conf, L = ref_gtpo_terms(ids, mask, index, b["advantages"], H, **kw)
    total = 0.0
    for i in range(lp.shape[0]):
        if L[i] == 0:
            continue
        r = torch.exp(lp[i] - lp[i].detach())
        total = total + sum(-(r[t] * a_mod[i] * delta[i, t]) for t in range(L[i])) / L[i] / n_conf[i]
    return total / lp.shape[0], delta, n_conf


def _gtpo_batch(seed, B=8, T=7, vocab=3):
    b = make_batch(B=B, T=T, seed=seed, dtype=F64)
    g = torch.Generator().manual_seed(seed + 50)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    adv = torch.randn(B, generator=g, dtype=F64)
    adv[2] = 0.0  # an inactive completion
    b["advantages"] = adv.unsqueeze(-1).expand(B, T).clone()
    index = [k // 4 for k in range(B)]
    return b, ids, index


@pytest.mark.parametrize("count", ["union", "max_run"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_gtpo_value_grad_and_delta_match_brute_force(seed, count):
    b, ids, index = _gtpo_batch(seed)
    H = _entropy(8, 7, seed, scale=1.2)
    loss, m = stablerl.compute_policy_loss("gtpo", **b, entropy=H, token_ids=ids, index=index, conflict_count=count)
    ref, delta, n_conf = ref_gtpo_loss(b, ids, index, H, count=count)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-10, abs=1e-14)
    torch.testing.assert_close(_grad(loss, b["log_prob"]), _grad(ref, b["log_prob"]), rtol=1e-9, atol=1e-14)
    # the plugin's delta / counts themselves
    batch = PolicyLossBatch(
        log_prob=b["log_prob"].detach(), old_log_prob=b["old_log_prob"], advantages=b["advantages"],
        response_mask=b["response_mask"].to(torch.float32), entropy=H, token_ids=ids,
        index=torch.tensor(index),
    )
    _, d, n, *_ = gtpo_terms(batch, GTPOParams(conflict_count=count))
    mask = b["response_mask"]
    torch.testing.assert_close(d[mask], delta[mask])
    assert n.tolist() == [float(x) for x in n_conf]


def test_gtpo_hand_example():
    # one group: two positive, one negative completion, length 5 (no padding) and one of length 3
    ids = torch.tensor([
        [1, 2, 3, 4, 9],   # +  shares prefix [1, 2] and suffix [.., 9] with the negative
        [1, 5, 6, 7, 9],   # +  shares prefix [1] and suffix [9]
        [1, 2, 8, 8, 9],   # -
        [4, 4, 9, 0, 0],   # +  length 3: its last token 9 aligns with the others' last token
    ])
    mask = torch.tensor([[1] * 5, [1] * 5, [1] * 5, [1, 1, 1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, 0.5, -1.0, 0.2], dtype=F64).unsqueeze(-1).expand(4, 5).clone()
    H = torch.full((4, 5), 0.5, dtype=F64)
    lp = torch.full((4, 5), -0.5, dtype=F64, requires_grad=True)
    kw = dict(log_prob=lp, old_log_prob=lp.detach(), advantages=adv, response_mask=mask, entropy=H, token_ids=ids, index=[0, 0, 0, 0])
    loss, m = stablerl.compute_policy_loss("gtpo", **kw)
    batch = PolicyLossBatch(lp.detach(), lp.detach(), adv, mask.float(), entropy=H, token_ids=ids, index=torch.zeros(4, dtype=torch.long))
    _, delta, n, conflict, *_ = gtpo_terms(batch, GTPOParams())
    expected = torch.tensor([
        [2, 2, 1, 1, 2],
        [2, 1, 1, 1, 2],
        [0, 0, 1, 1, 0],
        [1, 1, 2, 1, 1],
    ], dtype=F64)
    torch.testing.assert_close(delta * mask, expected * mask)
    assert n.tolist() == [3.0, 2.0, 3.0, 1.0]
    assert m["gtpo/conflict_tokens"] == 9
    # A' = A - 0.1 * 0.5 for every completion (entropy 0.5 <= 0.7)
    a_mod = [0.95, 0.45, -1.05, 0.15]
    L = [5, 5, 5, 3]
    ref = sum(-a_mod[i] * float((expected[i] * mask[i]).sum()) / L[i] / float(n[i]) for i in range(4)) / 4
    assert loss.item() == pytest.approx(ref, rel=1e-12)
    g = _grad(loss, lp)
    assert g[2, 0].item() == 0.0 and g[2, 2].item() == pytest.approx(1.05 / 5 / 3 / 4)
    assert g[0, 0].item() == pytest.approx(-0.95 * 2 / 5 / 3 / 4)
    # max_run: the reference's count -> max(2, 1) = 2 for row 0 instead of the union 3
    _, _, n_max, *_ = gtpo_terms(batch, GTPOParams(conflict_count="max_run"))
    assert n_max.tolist() == [2.0, 1.0, 2.0, 1.0]


def test_gtpo_entropy_filter_groups_and_inactive():
    b, ids, index = _gtpo_batch(4)
    H = _entropy(8, 7, 4, scale=0.5)
    H[1] = 0.9  # completion 1: above ENT_THRESHOLD -> A' = 0
    loss, m = stablerl.compute_policy_loss("gtpo", **b, entropy=H, token_ids=ids, index=index)
    g = _grad(loss, b["log_prob"])
    mask = b["response_mask"]
    assert torch.all(g[1] == 0)
    assert m["gtpo/entropy_filtered_fraction"] == pytest.approx(1 / 8)
    # the inactive completion (A = 0) still gets A' = -0.1 Hbar on every token (delta 1, n 1)
    h2 = H[2][mask[2]].mean().item()
    L2 = int(mask[2].sum())
    torch.testing.assert_close(g[2][mask[2]], torch.full((L2,), 0.1 * h2 / L2 / 8, dtype=F64))
    # different groups never conflict: every completion in its own group -> no conflict tokens
    _, m_solo = stablerl.compute_policy_loss("gtpo", **b, entropy=H, token_ids=ids, index=list(range(8)))
    assert m["gtpo/conflict_tokens"] > 0 and m_solo["gtpo/conflict_tokens"] == 0


def test_gtpo_per_completion_norm_off_uses_loss_agg_mode():
    b, ids, index = _gtpo_batch(5)
    H = _entropy(8, 7, 5, scale=0.5)
    l_seq, _ = stablerl.compute_policy_loss("gtpo", **b, entropy=H, token_ids=ids, index=index)
    l_tok, _ = stablerl.compute_policy_loss("gtpo", **b, entropy=H, token_ids=ids, index=index, per_completion_norm=False)
    l_seq2, _ = stablerl.compute_policy_loss(
        "gtpo", **b, entropy=H, token_ids=ids, index=index, per_completion_norm=False, loss_agg_mode="seq-mean-token-mean"
    )
    assert l_seq2.item() == pytest.approx(l_seq.item(), rel=1e-12)
    assert abs(l_tok.item() - l_seq.item()) > 1e-6


# ============================================================================ shared: degenerate, bf16, errors


def _inputs(name, B, T, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed + 99)
    ent = _entropy(B, T, seed, scale=0.6, dtype=dtype)
    extra = {"entropy": ent}
    if name == "erc":
        extra["old_entropy"] = (ent.to(F64) * (1 + 0.08 * (torch.rand(B, T, generator=g, dtype=F64) - 0.5))).to(dtype)
    if name == "gtpo":
        extra["token_ids"] = torch.randint(0, 3, (B, T), generator=g)
        extra["index"] = [k // 2 for k in range(B)]
    return extra


NAMES = ["steer", "erc", "entropic", "gtpo"]


@pytest.mark.parametrize("name", NAMES)
def test_all_masked_row_and_batch(name):
    b = make_batch(B=4, T=5, seed=1, dtype=F64)
    b["response_mask"] = b["response_mask"].clone()
    b["response_mask"][1] = False
    loss, m = stablerl.compute_policy_loss(name, **b, **_inputs(name, 4, 5))
    g = _grad(loss, b["log_prob"])
    assert math.isfinite(loss.item()) and torch.all(g[1] == 0) and torch.all(torch.isfinite(g))
    assert all(math.isfinite(v) for v in m.values())
    b = make_batch(B=4, T=5, seed=1, dtype=F64)
    b["response_mask"] = torch.zeros(4, 5, dtype=torch.bool)
    loss, m = stablerl.compute_policy_loss(name, **b, **_inputs(name, 4, 5))
    assert loss.item() == 0.0 and torch.all(_grad(loss, b["log_prob"]) == 0)
    assert all(math.isfinite(v) for v in m.values())


@pytest.mark.parametrize("name", NAMES)
def test_empty_batch(name):
    b = make_batch(B=2, T=4, seed=0, dtype=F64)
    empty = {k: v.detach()[:0].clone().requires_grad_(v.requires_grad) for k, v in b.items()}
    extra = {k: (v[:0] if isinstance(v, torch.Tensor) else []) for k, v in _inputs(name, 2, 4).items()}
    loss, m = stablerl.compute_policy_loss(name, **empty, **extra)
    assert loss.item() == 0.0 and all(math.isfinite(v) for v in m.values())


@pytest.mark.parametrize("name", NAMES)
def test_single_token_rows_and_group_of_one(name):
    b = make_batch(B=3, T=1, seed=4, dtype=F64, padded=False)
    extra = _inputs(name, 3, 1, seed=4)
    if name == "gtpo":
        extra["index"] = [0, 1, 2]  # groups of one: nothing can conflict
    loss, m = stablerl.compute_policy_loss(name, **b, **extra)
    g = _grad(loss, b["log_prob"])
    assert math.isfinite(loss.item()) and torch.all(torch.isfinite(g))


@pytest.mark.parametrize("name", NAMES)
def test_all_equal_advantages(name):
    b = make_batch(B=4, T=5, seed=2, dtype=F64)
    b["advantages"] = torch.zeros(4, 5, dtype=F64)
    loss, m = stablerl.compute_policy_loss(name, **b, **_inputs(name, 4, 5))
    g = _grad(loss, b["log_prob"])
    assert torch.all(torch.isfinite(g))
    if name in ("steer", "erc"):  # A = 0 -> no policy gradient at all
        assert loss.item() == 0.0 and torch.all(g == 0)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_inputs_close_to_fp32(name):
    b16 = make_batch(B=6, T=8, seed=3, dtype=torch.bfloat16)
    b32 = {k: (v.detach().float().requires_grad_(v.requires_grad) if v.is_floating_point() else v) for k, v in b16.items()}
    extra16 = _inputs(name, 6, 8, seed=3, dtype=torch.bfloat16)
    extra32 = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in extra16.items()}
    l16, m16 = stablerl.compute_policy_loss(name, **b16, **extra16)
    l32, m32 = stablerl.compute_policy_loss(name, **b32, **extra32)
    g16, g32 = _grad(l16, b16["log_prob"]), _grad(l32, b32["log_prob"])
    assert l16.dtype == torch.float32 and math.isfinite(l16.item())
    assert l16.item() == pytest.approx(l32.item(), rel=1e-5, abs=1e-6)
    assert g16.dtype == torch.bfloat16 and torch.all(torch.isfinite(g16.float()))
    torch.testing.assert_close(g16.float(), g32, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize(
    "name,missing",
    [("steer", "entropy"), ("erc", "entropy"), ("erc", "old_entropy"), ("entropic", "entropy"),
     ("gtpo", "entropy"), ("gtpo", "token_ids"), ("gtpo", "index")],
)
def test_missing_declared_input(name, missing):
    b = make_batch(B=4, T=5, seed=0)
    extra = _inputs(name, 4, 5, dtype=torch.float32)
    del extra[missing]
    with pytest.raises(MissingInputError, match=missing):
        stablerl.compute_policy_loss(name, **b, **extra)


@pytest.mark.parametrize("name", NAMES)
def test_non_finite_inputs_raise(name):
    b = make_batch(B=4, T=5, seed=0)
    extra = _inputs(name, 4, 5, dtype=torch.float32)
    bad = extra["entropy"].clone()
    bad[0, 0] = float("nan")
    with pytest.raises(StableRLError, match="entropy"):
        stablerl.compute_policy_loss(name, **b, **{**extra, "entropy": bad})
    lp = b["log_prob"].detach().clone()
    lp[0, 1] = float("inf")
    with pytest.raises(StableRLError, match="log_prob"):
        stablerl.compute_policy_loss(name, **{**b, "log_prob": lp.requires_grad_(True)}, **extra)
    if name == "erc":
        bad_old = extra["old_entropy"].clone()
        bad_old[0, 0] = float("inf")
        with pytest.raises(StableRLError, match="old_entropy"):
            stablerl.compute_policy_loss(name, **b, **{**extra, "old_entropy": bad_old})


@pytest.mark.parametrize(
    "name,key,value",
    [("steer", "token_weight_min", 0.0), ("steer", "token_weight_max", 0.5), ("erc", "entropy_mask_low", 1.2),
     ("erc", "entropy_mask_high", 0.9), ("erc", "base", "cispo"), ("entropic", "high_prob_thresh", 1.5),
     ("entropic", "entropy_control_i", -0.1), ("gtpo", "conflict_count", "both"), ("gtpo", "w_raw", -1.0)],
)
def test_bad_hyper_parameters(name, key, value):
    b = make_batch(B=2, T=3, seed=0)
    with pytest.raises(StableRLError, match=key):
        stablerl.compute_policy_loss(name, **b, **_inputs(name, 2, 3, dtype=torch.float32), **{key: value})


def test_gtpo_bad_token_ids():
    b = make_batch(B=2, T=3, seed=0)
    extra = _inputs("gtpo", 2, 3, dtype=torch.float32)
    with pytest.raises(StableRLError, match="token_ids"):
        stablerl.compute_policy_loss("gtpo", **b, **{**extra, "token_ids": extra["token_ids"].float()})
    neg = extra["token_ids"].clone()
    neg[0, 0] = -5
    with pytest.raises(StableRLError, match="token_ids"):
        stablerl.compute_policy_loss("gtpo", **b, **{**extra, "token_ids": neg})


def test_specs_and_unavailable_listings():
    specs = {s.name: s for s in stablerl.list_algorithms("policy_loss")}
    assert specs["steer"].status == "stable" and specs["erc"].status == "stable"
    assert specs["entropic"].status == "experimental" and specs["gtpo"].status == "experimental"
    assert specs["erc"].requires == ("entropy", "old_entropy")
    assert set(specs["gtpo"].requires) == {"token_ids", "index", "entropy"}
    for name, arxiv in [("st_ppo", "2511.20718"), ("haepo", "2508.18884"), ("sfpo", "2510.04072")]:
        s = specs[name]
        assert s.status == "unavailable" and s.fn is None and s.paper == arxiv and s.notes
        with pytest.raises(StableRLError, match="listed but not implemented") as err:
            stablerl.compute_policy_loss(name, **make_batch(B=2, T=3))
        assert s.notes in str(err.value)  # the error quotes the whole reason
    # the refusals of the two unread papers say what was searched and what is missing
    for name, missing in [("st_ppo", "what the correction normalises"), ("haepo", "how the weights meet the returns")]:
        assert "Searched for issue 16" in specs[name].notes and f"Missing: {missing}" in specs[name].notes
