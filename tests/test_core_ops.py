"""Core primitives: aggregation modes against hand-computed values, group ids and statistics."""

import numpy as np
import pytest
import torch

from stablerl import Context, StableRLError
from stablerl.ops import (
    aggregate,
    as_floats,
    clamped_log_ratio,
    group_ids,
    group_stats,
    masked_mean,
    masked_var,
)

L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])
M = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # 5 valid tokens; 100 is padding


def test_token_mean_by_hand():
    assert aggregate(L, M, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4 + 5) / 5)


def test_seq_mean_token_sum_by_hand():
    assert aggregate(L, M, "seq-mean-token-sum").item() == pytest.approx(((1 + 2 + 3) + (4 + 5)) / 2)


def test_seq_mean_token_mean_by_hand():
    assert aggregate(L, M, "seq-mean-token-mean").item() == pytest.approx((2.0 + 4.5) / 2)
    # a row without valid tokens is not a sequence (verl excludes it from the default count)
    three = torch.cat([L, L[:1]]), torch.cat([M, torch.zeros(1, 3)])
    assert aggregate(*three, "seq-mean-token-mean").item() == pytest.approx((2.0 + 4.5) / 2)


def test_seq_mean_token_sum_norm_needs_constant_and_ignores_padding_length():
    with pytest.raises(StableRLError, match="loss_scale_factor"):
        aggregate(L, M, "seq-mean-token-sum-norm")
    ctx = Context(loss_scale_factor=8.0)
    value = aggregate(L, M, "seq-mean-token-sum-norm", ctx).item()
    assert value == pytest.approx(15 / (2 * 8))
    # extra padding columns do not change it (the Dr. GRPO constant is not the padded length)
    padded = aggregate(torch.cat([L, torch.full((2, 5), 7.0)], 1), torch.cat([M, torch.zeros(2, 5)], 1), "seq-mean-token-sum-norm", ctx)
    assert padded.item() == pytest.approx(value)


def test_global_normalisers_and_dp_size():
    ctx = Context(token_count=10.0, seq_count=4.0, dp_size=2)
    assert aggregate(L, M, "token-mean", ctx).item() == pytest.approx(15 / 10 * 2)
    assert aggregate(L, M, "seq-mean-token-sum", ctx).item() == pytest.approx(15 / 4 * 2)
    assert aggregate(L, M, "seq-mean-token-mean", ctx).item() == pytest.approx(6.5 / 4 * 2)


def test_all_masked_is_zero_not_nan():
    zero = torch.zeros_like(M)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        assert aggregate(L, zero, mode).item() == 0.0
    empty = torch.zeros(0, 3)
    assert aggregate(empty, empty, "token-mean").item() == 0.0


def test_unknown_mode_names_nearest():
    with pytest.raises(StableRLError, match="did you mean 'token-mean'"):
        aggregate(L, M, "token_mean")


def test_token_mean_microbatch_invariance():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    mask = (torch.rand(6, 5, generator=g) > 0.3).double()
    whole = aggregate(lp * 2.0, mask, "token-mean")
    (full_grad,) = torch.autograd.grad(whole, lp)
    ctx = Context(token_count=mask.sum().item())
    total = aggregate(lp[:2] * 2.0, mask[:2], "token-mean", ctx) + aggregate(lp[2:] * 2.0, mask[2:], "token-mean", ctx)
    (split_grad,) = torch.autograd.grad(total, lp)
    torch.testing.assert_close(split_grad, full_grad)


def test_masked_stats():
    x = torch.tensor([1.0, 2.0, 3.0, 50.0])
    m = torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert masked_mean(x, m).item() == pytest.approx(2.0)
    assert masked_var(x, m).item() == pytest.approx(1.0)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(2 / 3)
    assert masked_mean(x, torch.zeros(4)).item() == 0.0


