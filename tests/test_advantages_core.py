"""Group-baseline advantage estimators (grpo, dr_grpo, rloo, opo), qae and bnpo.

Every value is checked against hand-computed numbers or an independent per-group loop written
here (float64); the degenerate cases follow verl's conventions (group of one: baseline 0, std 1).
"""

import math
import statistics

import numpy as np
import pytest
import torch
from conftest import adv, per_seq

import stablerl
from stablerl import Context, StableRLError, UnknownNameError

NAMES = ("grpo", "dr_grpo", "rloo", "opo", "qae", "bnpo")
EPS = 1e-6


def rewards_from_scores(scores, lengths, T=None, dtype=torch.float64):
    """Outcome rewards on the last valid token of right-padded responses, and the mask."""
    lengths = torch.as_tensor(lengths)
    T = T or int(lengths.max())
    mask = (torch.arange(T)[None] < lengths[:, None]).to(dtype)
    r = torch.zeros(len(scores), T, dtype=dtype)
    r[torch.arange(len(scores)), lengths - 1] = torch.as_tensor(scores, dtype=dtype)
    return r, mask


# ----------------------------------------------------------------------------- references (loops)


def reference(name, scores, lengths, ids, quantile_k=0.4, epsilon=EPS):
    """Per-response advantages written out group by group (python floats)."""
    groups = {}
    for i, u in enumerate(ids):
        groups.setdefault(u, []).append(i)
    out = [0.0] * len(scores)
    for members in groups.values():
        s = [float(scores[i]) for i in members]
        G = len(s)
        for j, i in enumerate(members):
            if G == 1:
                out[i] = s[0] / (1 + epsilon) if name in ("grpo", "qae") else s[0]
                continue
            mean, sd = statistics.fmean(s), statistics.stdev(s)
            if name == "grpo":
                out[i] = (s[j] - mean) / (sd + epsilon)
            elif name == "dr_grpo":
                out[i] = s[j] - mean
            elif name == "rloo":
                out[i] = s[j] - (sum(s) - s[j]) / (G - 1)
            elif name == "opo":
                ls = [float(lengths[m]) for m in members]
                out[i] = s[j] - sum(l * x for l, x in zip(ls, s)) / sum(ls)
            elif name == "qae":
                b = float(np.quantile(np.array(s), quantile_k, method="inverted_cdf"))
                out[i] = (s[j] - b) / (sd + epsilon)
    return torch.tensor(out, dtype=torch.float64)


def bnpo_reference(scores, ids, min_value=0.0, max_value=1.0, clamp=1e6):
    """BNPO written out with torch.distributions.Beta as the (independent) density."""
    s = [(float(x) - min_value) / (max_value - min_value) for x in scores]
    groups = {}
    for i, u in enumerate(ids):
        groups.setdefault(u, []).append(i)
    p = {u: (statistics.fmean([s[i] for i in m]) if len(m) > 1 else 0.0) for u, m in groups.items()}
    P = list(p.values())
    mu, var = (statistics.fmean(P), statistics.variance(P)) if len(P) > 1 else (0.0, 1.0)
    if var == 0:
        alpha = beta = 1.0
    else:
        a = (mu * (1 - mu) / var - 1) * mu
        b = (mu * (1 - mu) / var - 1) * (1 - mu)
        alpha, beta = max(1 + a / 3, 1.0), max(1 + b / 3, 1.0)
    dist = torch.distributions.Beta(torch.tensor(alpha, dtype=torch.float64), torch.tensor(beta, dtype=torch.float64))
    out = []
    for i, u in enumerate(ids):
        pdf = float(dist.log_prob(torch.tensor(p[u], dtype=torch.float64)).exp())
        w = min(1 / pdf, clamp) if pdf > 0 else clamp
        out.append(w * (s[i] - p[u]))
    return torch.tensor(out, dtype=torch.float64)


