"""stablerl.frameworks.apply_filter_result: a filter's result applied to a batch that keeps its size (the rule
verl, TRL and OpenRLHF share)."""

import pytest
import torch

import stablerl
from stablerl.contracts import FilterResult
from stablerl.frameworks import apply_filter_result

MASK = torch.tensor([[1.0, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]])
ADV = torch.tensor([[1.0, 1, 1], [2, 2, 0], [3, 0, 0], [0, 0, 0]])


def _apply(result, mask=MASK, adv=ADV):
    return apply_filter_result(result, mask, adv, selected_by="filter='f'", why_no_resampling="the batch is split")


def test_kept_rows_go_back_to_their_places_and_only_lose_tokens():
    # rows in another order than the batch's; row 2's mask asks for tokens it never had
    result = FilterResult(rows=torch.tensor([2, 0]), response_mask=torch.tensor([[1.0, 1, 1], [1, 0, 1]]),
                          metrics={"f/kept": 0.5})
    out = _apply(result)
    assert torch.equal(out.response_mask, torch.tensor([[1.0, 0, 1], [0, 0, 0], [1, 0, 0], [0, 0, 0]]))
    assert torch.equal(out.advantages, torch.tensor([[1.0, 0, 1], [0, 0, 0], [3, 0, 0], [0, 0, 0]]))
    assert out.dropped.tolist() == [False, True, False, True]
    # 2 of the 3 rows that had tokens keep some; 3 of 6 tokens
    assert out.metrics == {"f/kept": 0.5, "filter/kept_row_frac": pytest.approx(2 / 3), "filter/kept_token_frac": 0.5}


def test_the_filters_advantages_replace_the_old_ones_on_kept_tokens():
    result = FilterResult(rows=torch.tensor([2, 0]), response_mask=torch.tensor([[1.0, 1, 1], [1, 0, 1]]),
                          advantages=torch.tensor([[5.0, 5, 5], [7, 7, 7]]))
    out = _apply(result)
    assert torch.equal(out.advantages, torch.tensor([[7.0, 0, 7], [0, 0, 0], [5, 0, 0], [0, 0, 0]]))


def test_a_row_whose_tokens_are_all_removed_counts_as_dropped():
    none_of_row_0 = torch.tensor([[0.0, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1]])
    result = FilterResult(rows=torch.arange(4), response_mask=none_of_row_0)
    out = _apply(result)
    assert out.dropped.tolist() == [True, False, False, True]
    assert out.metrics["filter/kept_row_frac"] == pytest.approx(2 / 3)
    assert out.metrics["filter/kept_token_frac"] == pytest.approx(3 / 6)
    assert torch.equal(out.advantages[0], torch.zeros(3)) and torch.equal(out.advantages[1:], ADV[1:])


def test_dtypes_of_the_batch_are_kept():
    mask, adv = MASK.long(), ADV.to(torch.bfloat16)
    result = FilterResult(rows=torch.tensor([1]), response_mask=torch.tensor([[1.0, 0, 0]]),
                          advantages=torch.tensor([[0.25, 9, 9]], dtype=torch.float64))
    out = _apply(result, mask, adv)
    assert out.response_mask.dtype == torch.long and out.advantages.dtype == torch.bfloat16
    assert out.response_mask.sum().item() == 1 and out.advantages[1, 0].item() == 0.25
    assert out.advantages.sum().item() == 0.25


def test_repeated_rows_are_refused_with_the_key_and_the_reason():
    result = FilterResult(rows=torch.tensor([0, 1, 0]), response_mask=MASK[[0, 1, 0]])
    with pytest.raises(stablerl.StableRLError, match=r"filter='f' returned repeated rows .*the batch is split"):
        _apply(result)


def test_an_empty_batch_gives_zero_fractions_not_nan():
    result = FilterResult(rows=torch.tensor([], dtype=torch.long), response_mask=torch.zeros(0, 3))
    out = _apply(result, torch.zeros(2, 3), torch.zeros(2, 3))
    assert out.metrics["filter/kept_row_frac"] == 0.0 and out.metrics["filter/kept_token_frac"] == 0.0
    assert out.dropped.tolist() == [True, True]


# ----------------------------------------------------------------------------- declared loss inputs


def test_loss_inputs_reach_only_that_loss_inside_the_block_and_nest():
    from stablerl.frameworks import loss_inputs, pending_loss_inputs

    assert pending_loss_inputs() is None
    with loss_inputs("steer", {"entropy": 1}) as outer:
        assert pending_loss_inputs("steer") is outer and pending_loss_inputs() is outer
        assert pending_loss_inputs("capo") is None  # another loss's call sees nothing
        outer["token_ids"] = 2  # shared, not copied: a forward inside the block may still add to it
        with loss_inputs("capo", {"entropy": 3}):
            assert pending_loss_inputs("capo") == {"entropy": 3} and pending_loss_inputs("steer") is None
        assert pending_loss_inputs("steer") == {"entropy": 1, "token_ids": 2}
    assert pending_loss_inputs() is None


def test_loss_inputs_are_reset_when_the_call_raises():
    from stablerl.frameworks import loss_inputs, pending_loss_inputs

    with pytest.raises(RuntimeError, match="boom"):
        with loss_inputs("steer", {"entropy": 1}):
            raise RuntimeError("boom")
    assert pending_loss_inputs() is None