def test_clamped_log_ratio():
    lr = clamped_log_ratio(torch.tensor([0.0, 50.0]), torch.tensor([-100.0, 0.0]))
    assert lr.tolist() == [20.0, 20.0]


def test_group_ids_from_numpy_strings_list_and_tensor():
    uid = np.array(["b", "a", "b", "c", "a"], dtype=object)
    assert group_ids(uid).tolist() == [0, 1, 0, 2, 1]
    assert group_ids([7, 7, 3]).tolist() == [0, 0, 1]
    assert group_ids(torch.tensor([5, 5, 9])).tolist() == [0, 0, 1]
    with pytest.raises(StableRLError, match="3 entries but the batch has 4"):
        group_ids([1, 2, 3], n=4)
    with pytest.raises(StableRLError, match="integer group ids"):
        group_ids(torch.tensor([0.5, 1.0]))


def test_group_stats_unbiased_and_singleton():
    scores = torch.tensor([1.0, 0.0, 1.0, 5.0])
    gid = torch.tensor([0, 0, 0, 1])
    mean, std, count = group_stats(scores, gid)
    assert mean.tolist() == pytest.approx([2 / 3, 2 / 3, 2 / 3, 5.0])
    assert std[0].item() == pytest.approx(np.std([1, 0, 1], ddof=1))
    assert count.tolist() == [3, 3, 3, 1]
    assert std[3].item() == 0.0


def test_as_floats_keeps_order_and_types():
    out = as_floats({"a": torch.tensor(1.5), "b": 2, "c": torch.tensor([3.0])})
    assert out == {"a": 1.5, "b": 2.0, "c": 3.0}
    assert all(type(v) is float for v in out.values())


def test_dp_without_global_normalisers_is_an_error():
    for mode, needed in (("token-mean", "token_count"), ("seq-mean-token-mean", "seq_count")):
        with pytest.raises(StableRLError, match=f"needs the global {needed}"):
            aggregate(L, M, mode, Context(dp_size=2))


def test_scores_on_last_token():
    from stablerl.ops import last_valid_index, scores_on_last_token

    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert last_valid_index(mask).tolist() == [1, 3, 0]
    out = scores_on_last_token(torch.tensor([2.0, -1.0, 5.0]), mask)
    assert out.tolist() == [[0, 2.0, 0, 0], [0, 0, 0, -1.0], [5.0, 0, 0, 0]]


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.booleans(), min_size=7, max_size=7), min_size=1, max_size=5))
def test_mask_runs_numbers_each_contiguous_run_of_valid_tokens(rows):
    from stablerl.ops import mask_runs

    mask = torch.tensor(rows)
    runs = mask_runs(mask.to(torch.float32))
    assert runs.dtype == torch.int64 and runs.shape == mask.shape
    for row, out in zip(rows, runs.tolist()):
        want, k, prev = [], -1, False
        for on in row:  # a new id exactly where the mask goes 0 -> 1
            k += on and not prev
            want.append(k if on else -1)
            prev = on
        assert out == want


def test_sum_pi_squared_equals_a_direct_softmax():
    """``ops.sum_pi_squared`` (verl's logsumexp form) against ``sum softmax(z)^2`` in float64, and its bounds."""
    from stablerl.ops import sum_pi_squared

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 257, generator=g, dtype=torch.float64) * 4.0
    direct = logits.softmax(-1).pow(2).sum(-1)
    torch.testing.assert_close(sum_pi_squared(logits), direct, rtol=1e-12, atol=0)
    torch.testing.assert_close(sum_pi_squared(logits.float()), direct.float(), rtol=1e-5, atol=0)
    # 1/V for a uniform distribution, 1 for a one-hot one; no overflow at large logits
    assert float(sum_pi_squared(torch.zeros(257, dtype=torch.float64))) == pytest.approx(1 / 257, rel=1e-12)
    assert float(sum_pi_squared(torch.tensor([1e4, 0.0, 0.0]))) == pytest.approx(1.0)
    assert torch.all(direct >= 1 / 257)
