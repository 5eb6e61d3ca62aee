"""Routing replay without transformers: the Routes object, engine formats, alignment, and the
capture/replay mechanics on a torch-only toy MoE that follows the transformers-5 router contract."""

import base64

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stablerl
from stablerl import StableRLError
from stablerl import routing_replay as rr
from stablerl.routing_replay import Routes, RouterFamily, mismatch_fraction, softmax_gather_weights


def rand_routes(L, N, k, E, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(L * N)]).view(L, N, k)
    return Routes(idx, num_experts=E, **kw)


# ---------------------------------------------------------------- Routes basics


def test_dtype_and_bytes_per_token():
    r = rand_routes(3, 10, 4, 256)
    assert r.dtype == torch.uint8
    assert r.nbytes == 3 * 4 * 10 and r.bytes_per_token == 12.0
    r2 = rand_routes(3, 10, 4, 300)
    assert r2.dtype == torch.uint16 and r2.bytes_per_token == 24.0
    assert rr.index_dtype(256) == torch.uint8 and rr.index_dtype(257) == torch.uint16
    with pytest.raises(StableRLError):
        rr.index_dtype(70000)


def test_invalid_rows_encoded_as_duplicates_for_k2_and_mask_for_k1():
    r = rand_routes(2, 5, 2, 8)
    valid = torch.tensor([True, True, False, True, False])
    r2 = Routes(r.indices, num_experts=8, valid=valid)
    assert r2.nbytes == 2 * 5 * 2  # no mask kept
    assert torch.equal(r2.valid, valid.expand(2, 5))
    assert int(r2.indices[:, 2].long().sum()) == 0
    # top-1: explicit mask
    r1 = Routes(torch.tensor([[[3], [1], [0]]]), num_experts=4, valid=torch.tensor([True, False, True]))
    assert r1.valid.tolist() == [[True, False, True]]
    assert r1.nbytes == 3 + 3


def test_bad_routes_raise():
    with pytest.raises(StableRLError):
        Routes(torch.zeros(2, 3))  # not 3-D
    with pytest.raises(StableRLError):
        Routes(torch.tensor([[[0, -1]]]))
    with pytest.raises(StableRLError):
        Routes(torch.tensor([[[0, 9]]]), num_experts=8)
    with pytest.raises(StableRLError):
        Routes(torch.tensor([[[0, 1]]]).float())
    with pytest.raises(StableRLError):
        rand_routes(1, 6, 2, 8, batch_shape=(4, 2))


def test_check_messages():
    r = rand_routes(2, 12, 2, 8, batch_shape=(3, 4))
    with pytest.raises(StableRLError, match="13 tokens"):
        r.check(num_tokens=13)
    with pytest.raises(StableRLError, match="MoE layers"):
        r.check(num_layers=3)
    with pytest.raises(StableRLError, match="top-4"):
        r.check(top_k=4)
    with pytest.raises(StableRLError, match="batch of shape"):
        r.check_batch((4, 3))
    r.check_batch(torch.zeros(3, 4))


# ---------------------------------------------------------------- engine formats


def engine_array(L_moe_ids, H, n_rows, k, E, seed=0, dtype=np.uint8):
    g = np.random.default_rng(seed)
    arr = np.zeros((n_rows, H, k), dtype=dtype)
    for t in range(n_rows):
        for layer in L_moe_ids:
            arr[t, layer] = g.permutation(E)[:k]
    return arr


def test_from_vllm_maps_moe_layers_and_marks_missing_last_row():
    H, k, E, n = 4, 2, 8, 6  # layer 0 dense (first_k_dense_replace=1)
    arr = engine_array([1, 2, 3], H, n - 1, k, E)
    r = Routes.from_vllm(arr)
    assert r.num_layers == 3 and r.num_tokens == n and r.layer_ids == (1, 2, 3)
    assert r.dtype == torch.uint8
    assert r.valid[:, :-1].all() and not r.valid[:, -1].any()
    assert torch.equal(r.indices[:, :-1].long(), torch.from_numpy(arr[:, 1:].astype(np.int64)).permute(1, 0, 2))
    # explicit moe_layers and num_tokens
    r2 = Routes.from_vllm(arr, moe_layers=[1, 2, 3], num_tokens=n, num_experts=E)
    assert r2.equal(r)
    with pytest.raises(StableRLError, match="routed rows"):
        Routes.from_vllm(arr, num_tokens=n + 3)
    # round trip to the engine layout
    back = r.to_token_layer_slot(H)[:-1].numpy()
    assert np.array_equal(back, arr.astype(np.int64))