def random_case(seed, n_groups=7, max_size=9, binary=False, T=8):
    """Mixed group sizes (incl. one), interleaved string uids, random lengths."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, max_size + 1, (n_groups,), generator=g).tolist()
    sizes[0] = 1
    ids = np.array([f"uid-{k}" for k, n in enumerate(sizes) for _ in range(n)], dtype=object)
    ids = ids[torch.randperm(len(ids), generator=g).numpy()]
    B = len(ids)
    if binary:
        scores = torch.randint(0, 2, (B,), generator=g).double()
    else:
        scores = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    return scores, lengths, ids


# ----------------------------------------------------------------------------- hand-computed values


def test_hand_computed_values_small_group():
    # one group, scores [1, 0, 1, 1], lengths [3, 1, 2, 4]: mean 0.75, unbiased std 0.5
    r, mask = rewards_from_scores([1.0, 0.0, 1.0, 1.0], [3, 1, 2, 4])
    idx = ["q"] * 4
    d = 0.5 + EPS
    expected = {
        "grpo": [0.25 / d, -0.75 / d, 0.25 / d, 0.25 / d],
        "dr_grpo": [0.25, -0.75, 0.25, 0.25],
        "rloo": [1 / 3, -1.0, 1 / 3, 1 / 3],  # S_i - mean of the other three
        "opo": [0.1, -0.9, 0.1, 0.1],  # baseline (3 + 0 + 2 + 4) / (3 + 1 + 2 + 4) = 0.9
        "qae": [0.0, -1.0 / d, 0.0, 0.0],  # K=0.4, G=4: sorted [0,1,1,1][ceil(1.6)-1] = 1
    }
    for name, values in expected.items():
        a = adv(name, r, mask, idx)
        torch.testing.assert_close(per_seq(a, mask), torch.tensor(values, dtype=torch.float64), rtol=0, atol=1e-12)
    # grpo without std normalisation is Dr. GRPO's advantage
    a = adv("grpo", r, mask, idx, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(per_seq(a, mask), torch.tensor(expected["dr_grpo"], dtype=torch.float64))
    a = adv("grpo", r, mask, idx, epsilon=0.5)
    torch.testing.assert_close(per_seq(a, mask), torch.tensor([0.25, -0.75, 0.25, 0.25], dtype=torch.float64) / 1.0)


def test_hand_computed_bnpo():
    # prompts a: [1, 0] (p=0.5), b: [1, 1, 1, 0] (p=0.75), c: [0, 0] (p=0)
    # mu = 5/12, var = ((1/12)^2 + (4/12)^2 + (5/12)^2) / 2 = 7/48
    # k = mu(1-mu)/var - 1 = (35/144)/(7/48) - 1 = 2/3; a = k*mu = 5/18, b = k*(1-mu) = 7/18
    # alpha = 1 + 5/54, beta = 1 + 7/54
    scores = [1, 0, 1, 1, 1, 0, 0, 0]
    ids = ["a", "a", "b", "b", "b", "b", "c", "c"]
    r, mask = rewards_from_scores(scores, [2, 3, 1, 4, 2, 2, 5, 1])
    alpha, beta = 1 + 5 / 54, 1 + 7 / 54

    def w(p):
        log_b = math.lgamma(alpha) + math.lgamma(beta) - math.lgamma(alpha + beta)
        return math.exp(log_b - (alpha - 1) * math.log(p) - (beta - 1) * math.log(1 - p))

    expected = [w(0.5) * 0.5, -w(0.5) * 0.5] + [w(0.75) * 0.25] * 3 + [-w(0.75) * 0.75] + [1e6 * 0.0] * 2
    a = adv("bnpo", r, mask, ids)
    torch.testing.assert_close(per_seq(a, mask), torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(per_seq(a, mask), bnpo_reference(scores, ids), rtol=1e-10, atol=1e-10)
    # weights are not all 1: the Beta normalisation is doing something
    assert abs(w(0.5) - 1) > 1e-3 and abs(w(0.75) - 1) > 1e-3


# ----------------------------------------------------------------------------- against loops, mixed sizes


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_mixed_group_sizes_match_per_group_reference(seed, binary):
    scores, lengths, ids = random_case(seed, binary=binary)
    r, mask = rewards_from_scores(scores, lengths, T=10)
    for name in ("grpo", "dr_grpo", "rloo", "opo", "qae"):
        a = adv(name, r, mask, ids)
        torch.testing.assert_close(per_seq(a, mask), reference(name, scores, lengths, ids), rtol=1e-10, atol=1e-10)
    for k in (0.25, 0.6, 0.75):
        a = adv("qae", r, mask, ids, quantile_k=k)
        torch.testing.assert_close(per_seq(a, mask), reference("qae", scores, lengths, ids, quantile_k=k))
    bin_scores = (scores > 0).double() if not binary else scores
    r2, _ = rewards_from_scores(bin_scores, lengths, T=10)
    torch.testing.assert_close(per_seq(adv("bnpo", r2, mask, ids), mask), bnpo_reference(bin_scores, ids), rtol=1e-9, atol=1e-9)


def test_bnpo_continuous_rewards_with_range():
    scores, lengths, ids = random_case(11)
    scores = scores.clamp(-2.5, 2.5)
    r, mask = rewards_from_scores(scores, lengths, T=10)
    a = adv("bnpo", r, mask, ids, min_value=-3.0, max_value=3.0)
    torch.testing.assert_close(per_seq(a, mask), bnpo_reference(scores, ids, -3.0, 3.0), rtol=1e-9, atol=1e-9)


# ----------------------------------------------------------------------------- degenerate inputs


def test_group_of_one_is_raw_score():
    scores = [0.7, -1.3, 1.0]
    r, mask = rewards_from_scores(scores, [2, 3, 1])
    ids = ["a", "b", "c"]  # every group has one response
    raw = torch.tensor(scores, dtype=torch.float64)
    for name in ("dr_grpo", "rloo", "opo"):
        torch.testing.assert_close(per_seq(adv(name, r, mask, ids), mask), raw, rtol=0, atol=0)
    for name in ("grpo", "qae"):
        torch.testing.assert_close(per_seq(adv(name, r, mask, ids), mask), raw / (1 + EPS), rtol=0, atol=1e-15)
    # bnpo: p = 0 for a group of one; all p equal -> alpha = beta = 1 -> w = 1 -> A = s
    r01, _ = rewards_from_scores([0.0, 0.25, 1.0], [2, 3, 1])
    torch.testing.assert_close(per_seq(adv("bnpo", r01, mask, ids), mask), torch.tensor([0.0, 0.25, 1.0], dtype=torch.float64))


def test_bnpo_singleton_with_beta_above_one_hits_the_clamp():
    # five prompts with p=0.5 and one response alone (p=0): P = [.5]*5 + [0], mu = 5/12, var = 1/24,
    # alpha = 1 + (29/6)(5/12)/3 > 1, so BetaPDF(0) = 0 and the lone response's weight is the clamp
    scores = [1, 0] * 5 + [1]
    ids = [k // 2 for k in range(10)] + [99]
    r, mask = rewards_from_scores(scores, [1] * 11)
    a = per_seq(adv("bnpo", r, mask, ids), mask)
    assert a[10].item() == 1e6
    assert per_seq(adv("bnpo", r, mask, ids, clamp=10.0), mask)[10].item() == 10.0
    torch.testing.assert_close(a, bnpo_reference(scores, ids))


def test_all_equal_rewards_give_zero_advantage():
    ids = np.array(["a"] * 4 + ["b"] * 3 + ["c"] * 5, dtype=object)
    lengths = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 6, 2]
    for scores in ([1.0] * 12, [0.0] * 12, [1.0] * 4 + [0.0] * 3 + [1.0] * 5):
        r, mask = rewards_from_scores(scores, lengths)
        for name in NAMES:
            a = adv(name, r, mask, ids)
            assert torch.count_nonzero(a) == 0, name
    # continuous but equal within groups
    r, mask = rewards_from_scores([0.3] * 4 + [0.6] * 3 + [0.9] * 5, lengths)
    for name in NAMES:
        assert adv(name, r, mask, ids).abs().max() < 1e-12, name


def test_bnpo_equal_p_over_batch_falls_back_to_uniform_beta():
    # every prompt has p = 0.5: var(P) = 0 -> alpha = beta = 1 -> A = s - p
    scores = [1, 0, 0, 1, 1, 1, 0, 0]
    ids = ["a", "a", "b", "b", "c", "c", "c", "c"]
    r, mask = rewards_from_scores(scores, [2] * 8)
    expected = torch.tensor(scores, dtype=torch.float64) - 0.5
    torch.testing.assert_close(per_seq(adv("bnpo", r, mask, ids), mask), expected, rtol=0, atol=0)
    # p = 1/3 everywhere: sums of p and p^2 leave a rounding-size variance, still the fallback
    r, mask = rewards_from_scores([1, 0, 0] * 5, [1] * 15)
    ids = [k for k in range(5) for _ in range(3)]
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3] * 5, dtype=torch.float64)
    torch.testing.assert_close(per_seq(adv("bnpo", r, mask, ids), mask), expected)


def test_empty_batch():
    r = torch.zeros(0, 5)
    for name in NAMES:
        a = adv(name, r, torch.zeros(0, 5), np.array([], dtype=object))
        assert a.shape == (0, 5)


# ----------------------------------------------------------------------------- layout and masks


def test_interleaved_string_uids_equal_integer_ids_and_permutations():
    scores, lengths, ids = random_case(5, binary=True)
    r, mask = rewards_from_scores(scores, lengths, T=9)
    as_int = torch.tensor([int(u.split("-")[1]) for u in ids])
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(0))
    for name in NAMES:
        a = adv(name, r, mask, ids)
        torch.testing.assert_close(adv(name, r, mask, as_int), a, rtol=0, atol=0)
        torch.testing.assert_close(adv(name, r, mask, list(ids)), a, rtol=0, atol=0)
        a_perm = adv(name, r[perm], mask[perm], ids[perm.numpy()])
        torch.testing.assert_close(a_perm, a[perm], rtol=1e-12, atol=1e-12)


def test_advantages_zero_outside_response_mask_and_masked_rewards_ignored():
    g = torch.Generator().manual_seed(3)
    B, T = 12, 7
    mask = (torch.rand(B, T, generator=g) > 0.3).double()
    mask[:, 0] = 1
    mask[5] = 0  # an all-masked row (score 0)
    r = torch.randint(0, 2, (B, T), generator=g).double() * 0.25
    ids = np.array([f"u{i % 4}" for i in range(B)], dtype=object)
    noisy = r + 5.0 * (1 - mask)  # rewards on masked tokens must not count
    for name in NAMES:
        a = adv(name, r, mask, ids)
        assert torch.all(a[mask == 0] == 0), name
        assert torch.isfinite(a).all()
        torch.testing.assert_close(adv(name, noisy, mask, ids), a)
    # a boolean mask works the same
    for name in NAMES:
        torch.testing.assert_close(adv(name, r, mask.bool(), ids), adv(name, r, mask, ids))


def test_opo_uses_response_length_weights():
    # same scores, different lengths -> different baselines; uniform lengths -> mean baseline
    r, mask = rewards_from_scores([1.0, 0.0], [9, 1])
    torch.testing.assert_close(per_seq(adv("opo", r, mask, [0, 0]), mask), torch.tensor([0.1, -0.9], dtype=torch.float64))
    r, mask = rewards_from_scores([1.0, 0.0], [4, 4])
    torch.testing.assert_close(per_seq(adv("opo", r, mask, [0, 0]), mask), torch.tensor([0.5, -0.5], dtype=torch.float64))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_rewards_raise(bad):
    r, mask = rewards_from_scores([1.0, 0.0, 1.0], [2, 3, 1])
    r[1, 2] = bad
    for name in NAMES:
        with pytest.raises(StableRLError, match="non-finite"):
            adv(name, r, mask, [0, 0, 1])


def test_bf16_and_fp16_rewards():
    scores, lengths, ids = random_case(7, binary=True)
    scores = scores * 0.5 + 0.25  # in [0.25, 0.75], exact in bf16
    r, mask = rewards_from_scores(scores, lengths, T=9)
    for dtype in (torch.bfloat16, torch.float16):
        for name in NAMES:
            a = adv(name, r.to(dtype), mask.to(dtype), ids)
            assert a.dtype == torch.float32 and torch.isfinite(a).all()
            torch.testing.assert_close(a.double(), adv(name, r, mask, ids), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- QAE specifics


def _qae_binary(G, k, correct):
    scores = [1.0] * correct + [0.0] * (G - correct)
    r, mask = rewards_from_scores(scores, [1] * G)
    a = per_seq(adv("qae", r, mask, [0] * G, quantile_k=k), mask)
    sd = statistics.stdev(scores) + EPS
    return a, sd


def test_qae_worked_cases_from_the_catalogue():
    # G=8, K=0.4, 5/8 correct: b = 1.0 (torch.quantile would give 0.8): only failures move
    a, sd = _qae_binary(8, 0.4, 5)
    torch.testing.assert_close(a, torch.tensor([0.0] * 5 + [-1.0 / sd] * 3, dtype=torch.float64))
    # G=8, K=0.6, 3/8 correct: b = 0 (torch.quantile would give 0.2): only successes move
    a, sd = _qae_binary(8, 0.6, 3)
    torch.testing.assert_close(a, torch.tensor([1.0 / sd] * 3 + [0.0] * 5, dtype=torch.float64))
    # G=4, K=0.4, 2 correct: b = 0 (interpolation="higher" would give 1)
    a, sd = _qae_binary(4, 0.4, 2)
    torch.testing.assert_close(a, torch.tensor([1.0 / sd] * 2 + [0.0] * 2, dtype=torch.float64))


@pytest.mark.parametrize("G", [4, 8, 16])
@pytest.mark.parametrize("k", [0.4, 0.6])
def test_qae_binary_two_regimes(G, k):
    # b = 0 iff p <= 1 - K: hard prompts only reward successes, easy prompts only punish failures
    for correct in range(1, G):
        a, _ = _qae_binary(G, k, correct)
        if correct / G <= 1 - k + 1e-12:
            assert torch.all(a[correct:] == 0) and torch.all(a[:correct] > 0)
        else:
            assert torch.all(a[:correct] == 0) and torch.all(a[correct:] < 0)


def test_qae_quantile_rounding_tolerance():
    from stablerl.plugins.qae import group_quantile

    s = torch.arange(100, dtype=torch.float64)
    gid = torch.zeros(100, dtype=torch.long)
    assert 0.55 * 100 > 55  # float rounding that a bare ceil() would trip on
    assert group_quantile(s, gid, 0.55)[0].item() == 54.0  # 55th smallest
    s10 = torch.arange(10, dtype=torch.float64)
    assert group_quantile(s10, gid[:10], 3 * 0.1)[0].item() == 2.0  # K*G = 3.0000000000000004 -> 3rd
    # numpy's inverted_cdf everywhere else, per group, with ties and interleaved groups
    g = torch.Generator().manual_seed(0)
    gid = torch.randint(0, 6, (60,), generator=g)
    s = torch.randint(0, 4, (60,), generator=g).double()
    for k in (0.1, 0.25, 0.4, 0.5, 0.9):
        q = group_quantile(s, gid, k)
        for j in range(6):
            ref = np.quantile(s[gid == j].numpy(), k, method="inverted_cdf")
            assert torch.all(q[gid == j] == float(ref))


# ----------------------------------------------------------------------------- BNPO specifics


def test_bnpo_p_outside_unit_interval_raises():
    r, mask = rewards_from_scores([2.0, 1.0, 0.0, 1.0], [1, 1, 1, 1])
    with pytest.raises(StableRLError, match="outside \\[0, 1\\].*min_value/max_value"):
        adv("bnpo", r, mask, [0, 0, 1, 1])
    adv("bnpo", r, mask, [0, 0, 1, 1], max_value=2.0)  # fine once the range is declared


def test_bnpo_decomposition_averages_per_component_bnpo():
    scores, lengths, ids = random_case(3, binary=True)
    g = torch.Generator().manual_seed(9)
    acc = scores
    fmt = torch.randint(0, 2, (len(ids),), generator=g).double()
    r, mask = rewards_from_scores(acc + fmt, lengths, T=9)
    per_component = []
    for comp in (acc, fmt):
        rc, _ = rewards_from_scores(comp, lengths, T=9)
        per_component.append(adv("bnpo", rc, mask, ids))
    expected = (per_component[0] + per_component[1]) / 2
    as_matrix = adv("bnpo", r, mask, ids, decomposition=True, extras={"reward_components": torch.stack([acc, fmt], -1)})
    torch.testing.assert_close(as_matrix, expected, rtol=1e-12, atol=1e-12)
    # dict of per-response or token-level tensors
    fmt_tokens, _ = rewards_from_scores(fmt, lengths, T=9)
    as_dict = adv("bnpo", r, mask, ids, decomposition=True,
                  extras={"reward_components": {"acc_reward_tensor": acc, "format_reward_tensor": fmt_tokens}})
    torch.testing.assert_close(as_dict, expected, rtol=1e-12, atol=1e-12)
    # not a plain BNPO of the summed reward (which is outside [0, 1] anyway)
    assert not torch.allclose(as_matrix, adv("bnpo", r, mask, ids, max_value=2.0))
    # components are ignored unless decomposition=True
    torch.testing.assert_close(
        adv("bnpo", r, mask, ids, max_value=2.0, extras={"reward_components": torch.stack([acc, fmt], -1)}),
        adv("bnpo", r, mask, ids, max_value=2.0),
    )
    with pytest.raises(StableRLError, match="reward_components"):
        adv("bnpo", r, mask, ids, decomposition=True)
    with pytest.raises(StableRLError, match="shape"):
        adv("bnpo", r, mask, ids, decomposition=True, extras={"reward_components": torch.zeros(3, 2)})
    bad = torch.stack([acc, fmt], -1)
    bad[0, 1] = float("nan")
    with pytest.raises(StableRLError, match="non-finite"):
        adv("bnpo", r, mask, ids, decomposition=True, extras={"reward_components": bad})


def test_bnpo_batch_moments_go_through_ctx_all_reduce():
    calls = []

    def all_reduce(t, op):
        calls.append((t.clone(), op))
        return t

    scores = [1, 0, 1, 1, 0, 0]
    ids = ["a", "a", "b", "b", "c", "c"]
    r, mask = rewards_from_scores(scores, [1] * 6)
    a = adv("bnpo", r, mask, ids, ctx=Context(all_reduce_fn=all_reduce))
    torch.testing.assert_close(a, adv("bnpo", r, mask, ids))
    assert len(calls) == 1 and calls[0][1] == "sum"
    # [sum p, sum p^2, number of prompts, error flags]
    torch.testing.assert_close(calls[0][0][:3], torch.tensor([1.5, 1.25, 3.0], dtype=torch.float64))


# ----------------------------------------------------------------------------- registry and params


def test_specs_and_defaults():
    specs = {s.name: s for s in stablerl.list_algorithms("advantage_estimator") if s.name in NAMES}
    assert set(specs) == set(NAMES)
    assert specs["grpo"].defaults() == {"epsilon": 1e-6, "norm_adv_by_std_in_grpo": True}
    assert specs["qae"].defaults() == {"quantile_k": 0.4, "epsilon": 1e-6, "norm_adv_by_std_in_grpo": True,
                                       "quantile_method": "inverted_cdf"}
    assert specs["bnpo"].defaults() == {"min_value": 0.0, "max_value": 1.0, "clamp": 1e6, "decomposition": False}
    papers = {"grpo": "2402.03300", "dr_grpo": "2503.20783", "rloo": "2402.14740", "opo": "2505.23585",
              "qae": "2509.22611", "bnpo": "2506.02864"}
    for name, spec in specs.items():
        assert spec.paper == papers[name] and spec.formula and spec.title and spec.reference and spec.notes
    assert "torch.quantile" in specs["qae"].notes


def test_params_are_validated():
    r, mask = rewards_from_scores([1.0, 0.0], [1, 1])
    for k in (0.0, 1.0, -0.2, 1.5):
        with pytest.raises(StableRLError, match="quantile_k must be in \\(0, 1\\)"):
            adv("qae", r, mask, [0, 0], quantile_k=k)
    with pytest.raises(UnknownNameError, match="did you mean 'quantile_k'"):
        adv("qae", r, mask, [0, 0], quantile=0.5)
    with pytest.raises(StableRLError, match="max_value must be > min_value"):
        adv("bnpo", r, mask, [0, 0], min_value=1.0, max_value=1.0)
    with pytest.raises(StableRLError, match="clamp must be > 0"):
        adv("bnpo", r, mask, [0, 0], clamp=0.0)
    with pytest.raises(StableRLError, match="epsilon must be >= 0"):
        adv("grpo", r, mask, [0, 0], epsilon=-1.0)
    with pytest.raises(UnknownNameError):
        adv("rloo", r, mask, [0, 0], epsilon=1e-6)


@pytest.mark.parametrize("G,k", [(8, 0.4), (8, 0.6), (16, 0.4), (5, 0.3), (7, 0.75)])
def test_qae_linear_quantile_is_torch_quantile_the_authors_fork(G, k):
    """quantile_method='linear' is the baseline of the authors' verl fork (torch.quantile, linear interpolation)."""
    torch.manual_seed(G)
    groups = 3
    scores = torch.cat([torch.randint(0, 2, (G,)).double() if g == 0 else torch.randn(G, dtype=torch.float64)
                        for g in range(groups)])
    index = torch.arange(groups).repeat_interleave(G)
    mask = torch.ones(groups * G, 4, dtype=torch.float64)
    rewards = torch.zeros_like(mask)
    rewards[:, -1] = scores
    adv, _ = stablerl.compute_advantage("qae", token_level_rewards=rewards, response_mask=mask, index=index,
                                        quantile_k=k, quantile_method="linear")
    expect = []
    for g in range(groups):
        s = scores[index == g]
        expect.append((s - torch.quantile(s, k)) / (s.std() + 1e-6))
    torch.testing.assert_close(adv[:, 0], torch.cat(expect), rtol=1e-12, atol=1e-12)
    paper, _ = stablerl.compute_advantage("qae", token_level_rewards=rewards, response_mask=mask, index=index,
                                          quantile_k=k)
    if (G, k) in ((8, 0.4), (8, 0.6)):  # the (G, K) pairs where the fork and the paper differ on some groups
        assert not torch.allclose(adv, paper)


def test_qae_refuses_an_unknown_quantile_method():
    with pytest.raises(stablerl.StableRLError, match="quantile_method must be one of"):
        stablerl.compute_advantage("qae", token_level_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 3),
                                   index=[0, 0], quantile_method="nearest")
