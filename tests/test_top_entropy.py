"""``top_entropy_quantile`` (issue 16): TRL's high-entropy token mask as a call option of every per-token
stablerl policy loss (core.ops.high_entropy_mask, applied in compute_policy_loss). Parity with TRL's own
get_high_entropy_mask and training runs: integrations_tests/trl/test_trl_builtins_parity.py."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stablerl
from stablerl import frameworks as F
from stablerl.ops import high_entropy_mask

B, T = 5, 7


def _inputs(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lp = (torch.randn(B, T, generator=g, dtype=dtype) * 0.3 - 1.0).requires_grad_(True)
    old = lp.detach() + 0.1 * torch.randn(B, T, generator=g, dtype=dtype)
    adv = torch.randn(B, generator=g, dtype=dtype)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 4:] = False
    mask[2, 2:] = False
    mask[4, :] = False  # a row without a valid token
    entropy = torch.rand(B, T, generator=g, dtype=dtype) * 2
    entropy[~mask] = float("nan")  # garbage on padding reaches nothing
    return dict(log_prob=lp, old_log_prob=old, advantages=adv, response_mask=mask, entropy=entropy)


def _reference_mask(entropy, mask, q):
    """TRL's rule written out: threshold = torch.quantile(valid entropies, 1 - q), keep valid tokens >= it."""
    values = entropy[mask]
    return (entropy >= torch.quantile(values, 1 - q)) & mask


def test_mask_keeps_the_top_fraction_ties_included():
    entropy = torch.tensor([[0.1, 0.5, 0.5, 0.9], [0.5, 0.2, 0.0, 7.0]])
    mask = torch.tensor([[True, True, True, True], [True, True, True, False]])
    # valid: 0.1 .5 .5 .9 .5 .2 .0 -> quantile(0.5) = 0.5: every token at 0.5 is kept (>=), 7.0 (padding) is not
    keep = high_entropy_mask(entropy, mask, 0.5)
    assert keep.tolist() == [[False, True, True, True], [True, False, False, False]]
    assert high_entropy_mask(entropy, mask, 1.0).tolist() == mask.tolist()  # quantile 0: the minimum, all kept
    assert not high_entropy_mask(entropy, torch.zeros_like(mask), 0.2).any()  # no valid token: nothing kept


@pytest.mark.parametrize("q", [0.05, 0.2, 0.5, 0.8])
def test_mask_matches_the_quantile_rule(q):
    d = _inputs(seed=int(q * 100))
    keep = high_entropy_mask(d["entropy"], d["response_mask"], q)
    assert torch.equal(keep, _reference_mask(d["entropy"], d["response_mask"], q))
    n = int(d["response_mask"].sum())
    assert abs(int(keep.sum()) - q * n) <= 1 + 1e-9  # about that fraction of the valid tokens


def test_two_ranks_share_one_threshold():
    """The quantile is over the valid tokens of every DP rank (ctx.all_gather), as TRL gathers over processes."""
    d = _inputs(seed=3)
    e, m = d["entropy"], d["response_mask"]
    whole = high_entropy_mask(e, m, 0.3)
    halves = [(e[:2], m[:2]), (e[2:], m[2:])]
    for i, (ei, mi) in enumerate(halves):
        others = [hm for j, hm in enumerate(halves) if j != i]

        def gather(t, i=i, others=others):  # rank order: rank 0's entropies first
            parts = [t] if i == 0 else []
            parts += [oe[om].float() for oe, om in others]
            return torch.cat(parts if i == 0 else parts + [t])

        ctx = stablerl.Context(all_gather_fn=gather, all_reduce_fn=lambda t, op: t)
        assert torch.equal(high_entropy_mask(ei, mi, 0.3, ctx), whole[:2] if i == 0 else whole[2:])
    # per rank alone the thresholds differ: the gather matters
    assert not torch.equal(torch.cat([high_entropy_mask(ei, mi, 0.3) for ei, mi in halves]), whole)