def test_from_vllm_uint16_and_unforwarded_tool_tokens():
    H, k, E, n = 2, 2, 300, 5
    arr = engine_array([0, 1], H, n - 1, k, E, dtype=np.uint16)
    arr[2] = 0  # a tool token the engine never forwarded: zero row in every layer
    r = Routes.from_vllm(arr)
    assert r.dtype == torch.uint16 and r.num_experts >= 256
    assert r.valid.tolist() == [[True, True, False, True, False]] * 2


def test_from_vllm_top1_needs_layers():
    arr = np.ones((3, 2, 1), dtype=np.uint8)
    with pytest.raises(StableRLError, match="moe_layers"):
        Routes.from_vllm(arr)
    r = Routes.from_vllm(arr, moe_layers=[0, 1])
    assert r.valid.tolist() == [[True, True, True, False]] * 2


def test_from_token_layer_slot_one_row_per_token_verl_layout():
    """verl's ``routed_experts`` field: [N, H, k] absolute layers, one row per token, zero rows = no route."""
    H, k, E, n = 4, 2, 8, 7
    arr = torch.from_numpy(engine_array([1, 3], H, n, k, E).astype(np.int16))
    arr[4] = 0  # padding / the last sampled token: no route
    r = Routes.from_token_layer_slot(arr, num_experts=E, cu_seqlens=torch.tensor([0, 3, 7]))
    assert r.num_tokens == n and r.layer_ids == (1, 3) and r.batch_shape == (1, n)
    assert r.cu_seqlens.tolist() == [0, 3, 7]
    assert r.valid.tolist() == [[True] * 4 + [False] + [True] * 2] * 2
    back = r.to_token_layer_slot(H)
    assert torch.equal(back, arr.long())  # exact inverse, zero rows included
    # moe_layers given explicitly, and a [B, T] view
    r2 = Routes.from_token_layer_slot(arr, moe_layers=[1, 3], num_experts=E, batch_shape=(1, n))
    assert torch.equal(r2.indices, r.indices)
    with pytest.raises(StableRLError, match="batch_shape"):
        Routes.from_token_layer_slot(arr, moe_layers=[1, 3], batch_shape=(2, 3))
    with pytest.raises(StableRLError, match="top-1"):
        Routes.from_token_layer_slot(torch.ones(3, 2, 1, dtype=torch.int16), moe_layers=[0, 1])


def sglang_b64(arr_int32):
    return base64.b64encode(np.ascontiguousarray(arr_int32, dtype="<i4").tobytes()).decode("utf-8")


def test_from_sglang_base64_matches_vllm():
    H, k, E, n = 3, 2, 16, 7
    arr = engine_array([1, 2], H, n - 1, k, E).astype(np.int32)
    sg = arr.copy()
    sg[:, 0] = -1  # SGLang placeholder for the dense layer
    r = Routes.from_sglang(sglang_b64(sg.reshape(-1)), H, k)
    assert r.layer_ids == (1, 2) and r.num_tokens == n
    assert r.equal(Routes.from_vllm(arr.astype(np.uint8)))
    # decoded flat array also accepted
    assert r.equal(Routes.from_sglang(sg.reshape(-1), H, k))
    with pytest.raises(StableRLError, match="multiple"):
        Routes.from_sglang(sglang_b64(sg.reshape(-1)[:-1]), H, k)


# ---------------------------------------------------------------- alignment


def test_pad_batch_left_and_right():
    a, b = rand_routes(2, 3, 2, 8, seed=1), rand_routes(2, 5, 2, 8, seed=2)
    right = Routes.pad_batch([a, b], side="right")
    left = Routes.pad_batch([a, b], side="left")
    assert right.batch_shape == (2, 5) and left.batch_shape == (2, 5)
    vr, vl = right.valid.view(2, 2, 5), left.valid.view(2, 2, 5)
    assert vr[0, 0].tolist() == [True] * 3 + [False] * 2
    assert vl[0, 0].tolist() == [False] * 2 + [True] * 3
    assert torch.equal(right.as_batch()[:, 0, :3], a.indices)
    assert torch.equal(left.as_batch()[:, 0, 2:], a.indices)
    assert torch.equal(left.as_batch()[:, 1], b.indices)
    with pytest.raises(StableRLError, match="do not fit"):
        Routes.pad_batch([a, b], length=4)


