"""Routing replay on real transformers MoE models (tiny, built in code), one test per claim and family.

Run: cd /work/main && /tmp/v-trl/bin/python -m pytest integrations_tests/moe -q -p no:cacheprovider --import-mode=importlib
(add -s to see the measured numbers)."""

import base64
import copy

import numpy as np
import pytest
import torch

from stablerl import StableRLError
from stablerl import routing_replay as rr
from stablerl.routing_replay import Routes, mismatch_fraction

from moe_models import FAMILIES, VOCAB, build_moe, left_padded_batch

ROUTERS = {"qwen3_moe": 2, "qwen2_moe": 2, "mixtral": 2, "olmoe": 2, "deepseek_v3": 2}


def fwd(model, ids, mask=None, **kw):
    return model(input_ids=ids, attention_mask=mask, **kw).logits


def hooks_snapshot(model):
    return {
        name: (tuple(m._forward_hooks), tuple(m._forward_pre_hooks), tuple(m._backward_hooks))
        for name, m in model.named_modules()
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_detects_family_and_self_replay_is_exact(family):
    model = build_moe(family)
    routers = rr.find_routers(model)
    assert len(routers) == ROUTERS[family] and {r.family.name for r in routers} == {family}
    if family == "deepseek_v3":
        assert [r.layer_id for r in routers] == [1, 2]  # layer 0 is dense
    ids, mask = left_padded_batch()
    with torch.no_grad():
        with rr.capture(model) as cap:
            ref = fwd(model, ids, mask)
        routes = cap.routes()
        assert routes.batch_shape == tuple(ids.shape) and routes.top_k == 2
        with rr.replay(model, routes) as h:
            with rr.capture(model) as cap2:
                out = fwd(model, ids, mask)
    assert h.calls == [1] * len(routers)
    assert torch.equal(out, ref)  # bitwise: same experts, same weights
    assert mismatch_fraction(routes, cap2.routes()) == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_optimizer_step_drifts_without_replay_not_with(family):
    ids = torch.randint(2, VOCAB, (4, 16), generator=torch.Generator().manual_seed(3))
    results = {}
    for use_replay in (False, True):
        model = build_moe(family).train()
        with torch.no_grad(), rr.capture(model) as cap:
            fwd(model, ids)
        r0 = cap.routes()
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        handle = rr.replay(model, r0) if use_replay else None
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grad = sum(float(r.module.weight.grad.abs().sum()) for r in rr.find_routers(model))
        opt.step()
        with torch.no_grad(), rr.capture(model) as cap:
            fwd(model, ids)
        results[use_replay] = (mismatch_fraction(r0, cap.routes()), grad)
        if handle is not None:
            handle.remove()
    print(f"\n{family}: drift after one Adam step: without replay {results[False][0]:.4f}, "
          f"with replay {results[True][0]:.4f}; router |grad| with replay {results[True][1]:.3e}")
    assert results[False][0] > 0.0
    assert results[True][0] == 0.0
    assert results[True][1] > 0.0  # the router still learns under replay


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_holds_under_gradient_checkpointing(family):
    ids = torch.randint(2, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(6)
    model0 = build_moe(family)
    L = len(rr.find_routers(model0))
    other = Routes(torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(L * 16)]).view(L, 16, 2),
                   num_experts=8, batch_shape=(2, 8))
    runs = {}
    for gc in (False, True):
        model = copy.deepcopy(model0).train()
        if gc:
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        with rr.replay(model, other) as h, rr.capture(model) as cap:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        runs[gc] = (loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None], list(h.calls),
                    cap.routes())
    assert runs[False][2] == [1] * L and runs[True][2] == [2] * L  # the hook fired again in recomputation
    assert torch.equal(runs[False][0], runs[True][0])
    assert len(runs[False][1]) == len(runs[True][1])
    for a, b in zip(runs[False][1], runs[True][1]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    assert runs[True][3].equal(other)  # capture inside replay: the replayed experts, recorded once


def _kl(p_logits, q_logits):
    lp, lq = torch.log_softmax(p_logits.float(), -1), torch.log_softmax(q_logits.float(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_rollout_vs_fp32_training_kl_smaller_with_replay(family):
    """R3 in miniature: a bf16 'rollout' model and the fp32 'training' model disagree on some routes; replaying
    the bf16 routes in the fp32 forward makes the per-token log-prob KL smaller."""
    ids = torch.randint(2, VOCAB, (8, 32), generator=torch.Generator().manual_seed(1))
    seen = []
    for seed in range(3):
        model = build_moe(family, seed=seed, initializer_range=0.1)
        m16 = copy.deepcopy(model).to(torch.bfloat16)
        with torch.no_grad():
            with rr.capture(m16) as cap:
                l16 = fwd(m16, ids)
            r16 = cap.routes()
            with rr.capture(model) as cap:
                l_plain = fwd(model, ids)
            with rr.replay(model, r16):
                l_replay = fwd(model, ids)
        dis, kl_plain, kl_replay = mismatch_fraction(r16, cap.routes()), _kl(l16, l_plain), _kl(l16, l_replay)
        seen.append((dis, kl_plain, kl_replay))
        assert kl_replay <= kl_plain * (1 + 1e-6)
        if dis > 0:
            break
    print(f"\n{family}: bf16-vs-fp32 routing disagreement {dis:.4f}; KL(bf16||fp32) without replay {kl_plain:.3e}, "
          f"with replay {kl_replay:.3e} (seed {seed})")
    assert dis > 0, seen
    assert kl_replay < kl_plain


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_capture_aligns_with_training_layout(family):
    """Routes from generate (prefill (B*P,k) + per-step (B,k)) line up with the [prompt | completion] forward."""
    model = build_moe(family)
    ids, mask = left_padded_batch(B=3, T=6)
    with torch.no_grad(), rr.capture(model) as cap:
        seq = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert "generate" not in vars(model)
    routes = cap.routes()
    assert routes.batch_shape == (3, 6 + 4 - 1)  # the last sampled token is never forwarded
    full = routes.extend(1)
    full_mask = torch.cat([mask, torch.ones(3, 4, dtype=mask.dtype)], 1)
    with torch.no_grad():
        with rr.capture(model) as cap2:
            ref = fwd(model, seq, full_mask)
        with rr.replay(model, full):
            out = fwd(model, seq, full_mask)
    assert mismatch_fraction(full, cap2.routes()) == 0.0
    assert torch.allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_vllm_and_sglang_formats_replay_on_model(family):
    model = build_moe(family)
    H = model.config.num_hidden_layers
    ids = torch.randint(2, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), rr.capture(model) as cap:
        ref = fwd(model, ids)
    native = cap.routes()
    engine = native.to_token_layer_slot(H)[:-1]  # [tokens - 1, num_hidden_layers, k], dense layers zero
    vllm_arr = engine.numpy().astype(np.uint8)
    sg = engine.numpy().astype(np.int32)
    dense = [i for i in range(H) if i not in native.layer_ids]
    sg[:, dense] = -1
    sg_b64 = base64.b64encode(sg.reshape(-1).astype("<i4").tobytes()).decode()
    for routes in (Routes.from_vllm(vllm_arr, model=model), Routes.from_vllm(vllm_arr),
                   Routes.from_sglang(sg_b64, H, 2), Routes.from_sglang(sg_b64, H, 2, model=model)):
        assert routes.layer_ids == native.layer_ids and routes.num_tokens == 9
        assert not routes.valid[:, -1].any()
        with torch.no_grad(), rr.replay(model, routes.extend(0)):
            out = fwd(model, ids)
        assert torch.equal(out, ref)  # missing last row routed natively; others replayed exactly


def test_packed_layout_and_padding_alignment():
    model = build_moe("qwen3_moe")
    lens = (5, 3)
    seqs_ids = [torch.randint(2, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in lens]
    per_seq = []
    with torch.no_grad():
        for s in seqs_ids:
            with rr.capture(model) as cap:
                fwd(model, s)
            per_seq.append(cap.routes().sequences()[0])
        packed = Routes.pack(per_seq)
        packed_ids = torch.cat(seqs_ids, 1)
        pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
        with rr.replay(model, packed), rr.capture(model) as cap:
            fwd(model, packed_ids, position_ids=pos)
        assert mismatch_fraction(packed, cap.routes()) == 0.0
        # right-padded batch of the same sequences: pad rows route natively, real rows replay
        batch = Routes.pad_batch(per_seq, side="right")
        ids = torch.zeros(2, 5, dtype=torch.long)
        mask = torch.zeros(2, 5, dtype=torch.long)
        for i, s in enumerate(seqs_ids):
            ids[i, : s.shape[1]] = s[0]
            mask[i, : s.shape[1]] = 1
        assert batch.unpad(mask).equal(packed)
        with rr.replay(model, batch), rr.capture(model) as cap:
            fwd(model, ids, mask)
        assert mismatch_fraction(batch, cap.routes()) == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_memory_and_remove_restores_exactly(family):
    model = build_moe(family)
    ids, mask = left_padded_batch()
    before_hooks, before_attrs = hooks_snapshot(model), set(vars(model))
    with torch.no_grad():
        ref = fwd(model, ids, mask)
        with rr.capture(model) as cap:
            fwd(model, ids, mask)
        routes = cap.routes()
        L = len(rr.find_routers(model))
        assert routes.dtype == torch.uint8 and routes.nbytes == L * 2 * ids.numel()  # L x k bytes per token
        g = torch.Generator().manual_seed(0)
        other = Routes(torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(L * ids.numel())]).view(
            L, ids.numel(), 2), num_experts=8, batch_shape=tuple(ids.shape))
        h = rr.replay(model, other)
        assert not torch.equal(fwd(model, ids, mask), ref)
        h.remove()
        assert hooks_snapshot(model) == before_hooks and set(vars(model)) == before_attrs
        assert torch.equal(fwd(model, ids, mask), ref)
        with rr.replay(model, other):
            pass
        assert hooks_snapshot(model) == before_hooks
        assert torch.equal(fwd(model, ids, mask), ref)


def test_uint16_routes_above_256_experts():
    model = build_moe("qwen3_moe", num_experts=300, moe_intermediate_size=4)
    ids, mask = left_padded_batch(B=2, T=5)
    with torch.no_grad():
        with rr.capture(model) as cap:
            ref = fwd(model, ids, mask)
        routes = cap.routes()
        assert routes.dtype == torch.uint16 and routes.nbytes == 2 * 2 * 2 * ids.numel()
        with rr.replay(model, routes):
            assert torch.equal(fwd(model, ids, mask), ref)


def test_clear_errors_when_routes_do_not_match():
    model = build_moe("qwen3_moe")
    ids, mask = left_padded_batch(B=2, T=6)
    with torch.no_grad(), rr.capture(model) as cap:
        fwd(model, ids, mask)
    routes = cap.routes()
    with torch.no_grad(), rr.replay(model, routes):
        with pytest.raises(StableRLError, match="received 14 tokens but the routes hold 12"):
            fwd(model, torch.ones(2, 7, dtype=torch.long))
    three = Routes(torch.cat([routes.indices, routes.indices[:1]]).long(), num_experts=8)
    with pytest.raises(StableRLError, match="3 MoE layers but the model has 2"):
        rr.replay(model, three)
    top3 = Routes(torch.stack([torch.randperm(8)[:3] for _ in range(24)]).view(2, 12, 3), num_experts=8)
    with pytest.raises(StableRLError, match="top-3"):
        rr.replay(model, top3)
    assert hooks_snapshot(model) == hooks_snapshot(build_moe("qwen3_moe"))