# ----------------------------------------------------------------------------- whole prompt groups


def test_group_batch_sampler_keeps_groups_whole_and_contiguous():
    from stablerl.frameworks import GroupBatchSampler

    # positions 0..7: groups 5, 9, 2, 4 of 2 responses each, rows interleaved as a replay buffer may hold them
    ids = [5, 9, 5, 9, 2, 4, 2, 4]
    sizes = [2] * 8
    sampler = GroupBatchSampler(ids, sizes, batch_size=6, shuffle=False, drop_last=False)
    assert list(sampler) == [[0, 2, 1, 3, 4, 6], [5, 7]]  # first-seen group order, each group contiguous
    assert len(sampler) == 2
    assert list(GroupBatchSampler(ids, sizes, 6, shuffle=False, drop_last=True)) == [[0, 2, 1, 3, 4, 6]]
    torch.manual_seed(0)
    orders = set()
    for _ in range(8):  # shuffled: a fresh group order each epoch, every batch still made of whole groups
        batches = list(GroupBatchSampler(ids, sizes, 4, shuffle=True, drop_last=False))
        orders.add(tuple(p for b in batches for p in b))
        for batch in batches:
            assert all([ids[p] for p in batch].count(ids[p]) == 2 for p in batch), batch
    assert len(orders) > 1


def test_group_batch_sampler_refuses_split_groups_in_the_frameworks_words():
    from stablerl.frameworks import GroupBatchSampler

    split = GroupBatchSampler([1, 1, 2], [2, 2, 2], 2, shuffle=False, drop_last=False, incomplete_hint="set X")
    with pytest.raises(stablerl.StableRLError, match=r"prompt group 2 has 1 of its 2 responses here: set X"):
        list(split)
    odd = GroupBatchSampler([1, 1, 1], [3, 3, 3], 4, shuffle=False, drop_last=False, batch_size_key="--mb",
                            group_size_key="--n")
    with pytest.raises(stablerl.StableRLError, match=r"--mb=4 is not a multiple of --n=3"):
        list(odd)


def test_check_whole_groups():
    from stablerl.frameworks import check_whole_groups

    check_whole_groups(torch.tensor([3, 3, 7, 7]), torch.tensor([2, 2, 2, 2]))
    with pytest.raises(stablerl.StableRLError, match=r"prompt groups \[7\] are split across micro-batches.*\(why\)"):
        check_whole_groups(torch.tensor([3, 3, 7]), torch.tensor([2, 2, 2]), why="why")


def _groups_of(part, ids):
    return [ids[i] for i in part]


def test_balanced_group_partitions_deal_whole_groups_in_equal_shares_balancing_workloads():
    from stablerl.frameworks import balanced_group_partitions

    # 6 groups of 3 rows; group g's rows weigh g+1 each (one heavy group, several light ones)
    ids = [f"u{g}" for g in (0, 1, 2, 3, 4, 5) for _ in range(3)]
    work = [float(int(u[1:]) + 1) for u in ids]
    parts = balanced_group_partitions(ids, work, 2)
    assert sorted(i for p in parts for i in p) == list(range(18))  # a permutation of the rows
    assert [len(p) for p in parts] == [9, 9]  # equal shares (verl dispatches equal chunks)
    for p in parts:
        seen = _groups_of(p, ids)
        # whole groups, each contiguous, in its rows' own order
        for g in set(seen):
            at = [n for n, s in enumerate(seen) if s == g]
            assert len(at) == 3 and at == list(range(at[0], at[0] + 3))
        rows = [i for i in p if ids[i] == seen[0]]
        assert rows == sorted(rows)
    loads = [sum(work[i] for i in p) for p in parts]
    assert loads == [30.0, 33.0] or loads == [33.0, 30.0]  # greedy LPT: {6,3,2}=11 vs {5,4,1}=10 (x3)
    # one rank: every group, the lighter ones at both ends
    one, = balanced_group_partitions(ids, work, 1)
    assert [ids[i] for i in one[::3]] == ["u0", "u2", "u4", "u5", "u3", "u1"]


def test_balanced_group_partitions_keeps_interleaved_rows_of_a_group_together():
    from stablerl.frameworks import balanced_group_partitions

    ids = [0, 1, 0, 1, 2, 3, 2, 3]
    parts = balanced_group_partitions(ids, [1.0] * 8, 2)
    for p in parts:
        assert [ids[i] for i in p][0::2] == [ids[i] for i in p][1::2]  # pairs of one group
        assert len(p) == 4


def test_balanced_group_partitions_refuse_what_cannot_be_dealt_out_whole():
    from stablerl.frameworks import balanced_group_partitions

    with pytest.raises(stablerl.StableRLError, match=r"3 prompt groups .* over 2 data-parallel ranks \(trainer"):
        balanced_group_partitions([0, 0, 1, 1, 2, 2], [1.0] * 6, 2, balance_key="trainer.balance_batch=true")
    with pytest.raises(stablerl.StableRLError, match=r"sizes \[1, 3\] .* every group needs rollout.n responses"):
        balanced_group_partitions([0, 0, 0, 1], [1.0] * 4, 2, group_size_key="rollout.n")
    with pytest.raises(stablerl.StableRLError, match="0 ranks"):
        balanced_group_partitions([0], [1.0], 0)