def test_pad_prompt_response_layout():
    s0, s1 = rand_routes(2, 5, 2, 8, seed=3), rand_routes(2, 6, 2, 8, seed=4)  # prompts 2 and 4 tokens
    r = Routes.pad_prompt_response([s0, s1], prompt_lengths=[2, 4], prompt_width=4, response_width=3)
    assert r.batch_shape == (2, 7)
    v = r.valid[0].view(2, 7)
    assert v[0].tolist() == [False, False, True, True, True, True, True]
    assert v[1].tolist() == [True] * 6 + [False]
    assert torch.equal(r.as_batch()[:, 0, 2:], s0.indices)


def test_pack_unpad_pad_roundtrip():
    seqs = [rand_routes(2, n, 2, 8, seed=10 + n) for n in (3, 5, 2)]
    padded = Routes.pad_batch(seqs, side="left")
    mask = torch.zeros(3, 5, dtype=torch.long)
    for i, n in enumerate((3, 5, 2)):
        mask[i, 5 - n:] = 1
    packed = padded.unpad(mask)
    ref = Routes.pack(seqs)
    assert packed.equal(ref) and packed.cu_seqlens.tolist() == [0, 3, 8, 10] == ref.cu_seqlens.tolist()
    assert [s.num_tokens for s in packed.sequences()] == [3, 5, 2]
    back = packed.pad(mask)
    assert back.equal(padded)
    with pytest.raises(StableRLError):
        packed.pad(torch.ones(3, 5))


def test_rows_split_extend_concat():
    r = rand_routes(2, 12, 2, 8, batch_shape=(4, 3))
    sub = r.rows([2, 0])
    assert sub.batch_shape == (2, 3)
    assert torch.equal(sub.as_batch()[:, 0], r.as_batch()[:, 2])
    parts = r.split(3)
    assert [p.batch_shape for p in parts] == [(3, 3), (1, 3)]
    e = r.extend(2)
    assert e.batch_shape == (4, 5) and not e.valid.view(2, 4, 5)[:, :, 3:].any() and e.valid.view(2, 4, 5)[:, :, :3].all()
    flat = rand_routes(2, 4, 2, 8).extend(1)
    assert flat.batch_shape is None and flat.num_tokens == 5 and flat.valid[:, -1].sum() == 0
    cat = Routes.concat_tokens([rand_routes(2, 2, 2, 8), rand_routes(2, 3, 2, 8)])
    assert cat.num_tokens == 5
    with pytest.raises(StableRLError):
        Routes.concat_tokens([rand_routes(2, 2, 2, 8), rand_routes(3, 2, 2, 8)])


def test_mismatch_fraction_compares_sets():
    a = Routes(torch.tensor([[[0, 1], [2, 3], [4, 5]]]), num_experts=8)
    b = Routes(torch.tensor([[[1, 0], [2, 6], [7, 6]]]), num_experts=8)
    # token 0: same set (order differs) -> 0; token 1: one of two -> 1; token 2: both -> 2  => 3 / 6
    assert mismatch_fraction(a, b) == pytest.approx(0.5)
    assert mismatch_fraction(a, a) == 0.0
    c = Routes(b.indices, num_experts=8, valid=torch.tensor([True, True, False]))
    assert mismatch_fraction(a, c) == pytest.approx(1 / 4)
    with pytest.raises(StableRLError):
        mismatch_fraction(a, rand_routes(1, 4, 2, 8))


# ---------------------------------------------------------------- registry


def test_builtin_families_registered():
    names = {s.name for s in stablerl.list_algorithms("router_family")}
    assert {"qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3"} <= names
    fams = {f.name: f for f in rr.router_families()}
    assert fams["qwen3_moe"].class_names == ("Qwen3MoeTopKRouter",)


# ---------------------------------------------------------------- toy MoE (transformers-5 router contract)