@pytest.mark.parametrize("name", ["vanilla", "cispo", "gspo", "bapo", "gpg", "dppo_tv"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_loss_is_the_per_token_loss_times_the_mask_same_denominator(name, agg):
    """== the loss with the mask as per-token weights (TRL multiplies per_token_loss by it and keeps its
    loss-mask denominator); fused and eager paths agree; the masked tokens get no gradient."""
    spec = stablerl.get_spec("policy_loss", name)
    if spec.output != "per_token" or spec.fixed_aggregation(spec.params()):
        pytest.skip(f"{name}: not a per-token loss following loss_agg_mode")
    d = _inputs(seed=7)
    keep = _reference_mask(d["entropy"], d["response_mask"], 0.3)
    results = []
    for fused in (True, False):
        loss, metrics = stablerl.compute_policy_loss(name, **d, top_entropy_quantile=0.3, loss_agg_mode=agg, fused=fused)
        (grad,) = torch.autograd.grad(loss, d["log_prob"])
        results.append((loss.detach(), grad))
        assert not grad[~keep].any() and grad[keep].abs().sum() > 0
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-12, atol=1e-14)
    plain = {k: v for k, v in d.items() if k != "entropy"}
    ref, _ = stablerl.compute_policy_loss(name, **plain, is_weights=keep.double(), loss_agg_mode=agg)
    torch.testing.assert_close(results[0][0], ref.detach(), rtol=1e-12, atol=1e-14)
    full, _ = stablerl.compute_policy_loss(name, **plain, loss_agg_mode=agg)
    assert abs(float(full.detach()) - float(ref.detach())) > 1e-6


def test_one_is_off_and_combines_with_framework_weights():
    d = _inputs(seed=9)
    plain = {k: v for k, v in d.items() if k != "entropy"}
    off, _ = stablerl.compute_policy_loss("vanilla", **d, top_entropy_quantile=1.0)
    ref, _ = stablerl.compute_policy_loss("vanilla", **plain)
    assert torch.equal(off.detach(), ref.detach())
    w = torch.rand(B, T, dtype=torch.float64) + 0.5
    keep = _reference_mask(d["entropy"], d["response_mask"], 0.4)
    both, _ = stablerl.compute_policy_loss("vanilla", **d, is_weights=w, top_entropy_quantile=0.4)
    ref, _ = stablerl.compute_policy_loss("vanilla", **plain, is_weights=w * keep)
    torch.testing.assert_close(both.detach(), ref.detach(), rtol=1e-12, atol=1e-14)


def test_needs_entropy_and_a_per_token_loss():
    d = _inputs()
    plain = {k: v for k, v in d.items() if k != "entropy"}
    with pytest.raises(stablerl.MissingInputError, match="top_entropy_quantile=0.5 needs entropy"):
        stablerl.compute_policy_loss("vanilla", **plain, top_entropy_quantile=0.5)
    with pytest.raises(stablerl.StableRLError, match="'gmpo' returns a scalar"):
        stablerl.compute_policy_loss("gmpo", **d, top_entropy_quantile=0.5)
    bad = dict(d, entropy=d["entropy"].clone())
    bad["entropy"][1, 1] = float("inf")
    with pytest.raises(stablerl.StableRLError, match="entropy"):
        stablerl.compute_policy_loss("vanilla", **bad, top_entropy_quantile=0.5)


_BAD_NUMBERS = st.one_of(
    st.floats(max_value=0.0, allow_nan=False),
    st.floats(min_value=1.0, exclude_min=True, allow_nan=False),
    st.integers(max_value=0),
    st.integers(min_value=2),
    st.just(float("nan")),
)
_NOT_NUMBERS = st.one_of(st.text(max_size=4), st.booleans(), st.none(), st.lists(st.floats(0.1, 0.9), max_size=2),
                         st.just(torch.tensor(0.5)), st.just(0.5j))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(value=_BAD_NUMBERS)
def test_out_of_range_values_are_refused(value):
    d = _inputs()
    expected = "nan" if isinstance(value, float) and math.isnan(value) else repr(float(value))
    with pytest.raises(stablerl.StableRLError, match=r"top_entropy_quantile must be in \(0, 1\]") as err:
        stablerl.compute_policy_loss("vanilla", **d, top_entropy_quantile=value)
    assert expected in str(err.value)
    with pytest.raises(stablerl.StableRLError, match=r"top_entropy_quantile must be in \(0, 1\]"):
        F.check_call_options("verl", stablerl.get_spec("policy_loss", "vanilla"), {"top_entropy_quantile": value})


@settings(max_examples=25, deadline=None, derandomize=True)
@given(value=_NOT_NUMBERS)
def test_non_numbers_are_refused(value):
    d = _inputs()
    with pytest.raises(stablerl.StableRLError, match=r"top_entropy_quantile must be a number in \(0, 1\]"):
        stablerl.compute_policy_loss("vanilla", **d, top_entropy_quantile=value)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(value=st.floats(min_value=0.0, max_value=1.0, exclude_min=True))
def test_every_value_in_range_is_accepted_and_keeps_about_that_fraction(value):
    d = _inputs(seed=5)
    keep = high_entropy_mask(d["entropy"], d["response_mask"], value)
    n = int(d["response_mask"].sum())
    assert 1 <= int(keep.sum()) <= n and abs(int(keep.sum()) - value * n) <= 1 + 1e-9
    loss, _ = stablerl.compute_policy_loss("vanilla", **d, top_entropy_quantile=value)
    assert torch.isfinite(loss)


def test_framework_channel():
    """A call option like loss_agg_mode: split from the hyper-parameters, checked per framework."""
    vanilla = stablerl.get_spec("policy_loss", "vanilla")
    hyper, options = F.split_call_options({"clip_ratio_low": 0.2, "top_entropy_quantile": 0.2})
    assert hyper == {"clip_ratio_low": 0.2} and options == {"top_entropy_quantile": 0.2}
    assert F.top_entropy_on(options) and not F.top_entropy_on({"top_entropy_quantile": 1.0}) and not F.top_entropy_on({})
    for fw in ("verl", "trl", "openrlhf"):
        F.check_call_options(fw, vanilla, options)
    with pytest.raises(stablerl.MissingInputError, match="needs the current policy's entropy"):
        F.check_call_options("verl", vanilla, options, feedable={"token_ids"})
    with pytest.raises(stablerl.StableRLError, match="returns a scalar"):
        F.check_call_options("verl", stablerl.get_spec("policy_loss", "gmpo"), options)


def test_describe_and_list_report_reach(capsys):
    from stablerl.cli import main

    assert F.top_entropy_reach("verl")[0] == "partial"  # verl computes the update's entropy only on request
    assert "calculate_entropy=True" in F.top_entropy_reach("verl")[1][-1]
    assert F.top_entropy_reach("trl")[0] == F.top_entropy_reach("openrlhf")[0] == "selectable"
    assert main(["describe", "top_entropy_quantile"]) == 0
    out = capsys.readouterr().out
    assert "+actor_rollout_ref.actor.policy_loss.stablerl_params={top_entropy_quantile:0.2}" in out
    assert 'stablerl_loss_params={"top_entropy_quantile": 0.2}' in out
    assert "--actor.stablerl_params top_entropy_quantile=0.2" in out
    assert main(["list", "--brief"]) == 0
    assert "top_entropy_quantile (verl: partial, trl: selectable, openrlhf: selectable" in capsys.readouterr().out


def _gloo_rank(rank, world):
    """Rank r holds rows [r*3, (r+1)*3) of a 6-row batch (unequal valid-token counts per rank)."""
    g = torch.Generator().manual_seed(21)
    lp_all = torch.randn(6, 8, generator=g, dtype=torch.float64) * 0.3 - 1.0
    old_all = lp_all + 0.1 * torch.randn(6, 8, generator=g, dtype=torch.float64)
    adv_all = torch.randn(6, generator=g, dtype=torch.float64)
    ent_all = torch.rand(6, 8, generator=g, dtype=torch.float64) * 2
    lengths = torch.tensor([8, 2, 5, 7, 1, 3])
    mask_all = torch.arange(8).unsqueeze(0) < lengths.unsqueeze(-1)
    rows = slice(rank * 3, rank * 3 + 3)
    lp = lp_all[rows].clone().requires_grad_(True)
    ctx = stablerl.torch_distributed_context(token_count=float(mask_all.sum()), seq_count=6.0)
    loss, _ = stablerl.compute_policy_loss("vanilla", log_prob=lp, old_log_prob=old_all[rows], advantages=adv_all[rows],
                                           response_mask=mask_all[rows], entropy=ent_all[rows], ctx=ctx,
                                           top_entropy_quantile=0.3)
    (grad,) = torch.autograd.grad(loss, lp)
    keep = high_entropy_mask(ent_all[rows], mask_all[rows], 0.3, ctx)
    # / world: the framework averages the gradients over ranks (DDP)
    return {"grad": grad / world, "keep": keep, "data": (lp_all, old_all, adv_all, ent_all, mask_all)}


def test_two_gloo_ranks_equal_one_rank_with_the_whole_batch():
    from stablerl.testing import launch_gloo

    results = launch_gloo(_gloo_rank, 2)
    lp_all, old_all, adv_all, ent_all, mask_all = results[0]["data"]
    lp = lp_all.clone().requires_grad_(True)
    loss, _ = stablerl.compute_policy_loss("vanilla", log_prob=lp, old_log_prob=old_all, advantages=adv_all,
                                           response_mask=mask_all, entropy=ent_all, top_entropy_quantile=0.3)
    (grad,) = torch.autograd.grad(loss, lp)
    keep = high_entropy_mask(ent_all, mask_all, 0.3)
    assert torch.equal(torch.cat([r["keep"] for r in results]), keep)
    torch.testing.assert_close(torch.cat([r["grad"] for r in results]), grad, rtol=1e-12, atol=1e-15)
    # each rank alone would pick another threshold
    assert not torch.equal(torch.cat([high_entropy_mask(ent_all[s], mask_all[s], 0.3)
                                      for s in (slice(0, 3), slice(3, 6))]), keep)
