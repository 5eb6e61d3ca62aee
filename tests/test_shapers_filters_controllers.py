"""Reward shapers, batch filters/samplers and entropy controllers (issue 4B): hand-computed values,
degenerate inputs, errors that name the missing input, seeded reproducibility, state round trips."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from stablerl import Context
from stablerl.api import compute_advantage, filter_batch, list_algorithms, make_controller, shape_rewards
from stablerl.params import MissingInputError, StableRLError
from stablerl.plugins.batch_filters import max_variance_subset
from stablerl.plugins.entropy_controllers import epo_phase_weight

SHAPERS = ("redit", "grpo_lambda", "fapo")
FILTERS = ("dynamic_sampling", "simpletir", "gtpo_entropy_filter", "d3s", "shuffle_r1")
CONTROLLERS = ("aepo", "epo")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rows_adv(values, T=3, lengths=None):
    """[B, T] advantages broadcast from per-row values, with a right-padded mask."""
    v = torch.tensor(values, dtype=torch.float64)
    B = v.numel()
    lengths = lengths or [T] * B
    mask = (torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).to(torch.float64)
    return v.unsqueeze(-1) * mask, mask


# ----------------------------------------------------------------------------- specs


@pytest.mark.parametrize("kind,names", [("reward_shaper", SHAPERS), ("batch_filter", FILTERS), ("controller", CONTROLLERS)])
def test_specs_complete(kind, names):
    specs = {s.name: s for s in list_algorithms(kind)}
    for name in names:
        s = specs[name]
        assert s.paper and s.title and s.formula and s.notes and s.reference, name
        s.params().validate()  # defaults validate
        assert "\n" not in s.formula


# ----------------------------------------------------------------------------- ReDit


def test_redit_uniform_law_and_reproducible():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    out1, m = shape_rewards("redit", scores=scores, index=[0, 0, 1, 1], ctx=Context(generator=gen(3)))
    out2, _ = shape_rewards("redit", scores=scores, index=[0, 0, 1, 1], ctx=Context(generator=gen(3)))
    out3, _ = shape_rewards("redit", scores=scores, index=[0, 0, 1, 1], ctx=Context(generator=gen(4)))
    assert torch.equal(out1, out2) and not torch.equal(out1, out3)
    # independent: one U(-a, a) draw per response, in float64 from the generator
    expected = scores + (torch.rand(4, generator=gen(3), dtype=torch.float64) * 2 - 1) * 0.05
    torch.testing.assert_close(out1, expected, rtol=0, atol=1e-15)
    assert set(m) == {"redit/noise_std", "redit/noise_abs_max", "redit/flat_group_response_frac"}
    assert m["redit/flat_group_response_frac"] == 0.0
    assert m["redit/noise_abs_max"] <= 0.05


def test_redit_statistics_large_batch():
    n = 20000
    scores = torch.zeros(n)
    index = torch.arange(n)
    out, m = shape_rewards("redit", scores=scores, index=index, ctx=Context(generator=gen(0)), scale=0.5)
    noise = out.double()
    assert noise.abs().max() <= 0.5
    assert abs(noise.mean()) < 4 * (0.5 / math.sqrt(3)) / math.sqrt(n)  # zero mean
    assert abs(noise.std() - 0.5 / math.sqrt(3)) < 0.01  # U(-a, a): std a/sqrt(3)
    out_g, _ = shape_rewards("redit", scores=scores, index=index, ctx=Context(generator=gen(0)),
                             distribution="gaussian", scale=0.2)
    assert abs(out_g.double().std() - 0.2) < 0.005 and abs(out_g.double().mean()) < 0.005


def test_redit_flat_group_advantages_are_order_one_with_std_normalisation():
    """The documented subtlety: an all-equal group becomes pure noise with unit-scale GRPO advantages."""
    scores = torch.zeros(8, dtype=torch.float64)
    shaped, m = shape_rewards("redit", scores=scores, index=[0] * 8, ctx=Context(generator=gen(1)))
    assert m["redit/flat_group_response_frac"] == 1.0
    rewards = torch.zeros(8, 2, dtype=torch.float64)
    rewards[:, -1] = shaped
    adv, _ = compute_advantage("grpo", token_level_rewards=rewards, response_mask=torch.ones(8, 2), index=[0] * 8)
    a = adv[:, 0]
    assert abs(a.std().item() - 1.0) < 1e-4  # O(1), not O(0.05)
    adv_dr, _ = compute_advantage("dr_grpo", token_level_rewards=rewards, response_mask=torch.ones(8, 2), index=[0] * 8)
    assert adv_dr.abs().max() <= 0.1  # Dr. GRPO: O(a)


def test_extras_from_numpy_object_arrays():
    import numpy as np

    flawed = np.array([True, False], dtype=object)  # verl non_tensor_batch style
    out, _ = shape_rewards("fapo", scores=torch.tensor([1.0, 1.0]), index=np.array(["a", "a"], dtype=object), flawed=flawed)
    torch.testing.assert_close(out, torch.tensor([0.0, 1.0]))
    with pytest.raises(StableRLError, match="flawed must hold numbers"):
        shape_rewards("fapo", scores=torch.tensor([1.0]), index=[0], flawed=np.array(["yes"], dtype=object))


def test_redit_degenerate_and_errors():
    out, m = shape_rewards("redit", scores=torch.zeros(0), index=[], ctx=Context(generator=gen(0)))
    assert out.shape == (0,) and all(math.isfinite(v) for v in m.values())
    out, _ = shape_rewards("redit", scores=torch.tensor([1.0]), index=[7], scale=0.0)
    assert out.item() == 1.0  # scale 0: identity; group of one fine
    with pytest.raises(StableRLError, match="distribution"):
        shape_rewards("redit", scores=torch.zeros(2), index=[0, 0], distribution="laplace")
    with pytest.raises(StableRLError, match="scale"):
        shape_rewards("redit", scores=torch.zeros(2), index=[0, 0], scale=-1.0)
    with pytest.raises(StableRLError, match="non-finite"):
        shape_rewards("redit", scores=torch.tensor([0.0, float("nan")]), index=[0, 0])


# ----------------------------------------------------------------------------- GRPO-lambda


def test_grpo_lambda_hand_values():
    # group 0: c = 1/3, group 1: c = 1 (selected with lambda 0.5 of 2 groups), group 2: c = 2/3
    scores = torch.tensor([1, 0, 0, 1, 1, 1, 1, 1, 0], dtype=torch.float64)
    correct = scores.bool()
    lengths = torch.tensor([3, 5, 7, 2, 4, 6, 10, 20, 30])
    index = [0, 0, 0, 1, 1, 1, 2, 2, 2]
    out, m = shape_rewards("grpo_lambda", scores=scores, index=index, correct=correct, lengths=lengths, lambda_ratio=0.5)
    # floor(0.5 * 3) = 1 group: group 1 -> len = 0.5 - (l - 2)/4 = [0.5, 0, -0.5], all correct
    torch.testing.assert_close(out, torch.tensor([1, 0, 0, 1.5, 1.0, 0.5, 1, 1, 0], dtype=torch.float64))
    assert m["grpo_lambda/selected_group_frac"] == pytest.approx(1 / 3)
    # lambda 2/3: groups 1 and 2 -> group 2: len = 0.5 - (l - 10)/20 = [0.5, 0, -0.5]; wrong one gets min(0, -0.5)
    out, _ = shape_rewards("grpo_lambda", scores=scores, index=index, correct=correct, lengths=lengths, lambda_ratio=0.7)
    torch.testing.assert_close(out, torch.tensor([1, 0, 0, 1.5, 1.0, 0.5, 1.5, 1.0, -0.5], dtype=torch.float64))
    # an incorrect response with a positive length reward gets min(0, len) = 0
    out, _ = shape_rewards("grpo_lambda", scores=torch.tensor([1.0, 0.0]), index=[0, 0],
                           correct=torch.tensor([True, False]), lengths=torch.tensor([9, 1]), lambda_ratio=1.0)
    torch.testing.assert_close(out, torch.tensor([0.5, 0.0]))  # correct: 1 + (0.5 - 1) ; wrong: 0 + min(0, 0.5)


def test_grpo_lambda_degenerate():
    # equal lengths -> len reward 0; group of one; empty batch; lambda 0 -> identity
    out, _ = shape_rewards("grpo_lambda", scores=torch.tensor([1.0, 1.0, 0.0]), index=[0, 0, 1],
                           correct=[True, True, False], lengths=[4, 4, 9], lambda_ratio=1.0)
    torch.testing.assert_close(out, torch.tensor([1.0, 1.0, 0.0]))
    out, m = shape_rewards("grpo_lambda", scores=torch.zeros(0), index=[], correct=torch.zeros(0, dtype=torch.bool),
                           lengths=torch.zeros(0))
    assert out.shape == (0,) and all(math.isfinite(v) for v in m.values())
    s = torch.tensor([1.0, 0.0])
    out, _ = shape_rewards("grpo_lambda", scores=s, index=[0, 0], correct=[True, False], lengths=[1, 5], lambda_ratio=0.0)
    assert torch.equal(out, s)


def test_grpo_lambda_errors_name_the_input():
    s = torch.tensor([1.0, 0.0])
    with pytest.raises(MissingInputError, match="'lengths'"):
        shape_rewards("grpo_lambda", scores=s, index=[0, 0], correct=[True, False])
    with pytest.raises(MissingInputError, match="'correct'"):
        shape_rewards("grpo_lambda", scores=s, index=[0, 0], lengths=[1, 2])
    with pytest.raises(StableRLError, match="lengths must have one entry per response"):
        shape_rewards("grpo_lambda", scores=s, index=[0, 0], correct=[True, False], lengths=[1, 2, 3])
    with pytest.raises(StableRLError, match="correct must be boolean"):
        shape_rewards("grpo_lambda", scores=s, index=[0, 0], correct=[2, 0], lengths=[1, 2])
    with pytest.raises(StableRLError, match="lambda_ratio"):
        shape_rewards("grpo_lambda", scores=s, index=[0, 0], correct=[True, False], lengths=[1, 2], lambda_ratio=1.5)


# ----------------------------------------------------------------------------- FAPO


def test_fapo_hand_values():
    scores = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0])
    flawed = torch.tensor([True, False, True, False, True])
    out, m = shape_rewards("fapo", scores=scores, index=[0, 0, 0, 1, 2], flawed=flawed)
    torch.testing.assert_close(out, torch.tensor([0.0, 1.0, -1.0, -1.0, 0.0]))  # only flawed positives: R - 1
    assert m["fapo/flawed_positive_frac"] == pytest.approx(2 / 5)
    assert m["fapo/flawed_of_correct_frac"] == pytest.approx(2 / 3)
    # 0/1 scale with explicit correctness and lambda = 0.5
    out, _ = shape_rewards("fapo", scores=torch.tensor([1.0, 0.0, 1.0]), index=[0, 0, 0], flawed=[True, True, False],
                           correct=[True, False, True], flawed_reward_penalty=0.5)
    torch.testing.assert_close(out, torch.tensor([0.5, 0.0, 1.0]))
    # explicit correct overrides score > 0
    out, _ = shape_rewards("fapo", scores=torch.tensor([1.0]), index=[0], flawed=[True], correct=[False])
    assert out.item() == 1.0


def test_fapo_errors_and_degenerate():
    with pytest.raises(MissingInputError, match="'flawed'"):
        shape_rewards("fapo", scores=torch.tensor([1.0]), index=[0])
    with pytest.raises(StableRLError, match="flawed_reward_penalty"):
        shape_rewards("fapo", scores=torch.tensor([1.0]), index=[0], flawed=[True], flawed_reward_penalty=-1)
    out, m = shape_rewards("fapo", scores=torch.zeros(0), index=[], flawed=torch.zeros(0, dtype=torch.bool))
    assert out.shape == (0,) and m["fapo/flawed_of_correct_frac"] == 0.0
    # a misspelt hyper-parameter would otherwise travel as an (ignored) extra input: it is refused
    with pytest.raises(StableRLError, match="did you mean 'flawed_reward_penalty'"):
        shape_rewards("fapo", scores=torch.tensor([1.0]), index=[0], flawed=[True], flawed_reward_penaltyy=0.5)


def test_unrelated_extras_are_ignored():
    out, _ = shape_rewards("fapo", scores=torch.tensor([1.0]), index=[0], flawed=[True], lengths=[3])
    assert out.item() == 0.0
    adv, mask = rows_adv([1.0, -1.0])
    r = filter_batch("dynamic_sampling", advantages=adv, response_mask=mask, index=[0, 0], scores=torch.tensor([1.0, 0.0]),
                     void_turn=[True, False])
    assert r.rows.tolist() == [0, 1]
    with pytest.raises(StableRLError, match="did you mean 'keep_singletons'"):
        filter_batch("dynamic_sampling", advantages=adv, response_mask=mask, index=[0, 0], scores=torch.tensor([1.0, 0.0]),
                     keep_singleton=False)


# ----------------------------------------------------------------------------- dynamic sampling


def test_dynamic_sampling_hand_values():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 5.0])
    index = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    adv, mask = rows_adv(list(range(10)), lengths=[3, 2, 1, 3, 3, 3, 3, 3, 3, 2])
    r = filter_batch("dynamic_sampling", advantages=adv, response_mask=mask, index=index, scores=scores)
    assert r.rows.tolist() == [0, 1, 2, 9]  # varied group 0 and the group of one
    assert torch.equal(r.response_mask, mask[[0, 1, 2, 9]]) and r.advantages is None
    assert r.metrics["dynamic_sampling/kept_group_frac"] == 0.5
    assert r.metrics["dynamic_sampling/kept_frac"] == pytest.approx(0.4)
    assert r.metrics["dynamic_sampling/num_kept_groups"] == 2
    r = filter_batch("dynamic_sampling", advantages=adv, response_mask=mask, index=index, scores=scores, keep_singletons=False)
    assert r.rows.tolist() == [0, 1, 2]


def test_dynamic_sampling_degenerate_and_errors():
    adv, mask = rows_adv([0.0, 0.0])
    r = filter_batch("dynamic_sampling", advantages=adv, response_mask=mask, index=[0, 0], scores=torch.tensor([1.0, 1.0]))
    assert r.rows.numel() == 0 and r.response_mask.shape == (0, 3) and r.metrics["dynamic_sampling/kept_frac"] == 0.0
    r = filter_batch("dynamic_sampling", advantages=torch.zeros(0, 3), response_mask=torch.zeros(0, 3), index=[],
                     scores=torch.zeros(0))
    assert r.rows.numel() == 0 and all(math.isfinite(v) for v in r.metrics.values())
    with pytest.raises(MissingInputError, match="'scores'"):
        filter_batch("dynamic_sampling", advantages=adv, response_mask=mask, index=[0, 0])
    with pytest.raises(StableRLError, match="non-finite"):
        filter_batch("dynamic_sampling", advantages=adv, response_mask=mask, index=[0, 0], scores=torch.tensor([1.0, float("nan")]))


# ----------------------------------------------------------------------------- SimpleTIR


def test_simpletir_masks_void_trajectories_after_the_estimator():
    rewards = torch.zeros(4, 3, dtype=torch.float64)
    rewards[:, -1] = torch.tensor([1.0, 0.0, 1.0, 0.0])
    mask = torch.ones(4, 3, dtype=torch.float64)
    adv, _ = compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask, index=[0, 0, 0, 0])
    void = torch.tensor([False, True, False, False])
    r = filter_batch("simpletir", advantages=adv, response_mask=mask, index=[0, 0, 0, 0], void_turn=void)
    assert r.rows.tolist() == [0, 1, 2, 3] and r.advantages is None
    expected_mask = mask.clone()
    expected_mask[1] = 0
    assert torch.equal(r.response_mask, expected_mask)
    # the void trajectory stayed in the baseline: mean 0.5 and unbiased std over all four responses
    std = torch.tensor([1.0, 0.0, 1.0, 0.0]).std().item()
    torch.testing.assert_close(adv[0, 0].item(), 0.5 / (std + 1e-6))
    assert r.metrics["simpletir/void_frac"] == 0.25 and r.metrics["simpletir/masked_frac"] == 0.25


def test_simpletir_min_n_and_errors():
    adv, mask = rows_adv([1.0, -1.0, 1.0, -1.0, 0.5])
    void = torch.tensor([True, True, False, False, False])
    r = filter_batch("simpletir", advantages=adv, response_mask=mask, index=[0, 0, 0, 1, 1], void_turn=void, min_n=2)
    # group 0 has 1 unmasked response (< 2): masked entirely; group 1 keeps both
    assert r.response_mask.sum(-1).tolist() == [0, 0, 0, 3, 3]
    assert r.metrics["simpletir/masked_group_frac"] == 0.5 and r.metrics["simpletir/masked_frac"] == pytest.approx(0.6)
    with pytest.raises(MissingInputError, match="'void_turn'"):
        filter_batch("simpletir", advantages=adv, response_mask=mask, index=[0, 0, 0, 1, 1])
    with pytest.raises(StableRLError, match="void_turn must have one entry per response"):
        filter_batch("simpletir", advantages=adv, response_mask=mask, index=[0, 0, 0, 1, 1], void_turn=[True])
    with pytest.raises(StableRLError, match="min_n"):
        filter_batch("simpletir", advantages=adv, response_mask=mask, index=[0, 0, 0, 1, 1], void_turn=void, min_n=-1)
    r = filter_batch("simpletir", advantages=torch.zeros(0, 2), response_mask=torch.zeros(0, 2), index=[],
                     void_turn=torch.zeros(0, dtype=torch.bool))
    assert r.rows.numel() == 0 and all(math.isfinite(v) for v in r.metrics.values())


# ----------------------------------------------------------------------------- GTPO entropy filter


def test_gtpo_entropy_filter_hand_values():
    adv, mask = rows_adv([1.0, -1.0, 0.5, 2.0], T=4, lengths=[4, 2, 3, 0])
    H = torch.tensor([[0.2, 0.4, 0.6, 0.8],     # mean 0.5 -> A = 1 - 0.05
                      [1.0, 0.8, 9.0, 9.0],     # mean 0.9 > 0.7 -> dropped (padding ignored)
                      [0.7, 0.7, 0.7, 5.0],     # mean 0.7 (not > 0.7) -> 0.5 - 0.07
                      [9.0, 9.0, 9.0, 9.0]], dtype=torch.float64)  # all-masked row
    H[1, 2:] = float("nan")  # garbage in padding is ignored
    r = filter_batch("gtpo_entropy_filter", advantages=adv, response_mask=mask, index=[0, 0, 0, 1], entropy=H)
    expected = torch.tensor([[0.95] * 4, [0.0] * 4, [0.43, 0.43, 0.43, 0.0], [0.0] * 4], dtype=torch.float64)
    torch.testing.assert_close(r.advantages, expected)
    assert torch.equal(r.response_mask, mask) and r.rows.tolist() == [0, 1, 2, 3]
    assert r.metrics["gtpo_filter/dropped_frac"] == pytest.approx(1 / 3)
    assert r.metrics["gtpo_filter/entropy_mean"] == pytest.approx((0.5 + 0.9 + 0.7) / 3)


def test_gtpo_entropy_filter_errors_and_bf16():
    adv, mask = rows_adv([1.0, -1.0])
    with pytest.raises(MissingInputError, match="'entropy'"):
        filter_batch("gtpo_entropy_filter", advantages=adv, response_mask=mask, index=[0, 0])
    H = torch.full((2, 3), 0.3, dtype=torch.float64)
    H[0, 1] = float("inf")
    with pytest.raises(StableRLError, match="entropy has non-finite"):
        filter_batch("gtpo_entropy_filter", advantages=adv, response_mask=mask, index=[0, 0], entropy=H)
    bad = adv.clone()
    bad[1, 0] = float("nan")
    with pytest.raises(StableRLError, match="advantages has non-finite"):
        filter_batch("gtpo_entropy_filter", advantages=bad, response_mask=mask, index=[0, 0], entropy=H.clamp(max=1))
    g = gen(0)
    A = torch.randn(6, 5, generator=g)
    Hr = torch.rand(6, 5, generator=g)
    m = torch.ones(6, 5)
    r32 = filter_batch("gtpo_entropy_filter", advantages=A, response_mask=m, index=[0] * 6, entropy=Hr)
    r16 = filter_batch("gtpo_entropy_filter", advantages=A.bfloat16(), response_mask=m, index=[0] * 6, entropy=Hr.bfloat16())
    assert torch.isfinite(r16.advantages.float()).all()
    torch.testing.assert_close(r16.advantages.float(), r32.advantages, rtol=0.02, atol=0.02)


# ----------------------------------------------------------------------------- D3S


def test_max_variance_subset_matches_brute_force():
    g = gen(5)
    for trial in range(30):
        m = int(torch.randint(2, 8, (1,), generator=g))
        n = int(torch.randint(1, m + 1, (1,), generator=g))
        v = torch.randn(m, generator=g, dtype=torch.float64)
        if trial % 3 == 0:
            v = torch.round(v)  # ties
        chosen = max_variance_subset(v, n)
        assert chosen.numel() == n and torch.unique(chosen).numel() == n
        best = max(v[list(c)].var(unbiased=False).item() for c in itertools.combinations(range(m), n))
        assert v[chosen].var(unbiased=False).item() == pytest.approx(best, abs=1e-12)


def test_d3s_hand_values():
    # group 0: A = [1.5, 0.5, -0.5, -1.5, 0] with N = ceil(0.5 * 5) = 3 of the non-zero ones;
    # group 1: all zero -> dropped; group 2: a group of one
    adv, mask = rows_adv([1.5, 0.5, -0.5, -1.5, 0.0, 0.0, 0.0, 0.7], T=2)
    H = torch.tensor([[1.0, 0.1], [1, 1], [1, 1], [0.2, 0.3], [1, 1], [1, 1], [1, 1], [2.0, 0.0]], dtype=torch.float64)
    index = [0, 0, 0, 0, 0, 1, 1, 2]
    r = filter_batch("d3s", advantages=adv, response_mask=mask, index=index, entropy=H,
                     n_init=0.5, n_final=0.5, k_init=0.5, k_final=0.5)
    # max variance of size 3 from {1.5, 0.5, -0.5, -1.5}: {1.5, 0.5, -1.5} or {1.5, -0.5, -1.5} (equal);
    # tie rule picks j closest to 3/2 then smaller j: j = 1 -> {1.5, -0.5, -1.5}
    assert r.rows.tolist() == [0, 2, 3, 7]
    # tokens of kept rows: |A| H = [1.5, 0.15], [0.5, 0.5], [0.3, 0.45], [1.4, 0]; keep ceil(0.5 * 8) = 4
    # -> 1.5 (row 0 t0), 1.4 (row 7 t0), 0.5, 0.5 (row 2)
    expected = torch.tensor([[1, 0], [1, 1], [0, 0], [1, 0]], dtype=torch.float64)
    assert torch.equal(r.response_mask, expected)
    assert r.metrics["d3s/kept_sample_frac"] == pytest.approx(4 / 8)
    assert r.metrics["d3s/kept_token_frac"] == pytest.approx(4 / 16)
    assert r.metrics["d3s/adv_var_after"] > r.metrics["d3s/adv_var_before"]


def test_d3s_schedule_and_scope():
    adv, mask = rows_adv([2.0, 1.0, -1.0, -2.0], T=1)
    H = torch.ones(4, 1, dtype=torch.float64)
    kw = dict(advantages=adv, response_mask=mask, index=[0, 0, 0, 0], entropy=H, n_init=0.25, n_final=1.0, k_init=1.0, k_final=1.0)
    with pytest.raises(StableRLError, match="ctx.step and ctx.total_steps"):
        filter_batch("d3s", **kw)
    r0 = filter_batch("d3s", ctx=Context(step=0, total_steps=10), **kw)
    assert r0.rows.numel() == 1 and r0.metrics["d3s/n_frac"] == 0.25
    r_mid = filter_batch("d3s", ctx=Context(step=4, total_steps=12), **kw)  # p = 1/3 -> n = 0.5 -> 2 rows: extremes
    assert r_mid.rows.tolist() == [0, 3] and r_mid.metrics["d3s/progress"] == pytest.approx(1 / 3)
    r_end = filter_batch("d3s", ctx=Context(step=50, total_steps=10), **kw)  # clamped to p = 1
    assert r_end.rows.tolist() == [0, 1, 2, 3]
    # cross-group scope: the whole batch is one pool
    adv2, mask2 = rows_adv([2.0, 1.0, -1.0, -2.0, 0.1, -0.1], T=1)
    r = filter_batch("d3s", advantages=adv2, response_mask=mask2, index=[0, 0, 1, 1, 2, 2], entropy=torch.ones(6, 1),
                     n_init=0.5, n_final=0.5, k_init=1.0, k_final=1.0, scope="batch")
    # ceil(0.5 * 6) = 3 of the batch: j = 1 ({2, -2, -1}) and j = 2 ({2, 1, -2}) tie -> the smaller j
    assert r.rows.tolist() == [0, 2, 3]
    with pytest.raises(StableRLError, match="scope"):
        filter_batch("d3s", advantages=adv2, response_mask=mask2, index=[0] * 6, entropy=torch.ones(6, 1), scope="global")
    with pytest.raises(StableRLError, match="k_init"):
        filter_batch("d3s", advantages=adv2, response_mask=mask2, index=[0] * 6, entropy=torch.ones(6, 1), k_init=0.0)


def test_d3s_bf16_long_rows_match_fp32():
    g = gen(4)
    B, T = 8, 300  # more valid tokens per row than bf16 counts exactly
    adv = torch.tensor([2.0, 1.0, -1.0, -2.0, 1.5, 0.5, -0.5, -1.5]).unsqueeze(-1).expand(B, T).clone()
    H = torch.rand(B, T, generator=g)
    mask = torch.ones(B, T)
    kw = dict(index=[0] * 4 + [1] * 4, n_init=0.5, n_final=0.5, k_init=0.3, k_final=0.3)
    r32 = filter_batch("d3s", advantages=adv, response_mask=mask, entropy=H, **kw)
    r16 = filter_batch("d3s", advantages=adv.bfloat16(), response_mask=mask, entropy=H, **kw)
    assert r16.rows.tolist() == r32.rows.tolist() == [0, 3, 4, 7]
    assert r16.metrics["d3s/kept_token_frac"] == pytest.approx(r32.metrics["d3s/kept_token_frac"])
    assert r32.metrics["d3s/kept_token_frac"] == pytest.approx(math.ceil(0.3 * 4 * T) / (B * T))


def test_d3s_degenerate():
    const = dict(n_init=0.5, n_final=0.5, k_init=0.5, k_final=0.5)
    r = filter_batch("d3s", advantages=torch.zeros(0, 3), response_mask=torch.zeros(0, 3), index=[],
                     entropy=torch.zeros(0, 3), **const)
    assert r.rows.numel() == 0 and all(math.isfinite(v) for v in r.metrics.values())
    adv, mask = rows_adv([1.0, 1.0, 1.0], T=2, lengths=[2, 2, 0])  # all-equal non-zero, all-masked row
    r = filter_batch("d3s", advantages=adv, response_mask=mask, index=[0, 0, 0], entropy=torch.ones(3, 2), **const)
    assert r.rows.numel() == 1 and 2 not in r.rows.tolist()
    with pytest.raises(MissingInputError, match="'entropy'"):
        filter_batch("d3s", advantages=adv, response_mask=mask, index=[0, 0, 0], **const)


# ----------------------------------------------------------------------------- Shuffle-R1


def test_shuffle_r1_pairwise_sampling_by_hand():
    # group 0: A = [1, 3, -2, -1] -> sorted rows [1, 0, 3, 2]; pairs (1, 2), (0, 3); alpha 0.5 keeps (1, 2)
    # group 1: A = [0.5, -0.5, 2] -> one pair (2, 1) (median 0.5 unpaired); group 2: a group of one -> none
    adv, mask = rows_adv([1.0, 3.0, -2.0, -1.0, 0.5, -0.5, 2.0, 9.0])
    index = [0, 0, 0, 0, 1, 1, 1, 2]
    r = filter_batch("shuffle_r1", advantages=adv, response_mask=mask, index=index, shuffle=False)
    assert r.rows.tolist() == [1, 2, 6, 5]
    assert r.metrics["shuffle_r1/kept_pair_frac"] == pytest.approx(2 / 3)
    assert r.metrics["shuffle_r1/pair_weight_mean"] == pytest.approx((5.0 + 2.5) / 2)
    r = filter_batch("shuffle_r1", advantages=adv, response_mask=mask, index=index, shuffle=False, alpha=1.0)
    assert r.rows.tolist() == [1, 2, 0, 3, 6, 5]


def test_shuffle_r1_batch_shuffle_reproducible_and_weighted():
    g = gen(2)
    B = 64
    adv = torch.randn(B, generator=g, dtype=torch.float64).unsqueeze(-1).expand(B, 2).clone()
    mask = torch.ones(B, 2)
    index = [i // 8 for i in range(B)]
    run = lambda seed: filter_batch("shuffle_r1", advantages=adv, response_mask=mask, index=index,  # noqa: E731
                                    ctx=Context(generator=gen(seed)))
    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a.rows, b.rows) and not torch.equal(a.rows, c.rows)
    pts = filter_batch("shuffle_r1", advantages=adv, response_mask=mask, index=index, shuffle=False)
    assert a.rows.numel() == pts.rows.numel() == 8 * 2 * 2  # 8 groups x alpha*4 = 2 pairs, 2 rows each
    pairs = {tuple(p) for p in pts.rows.reshape(-1, 2).tolist()}
    assert all(tuple(p) in pairs for p in a.rows.reshape(-1, 2).tolist())  # pairs stay together
    assert torch.equal(a.response_mask, mask[a.rows])
    # each of S = 8 sub-batches of 2 pairs is drawn without replacement: no pair twice within one
    for sub in a.rows.reshape(8, 2, 2):
        assert sub[0].tolist() != sub[1].tolist()
    # selection frequency follows W / sum W (first draw of a sub-batch): check over many seeds
    w = torch.tensor([abs(adv[i, 0]) + abs(adv[j, 0]) for i, j in pts.rows.reshape(-1, 2).tolist()])
    first = torch.zeros(len(w))
    order = [tuple(p) for p in pts.rows.reshape(-1, 2).tolist()]
    n_runs = 200
    for seed in range(n_runs):
        rows = run(100 + seed).rows.reshape(-1, 2)
        for s in range(8):
            first[order.index(tuple(rows[2 * s].tolist()))] += 1
    freq = first / first.sum()
    prob = w / w.sum()
    assert (freq - prob).abs().max() < 0.03


def test_shuffle_r1_degenerate():
    r = filter_batch("shuffle_r1", advantages=torch.zeros(0, 2), response_mask=torch.zeros(0, 2), index=[])
    assert r.rows.numel() == 0 and all(math.isfinite(v) for v in r.metrics.values())
    adv, mask = rows_adv([1.0, 2.0])
    r = filter_batch("shuffle_r1", advantages=adv, response_mask=mask, index=[0, 1], ctx=Context(generator=gen(0)))
    assert r.rows.numel() == 0  # groups of one: nothing to pair
    adv, mask = rows_adv([0.0, 0.0, 0.0, 0.0])  # all-zero weights: uniform draws, still the right size
    r = filter_batch("shuffle_r1", advantages=adv, response_mask=mask, index=[0, 0, 1, 1], ctx=Context(generator=gen(0)),
                     num_sub_batches=2)
    assert r.rows.numel() == 4 and r.metrics["shuffle_r1/pair_weight_mean"] == 0.0
    with pytest.raises(StableRLError, match="alpha"):
        filter_batch("shuffle_r1", advantages=adv, response_mask=mask, index=[0, 0, 1, 1], alpha=0.0)
    with pytest.raises(StableRLError, match="num_sub_batches"):
        filter_batch("shuffle_r1", advantages=adv, response_mask=mask, index=[0, 0, 1, 1], num_sub_batches=0)


# ----------------------------------------------------------------------------- AEPO controller


def test_aepo_controller_rule():
    c = make_controller("aepo")
    out = c.step(entropy=None)
    assert out == {"temperature": None, "num_samples": 0, "below_target": None, "active": False}
    assert c.step(entropy=0.5) == {"temperature": 1.2, "num_samples": 60, "below_target": True, "active": True}
    assert c.step(entropy=torch.tensor(0.51)) == {"temperature": 0.8, "num_samples": 30, "below_target": False, "active": True}
    assert c.step(entropy=0.2, num_kept=25)["num_samples"] == 25
    assert c.step(entropy=0.9, num_kept=25)["num_samples"] == 12  # min(60, 25) halved (integer)
    assert c.step(num_kept=100)["temperature"] == 0.8  # no new measurement: keeps the last one (0.9)
    # above target (last entropy 0.9): min(60, 3 kept) // 2 = 1
    idx, new_adv = c.select(torch.tensor([0.01, 0.3, 0.05, 0.06, -1.0, 0.2]))
    assert idx.tolist() == [1] and new_adv.tolist() == [1.0] and c.num_samples == 1
    c.step(entropy=0.1)  # below target: min(60, 3 kept) = 3
    idx, new_adv = c.select([0.01, 0.3, 0.05, 0.06, -1.0, 0.2])
    assert idx.tolist() == [1, 3, 5] and new_adv.tolist() == [1.0] * 3
    assert make_controller("aepo").select(torch.tensor([1.0]))[0].numel() == 0  # inactive before any entropy
    with pytest.raises(StableRLError, match="one advantage per control sample"):
        c.select(torch.ones(2, 2))
    with pytest.raises(StableRLError, match="entropy must be finite"):
        c.step(entropy=float("nan"))
    with pytest.raises(StableRLError, match="unexpected statistics"):
        c.step(entropy=0.3, temprature=1.0)
    with pytest.raises(StableRLError, match="temperature_high"):
        make_controller("aepo", temperature_high=0.0)


def test_aepo_state_round_trip_and_rank_agreement():
    a, b = make_controller("aepo", entropy_base=0.75), make_controller("aepo", entropy_base=0.75)
    stats = [dict(entropy=0.9), dict(entropy=0.7, num_kept=10), dict(entropy=0.8, num_kept=100)]
    for s in stats:
        assert a.step(**s) == b.step(**s)  # two ranks fed the same all-reduced stats agree
    state = a.state_dict()
    c = make_controller("aepo", entropy_base=0.75)
    c.load_state_dict(state)
    assert c.state_dict() == state
    assert c.step(num_kept=40) == a.step(num_kept=40)


# ----------------------------------------------------------------------------- EPO controller


def test_epo_phase_weight_hand_values():
    assert epo_phase_weight(0) == 1.0
    assert epo_phase_weight(75) == pytest.approx(1 - 0.2 * (1 - math.exp(-2)))
    assert epo_phase_weight(150) == pytest.approx(0.8 * math.exp(-3))
    assert epo_phase_weight(100) == pytest.approx(0.8 * math.exp(-3 * 25 / 75))
    c = make_controller("epo", enable_smooth_weights=False)
    assert c.phase_weight(120) == 1.0


def test_epo_history_and_released_penalty_by_hand():
    c = make_controller("epo", max_steps=4, entropy_smooth_min_ratio=0.5, entropy_smooth_max_ratio=1.5,
                        out_range_penalty=0.1, entropy_coeff=0.01, entropy_smooth_coeff=2.0)
    c.step(epoch=0, turn_entropy=[0.4, 0.4, 1.0, float("nan")])
    c.step(epoch=1, turn_entropy=[0.6, 0.6, 0.6, float("nan")])
    torch.testing.assert_close(c.history()[:3], torch.tensor([0.5, 0.5, 0.8], dtype=torch.float64))
    assert math.isnan(c.history()[3].item()) and c.epoch == 2
    # samples at turns 0 (inactive: < 4/2), 2 (range (0.4, 1.2)) and 3 (no history: inactive)
    H = torch.tensor([[5.0, 5.0, 5.0], [0.3, 0.8, 1.3], [9.0, 9.0, 9.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.float64)
    term, m = c.penalty(H, torch.tensor([0, 2, 3]), mask)
    w = epo_phase_weight(2)
    # out of range on row 1: token 0 (0.3 < 0.4); token 2 is masked. token-mean over 8 valid tokens
    expected = 0.01 * 2.0 * w * (0.1 / 8)
    assert term.item() == pytest.approx(expected)
    assert m["epo/out_of_range_frac"] == pytest.approx(1 / 8) and m["epo/active_sample_frac"] == pytest.approx(1 / 3)
    assert not term.requires_grad  # the released penalty has no gradient path
    # with the entropy bonus the gradient is the bonus only: -c_ent / 8 on valid tokens
    c2 = make_controller("epo", max_steps=4, entropy_smooth_min_ratio=0.5, entropy_smooth_max_ratio=1.5,
                         entropy_coeff=0.01, include_entropy_bonus=True)
    c2.load_state_dict(c.state_dict())
    term2, _ = c2.penalty(H, [0, 2, 3], mask)
    (grad,) = torch.autograd.grad(term2, H)
    torch.testing.assert_close(grad, -0.01 / 8 * mask)


def test_epo_differentiable_penalty_gradient():
    c = make_controller("epo", max_steps=2, entropy_smooth_min_ratio=0.5, entropy_smooth_max_ratio=1.5,
                        entropy_coeff=0.1, mode="differentiable", enable_smooth_weights=False)
    c.step(epoch=0, turn_entropy=[1.0, 1.0])
    H = torch.tensor([[0.2, 1.0, 2.0, 7.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.float64)
    term, _ = c.penalty(H, [1], mask)
    # P = relu(H - 1.5) + relu(0.5 - H) = [0.3, 0, 0.5]; token-mean over 3; times c_ent * c_smooth * w = 0.1
    assert term.item() == pytest.approx(0.1 * 0.8 / 3)
    (grad,) = torch.autograd.grad(term, H)
    torch.testing.assert_close(grad, torch.tensor([[-0.1 / 3, 0.0, 0.1 / 3, 0.0]], dtype=torch.float64))


def test_epo_state_round_trip_rank_agreement_and_errors():
    a, b = make_controller("epo", max_steps=3), make_controller("epo", max_steps=3)
    for e, te in enumerate([[0.5, 0.4], [0.6, 0.2, 0.1], torch.tensor([0.3, float("nan"), 0.2])]):
        assert a.step(epoch=e, turn_entropy=te) == b.step(epoch=e, turn_entropy=te)
    assert a.state_dict() == b.state_dict()
    c = make_controller("epo", max_steps=3)
    c.load_state_dict(a.state_dict())
    H = torch.rand(4, 5, generator=gen(0), dtype=torch.float64) * 2
    mask = torch.ones(4, 5, dtype=torch.float64)
    ta, ma = a.penalty(H, [0, 1, 2, 2], mask)
    tc, mc = c.penalty(H, [0, 1, 2, 2], mask)
    assert ta.item() == tc.item() and ma == mc
    with pytest.raises(StableRLError, match="max_steps"):
        make_controller("epo", max_steps=2).load_state_dict(a.state_dict())
    with pytest.raises(StableRLError, match="turn_entropy"):
        a.step(epoch=3)
    with pytest.raises(StableRLError, match="more than max_steps"):
        a.step(epoch=3, turn_entropy=[0.1] * 4)
    with pytest.raises(StableRLError, match="turn_index"):
        a.penalty(H, [0, 1, 2, 3], mask)
    with pytest.raises(StableRLError, match="mode"):
        make_controller("epo", mode="smooth")
    # empty batch: finite 0
    t, m = a.penalty(torch.zeros(0, 5), [], torch.zeros(0, 5))
    assert t.item() == 0.0 and all(math.isfinite(v) for v in m.values())