class ToyRouter(nn.Module):
    def __init__(self, H, E, k, norm):
        super().__init__()
        self.top_k, self.num_experts, self.norm_topk_prob, self.hidden_dim = k, E, norm, H
        self.weight = nn.Parameter(torch.randn(E, H) * 0.5)

    def forward(self, h):
        h = h.reshape(-1, self.hidden_dim)
        logits = F.linear(h, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return logits, w.to(logits.dtype), idx


class ToyBlock(nn.Module):
    def __init__(self, H, E, k, norm):
        super().__init__()
        self.gate = ToyRouter(H, E, k, norm)
        self.w = nn.Parameter(torch.randn(E, H, H) * 0.3)

    def forward(self, x):
        B, T, H = x.shape
        h = x.reshape(-1, H)
        _, w, idx = self.gate(h)
        out = torch.einsum("nh,nkhg->nkg", h, self.w[idx])
        return x + (out * w.unsqueeze(-1)).sum(1).view(B, T, H)


class ToyLayer(nn.Module):
    def __init__(self, H, E, k, norm):
        super().__init__()
        self.mlp = ToyBlock(H, E, k, norm)

    def forward(self, x):
        return self.mlp(x)


class Recompute(torch.autograd.Function):
    """Minimal activation checkpointing (what torch.utils.checkpoint does, without its slow first import):
    forward without a graph, the layer re-run in backward."""

    @staticmethod
    def forward(ctx, layer, x):
        ctx.layer = layer
        ctx.save_for_backward(x)
        with torch.no_grad():
            return layer(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = ctx.layer(x)
        torch.autograd.backward(out, grad)
        return None, x.grad


class ToyMoE(nn.Module):
    def __init__(self, V=16, H=8, E=6, k=2, L=3, norm=False, gc=False):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.layers = nn.ModuleList(ToyLayer(H, E, k, norm) for _ in range(L))
        self.head = nn.Linear(H, V)
        self.gc = gc

    def forward(self, input_ids):
        x = self.emb(input_ids)
        for layer in self.layers:
            x = Recompute.apply(layer, x) if self.gc else layer(x)
        return self.head(x)


TOY = RouterFamily(
    "toy", lambda lg, idx, m: softmax_gather_weights(lg, idx, m.norm_topk_prob, lg.dtype), class_names=("ToyRouter",)
)


def toy(seed=0, **kw):
    torch.manual_seed(seed)
    return ToyMoE(**kw).double()


def test_find_routers_layer_ids_and_unknown_model():
    m = toy()
    rs = rr.find_routers(m, [TOY])
    assert [r.layer_id for r in rs] == [0, 1, 2] and rs[0].name == "layers.0.mlp.gate"
    with pytest.raises(StableRLError, match="no MoE router"):
        rr.capture(nn.Linear(2, 2), [TOY])


def test_self_replay_exact_and_capture_inside_replay():
    m = toy()
    x = torch.randint(0, 16, (2, 5))
    with rr.capture(m, [TOY]) as cap:
        ref = m(x)
    r = cap.routes()
    assert r.batch_shape == (2, 5) and r.num_layers == 3 and r.nbytes == 3 * 2 * 10
    with rr.replay(m, r, [TOY]):
        assert torch.equal(m(x), ref)
    other = rand_routes(3, 10, 2, 6, seed=5, batch_shape=(2, 5))
    with rr.replay(m, other, [TOY]):
        with rr.capture(m, [TOY]) as cap2:
            out = m(x)
    assert cap2.routes().equal(other)
    assert not torch.allclose(out, ref)


def test_replay_weights_recomputed_from_live_logits_with_gradient():
    m = toy(norm=False)
    x = torch.randint(0, 16, (1, 4))
    other = rand_routes(3, 4, 2, 6, seed=7, batch_shape=(1, 4))
    seen = {}

    def spy(mod, args, out):
        seen["w"], seen["idx"], seen["logits"] = out[1], out[2], out[0]

    h = m.layers[0].mlp.gate.register_forward_hook(spy)  # registered first; replay is prepended
    with rr.replay(m, other, [TOY]):
        m(x).sum().backward()
    h.remove()
    idx = other.indices[0].long()
    expect = torch.softmax(seen["logits"].detach(), -1).gather(-1, idx)  # no renormalisation (norm_topk_prob=False)
    assert torch.equal(seen["idx"], idx)
    assert torch.allclose(seen["w"].detach(), expect, atol=1e-12)
    assert m.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_replay_gradient_checkpointing_keyed_by_module():
    x = torch.randint(0, 16, (2, 5))
    other = rand_routes(3, 10, 2, 6, seed=9, batch_shape=(2, 5))
    grads, calls = [], []
    for gc in (False, True):
        m = toy(seed=1, gc=gc)
        with rr.replay(m, other, [TOY]) as h, rr.capture(m, [TOY]) as cap:
            m(x).pow(2).sum().backward()
        assert cap.routes().equal(other)  # recomputation in backward is not recorded twice
        grads.append([p.grad.clone() for p in m.parameters()])
        calls.append(list(h.calls))
    assert calls == [[1, 1, 1], [2, 2, 2]]  # recomputed in backward with the same routes
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_invalid_rows_route_natively_and_token_mismatch_raises():
    m = toy()
    x = torch.randint(0, 16, (2, 5))
    ref = m(x)
    other = rand_routes(3, 10, 2, 6, seed=3, batch_shape=(2, 5))
    none_valid = Routes(other.indices, num_experts=6, batch_shape=(2, 5), valid=torch.zeros(10, dtype=torch.bool))
    with rr.replay(m, none_valid, [TOY]):
        assert torch.equal(m(x), ref)
    with rr.replay(m, other, [TOY]):
        with pytest.raises(StableRLError, match="received 12 tokens"):
            m(torch.randint(0, 16, (2, 6)))
    with pytest.raises(StableRLError, match="MoE layers"):
        rr.replay(m, rand_routes(2, 10, 2, 6), [TOY])
    with pytest.raises(StableRLError, match="top-"):
        rr.replay(m, rand_routes(3, 10, 3, 6), [TOY])


def test_remove_restores_and_no_nesting():
    m = toy()
    x = torch.randint(0, 16, (2, 5))
    ref = m(x)
    h = rr.replay(m, rand_routes(3, 10, 2, 6, batch_shape=(2, 5)), [TOY])
    with pytest.raises(StableRLError, match="already active"):
        rr.replay(m, None, [TOY])
    assert not torch.equal(m(x), ref)
    h.remove()
    assert torch.equal(m(x), ref)
    assert all(not mod._forward_hooks and not mod._forward_pre_hooks for mod in m.modules())
    with rr.capture(m, [TOY]):
        pass
    assert all(not mod._forward_hooks and not mod._forward_pre_hooks for mod in m.modules())


def test_capture_groups_and_set_routes():
    m = toy()
    with rr.capture(m, [TOY]) as cap:
        m(torch.randint(0, 16, (2, 3)))
        m(torch.randint(0, 16, (1, 4)))
    rl = cap.routes_list()
    assert [r.batch_shape for r in rl] == [(2, 3), (1, 4)]
    with pytest.raises(StableRLError, match="routes_list"):
        cap.routes()
    h = rr.replay(m, None, [TOY])
    x = torch.randint(0, 16, (2, 3))
    ref = m(x)
    h.set_routes(rl[0])
    with rr.capture(m, [TOY]) as cap2:
        m(x)
    assert cap2.routes().equal(rl[0])
    h.set_routes(None)
    assert torch.equal(m(x), ref)
    h.remove()


def test_family_spec_and_ambiguous_match():
    spec = TOY.spec(paper="2510.11370")
    assert spec.kind == stablerl.ROUTER_FAMILY and spec.fn is TOY and spec.name == "toy"
    clash = RouterFamily("toy2", TOY.recompute, matcher=lambda m: isinstance(m, ToyRouter))
    with pytest.raises(StableRLError, match="several router families"):
        rr.find_routers(toy(), [TOY, clash])
    preferred = RouterFamily("toy3", TOY.recompute, class_names=("ToyRouter",), priority=1)
    assert {r.family.name for r in rr.find_routers(toy(), [TOY, preferred])} == {"toy3"}


# ---------------------------------------------------------------- batch-first tensors (TRL rows)


def test_batch_tensor_roundtrip_rows_and_shuffle():
    r = rand_routes(3, 4 * 5, 2, 8, batch_shape=(4, 5))
    valid = torch.ones(3, 20, dtype=torch.bool)
    valid[:, 0] = False  # padding column of row 0
    r = Routes(r.indices, num_experts=8, batch_shape=(4, 5), layer_ids=(1, 2, 3), valid=valid)
    t, v = r.batch_tensor()
    assert t.shape == (4, 5, 3, 2) and t.dtype == torch.uint8 and v is None
    # token (b, j) of layer l is indices[l, b*T + j]
    assert torch.equal(t[2, 3, 1], r.indices[1, 2 * 5 + 3])
    back = Routes.from_batch_tensor(t, num_experts=8, layer_ids=r.layer_ids)
    assert back.equal(r) and back.batch_shape == (4, 5) and back.layer_ids == (1, 2, 3)
    assert not bool(back.valid[:, 0].any())
    perm = torch.tensor([2, 0, 3, 1])  # a framework shuffle of the rows == Routes.rows
    assert Routes.from_batch_tensor(t[perm], num_experts=8).equal(r.rows(perm))
    assert Routes.from_batch_tensor(t[2:4], num_experts=8).equal(r.split(2)[1])


def test_batch_tensor_wide_and_top1_mask():
    r = rand_routes(2, 6, 2, 300, batch_shape=(2, 3))
    t, _ = r.batch_tensor()
    assert t.dtype == torch.int16
    assert Routes.from_batch_tensor(t, num_experts=300).equal(r)
    idx = torch.randint(0, 4, (2, 6, 1))
    valid = torch.tensor([True, False, True, True, True, False])
    r1 = Routes(idx, num_experts=4, batch_shape=(2, 3), valid=valid)
    t1, v1 = r1.batch_tensor()
    assert v1 is not None and v1.shape == (2, 3, 2) and not bool(v1[0, 1].any()) and bool(v1[0, 0].all())
    back = Routes.from_batch_tensor(t1, num_experts=4, valid=v1)
    assert back.equal(r1)
    with pytest.raises(StableRLError, match="B, T, L, k"):
        Routes.from_batch_tensor(t1[0], num_experts=4)
    with pytest.raises(StableRLError, match="valid must be"):
        Routes.from_batch_tensor(t1, num_experts=4, valid=v1[:, :2])
    with pytest.raises(StableRLError, match="batch_shape"):
        Routes(idx, num_experts=4).batch_tensor()


# ---------------------------------------------------------------- router log-probs at the experts used (RSPO)


def test_capture_records_router_log_probs_at_used_experts():
    m = toy()
    x = torch.randint(0, 16, (2, 5))
    logits = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, a, out: logits.append(out[0].detach()))
             for layer in m.layers]
    other = rand_routes(3, 10, 2, 6, seed=5, batch_shape=(2, 5))
    with rr.replay(m, other, [TOY]), rr.capture(m, [TOY], record_log_probs=True) as cap:
        m(x).sum().backward()
    for h in hooks:
        h.remove()
    (lp,) = cap.log_probs_list()
    assert lp.shape == (3, 10, 2) and lp.dtype == torch.float32 and not lp.requires_grad
    idx = other.indices.long()
    for layer in range(3):  # log_softmax over all 6 experts, at the replayed experts (float64 reference)
        ref = torch.log_softmax(logits[layer].double(), -1).gather(-1, idx[layer])
        assert torch.allclose(lp[layer].double(), ref, atol=1e-6)
    (bf,) = cap.log_probs_list(batch_first=True)
    assert bf.shape == (2, 5, 3, 2) and torch.equal(bf[1, 3, 2], lp[2, 1 * 5 + 3])
    with rr.capture(m, [TOY]) as plain:
        m(x)
    with pytest.raises(StableRLError, match="record_log_probs"):
        plain.log_probs_list()


def test_capture_log_probs_ignore_checkpoint_recomputation():
    m = toy(gc=True)
    x = torch.randint(0, 16, (1, 4))
    with rr.capture(m, [TOY], record_log_probs=True) as cap:
        m(x).sum().backward()  # the routers run again in backward
    lps = cap.log_probs_list()
    assert len(lps) == 1 and lps[0].shape == (3, 4, 2) and bool((lps[0] <= 0).all())
