"""The frameworks' built-ins stablerl now offers everywhere (issue 16): reference checks in float64 against
independent loop-by-loop computations written here, degenerate inputs, parameter validation, and BAPO's
paper-form statistic. Parity with the frameworks' own functions is in integrations_tests/{verl,trl,openrlhf}."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stablerl
from stablerl import compute_advantage, compute_policy_loss

F64 = torch.float64


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def loss_and_grad(name, b, **kw):
    lp = leaf(b["log_prob"])
    loss, metrics = compute_policy_loss(name, log_prob=lp, old_log_prob=b["old_log_prob"], advantages=b["advantages"],
                                        response_mask=b["response_mask"], **kw)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def batch(B=5, T=6, seed=0, spread=0.5, token_adv=True):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 2.5 - 0.05
    lp = (old + spread * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-4)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    adv = torch.randn(B, T, generator=g, dtype=F64) if token_adv else torch.randn(B, 1, generator=g, dtype=F64).expand(B, T)
    return {"log_prob": lp, "old_log_prob": old, "advantages": adv.clone() * mask, "response_mask": mask}


def token_mean_reference(b, per_token):
    """token-mean of a per-token loss given as a python function of (lp, old, A) -> scalar, with autograd."""
    lp = leaf(b["log_prob"])
    total, n = 0.0, 0
    B, T = lp.shape
    for i in range(B):
        for t in range(T):
            if b["response_mask"][i, t]:
                total = total + per_token(lp[i, t], b["old_log_prob"][i, t], b["advantages"][i, t])
                n += 1
    loss = total / n
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad


# ----------------------------------------------------------------------------- policy losses


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpg_loss_is_plain_policy_gradient(seed):
    b = batch(seed=seed)
    ref = token_mean_reference(b, lambda lp, old, a: -a * lp)
    got = loss_and_grad("gpg", b)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-12, atol=1e-12)


def _dppo_ref(kind, low, high, c):
    def per_token(lp, old, a):
        p, p_old = math.exp(lp.item()), math.exp(float(old))
        if kind == "tv":
            keep = (p - p_old <= high) if a > 0 else (p - p_old >= -low)
        else:
            kl = p_old * (float(old) - lp.item()) + (1 - p_old) * math.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
            keep = (kl <= high or p <= p_old) if a > 0 else (kl <= low or p >= p_old)
        w = min(math.exp(lp.item() - float(old)), c)
        return -a * w * lp * float(keep)
    return per_token


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", ["tv", "kl"])
def test_dppo_value_and_gradient(seed, kind):
    b = batch(seed=seed, spread=0.8)
    low, high, c = 0.05, 0.1, 1.5
    ref = token_mean_reference(b, _dppo_ref(kind, low, high, c))
    got = loss_and_grad(f"dppo_{kind}", b, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-12, atol=1e-12)
    assert 0 < float(got[2]["pg_clipfrac"]) < 1  # the region kept some tokens and dropped others
    # a dropped token gets exactly zero gradient
    assert (got[1][b["response_mask"]] == 0).any()


def test_dppo_tv_keeps_everything_inside_a_wide_region():
    b = batch(seed=3, spread=0.3)
    loss, grad, m = loss_and_grad("dppo_tv", b, clip_ratio_low=1.0, clip_ratio_high=1.0, clip_ratio_c=1e9)
    assert float(m["pg_clipfrac"]) == 0.0
    ref = token_mean_reference(b, lambda lp, old, a: -a * torch.exp(lp - old).detach() * lp)
    torch.testing.assert_close(loss, ref[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("beta", [0.1, 1.7])
def test_dro_value_and_gradient(beta):
    b = batch(seed=4)
    ref = token_mean_reference(b, lambda lp, old, a: -(a * lp - 0.5 * beta * (lp - old) ** 2))
    got = loss_and_grad("dro", b, dro_beta=beta)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_vespo_value_and_gradient(seed):
    b = batch(seed=seed, spread=0.15, token_adv=False)
    kp, lpos, kn, lneg = 2.0, 3.0, 3.0, 2.0
    mask = b["response_mask"]
    seq_log_w = ((b["log_prob"] - b["old_log_prob"]) * mask).sum(-1)

    def per_token_row(i):
        w = math.exp(min(max(float(seq_log_w[i]), math.log(1e-8)), 20.0))
        return w

    lp = leaf(b["log_prob"])
    total, n = 0.0, 0
    for i in range(lp.shape[0]):
        w = per_token_row(i)
        for t in range(lp.shape[1]):
            if mask[i, t]:
                a = float(b["advantages"][i, t])
                k, lam = (kp, lpos) if a >= 0 else (kn, lneg)
                phi = math.exp(lam + k * math.log(w) - lam * w)
                total = total - phi * a * lp[i, t]
                n += 1
    ref_loss = total / n
    (ref_grad,) = torch.autograd.grad(ref_loss, lp)
    got = loss_and_grad("vespo", b)
    torch.testing.assert_close(got[0], ref_loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], ref_grad, rtol=1e-12, atol=1e-12)
    assert float(got[2]["vespo/phi_seq_mean"]) != pytest.approx(1.0, abs=1e-6)


def test_vespo_folds_is_weights_into_the_sequence_ratio():
    b = batch(seed=5, spread=0.1, token_adv=False)
    mask = b["response_mask"]
    rho = torch.full(mask.shape, 1.1, dtype=F64)
    with_w = loss_and_grad("vespo", b, is_weights=rho)
    # the same as moving log rho into the old policy: w = prod r rho
    shifted = dict(b, old_log_prob=b["old_log_prob"] - math.log(1.1))
    lp = leaf(b["log_prob"])
    # the loss is -phi A log pi: shifting old_log_prob changes only phi, so the value must agree
    ref = compute_policy_loss("vespo", log_prob=lp, old_log_prob=shifted["old_log_prob"], advantages=b["advantages"],
                              response_mask=mask)[0]
    torch.testing.assert_close(with_w[0], ref.detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_luspo_is_gspo_with_length_scaled_sequences(seed):
    b = batch(seed=seed, spread=0.02, token_adv=False)
    lo, hi = 1e-3, 2e-3
    mask = b["response_mask"]
    lp = leaf(b["log_prob"])
    rows = []
    for i in range(lp.shape[0]):
        m = mask[i]
        L = int(m.sum())
        s = torch.exp(((lp[i] - b["old_log_prob"][i]) * m).sum() / L)
        a = float(b["advantages"][i, 0])
        l_i = torch.maximum(-a * s, -a * torch.clamp(s, 1 - lo, 1 + hi))
        rows.append(L * l_i)  # the sequence's tokens summed
    ref = torch.stack(rows).mean()
    (ref_grad,) = torch.autograd.grad(ref, lp)
    got = loss_and_grad("luspo", b, clip_ratio_low=lo, clip_ratio_high=hi)
    torch.testing.assert_close(got[0], ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], ref_grad, rtol=1e-10, atol=1e-12)
    assert float(got[2]["pg_clipfrac"]) > 0


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["clip_ratio_low", "clip_ratio_high", "clip_ratio_c"]),
       value=st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False))
def test_dppo_refuses_negative_thresholds(name, value):
    b = batch(seed=0)
    with pytest.raises(stablerl.StableRLError, match=name):
        loss_and_grad("dppo_tv", b, **{name: value})


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["k_pos", "lambda_pos", "k_neg", "lambda_neg"]),
       value=st.one_of(st.floats(max_value=-1e-9, allow_nan=False), st.just(float("nan")), st.just(float("inf"))))
def test_vespo_refuses_bad_shape_parameters(name, value):
    with pytest.raises(stablerl.StableRLError, match=name):
        loss_and_grad("vespo", batch(seed=0), **{name: value})


@settings(max_examples=30, deadline=None)
@given(beta=st.floats(max_value=0.0, allow_nan=False, allow_infinity=False))
def test_dro_refuses_non_positive_beta(beta):
    with pytest.raises(stablerl.StableRLError, match="dro_beta"):
        loss_and_grad("dro", batch(seed=0), dro_beta=beta)


# ----------------------------------------------------------------------------- estimators


def rewards(seed=0, B=8, T=6, token_rewards=False):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).to(F64)
    scores = torch.randint(0, 3, (B,), generator=g).to(F64) - 0.5
    r = torch.zeros(B, T, dtype=F64)
    r[torch.arange(B), lengths - 1] = scores
    if token_rewards:
        r = r + 0.2 * torch.randn(B, T, generator=g, dtype=F64) * mask
    index = [i // 3 for i in range(B)]  # groups of 3, 3 and 2
    return r, mask, index


def whiten_ref(x, mask, unbiased, clamp):
    vals = [float(x[i, t]) for i in range(x.shape[0]) for t in range(x.shape[1]) if mask[i, t]]
    n = len(vals)
    mu = sum(vals) / n
    var = sum((v - mu) ** 2 for v in vals) / (n - 1 if unbiased else n)
    rstd = 1 / math.sqrt(max(var, 1e-8) if clamp else var + 1e-8)
    return (x - mu) * rstd * mask


def returns_ref(r, mask, gamma, skip_masked):
    B, T = r.shape
    out = torch.zeros_like(r)
    for i in range(B):
        run = 0.0
        for t in reversed(range(T)):
            m = float(mask[i, t])
            new = float(r[i, t]) * m + gamma * run
            out[i, t] = new * m
            run = new if (m or not skip_masked) else run
    return out


def group_mean(scores, index):
    out = []
    for i, g in enumerate(index):
        members = [float(scores[j]) for j, h in enumerate(index) if h == g]
        out.append(0.0 if len(members) == 1 else sum(members) / len(members))
    return torch.tensor(out, dtype=F64)


@pytest.mark.parametrize("gamma", [1.0, 0.8])
def test_reinforce_plus_plus_reference(gamma):
    r, mask, index = rewards(seed=1, token_rewards=True)
    mask[:, 1] = 0  # an observation token: no reward, no discount (verl)
    mask[0, 0] = 1
    G = returns_ref(r, mask, gamma, skip_masked=True)
    a, ret = compute_advantage("reinforce_plus_plus", token_level_rewards=r, response_mask=mask, index=index, gamma=gamma)
    torch.testing.assert_close(ret, G, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a, whiten_ref(G, mask, unbiased=True, clamp=False), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gamma", [1.0, 0.7])
@pytest.mark.parametrize("norm", [True, False])
def test_openrlhf_reinforce_reference(gamma, norm):
    r, mask, index = rewards(seed=2, token_rewards=True)
    mask[:, 1] = 0
    G = returns_ref(r, mask, gamma, skip_masked=False)
    a, _ = compute_advantage("reinforce", token_level_rewards=r, response_mask=mask, index=index, gamma=gamma,
                             norm_adv_by_std_in_grpo=norm)
    want = whiten_ref(G, mask, unbiased=False, clamp=True)
    if not norm:
        n = mask.sum()
        want = (G - (G * mask).sum() / n) * mask
    torch.testing.assert_close(a, want, rtol=1e-12, atol=1e-12)


def test_reinforce_baselines_reference():
    r, mask, index = rewards(seed=3)
    scores = (r * mask).sum(-1)
    centred = (scores - group_mean(scores, index)).unsqueeze(-1) * mask
    a, _ = compute_advantage("reinforce_plus_plus_baseline", token_level_rewards=r, response_mask=mask, index=index)
    torch.testing.assert_close(a, whiten_ref(centred, mask, unbiased=True, clamp=False), rtol=1e-12, atol=1e-12)
    a, _ = compute_advantage("reinforce_baseline", token_level_rewards=r, response_mask=mask, index=index)
    torch.testing.assert_close(a, whiten_ref(centred, mask, unbiased=False, clamp=True), rtol=1e-12, atol=1e-12)
    a, ret = compute_advantage("flash_reinforce", token_level_rewards=r, response_mask=mask, index=index)
    torch.testing.assert_close(a, (scores - scores.mean()).unsqueeze(-1) * mask, rtol=1e-12, atol=1e-12)


def test_gpg_estimator_reference():
    r, mask, index = rewards(seed=4)
    scores = (r * mask).sum(-1)
    scores[1] = 0.0
    r[1] = 0.0
    alpha = len(scores) / int((scores != 0).sum())
    a, _ = compute_advantage("gpg", token_level_rewards=r, response_mask=mask, index=index, f_norm=2.0)
    want = (alpha * (scores - group_mean(scores, index)) / 2.0).unsqueeze(-1) * mask
    torch.testing.assert_close(a, want, rtol=1e-12, atol=1e-12)
    assert alpha != 1.0


def test_remax_reference():
    r, mask, index = rewards(seed=5, token_rewards=True)
    base = torch.linspace(-1, 1, r.shape[0], dtype=F64)
    a, ret = compute_advantage("remax", token_level_rewards=r, response_mask=mask, index=index, reward_baselines=base)
    G = returns_ref(r, mask, 1.0, skip_masked=False)
    torch.testing.assert_close(ret, G, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a, (G - base.unsqueeze(-1)) * mask, rtol=1e-12, atol=1e-12)
    with pytest.raises(stablerl.StableRLError, match=r"input .reward_baselines. has shape \(3,\)"):
        compute_advantage("remax", token_level_rewards=r, response_mask=mask, index=index, reward_baselines=base[:3])
    with pytest.raises(stablerl.StableRLError, match="non-finite"):
        compute_advantage("remax", token_level_rewards=r, response_mask=mask, index=index,
                          reward_baselines=torch.full_like(base, float("nan")))


@pytest.mark.parametrize("name", ["reinforce_plus_plus", "reinforce_plus_plus_baseline", "reinforce",
                                  "reinforce_baseline", "flash_reinforce", "gpg"])
def test_whole_batch_estimators_on_degenerate_batches(name):
    r, mask, index = rewards(seed=6)
    # an all-masked batch: zeros, no NaN
    a, _ = compute_advantage(name, token_level_rewards=r, response_mask=torch.zeros_like(mask), index=index)
    assert torch.equal(a, torch.zeros_like(a))
    # all-equal rewards: finite (whitening of a constant gives 0)
    eq = torch.zeros_like(r)
    eq[:, 0] = 0.7
    a, _ = compute_advantage(name, token_level_rewards=eq, response_mask=mask, index=index)
    assert torch.isfinite(a).all()


def test_gamma_is_validated():
    r, mask, index = rewards()
    with pytest.raises(stablerl.StableRLError, match="gamma must be in"):
        compute_advantage("reinforce_plus_plus", token_level_rewards=r, response_mask=mask, index=index, gamma=1.5)


# ----------------------------------------------------------------------------- statuses


def test_reinforce_ada_is_experimental_and_says_why():
    spec = stablerl.get_spec("advantage_estimator", "reinforce_ada")
    assert spec.status == stablerl.EXPERIMENTAL
    assert "adaptive sampler" in spec.notes and "MissingInputError" in spec.notes


def _bapo_bounds(contribution, seed):
    b = batch(seed=seed, spread=0.5)
    _, _, m = loss_and_grad("bapo", b, contribution=contribution)
    return float(m["bapo/c_low"]), float(m["bapo/c_high"])


def test_bapo_paper_form_moves_c_low_where_the_code_form_cannot():
    """The code form's c_low is always the start or the end of its range (raising it never helps); the paper
    form stops in between on some batches."""
    code = [_bapo_bounds("code", s)[0] for s in range(40)]
    paper = [_bapo_bounds("paper", s)[0] for s in range(40)]
    assert set(round(c, 6) for c in code) <= {0.6, 0.9}
    assert any(0.6 + 1e-9 < c < 0.9 - 1e-9 for c in paper), paper


def test_bapo_paper_statistic_by_hand():
    # tokens: A>0 r=1.1 and r=2.0, A<0 r=0.62 and r=0.95; paper form: pos(c_high=1.2) = 1.1, neg(c_low=0.6) = 1.57
    old = torch.full((1, 4), -1.0, dtype=F64)
    r = torch.tensor([[1.1, 2.0, 0.62, 0.95]], dtype=F64)
    b = {"log_prob": old + torch.log(r), "old_log_prob": old, "advantages": torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=F64),
         "response_mask": torch.ones(1, 4, dtype=torch.bool)}
    # target 1.0: c_low 0.6 -> 0.65 drops the 0.62 token (neg 0.95, pos/neg = 1.158 >= 1), c_high stays 1.2
    _, _, m = loss_and_grad("bapo", b, contribution="paper", adv_ratio_target=1.0)
    assert float(m["bapo/c_low"]) == pytest.approx(0.65)
    assert float(m["bapo/c_high"]) == pytest.approx(1.2)
    assert float(m["bapo/pos_neg_ratio"]) == pytest.approx(1.1 / 0.95, rel=1e-6)
    with pytest.raises(stablerl.StableRLError, match="contribution must be one of"):
        loss_and_grad("bapo", b, contribution="book")


# ----------------------------------------------------------------------------- rollout corrections


def _correction(name, b, rollout, **params):
    from stablerl.contracts import PolicyLossBatch

    spec = stablerl.get_spec("rollout_correction", name)
    batch_ = PolicyLossBatch(log_prob=b["log_prob"], old_log_prob=b["old_log_prob"], advantages=b["advantages"],
                             response_mask=b["response_mask"].to(F64), rollout_log_prob=rollout)
    return spec.fn(batch_, spec.params(**params), stablerl.Context())


def test_kl_rs_by_hand():
    old = torch.tensor([[-1.0, -1.0, -1.0]], dtype=F64)
    log_rho = torch.tensor([[0.1, -0.3, 0.5]], dtype=F64)  # k2 = 0.005, 0.045, 0.125
    b = {"log_prob": old, "old_log_prob": old, "advantages": torch.ones_like(old),
         "response_mask": torch.tensor([[1, 1, 0]], dtype=torch.bool)}
    w, _ = _correction("kl_rs", b, old - log_rho, estimator="k2", level="token", threshold=0.01)
    assert w.tolist() == [[1.0, 0.0, 0.0]]
    # seq_max over the valid tokens only (the padded 0.125 does not count): 0.045 <= 0.05 keeps the row
    w, _ = _correction("kl_rs", b, old - log_rho, estimator="k2", level="seq_max", threshold=0.05)
    assert w.tolist() == [[1.0, 1.0, 0.0]]
    k3 = math.exp(-0.3) - 1 + 0.3  # 0.0408
    w, _ = _correction("kl_rs", b, old - log_rho, estimator="k3", level="seq_sum", threshold=0.0052 + k3)
    assert w.tolist() == [[1.0, 1.0, 0.0]]
    with pytest.raises(stablerl.StableRLError, match="level must be one of"):
        stablerl.get_spec("rollout_correction", "kl_rs").params(level="seq_min").validate()


def test_divergence_is_by_hand():
    p_roll, q_train = 0.5, 0.6
    b = {"log_prob": torch.log(torch.tensor([[q_train]], dtype=F64)), "old_log_prob": torch.log(torch.tensor([[q_train]], dtype=F64)),
         "advantages": torch.ones(1, 1, dtype=F64), "response_mask": torch.ones(1, 1, dtype=torch.bool)}
    rollout = torch.log(torch.tensor([[p_roll]], dtype=F64))
    bkl = p_roll * math.log(p_roll / q_train) + (1 - p_roll) * math.log((1 - p_roll) / (1 - q_train))
    w, m = _correction("divergence_is", b, rollout, gating="binary_kl", level="token", threshold=bkl * 1.01)
    assert float(w) == pytest.approx(q_train / p_roll)  # kept: the token IS ratio
    w, _ = _correction("divergence_is", b, rollout, gating="binary_kl", level="token", threshold=bkl * 0.99)
    assert float(w) == 0.0
    w, _ = _correction("divergence_is", b, rollout, gating="tv", level="sequence", threshold=0.09)
    assert float(w) == 0.0  # |0.5 - 0.6| = 0.1 > 0.09


def test_grpo_batch_std_reference():
    r, mask, index = rewards(seed=7)
    scores = (r * mask).sum(-1)
    want = (scores - group_mean(scores, index)) / (scores.std() + 1e-4)
    a, _ = compute_advantage("grpo_batch_std", token_level_rewards=r, response_mask=mask, index=index)
    torch.testing.assert_close(a, want.unsqueeze(-1) * mask, rtol=1e-12, atol=1e-12)


def test_optimal_token_baseline_by_hand():
    # one group of two: r = [1 on t=1], [0 on t=0]; lengths 2 and 1; old pi = 0.5, sum pi^2 = 0.5 -> w = 0.5
    r = torch.tensor([[0.0, 1.0], [0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=F64)
    old = torch.full((2, 2), math.log(0.5), dtype=F64)
    spp = torch.full((2, 2), 0.5, dtype=F64)
    a, ret = compute_advantage("optimal_token_baseline", token_level_rewards=r, response_mask=mask, index=[0, 0],
                               old_log_prob=old, sum_pi_squared=spp, epsilon=0.0)
    # G = [[1, 1], [0, 0]], W = [[0.5, 1.0], [0.5, 0]]; B_0 = (1*0.5 + 0)/(0.5+0.5) = 0.5; t=1: zero tail (row 0 is
    # the unique longest, second length 1) -> B = 0
    torch.testing.assert_close(a, torch.tensor([[0.5, 1.0], [-0.5, 0.0]], dtype=F64), rtol=0, atol=1e-15)
    a, _ = compute_advantage("optimal_token_baseline", token_level_rewards=r, response_mask=mask, index=[0, 0],
                             old_log_prob=old, sum_pi_squared=spp, epsilon=0.0, handle_zero_tail=False)
    assert float(a[0, 1]) == 0.0  # B_1 = 1*1.0/1.0 from row 0 alone
    with pytest.raises(stablerl.MissingInputError, match="sum_pi_squared"):
        compute_advantage("optimal_token_baseline", token_level_rewards=r, response_mask=mask, index=[0, 0],
                          old_log_prob=old)


def test_tir_optimal_token_baseline_by_hand():
    # one group of two; row 0 has an observation token at t=1: its generated tokens are t=0 and t=2, which the
    # multi-turn variant aligns with row 1's t=0 and t=1 (the plain one aligns t=2 with row 1's t=2)
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
    old = torch.full((2, 3), math.log(0.5), dtype=F64)
    spp = torch.full((2, 3), 0.5, dtype=F64)  # w = 0.5 per valid token
    a, ret = compute_advantage("tir_optimal_token_baseline", token_level_rewards=r, response_mask=mask, index=[0, 0],
                               old_log_prob=old, sum_pi_squared=spp, epsilon=0.0)
    # packed: G = [[1, 1], [2, 2]], W = [[0.5, 1.0], [0.5, 1.0]]; B_0 = (0.5 + 1.0)/1.0 = 1.5, B_1 = (1 + 2)/2 = 1.5
    torch.testing.assert_close(a, torch.tensor([[-0.5, 0.0, -0.5], [0.5, 0.5, 0.0]], dtype=F64), rtol=0, atol=1e-15)
    torch.testing.assert_close(ret, torch.tensor([[1.0, 0.0, 1.0], [2.0, 2.0, 0.0]], dtype=F64), rtol=0, atol=0)
    # the plain baseline aligns row 0's t=2 with nothing (row 1 has no t=2): a different advantage there
    plain, _ = compute_advantage("optimal_token_baseline", token_level_rewards=r, response_mask=mask, index=[0, 0],
                                 old_log_prob=old, sum_pi_squared=spp, epsilon=0.0)
    assert float(plain[0, 2]) != -0.5
    # contiguous responses (no masked span inside): the same as optimal_token_baseline
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
    kw = dict(token_level_rewards=r, response_mask=mask, index=[0, 0], old_log_prob=old, sum_pi_squared=spp)
    torch.testing.assert_close(compute_advantage("tir_optimal_token_baseline", **kw)[0],
                               compute_advantage("optimal_token_baseline", **kw)[0], rtol=0, atol=0)
