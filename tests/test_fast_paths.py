"""Core's fast paths give today's results bit for bit.

* ``group_ids``: the hashing / ``torch.unique`` mapping against the per-id dict loop it replaces.
* ``compute_advantage``: scores from a product with a 0/1 mask, the finiteness check on the scores,
  and outputs built by ``AdvantageBatch.on_response_tokens`` (masked once, checked per response),
  against the general path (masked select, mask product after the estimator, check over [B, T]),
  compared bit for bit (values and signs of zero) for every estimator and mask dtype.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stablerl
from stablerl import ADVANTAGE_ESTIMATOR, StableRLError
from stablerl.api import get_spec, is_binary_mask
from stablerl.contracts import AdvantageBatch
from stablerl.ops import group_ids
from stablerl.params import build_params


def dict_group_ids(values):
    mapping = {}
    return [mapping.setdefault(v, len(mapping)) for v in values]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.integers(-3, 3), st.sampled_from(["a", "b", "c"]), st.booleans(),
                          st.sampled_from([1.0, 2.0, 0.5])), max_size=40))
def test_group_ids_equal_the_dict_mapping_for_python_ids(values):
    # 1 == 1.0 == True are one group, as in a dict
    assert group_ids(values).tolist() == dict_group_ids(values)
    assert group_ids(np.array(values, dtype=object)).tolist() == dict_group_ids(values)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-(2**40), 2**40), max_size=40), st.sampled_from([torch.int64, torch.int32, torch.uint8]))
def test_group_ids_of_an_integer_tensor_number_groups_by_first_appearance(values, dtype):
    if dtype != torch.int64:
        values = [v % 200 for v in values]
    t = torch.tensor(values, dtype=dtype)
    ids = group_ids(t)
    assert ids.dtype == torch.long and ids.device.type == "cpu"
    assert ids.tolist() == dict_group_ids(t.tolist())


def test_group_ids_errors_are_unchanged():
    with pytest.raises(StableRLError, match="index has 3 entries but the batch has 4 responses"):
        group_ids(torch.tensor([1, 2, 3]), n=4)
    with pytest.raises(StableRLError, match="integer group ids, got dtype torch.float32"):
        group_ids(torch.tensor([1.0]))
    with pytest.raises(TypeError):
        group_ids([[1], [2]])  # unhashable ids, as before


# ----------------------------------------------------------------------------- compute_advantage


def general_path(name, rewards, response_mask, index, **params):
    """compute_advantage as it was before the fast paths: masked-select scores, the estimator,
    then the mask product on both outputs."""
    spec = get_spec(ADVANTAGE_ESTIMATOR, name)
    r = rewards.float() if rewards.dtype != torch.float64 else rewards
    m = response_mask.to(torch.float32).to(r.dtype)
    batch = AdvantageBatch(token_level_rewards=r, response_mask=m, index=group_ids(index, n=r.shape[0]))
    assert not batch.mask_is_binary
    adv, ret = spec.fn(batch, build_params(spec, params), stablerl.Context())
    return adv * m, ret * m


ESTIMATORS = [s.name for s in stablerl.list_algorithms(ADVANTAGE_ESTIMATOR) if s.status != "unavailable" and not s.requires]


def same_bits(a, b):
    """Equal bit for bit: values, NaN positions and signs of zero."""
    as_int = {torch.float32: torch.int32, torch.float64: torch.int64}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(as_int[a.dtype]), b.view(as_int[b.dtype]))


def batch_inputs(dtype, seed=0, B=24, T=9, padding=(float("nan"), float("inf"), -3.0, -0.0)):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[3] = 0  # a response without a valid token
    mask = torch.arange(T)[None] < lengths[:, None]
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64).to(dtype)
    rewards[0] = -0.0  # a row whose score is a sum of negative zeros
    rewards[5, :2] = -rewards[5, :2].abs()
    rewards[~mask] = torch.tensor(padding)[torch.arange(int((~mask).sum())) % len(padding)].to(dtype)
    index = np.array([f"uid-{i // 4}" for i in range(B - 1)] + ["single"], dtype=object)
    return rewards, mask, index


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("padding", [(-3.0, -0.0, 2.5), (float("nan"), float("inf"), -3.0, -0.0)], ids=["finite", "garbage"])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32, torch.float64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compute_advantage_is_bit_identical_to_the_general_path(name, mask_dtype, dtype, padding):
    # finite padding: the product path is taken; NaN/inf on padding: the masked select
    rewards, mask, index = batch_inputs(dtype, padding=padding)
    if name == "bnpo":  # scores must lie in its [min_value, max_value] = [0, 1]
        rewards = torch.where(mask, rewards.abs() / mask.shape[1], rewards)
    if name in ("grpo_passk", "reinforce_ada"):  # no group of one
        index[-1] = index[-2]
    params = {"global_stat_est": False} if name == "reinforce_ada" else {}
    response_mask = mask.to(mask_dtype)
    adv, ret = stablerl.compute_advantage(name, token_level_rewards=rewards, response_mask=response_mask, index=index,
                                          **params)
    ref_adv, ref_ret = general_path(name, rewards, response_mask, index, **params)
    assert same_bits(adv, ref_adv) and same_bits(ret, ref_ret)


def test_a_fractional_mask_is_refused_before_any_path():
    rewards, mask, index = batch_inputs(torch.float32)
    frac = mask.float() * 0.5
    assert not is_binary_mask(frac, frac)
    with pytest.raises(StableRLError, match="response_mask must hold only 0 and 1"):
        stablerl.compute_advantage("grpo", token_level_rewards=rewards, response_mask=frac, index=index)


def test_is_binary_mask_per_dtype():
    for values, expected in (([0, 1], True), ([0, 2], False), ([-1, 0], False)):
        t = torch.tensor(values)
        assert is_binary_mask(t, t.float()) is expected
    for values, expected in (([0.0, -0.0, 1.0], True), ([1 - 2**-24], False), ([2**-149], False), ([float("nan")], False),
                             ([1e30], False)):
        t = torch.tensor(values)
        assert is_binary_mask(t, t) is expected


def test_non_finite_reward_on_a_valid_token_still_names_the_input():
    rewards, mask, index = batch_inputs(torch.float32)
    rewards[1, 0] = float("inf")
    with pytest.raises(StableRLError, match="token_level_rewards has non-finite values"):
        stablerl.compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask, index=index)


def test_finite_rewards_whose_sum_overflows_reach_the_output_check():
    rewards = torch.full((2, 3), 3e38)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(StableRLError, match="advantage estimator 'grpo' produced non-finite advantages"):
        stablerl.compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask, index=[0, 0])


def test_scores_follow_a_reassigned_field():
    rewards, mask, index = batch_inputs(torch.float32)
    m = mask.float()
    rewards = torch.where(mask, rewards, torch.zeros(()))
    b = AdvantageBatch(token_level_rewards=rewards, response_mask=m, index=group_ids(index))
    first = b.scores
    assert b.scores is first  # computed once
    b.token_level_rewards = rewards * 2
    assert torch.equal(b.scores, first * 2)


# ----------------------------------------------------------------------------- half precision: recompute


# every loss recomputed by default: no batch statistics
# generalized_jsd: its gradient flows through student_topk_log_prob, an input other than log_prob, so core keeps its
# forward (test_an_input_with_gradient_is_never_recomputed)
RECOMPUTED = [s.name for s in stablerl.list_algorithms("policy_loss")
              if s.status != "unavailable" and s.fn is not None and not s.batch_statistics
              and s.name != "generalized_jsd"]


def _half_inputs(dtype, B=6, T=40):
    from stablerl.tools import bench

    return bench.make_inputs(B, T, dtype, vocab=64)


def _loss_and_grad(name, inp, **kw):
    from stablerl.tools import bench

    # the recompute path; the fused path, which takes precedence where a loss has one, is
    # tests/test_fused.py's
    kw.setdefault("fused", False)

    spec = stablerl.get_spec("policy_loss", name)
    lp = inp["log_prob"].detach().clone().requires_grad_(True)

    def call(x):
        return stablerl.compute_policy_loss(name, log_prob=x, old_log_prob=inp["old_log_prob"],
                                            advantages=inp["advantages"], response_mask=inp["response_mask"],
                                            **{k: inp[k] for k in spec.requires}, **kw)

    loss, metrics = call(lp)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics, bench.saved_bytes(call, inp)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", RECOMPUTED)
def test_half_precision_recompute_is_bit_identical_and_keeps_nothing(name, dtype):
    inp = _half_inputs(dtype)
    kept_loss, kept_grad, kept_metrics, kept_bytes = _loss_and_grad(name, inp, recompute_half=False)
    loss, grad, metrics, saved = _loss_and_grad(name, inp, recompute_half=True)
    assert loss.dtype == kept_loss.dtype == torch.float32 and grad.dtype == dtype
    assert torch.equal(loss.view(torch.int32), kept_loss.view(torch.int32))
    assert torch.equal(grad.view(torch.int16), kept_grad.view(torch.int16))
    assert metrics == kept_metrics
    assert saved == 4 < kept_bytes  # only the scalar loss; the inputs are the caller's


def test_recompute_only_where_a_second_forward_is_the_same():
    inp = _half_inputs(torch.bfloat16)
    # batch statistics (clip_cov's random selection may draw from ctx.generator): kept, not recomputed
    *_, saved = _loss_and_grad("clip_cov", inp, recompute_half=True)
    assert saved > 4
    *_, saved = _loss_and_grad("vanilla", inp)  # off by default
    assert saved > 4
    # a collective in the context: kept
    ctx = stablerl.Context(all_reduce_fn=lambda t, op: t)
    *_, saved = _loss_and_grad("vanilla", inp, ctx=ctx, recompute_half=True)
    assert saved > 4
    # fp32 inputs: nothing to recompute
    *_, saved = _loss_and_grad("vanilla", _half_inputs(torch.float32), recompute_half=True)
    assert saved > 4


def test_fused_path_takes_precedence_over_recompute():
    inp = _half_inputs(torch.bfloat16)
    loss, grad, metrics, saved = _loss_and_grad("vanilla", inp, recompute_half=True, fused=True)
    kept_loss, kept_grad, kept_metrics, _ = _loss_and_grad("vanilla", inp)
    B, T = inp["log_prob"].shape
    # -A and the ratio factor (fp32), not the recompute path's 4-byte loss
    assert saved > 4 and saved <= 2 * 4 * B * T + 64
    assert torch.equal(loss, kept_loss) and torch.equal(grad, kept_grad) and metrics == kept_metrics


def test_recompute_switch_from_the_environment(monkeypatch):
    inp = _half_inputs(torch.bfloat16)
    monkeypatch.setenv("STABLERL_RECOMPUTE_HALF", "1")
    *_, saved = _loss_and_grad("vanilla", inp)
    assert saved == 4
    *_, saved = _loss_and_grad("vanilla", inp, recompute_half=False)
    assert saved > 4


def test_recompute_still_raises_on_non_finite_input():
    inp = _half_inputs(torch.bfloat16)
    inp["old_log_prob"][0, 0] = float("nan")
    with pytest.raises(StableRLError, match="old_log_prob has non-finite values"):
        _loss_and_grad("vanilla", inp, recompute_half=True)


# ----------------------------------------------------------------------------- bapo's bound search


@pytest.mark.parametrize("seed", range(6))
def test_bapo_search_from_signed_advantages_is_bit_identical(seed, monkeypatch):
    from stablerl.plugins import bapo

    g = torch.Generator().manual_seed(seed)
    B, T = 8, 300
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B, 1), generator=g)).float()
    adv = torch.randn(B, 1, generator=g).expand(B, T) * mask
    adv[0, :5] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3.0])
    ratio = torch.exp(0.4 * torch.randn(B, T, generator=g)) * mask + (1 - mask)
    p = bapo.BAPOParams()
    assert bapo._statistics_by_signed_advantages(ratio, adv, mask)
    assert not bapo._statistics_by_signed_advantages(ratio, adv + (1 - mask), mask)  # A nonzero on padding
    assert not bapo._statistics_by_signed_advantages(-ratio, adv, mask)
    # the statistics themselves (through the all-reduce), not only the chosen bounds
    seen = []
    ctx = stablerl.Context(all_reduce_fn=lambda t, op: seen.append(t.clone()) or t)
    fast = bapo.bapo_bounds(ratio, adv, mask, p, ctx)
    monkeypatch.setattr(bapo, "_statistics_by_signed_advantages", lambda *a: False)
    general = bapo.bapo_bounds(ratio, adv, mask, p, ctx)
    assert torch.equal(seen[0].view(torch.int32), seen[1].view(torch.int32))
    for a, b in zip(fast, general):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


# --------------------------------------------------------------- policy-loss finite check by sums


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["log_prob", "old_log_prob", "advantages"]), st.integers(0, 23),
       st.sampled_from([float("nan"), float("inf"), float("-inf")]), st.booleans())
def test_loss_finite_check_by_sums_names_the_input_and_ignores_padding(which, pos, bad, on_padding):
    # one non-finite value: named when on a valid token, ignored (the same loss) on padding
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[:, 4:] = False
    r, c = divmod(pos, 6)
    c = c % 4 if not on_padding else 4 + c % 2
    good = {"log_prob": -torch.rand(4, 6) - 0.1, "old_log_prob": -torch.rand(4, 6) - 0.1, "advantages": torch.randn(4, 6)}
    tensors = {k: v.clone() for k, v in good.items()}
    tensors[which][r, c] = bad
    if on_padding:
        loss, _ = stablerl.compute_policy_loss("vanilla", response_mask=mask, **tensors)
        ref, _ = stablerl.compute_policy_loss("vanilla", response_mask=mask, **good)
        assert torch.equal(loss, ref)
    else:
        with pytest.raises(StableRLError, match=f"^{which} has non-finite values"):
            stablerl.compute_policy_loss("vanilla", response_mask=mask, **tensors)


def test_loss_finite_check_passes_finite_inputs_whose_sum_overflows():
    # each advantage is finite, their sum is inf: min and max decide (they pass), as before
    adv = torch.full((1, 2), 3e38)
    lp = torch.full((1, 2), -0.5, requires_grad=True)
    assert torch.isinf(adv.sum())
    loss, _ = stablerl.compute_policy_loss("cispo", log_prob=lp, old_log_prob=lp.detach(), advantages=adv,
                                           response_mask=torch.ones(1, 2))
    # cispo at ratio 1: -(1 * A) * lp per token, token mean
    assert loss.item() == pytest.approx(1.5e38, rel=1e-6)
    loss.backward()
    assert torch.equal(lp.grad, torch.full((1, 2), -1.5e38))


# --------------------------------------------------------------- scores without a [B, T] temporary


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.integers(1, 70), st.sampled_from([1, 7, 64, 1000]), st.sampled_from([torch.float32, torch.float64]),
       st.integers(0, 2**31 - 1))
def test_row_sums_of_product_by_slices_are_bit_identical(B, T, slice_elements, dtype, seed):
    import stablerl.fast_paths as fast_paths

    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(B, T, generator=g) * torch.rand(B, T, generator=g) * 1e3).to(dtype)
    b = (torch.rand(B, T, generator=g) > 0.3).to(dtype)
    before = fast_paths._ROW_SLICE_ELEMENTS
    fast_paths._ROW_SLICE_ELEMENTS = slice_elements
    try:
        got = fast_paths.row_sums_of_product(a, b)
    finally:
        fast_paths._ROW_SLICE_ELEMENTS = before
    want = (a * b).sum(-1)
    assert got.dtype == want.dtype
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bit for bit, signs of zero included


@pytest.mark.parametrize("name", ["grpo", "rloo", "dr_grpo", "opo"])
def test_estimators_with_sliced_scores_are_bit_identical(name, monkeypatch):
    import stablerl.fast_paths as fast_paths

    g = torch.Generator().manual_seed(3)
    B, T = 48, 40
    rewards = torch.randn(B, T, generator=g)
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).long()
    index = [str(i // 6) for i in range(B)]
    want = stablerl.compute_advantage(name, token_level_rewards=rewards, response_mask=mask, index=index)
    monkeypatch.setattr(fast_paths, "_ROW_SLICE_ELEMENTS", 3 * T)  # 16 slices of 3 rows
    got = stablerl.compute_advantage(name, token_level_rewards=rewards, response_mask=mask, index=index)
    for w, o in zip(want, got):
        assert torch.equal(w.view(torch.uint8), o.view(torch.uint8))


def test_an_input_with_gradient_is_never_recomputed(monkeypatch):
    """generalized_jsd's gradient also flows through student_topk_log_prob: with recompute on, core keeps the forward
    (a recompute from log_prob alone would lose that gradient), so loss and both gradients are unchanged."""
    from stablerl.tools import bench

    inp = _half_inputs(torch.bfloat16)
    call = bench.ours_fn("generalized_jsd", inp, params={"task_loss": "vanilla"})
    student = inp["student_topk_log_prob"]
    lp = inp["log_prob"].detach().clone().requires_grad_(True)
    loss = call(lp)[0]
    kept = torch.autograd.grad(loss, (lp, student))
    monkeypatch.setenv("STABLERL_RECOMPUTE_HALF", "1")
    again_loss = call(lp)[0]
    again = torch.autograd.grad(again_loss, (lp, student))
    assert torch.equal(loss, again_loss)
    assert all(torch.equal(a, b) for a, b in zip(kept, again)) and bool((again[1] != 0).any())
