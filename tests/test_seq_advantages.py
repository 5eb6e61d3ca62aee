"""Sequence-level advantages: losses registered with ``seq_advantages=True`` get a cleaned ``[B, 1]``
tensor when the caller's advantages are one per sequence (``[B]`` or a ``[B, T]`` view expanded along
T), and must give the same bits as from today's per-token ``[B, T]`` advantages: loss, gradient and
metrics, signs of zeros and padding garbage (NaN/inf) included. Contiguous ``[B, T]`` advantages take
today's path, so they are the reference.
"""

import math

import pytest
import torch

import stablerl
from stablerl import POLICY_LOSS, AlgorithmSpec, Context, compute_policy_loss
from stablerl.api import get_spec

FAST = ("sapo", "gspo", "cispo", "vanilla")
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
INT_OF = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}


def bits(t):
    t = t.detach()
    return t.contiguous().view(INT_OF[t.dtype])


def dirty_batch(dtype, seed=0, B=6, T=23, garbage=True):
    """A padded batch with an all-masked row, a full row, holes inside rows, zero (+0/-0) and tiny
    advantages, NaN/inf on padding (log-probs) and a NaN advantage on the all-masked row."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0], lengths[2] = T, 0
    valid = (torch.arange(T)[None] < lengths[:, None]) & (torch.rand(B, T, generator=g) > 0.15)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = lp + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    a = torch.randn(B, generator=g, dtype=torch.float64)
    a[1], a[3], a[4] = -0.0, 0.0, -1e-45
    if garbage:
        bad = torch.tensor([math.nan, math.inf, -math.inf], dtype=torch.float64)
        fill = bad[torch.randint(0, 3, (B, T), generator=g)]
        lp, old = torch.where(valid, lp, fill), torch.where(valid, old, fill.flip(-1))
        a[2] = math.nan  # row 2 has no valid token: its advantage must reach nothing
    return lp.to(dtype), old.to(dtype), a.to(dtype), valid


def run(name, lp, old, adv, mask, mode="token-mean", **kw):
    leaf = lp.clone().requires_grad_(True)
    ctx = Context(loss_scale_factor=float(lp.shape[1]))
    loss, metrics = compute_policy_loss(name, log_prob=leaf, old_log_prob=old, advantages=adv, response_mask=mask,
                                        loss_agg_mode=mode, ctx=ctx, **kw)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss, grad, metrics


# gspo's sequence form (taken with sequence-level advantages, no IS weights, a built-in aggregation): the
# same loss bits and metrics, but the gradient and ppo_kl are summed in another order
ROUNDED = {"gspo": ("ppo_kl",)}


def assert_same_bits(fast, slow, name=None):
    (l1, g1, m1), (l2, g2, m2) = fast, slow
    assert torch.equal(bits(l1), bits(l2)), (l1, l2)
    rounded = ROUNDED.get(name, ())
    if rounded:
        eps = torch.finfo(g1.dtype).eps * 8
        assert torch.allclose(g1, g2, rtol=eps, atol=eps * float(g2.abs().max()))
    else:
        assert torch.equal(bits(g1), bits(g2))
    assert list(m1) == list(m2)
    for k in m1:
        both_nan = math.isnan(m1[k]) and math.isnan(m2[k])
        if k in rounded:
            assert both_nan or math.isclose(m1[k], m2[k], rel_tol=1e-6, abs_tol=1e-7), k
            continue
        assert both_nan or (m1[k] == m2[k] and math.copysign(1, m1[k]) == math.copysign(1, m2[k])), k


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("form", ["1d", "expand"])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_sequence_advantages_give_the_per_token_bits(name, dtype, mode, form, mask_kind):
    lp, old, a, valid = dirty_batch(dtype, seed=len(name) + len(mode))
    mask = valid if mask_kind == "bool" else valid.float()
    B, T = lp.shape
    fast_adv = a if form == "1d" else a[:, None].expand(B, T)
    # reference: today's path (contiguous [B, T]), with garbage on the padding of the advantages too
    slow_adv = torch.where(valid, a[:, None].expand(B, T), torch.tensor(math.inf, dtype=dtype))
    assert_same_bits(run(name, lp, old, fast_adv, mask, mode), run(name, lp, old, slow_adv, mask, mode), name)


@pytest.mark.parametrize("name", FAST)
@pytest.mark.parametrize("extra", ["is_weights", "opsm", "bit_path"])
def test_sequence_advantages_with_weights_corrections_and_large_batches(name, extra):
    B, T = (6, 6000) if extra == "bit_path" else (6, 23)  # >= 2**15 elements: core's bit-mask clean-up
    lp, old, a, valid = dirty_batch(torch.float32, seed=3, B=B, T=T)
    kw = {}
    if extra == "is_weights":
        kw["is_weights"] = torch.rand(B, T, generator=torch.Generator().manual_seed(1)) + 0.5
    if extra == "opsm":  # a rollout correction that reads batch.advantages: built on demand, today's bits
        kw.update(rollout_correction="opsm", rollout_correction_params={"threshold": 0.05},
                  rollout_log_prob=torch.where(valid, old + 0.1, old))
    slow_adv = a[:, None].expand(B, T).contiguous()
    # with IS weights or a correction gspo keeps its token form: then every bit is the same
    assert_same_bits(run(name, lp, old, a, valid, **kw), run(name, lp, old, slow_adv, valid, **kw),
                     name if extra == "bit_path" else None)


def saved_for_backward(name, adv, lp, old, mask, mode="token-mean"):
    saved = []
    leaf = lp.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        compute_policy_loss(name, log_prob=leaf, old_log_prob=old, advantages=adv, response_mask=mask,
                            loss_agg_mode=mode)
    return saved


@pytest.mark.parametrize("name,copies", [
    ("sapo", lambda a: (-a, torch.where(a > 0, 1.0, 1.05))),  # the product with -A; tau, a function of A
    ("vanilla", lambda a: (-a, -a * 3.0)),  # -A (twice: with r and with clip(r)), -A c of the dual clip
    ("gspo", lambda a: (-a,)),  # -A (twice)
])
def test_fast_path_keeps_no_per_token_advantage_copy(name, copies, monkeypatch):
    monkeypatch.setenv("STABLERL_FUSED", "0")  # the eager path's saved tensors (the fused path: tests/test_fused.py)
    lp, old, a, valid = dirty_batch(torch.float32, seed=5, garbage=False)
    B, T = lp.shape
    a[2] = 0.0  # as core cleans it
    zero = torch.zeros(())
    candidates = [torch.where(valid, c[:, None].expand(B, T), zero) for c in copies(a)]

    def advantage_copies(saved):  # storages of [B, T] tensors equal to a candidate on the valid tokens
        return {t.untyped_storage().data_ptr() for t in saved if t.shape == (B, T) and t.dtype == torch.float32
                and any(torch.equal(torch.where(valid, t, zero), c) for c in candidates)}

    slow = saved_for_backward(name, a[:, None].expand(B, T).contiguous(), lp, old, valid)
    fast = saved_for_backward(name, a, lp, old, valid)
    assert len(advantage_copies(slow)) == {"sapo": 2, "vanilla": 3, "gspo": 2}[name]
    assert len(advantage_copies(fast)) == 0
    assert any(t.shape == (B, 1) and torch.equal(t, -a[:, None]) for t in fast)  # kept as [B, 1] instead
    bytes_kept = [sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
                       if t.shape == (B, T)}.values()) for saved in (slow, fast)]  # per-token tensors kept
    # sapo: tau and -A (8 bytes/token) -> nothing (its mask product reuses core's bool mask); vanilla: -A twice,
    # -A c and A < 0 (13) -> nothing; gspo: its sequence form keeps no per-token float at all, where GSPO-token
    # keeps -A twice, s_it and exp's input (24 bytes/token); only the shared bool mask is left
    assert bytes_kept[0] - bytes_kept[1] == {"sapo": 8, "vanilla": 13, "gspo": 24}[name] * B * T
    if name == "gspo":
        assert bytes_kept[1] == B * T and all(t.dtype in (torch.bool, torch.uint8) for t in fast if t.shape == (B, T))


def test_batch_seen_by_losses(monkeypatch):
    monkeypatch.setenv("STABLERL_FUSED", "0")  # spies on the eager functions
    lp, old, a, valid = dirty_batch(torch.float32, seed=7)
    B, T = lp.shape
    seen = {}

    def spy(name):
        spec = get_spec(POLICY_LOSS, name)
        fn = spec.fn

        def wrapped(b, p, ctx):
            seq = b.seq_advantages
            seen[name] = (type(b).__name__, None if seq is None else seq.clone(), b.advantages.clone())
            return fn(b, p, ctx)
        monkeypatch.setattr(spec, "fn", wrapped)

    for name in ("sapo", "gmpo"):
        spy(name)
    expected = torch.where(valid, a[:, None].expand(B, T), torch.zeros(()))
    run("sapo", lp, old, a, valid)
    kind, seq, per_token = seen["sapo"]
    # row 2 (no valid token, NaN advantage) holds +0.0; per-token advantages on demand, today's bits
    assert seq.shape == (B, 1) and torch.equal(bits(seq[:, 0]), bits(torch.where(valid.any(-1), a, torch.zeros(()))))
    assert torch.equal(bits(per_token), bits(expected))
    # a loss that did not opt in sees exactly today's batch
    run("gmpo", lp, old, a, valid)
    kind, seq, per_token = seen["gmpo"]
    assert kind == "PolicyLossBatch" and seq is None and torch.equal(bits(per_token), bits(expected))
    # per-token advantages, and check_finite=False (which lets non-finite A on valid tokens through), take today's path
    for adv, kw in ((a[:, None].expand(B, T).contiguous(), {}), (a, {"check_finite": False})):
        run("sapo", lp, old, adv, valid, **kw)
        assert seen["sapo"][0] == "PolicyLossBatch" and seen["sapo"][1] is None


def test_non_finite_sequence_advantage_on_a_valid_row_is_still_an_error():
    lp, old, a, valid = dirty_batch(torch.float32, seed=9)
    a[0] = math.inf  # row 0 is full
    for name in FAST:
        with pytest.raises(stablerl.StableRLError, match="advantages has non-finite values"):
            run(name, lp, old, a, valid)


def test_only_policy_losses_may_opt_in():
    with pytest.raises(ValueError, match="only a policy loss may set seq_advantages"):
        AlgorithmSpec(name="x", kind="advantage_estimator", fn=lambda *a: None, seq_advantages=True)
    assert {s.name for s in stablerl.list_algorithms(POLICY_LOSS) if s.seq_advantages} == set(FAST)


def test_losses_see_cores_bool_mask(monkeypatch):
    monkeypatch.setenv("STABLERL_FUSED", "0")  # spies on the eager function
    # batch.valid_tokens is the very bool tensor core aggregates with (a bool caller mask is used as is), so a
    # loss masking with batch.bool_mask keeps no second mask; a hand-built batch falls back to a bool copy
    lp, old, a, valid = dirty_batch(torch.float32, seed=11)
    spec = get_spec(POLICY_LOSS, "sapo")
    seen = {}
    fn = spec.fn

    def wrapped(b, p, ctx):
        seen["valid_tokens"], seen["bool_mask"] = b.valid_tokens, b.bool_mask
        return fn(b, p, ctx)

    monkeypatch.setattr(spec, "fn", wrapped)
    run("sapo", lp, old, a, valid)
    assert seen["valid_tokens"] is valid and seen["bool_mask"] is valid
    run("sapo", lp, old, a, valid.float())
    assert seen["valid_tokens"].dtype == torch.bool and torch.equal(seen["valid_tokens"], valid)
    from stablerl.contracts import PolicyLossBatch

    by_hand = PolicyLossBatch(log_prob=lp, old_log_prob=old, advantages=a[:, None].expand_as(lp),
                              response_mask=valid.float())
    assert by_hand.valid_tokens is None and torch.equal(by_hand.bool_mask, valid)
