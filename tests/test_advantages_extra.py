"""Advantage estimators s_grpo, riskpo, krpo, reinforce_ada, empg, grpo_passk; unavailable salt / sgpo.

Every value is checked against hand-computed numbers (the catalogue's worked examples) or an
independent loop written here with python floats / numpy; degenerate inputs (group of one,
all-equal rewards, empty batch, masked rows, non-finite input) and bf16 are covered too.
"""

import math
import statistics

import numpy as np
import pytest
import torch
from conftest import adv, per_seq

import stablerl
from stablerl import Context, MissingInputError, StableRLError
from stablerl.testing import check_advantage_estimator

NAMES = ("s_grpo", "riskpo", "krpo", "reinforce_ada", "empg", "grpo_passk")


def rewards_from_scores(scores, lengths=None, T=None, dtype=torch.float64):
    """Outcome rewards on the last valid token of right-padded responses, and the mask."""
    if lengths is None:
        lengths = [3] * len(scores)
    lengths = torch.as_tensor(lengths)
    T = T or max(int(lengths.max()), 1) if len(lengths) else (T or 1)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(dtype)
    r = torch.zeros(len(scores), T, dtype=dtype)
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    r[rows, lengths[rows] - 1] = torch.as_tensor(scores, dtype=dtype)[rows]
    return r, mask


def run(name, scores, ids, **kw):
    r, mask = rewards_from_scores(scores)
    return per_seq(adv(name, r, mask, ids, **kw), mask)


def counts_for(ids, pos, neg):
    return {"pos_count": torch.tensor([pos[u] for u in ids]), "neg_count": torch.tensor([neg[u] for u in ids])}


def empg_inputs(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    turn_ids = (torch.arange(T) // 3).unsqueeze(0).expand(B, T).clone()
    return {"entropy": entropy, "turn_ids": turn_ids}


def default_kwargs(name, ids, B, T):
    if name == "reinforce_ada":
        return {"extras": counts_for(ids, {u: 3 for u in ids}, {u: 5 for u in ids})}
    if name == "empg":
        return empg_inputs(B, T)
    return {}


# ----------------------------------------------------------------------------- S-GRPO


def s_grpo_reference(scores, ids, p=0.1, eps=1e-8):
    """The reference's group_weight(n, k, p) times GRPO, written out per group (python floats)."""
    groups = {}
    for i, u in enumerate(ids):
        groups.setdefault(u, []).append(i)
    out = [0.0] * len(scores)
    for members in groups.values():
        s = [float(scores[i]) for i in members]
        n, k = len(s), sum(1 for x in s if x > 0)
        r_bar = k / n
        t = min(1.0, max(0.0, (r_bar - p) / (1 - 2 * p)))
        w = (1 - 2 * p) * t * (1 - t) / (math.sqrt(r_bar * (1 - r_bar) + 1e-8) * math.sqrt(t * (1 - t) + 1e-8))
        sd = statistics.stdev(s) if n > 1 else 1.0
        for j, i in enumerate(members):
            out[i] = w * (s[j] - statistics.fmean(s)) / (sd + eps)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("p,expected", [
    (0.10, [0, .421, .721, .785, .80, .785, .721, .421, 0]),
    (0.15, [0, 0, .566, .675, .70, .675, .566, 0, 0]),
])
def test_s_grpo_worked_example_weights(p, expected):
    from stablerl.plugins.s_grpo import noise_weight

    k = torch.arange(9)
    w = noise_weight(torch.full((9,), 8), k, p)
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=6e-4)
    # the same weights through the estimator: A = w * (r - k/8) / (std + 1e-8) in a group of 8
    for kk in range(9):
        scores = [1.0] * kk + [0.0] * (8 - kk)
        a = run("s_grpo", scores, [0] * 8, drgrpo_p=p)
        sd = statistics.stdev(scores)
        want = [float(w[kk]) * (x - kk / 8) / (sd + 1e-8) for x in scores]
        torch.testing.assert_close(a, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # rare-success groups are dropped at p = 0.15 (1/8 and 7/8), kept at p = 0.10
    assert run("s_grpo", [1.0] + [0.0] * 7, [0] * 8, drgrpo_p=0.15).abs().max() == 0
    assert run("s_grpo", [1.0] + [0.0] * 7, [0] * 8, drgrpo_p=0.10).abs().max() > 1


@pytest.mark.parametrize("seed", range(4))
def test_s_grpo_matches_reference_loop_mixed_groups(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 6, (40,), generator=g).tolist()
    scores = torch.randint(0, 2, (40,), generator=g).double().tolist()
    for p in (0.0, 0.1, 0.15, 0.3):
        torch.testing.assert_close(run("s_grpo", scores, ids, drgrpo_p=p), s_grpo_reference(scores, ids, p),
                                   rtol=1e-10, atol=1e-10)


def test_s_grpo_p_zero_is_grpo_with_its_epsilon():
    scores, ids = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0], [0, 0, 0, 1, 1, 1]
    # p = 0: w = t(1-t)/(t(1-t) + 1e-8) ~ 1, so S-GRPO ~ GRPO
    torch.testing.assert_close(run("s_grpo", scores, ids, drgrpo_p=0.0), run("grpo", scores, ids, epsilon=1e-8),
                               rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- KRPO


def krpo_reference(scores, ids, Q=1e-5, R=1e-2, eps=1e-8):
    groups = {}
    for i, u in enumerate(ids):
        groups.setdefault(u, []).append(i)
    out = [0.0] * len(scores)
    for members in groups.values():
        x, P = 0.0, 1.0
        for i in members:
            Pm = P + Q
            K = Pm / (Pm + R)
            x = x + K * (float(scores[i]) - x)
            P = (1 - K) * Pm
            out[i] = (float(scores[i]) - x) / (math.sqrt(P) + eps)
    return torch.tensor(out, dtype=torch.float64)


def test_krpo_all_equal_group_is_not_zero_catalogue_example():
    a = run("krpo", [1.0] * 4, [0] * 4)
    # x_1 = K_1 = 1.00001/1.01001 ~ 0.990, P_1 = (1 - K_1) 1.00001, A_1 = (1 - x_1)/sqrt(P_1) ~ 0.0995
    K1 = 1.00001 / 1.01001
    assert abs(float(a[0]) - (1 - K1) / (math.sqrt((1 - K1) * 1.00001) + 1e-8)) < 1e-12
    assert abs(float(a[0]) - 0.0995) < 1e-4
    assert bool((a > 0).all())
    torch.testing.assert_close(a, krpo_reference([1.0] * 4, [0] * 4), rtol=1e-10, atol=1e-10)
    assert run("krpo", [0.0] * 4, [0] * 4).abs().max() == 0  # all zero: x stays 0


@pytest.mark.parametrize("seed", range(3))
def test_krpo_matches_reference_loop_and_is_order_dependent(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 5, (30,), generator=g).tolist()
    scores = (torch.rand(30, generator=g, dtype=torch.float64) * 2 - 0.5).tolist()
    for Q, R in ((1e-5, 1e-2), (1e-2, 0.5)):
        torch.testing.assert_close(run("krpo", scores, ids, process_var=Q, meas_var=R),
                                   krpo_reference(scores, ids, Q, R), rtol=1e-10, atol=1e-10)
    # reversing the rows of the batch reverses each group's rollout order: a different result
    a = run("krpo", scores, ids)
    rev = run("krpo", scores[::-1], ids[::-1]).flip(0)
    assert not torch.allclose(a, rev)
    torch.testing.assert_close(rev, krpo_reference(scores[::-1], ids[::-1]).flip(0), rtol=1e-10, atol=1e-10)


def test_krpo_whole_groups_reordered_is_equivariant():
    scores, ids = [1.0, 0.0, 0.5, 0.2, 1.0, 0.0], ["a", "b", "a", "b", "a", "b"]
    a = run("krpo", scores, ids)
    order = [1, 3, 5, 0, 2, 4]  # group b first, each group keeps its own order
    b = run("krpo", [scores[i] for i in order], [ids[i] for i in order])
    torch.testing.assert_close(b, a[order], rtol=0, atol=0)


# ----------------------------------------------------------------------------- grpo_passk


def test_grpo_passk_hand_values():
    scores, ids = [0.0, 2.0, 1.0, 0.5, 3.0, 3.0, 1.0], [0, 0, 0, 1, 1, 1, 1]
    a = run("grpo_passk", scores, ids)
    sd0 = statistics.stdev([0.0, 2.0, 1.0])
    want = [0.0, (2.0 - 1.0) / (sd0 + 1e-6), 0.0, 0.0, 0.0, 0.0, 0.0]  # group 1: tied max -> 0 everywhere
    torch.testing.assert_close(a, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    a = run("grpo_passk", scores, ids, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(a, torch.tensor([0, 1.0, 0, 0, 0, 0, 0], dtype=torch.float64), rtol=0, atol=0)
    # all equal: 0
    assert run("grpo_passk", [1.0] * 4, [0] * 4).abs().max() == 0


def test_grpo_passk_group_of_one_raises():
    with pytest.raises(StableRLError, match="at least 2 responses per group"):
        run("grpo_passk", [1.0, 0.0, 1.0], [0, 0, 1])


@pytest.mark.parametrize("seed", range(3))
def test_grpo_passk_matches_reference_loop(seed):
    g = torch.Generator().manual_seed(seed)
    ids = (torch.arange(24) % 6).tolist()
    scores = torch.randint(0, 4, (24,), generator=g).double().tolist()
    groups = {}
    for i, u in enumerate(ids):
        groups.setdefault(u, []).append(i)
    want = [0.0] * 24
    for members in groups.values():
        s = sorted((scores[i], i) for i in members)
        gap = s[-1][0] - s[-2][0]
        want[s[-1][1]] = gap / (statistics.stdev([scores[i] for i in members]) + 1e-6)
    torch.testing.assert_close(run("grpo_passk", scores, ids), torch.tensor(want, dtype=torch.float64),
                               rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- Reinforce-Ada


def test_reinforce_ada_hand_values():
    scores, ids = [1.0, 0.0, 1.0, 0.0, 0.3], ["a", "a", "b", "b", "c"]
    pos, neg = {"a": 3, "b": 1, "c": 0}, {"a": 13, "b": 0, "c": 1}
    extras = counts_for(ids, pos, neg)
    a = run("reinforce_ada", scores, ids, extras=extras)
    # a: p = 3/16; b: N = 1 -> mean 0; c: N = 1 -> mean 0 (default: no std division)
    torch.testing.assert_close(a, torch.tensor([1 - 3 / 16, -3 / 16, 1.0, 0.0, 0.3], dtype=torch.float64),
                               rtol=0, atol=1e-15)
    a = run("reinforce_ada", scores, ids, extras=extras, norm_adv_by_std_in_grpo=True)
    sd = math.sqrt(16 * (3 / 16) * (13 / 16) / 15)  # unbiased std of 3 ones and 13 zeros
    assert abs(sd - statistics.stdev([1.0] * 3 + [0.0] * 13)) < 1e-12
    want = [(1 - 3 / 16) / (sd + 1e-6), (-3 / 16) / (sd + 1e-6), 1 / (1 + 1e-6), 0.0, 0.3 / (1 + 1e-6)]
    torch.testing.assert_close(a, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    # all positive: std 0 is clamped to epsilon before adding epsilon
    a = run("reinforce_ada", [1.0, 1.0], [0, 0], extras={"pos_count": torch.tensor([4, 4]), "neg_count": torch.tensor([0, 0])},
            norm_adv_by_std_in_grpo=True)
    assert a.abs().max() == 0


def test_reinforce_ada_uses_counts_not_the_balanced_batch():
    scores, ids = [1.0, 1.0, 0.0, 0.0], [0] * 4  # balanced kept subset: in-batch mean 0.5
    a = run("reinforce_ada", scores, ids, extras={"pos_count": torch.full((4,), 2), "neg_count": torch.full((4,), 30)})
    torch.testing.assert_close(a, torch.tensor([1 - 2 / 32] * 2 + [-2 / 32] * 2, dtype=torch.float64))
    local = run("reinforce_ada", scores, ids, global_stat_est=False)
    torch.testing.assert_close(local, run("dr_grpo", scores, ids), rtol=0, atol=0)
    local = run("reinforce_ada", scores, ids, global_stat_est=False, norm_adv_by_std_in_grpo=True)
    torch.testing.assert_close(local, run("grpo", scores, ids), rtol=0, atol=0)


def test_reinforce_ada_bad_counts():
    scores, ids = [1.0, 0.0], [0, 0]
    with pytest.raises(MissingInputError, match="pos_count"):
        run("reinforce_ada", scores, ids)
    with pytest.raises(StableRLError, match="differs between responses of the same prompt"):
        run("reinforce_ada", scores, ids, extras={"pos_count": torch.tensor([1, 2]), "neg_count": torch.tensor([1, 1])})
    with pytest.raises(StableRLError, match="non-negative integer"):
        run("reinforce_ada", scores, ids, extras={"pos_count": torch.tensor([-1, -1]), "neg_count": torch.tensor([1, 1])})
    with pytest.raises(StableRLError, match="expected \\[2\\]"):
        run("reinforce_ada", scores, ids, extras={"pos_count": torch.tensor([1]), "neg_count": torch.tensor([1, 1])})


# ----------------------------------------------------------------------------- RiskPO


def np_quantile(values, q):
    return float(np.quantile(np.array(values, dtype=np.float64), q, method="linear"))


def riskpo_reference(scores, qids, bids, alpha=0.2, beta=0.9, w_mix=1.5, mode="std", mix=True, norm=True, eps=1e-6):
    """Bundles -> papers (j-th response of every question, row order) -> mixed VaR -> credit (python floats)."""
    q_rows = {}
    for i, q in enumerate(qids):
        q_rows.setdefault(q, []).append(i)
    q_std = {q: (statistics.stdev([scores[i] for i in r]) if len(r) > 1 else 1.0) for q, r in q_rows.items()}
    q_std = {q: (s if s > 1e-3 else 1.0) for q, s in q_std.items()}
    q_mean = {q: statistics.fmean([scores[i] for i in r]) for q, r in q_rows.items()}
    b_questions = {}
    for q, b in zip(qids, bids):
        b_questions.setdefault(b, [])
        if q not in b_questions[b]:
            b_questions[b].append(q)
    out = [0.0] * len(scores)
    for b, qs in b_questions.items():
        n = min(len(q_rows[q]) for q in qs)
        papers = [[q_rows[q][j] for q in qs] for j in range(n)]
        S = [sum(scores[i] for i in rows) for rows in papers]
        if n == 1:
            a = bb = S[0]
            sd = 1.0
        else:
            a, bb, sd = np_quantile(S, alpha), np_quantile(S, beta), statistics.stdev(S)
        for rows, s in zip(papers, S):
            g = (max(s - a, 0) - max(s - bb, 0) + a - bb) / (beta - alpha + eps)
            if mix:
                c = -max(a - s, 0) / (alpha + eps)
                g = (w_mix * c + g) / (w_mix + 1)
            if norm:
                g = g / (sd + eps)
            ratios = [scores[i] - q_mean[qids[i]] for i in rows]
            for i, ratio in zip(rows, ratios):
                if mode == "uniform":
                    out[i] = g
                elif mode == "std":
                    out[i] = g / (q_std[qids[i]] + eps)
                elif mode == "score":
                    out[i] = (0.5 if scores[i] > 0 else 1.5) * g
                else:
                    total = sum(ratios)
                    out[i] = g * ratio / total if abs(total) > 1e-6 else g / len(rows)
    return torch.tensor(out, dtype=torch.float64)


def test_riskpo_hand_values_one_bundle():
    # question 0: [1, 0, 1], question 1: [0, 0, 1] (rows interleaved); papers S = [1, 0, 2]
    scores = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    qids = [0, 1, 0, 1, 0, 1]
    a = run("riskpo", scores, qids, extras={"bundle_index": [7] * 6}, credit_assign_mode="uniform")
    qa, qb = 0.4, 1.8  # linear quantiles of {0, 1, 2} at 0.2 and 0.9
    d = 0.7 + 1e-6
    g = {1.0: (0.6 - 0 + qa - qb) / d, 0.0: (qa - qb) / d, 2.0: (1.6 - 0.2 + qa - qb) / d}
    c = {1.0: 0.0, 0.0: -0.4 / (0.2 + 1e-6), 2.0: 0.0}
    A = {s: (1.5 * c[s] + g[s]) / 2.5 / (1.0 + 1e-6) for s in g}  # std of {1, 0, 2} is 1
    want = [A[1.0], A[1.0], A[0.0], A[0.0], A[2.0], A[2.0]]
    torch.testing.assert_close(a, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert bool((a <= 1e-12).all()), "released flags: every advantage <= 0 (up to rounding)"
    # default credit 'std': divide by each question's reward std (both 0.57735)
    a_std = run("riskpo", scores, qids, extras={"bundle_index": [7] * 6})
    sd = statistics.stdev([1.0, 0.0, 1.0])
    torch.testing.assert_close(a_std, torch.tensor(want, dtype=torch.float64) / (sd + 1e-6), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", ["std", "uniform", "score", "sum-mean"])
def test_riskpo_matches_reference_loop(seed, mode):
    g = torch.Generator().manual_seed(seed)
    qids, bids = [], []
    for q in range(7):
        k = int(torch.randint(1, 6, (1,), generator=g))
        qids += [q] * k
        bids += [q // 3] * k
    perm = torch.randperm(len(qids), generator=g).tolist()
    qids, bids = [qids[i] for i in perm], [bids[i] for i in perm]
    scores = [float(x) for x in torch.randint(0, 3, (len(qids),), generator=g) * 0.5]
    for mix, norm in ((True, True), (False, False)):
        a = run("riskpo", scores, qids, extras={"bundle_index": torch.tensor(bids)}, credit_assign_mode=mode,
                use_mixing_risk_measure=mix, norm_adv_by_std_in_grpo=norm)
        torch.testing.assert_close(a, riskpo_reference(scores, qids, bids, mode=mode, mix=mix, norm=norm),
                                   rtol=1e-10, atol=1e-10)


def test_riskpo_conventions():
    # no bundle_index: every question is its own bundle (papers = its responses)
    scores, qids = [1.0, 0.0, 0.0, 1.0, 1.0], [0, 0, 0, 1, 1]
    torch.testing.assert_close(run("riskpo", scores, qids),
                               run("riskpo", scores, qids, extras={"bundle_index": qids}), rtol=0, atol=0)
    # questions with more responses than the bundle's smallest: the extra ones get 0
    a = run("riskpo", [1.0, 0.0, 1.0, 1.0, 0.0], [0, 0, 0, 1, 1], extras={"bundle_index": [0] * 5})
    assert a[2] == 0 and bool((a[[0, 1, 3, 4]] != 0).any())
    # all papers equal / one paper / all rewards equal: 0
    assert run("riskpo", [1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1], extras={"bundle_index": [0] * 4}).abs().max() == 0
    assert run("riskpo", [1.0, 0.0], [0, 1], extras={"bundle_index": [0, 0]}).abs().max() == 0
    assert run("riskpo", [1.0] * 6, [0, 0, 0, 1, 1, 1]).abs().max() == 0
    with pytest.raises(StableRLError, match="different bundle_index"):
        run("riskpo", scores, qids, extras={"bundle_index": [0, 0, 1, 1, 1]})
    with pytest.raises(StableRLError, match="quantile_down < quantile_up"):
        run("riskpo", scores, qids, quantile_down=0.9, quantile_up=0.2)
    with pytest.raises(StableRLError, match="credit_assign_mode"):
        run("riskpo", scores, qids, credit_assign_mode="mean")


# ----------------------------------------------------------------------------- EMPG


def empg_reference(scores, ids, entropy, turn_ids, mask, k=1.0, k_f=1.0, zeta=0.1, eps=1e-6):
    """Steps, min-max, g, next-step bonus, zero-mean shift, written out with python loops."""
    base = [float(x) for x in stablerl.compute_advantage(
        "grpo", token_level_rewards=rewards_from_scores(scores, mask.sum(-1).long().tolist(), T=mask.shape[1])[0],
        response_mask=mask, index=ids, epsilon=eps)[0].sum(-1) / mask.sum(-1).clamp(min=1)]
    steps = []  # (row, turn, [token positions])
    for i in range(mask.shape[0]):
        turns = sorted({int(turn_ids[i, t]) for t in range(mask.shape[1]) if mask[i, t] > 0})
        for tu in turns:
            steps.append((i, tu, [t for t in range(mask.shape[1]) if mask[i, t] > 0 and int(turn_ids[i, t]) == tu]))
    H = [statistics.fmean(float(entropy[i, t]) for t in pos) for i, _, pos in steps]
    lo, hi = min(H), max(H)
    Hn = [(h - lo) / (hi - lo + 1e-8) for h in H]
    e = [math.exp(-k * h) for h in Hn]
    em = statistics.fmean(e)
    A = []
    for j, (i, tu, pos) in enumerate(steps):
        nxt = j + 1 < len(steps) and steps[j + 1][0] == i
        A.append(e[j] / em * base[i] + (zeta * math.exp(-k_f * Hn[j + 1]) if nxt else 0.0))
    mean = statistics.fmean(A)
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for (i, tu, pos), a in zip(steps, A):
        for t in pos:
            out[i, t] = a - mean
    return out


def empg_case(seed=0, B=8, T=10):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    scores = torch.randint(0, 2, (B,), generator=g).double().tolist()
    r, mask = rewards_from_scores(scores, lengths.tolist(), T=T)
    ids = [i // 4 for i in range(B)]
    entropy = torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    turn = torch.randint(0, 3, (B, T), generator=g).sort(-1).values  # monotone steps, gaps allowed
    turn[~mask.bool()] = -1
    return scores, ids, r, mask, entropy, turn


@pytest.mark.parametrize("seed", range(4))
def test_empg_matches_reference_loop(seed):
    scores, ids, r, mask, entropy, turn = empg_case(seed)
    for kw in ({}, {"k": 2.0, "k_f": 0.5, "zeta": 0.05}):
        a = adv("empg", r, mask, ids, entropy=entropy, turn_ids=turn, **kw)
        ref_kw = {{"k": "k", "k_f": "k_f", "zeta": "zeta"}[k]: v for k, v in kw.items()}
        torch.testing.assert_close(a, empg_reference(scores, ids, entropy, turn, mask, **ref_kw), rtol=1e-10, atol=1e-10)


def test_empg_hand_values_two_steps():
    # one response, two steps with entropies 1 and 3 -> H^ = [0, 1 - ~]; base A from a group of two
    T = 4
    r, mask = rewards_from_scores([1.0, 0.0], [4, 4], T=T)
    entropy = torch.tensor([[1.0, 1.0, 3.0, 3.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    turn = torch.tensor([[0, 0, 1, 1], [0, 0, 0, 0]])
    a = adv("empg", r, mask, [0, 0], entropy=entropy, turn_ids=turn)
    base = 0.5 / (statistics.stdev([1.0, 0.0]) + 1e-6)
    h1 = 2 / (2 + 1e-8)
    e = [1.0, math.exp(-h1), 1.0]  # steps: (0, 0), (0, 1), (1, 0)
    em = sum(e) / 3
    A = [e[0] / em * base + 0.1 * math.exp(-h1), e[1] / em * base, -e[2] / em * base]  # bonus: next step's f
    m = sum(A) / 3
    want = torch.tensor([[A[0] - m] * 2 + [A[1] - m] * 2, [A[2] - m] * 4], dtype=torch.float64)
    torch.testing.assert_close(a, want, rtol=1e-12, atol=1e-12)
    assert abs(sum(x - m for x in A)) < 1e-12  # zero mean over steps (not over tokens)


def test_empg_inputs_and_errors():
    scores, ids, r, mask, entropy, turn = empg_case(1)
    # without turn_ids a step is a contiguous run of trained tokens: here each response is one step (no masked
    # tool segment), which the reference loop reproduces with turn ids 0 on every trained token
    runs = stablerl.ops.mask_runs(mask)
    torch.testing.assert_close(adv("empg", r, mask, ids, entropy=entropy),
                               empg_reference(scores, ids, entropy, runs, mask), rtol=1e-10, atol=1e-10)
    assert not torch.allclose(adv("empg", r, mask, ids, entropy=entropy), adv("empg", r, mask, ids, entropy=entropy, turn_ids=turn))
    with pytest.raises(MissingInputError, match="entropy"):
        adv("empg", r, mask, ids, turn_ids=turn)
    with pytest.raises(StableRLError, match=r"input .entropy. has shape \(8, 9\), but the rewards are \(8, 10\)"):
        adv("empg", r, mask, ids, entropy=entropy[:, :-1], turn_ids=turn)
    with pytest.raises(StableRLError, match="turn_ids must hold integer"):
        adv("empg", r, mask, ids, entropy=entropy, turn_ids=turn.double())
    bad = turn.clone()
    bad[0, 0] = -1
    with pytest.raises(StableRLError, match="turn_ids < 0 on a token where response_mask is 1"):
        adv("empg", r, mask, ids, entropy=entropy, turn_ids=bad)
    nan = entropy.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(StableRLError, match="entropy has non-finite values"):
        adv("empg", r, mask, ids, entropy=nan, turn_ids=turn)
    # garbage entropy and turn ids on padding change nothing
    pad = ~mask.bool()
    noisy_e = torch.where(pad, torch.full_like(entropy, float("inf")), entropy)
    noisy_t = torch.where(pad, torch.full_like(turn, 99), turn)
    torch.testing.assert_close(adv("empg", r, mask, ids, entropy=noisy_e, turn_ids=noisy_t),
                               adv("empg", r, mask, ids, entropy=entropy, turn_ids=turn), rtol=0, atol=0)
    with pytest.raises(StableRLError, match="zeta"):
        adv("empg", r, mask, ids, entropy=entropy, turn_ids=turn, zeta=-1.0)


def test_empg_statistics_go_through_ctx():
    scores, ids, r, mask, entropy, turn = empg_case(2)
    calls = []

    def reduce(t, op):
        calls.append(op)
        return t

    a = adv("empg", r, mask, ids, entropy=entropy, turn_ids=turn, ctx=Context(all_reduce_fn=reduce))
    assert calls == ["max", "sum"]
    torch.testing.assert_close(a, adv("empg", r, mask, ids, entropy=entropy, turn_ids=turn))
    spec = stablerl.get_spec("advantage_estimator", "empg")
    assert spec.batch_statistics and spec.requires == ("entropy",) and spec.optional_inputs == ("turn_ids",)


# ----------------------------------------------------------------------------- common


@pytest.mark.parametrize("name", NAMES)
def test_masked_rows_empty_batch_and_zero_outside_mask(name):
    ids = [0, 0, 0, 1, 1, 1]
    r, mask = rewards_from_scores([1.0, 0.0, 1.0, 0.5, 0.0, 1.0], [3, 0, 2, 3, 1, 3], T=4)
    a = adv(name, r, mask, ids, **default_kwargs(name, ids, 6, 4))
    assert bool(torch.isfinite(a).all())
    assert bool((a[~mask.bool()] == 0).all()) and bool((a[1] == 0).all())
    # B = 0
    r0, m0 = torch.zeros(0, 4, dtype=torch.float64), torch.zeros(0, 4, dtype=torch.float64)
    a0 = adv(name, r0, m0, [], **default_kwargs(name, [], 0, 4))
    assert a0.shape == (0, 4)
    # all-masked batch
    am = adv(name, r, torch.zeros_like(mask), ids, **default_kwargs(name, ids, 6, 4))
    assert bool(torch.isfinite(am).all()) and am.abs().max() == 0


@pytest.mark.parametrize("name", NAMES)
def test_non_finite_rewards_raise(name):
    ids = [0, 0, 1, 1]
    r, mask = rewards_from_scores([1.0, 0.0, 1.0, 0.0])
    r[0, 0] = float("nan")
    with pytest.raises(StableRLError, match="non-finite"):
        adv(name, r, mask, ids, **default_kwargs(name, ids, 4, 3))


@pytest.mark.parametrize("name", NAMES)
def test_bf16_rewards_close_to_fp32(name):
    g = torch.Generator().manual_seed(3)
    ids = [i // 4 for i in range(16)]
    scores = (torch.randint(0, 2, (16,), generator=g) * 0.75).tolist()
    r, mask = rewards_from_scores(scores, torch.randint(1, 6, (16,), generator=g).tolist(), T=5)
    kw = default_kwargs(name, ids, 16, 5)
    a32 = adv(name, r.float(), mask.float(), ids, **kw)
    kw16 = {k: (v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
    a16 = adv(name, r.to(torch.bfloat16), mask.to(torch.bfloat16), ids, **kw16)
    assert a16.dtype == torch.float32 and bool(torch.isfinite(a16).all())
    scale = max(1.0, float(a32.abs().max()))
    torch.testing.assert_close(a16, a32, rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.parametrize("name", NAMES)
def test_conformance_suite(name):
    skip, inputs = [], {}
    if name == "krpo":
        skip = ["permutation"]  # by design: the filter runs in rollout order within a group
    if name == "reinforce_ada":
        inputs = {"extras": lambda base: {"pos_count": torch.full((base["response_mask"].shape[0],), 3),
                                          "neg_count": torch.full((base["response_mask"].shape[0],), 5)}}
    check_advantage_estimator(name, skip=skip, inputs=inputs)


def test_specs_defaults_and_validation():
    specs = {s.name: s for s in stablerl.list_algorithms("advantage_estimator")}
    assert specs["s_grpo"].defaults() == {"drgrpo_p": 0.1, "epsilon": 1e-8}
    assert specs["krpo"].defaults() == {"process_var": 1e-5, "meas_var": 1e-2, "epsilon": 1e-8}
    assert specs["reinforce_ada"].defaults() == {"epsilon": 1e-6, "norm_adv_by_std_in_grpo": False, "global_stat_est": True}
    assert specs["riskpo"].defaults() == {"quantile_down": 0.2, "quantile_up": 0.9, "w_mix": 1.5, "use_mixing_risk_measure": True,
                                          "credit_assign_mode": "std", "norm_adv_by_std_in_grpo": True, "epsilon": 1e-6}
    assert specs["empg"].defaults() == {"k": 1.0, "k_f": 1.0, "zeta": 0.1, "epsilon": 1e-6, "norm_adv_by_std_in_grpo": True}
    assert specs["grpo_passk"].defaults() == {"epsilon": 1e-6, "norm_adv_by_std_in_grpo": True}
    assert {specs[n].status for n in ("riskpo", "empg")} == {"experimental"}
    for n in NAMES:
        assert specs[n].paper and specs[n].formula and specs[n].notes and specs[n].reference
    r, mask = rewards_from_scores([1.0, 0.0])
    with pytest.raises(StableRLError, match="drgrpo_p"):
        adv("s_grpo", r, mask, [0, 0], drgrpo_p=0.5)
    with pytest.raises(StableRLError, match="meas_var"):
        adv("krpo", r, mask, [0, 0], meas_var=0.0)
    with pytest.raises(stablerl.UnknownNameError, match="did you mean 'drgrpo_p'"):
        adv("s_grpo", r, mask, [0, 0], drgrpo_q=0.1)


def test_unavailable_listings():
    specs = {(s.kind, s.name): s for s in stablerl.list_algorithms()}
    assert specs[("advantage_estimator", "salt")].status == "unavailable"
    assert specs[("reward_shaper", "sgpo")].status == "unavailable"
    r, mask = rewards_from_scores([1.0, 0.0])
    with pytest.raises(StableRLError, match="listed but not implemented") as salt_err:
        adv("salt", r, mask, [0, 0])
    with pytest.raises(StableRLError, match="listed but not implemented") as sgpo_err:
        stablerl.shape_rewards("sgpo", scores=torch.tensor([1.0, 0.0]), index=[0, 0])
    # the errors quote the reasons, which say what was searched and what is missing
    for err, key, missing in [(salt_err, ("advantage_estimator", "salt"), "the step key"),
                              (sgpo_err, ("reward_shaper", "sgpo"), "what the judge outputs")]:
        notes = specs[key].notes
        assert notes in str(err.value)
        assert "Searched for issue 16" in notes and f"Missing: {missing}" in notes
