"""Distributed invariance: 2 data-parallel ranks (gloo, CPU) equal 1 rank with the whole batch.

Two processes started with torch.multiprocessing each hold half of the rows of one batch, call the
loss with ``stablerl.torch_distributed_context(token_count=<global valid tokens>, seq_count=<global
sequences>)``, and average the gradient of a shared parameter over ranks as DDP/FSDP do. That
average must equal the gradient of the whole-batch loss on one rank; for M2PO also the mask (seen
through the per-token gradient) and the batch metrics, since its M2 statistic is gathered over
ranks. Also: splitting a batch into micro-batches with the global token count does not change the
summed gradient of a token-mean loss.
"""

import pytest
import torch

import stablerl
from stablerl import Context, compute_policy_loss
from stablerl.testing import launch_gloo

F64 = torch.float64
B, T, WORLD = 8, 12, 2
# (case, loss name, hyper-parameters); all aggregated with token-mean except gmpo (sequence mean)
CASES = [
    ("vanilla", "vanilla", {}),
    ("m2po", "m2po", {}),
    ("m2po_clip_bounds", "m2po", {"variant": "clip_bounds"}),
    ("gspo", "gspo", {"clip_ratio_low": 0.02, "clip_ratio_high": 0.03}),
    ("gmpo", "gmpo", {}),
    ("cispo", "cispo", {}),
    ("cpgd", "cpgd", {}),
]
BATCH_METRICS = ("m2po/m2_before", "m2po/m2_after", "m2po/masked_fraction", "m2po/trust_region_fraction")


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=F64) * 2 - 0.05
    feats = torch.randn(B, T, 4, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64).unsqueeze(-1).expand(B, T).clone()
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(-1)
    w0 = torch.randn(4, generator=g, dtype=F64) * 0.5
    return {"old": old, "feats": feats, "adv": adv, "mask": mask, "w0": w0}


def _loss(d, rows, name, kw, ctx):
    """A tiny 'model': log_prob = old + 0.5 tanh(features @ w), with w the shared parameter."""
    w = d["w0"].clone().requires_grad_(True)
    lp = d["old"][rows] + 0.5 * torch.tanh(d["feats"][rows] @ w)
    lp.retain_grad()
    loss, metrics = compute_policy_loss(
        name, log_prob=lp, old_log_prob=d["old"][rows], advantages=d["adv"][rows],
        response_mask=d["mask"][rows], ctx=ctx, **kw,
    )
    loss.backward()
    return loss.detach(), w.grad, lp.grad, metrics


def _rank(rank, world):
    d = _data()
    per = B // world
    rows = slice(rank * per, (rank + 1) * per)
    ctx_kw = {"token_count": float(d["mask"].sum()), "seq_count": float(B)}
    out = {}

    def run(case, data, name, kw, ctx):
        _, grad_w, grad_lp, metrics = _loss(data, rows, name, kw, ctx)
        torch.distributed.all_reduce(grad_w)  # DDP: average the parameter gradient over ranks
        out[case] = {"grad_w": grad_w / world, "grad_lp": grad_lp / world, "metrics": metrics}

    for case, name, kw in CASES:
        ctx = stablerl.torch_distributed_context(**ctx_kw)
        assert ctx.dp_size == world
        run(case, d, name, kw, ctx)
    # a rank without trust-region tokens (its advantages are 0: zero-variance groups), then both
    for case, zero_rows in (("m2po_rank1_empty", slice(B // 2, B)), ("m2po_all_empty", slice(None))):
        d_zero = _data()
        d_zero["adv"][zero_rows] = 0.0
        run(case, d_zero, "m2po", {}, stablerl.torch_distributed_context(**ctx_kw))
    # the same M2PO call without the gather: the statistic of this rank's rows only
    run("m2po_local_only", d, "m2po", {}, Context(dp_size=world, **ctx_kw))
    return out


@pytest.fixture(scope="module")
def two_rank_results():
    return launch_gloo(_rank, WORLD)


def _one_rank(name, kw):
    d = _data()
    return _loss(d, slice(None), name, kw, Context())


@pytest.mark.parametrize("case,name,kw", CASES, ids=[c[0] for c in CASES])
def test_two_ranks_equal_one_rank(two_rank_results, case, name, kw):
    _, grad_w, grad_lp, metrics = _one_rank(name, kw)
    assert torch.count_nonzero(grad_w) > 0
    for rank, res in enumerate(two_rank_results):
        torch.testing.assert_close(res[case]["grad_w"], grad_w, rtol=1e-10, atol=1e-13)
    rank_grads = torch.cat([res[case]["grad_lp"] for res in two_rank_results])
    torch.testing.assert_close(rank_grads, grad_lp, rtol=1e-10, atol=1e-13)
    if name == "m2po":
        for res in two_rank_results:
            for k in BATCH_METRICS:
                assert res[case]["metrics"][k] == pytest.approx(metrics[k], rel=1e-6, abs=1e-9), k
        if case == "m2po":
            assert metrics["m2po/masked_fraction"] > 0  # the batch exercises the mask
            assert metrics["m2po/m2_after"] <= 0.04 < metrics["m2po/m2_before"]
            # the mask itself (zero-gradient valid tokens) is the same
            mask = _data()["mask"]
            assert torch.equal((rank_grads == 0) & mask, (grad_lp == 0) & mask)
        else:
            for res in two_rank_results:
                assert res[case]["metrics"]["m2po/clip_high"] == pytest.approx(metrics["m2po/clip_high"], rel=1e-12)
            assert metrics["m2po/clip_high"] < 1.0  # the batch exercises the bounds


@pytest.mark.parametrize("case,zero_rows", [("m2po_rank1_empty", slice(B // 2, B)), ("m2po_all_empty", slice(None))])
def test_m2po_rank_without_trust_region_tokens(two_rank_results, case, zero_rows):
    d = _data()
    d["adv"][zero_rows] = 0.0
    _, grad_w, grad_lp, metrics = _loss(d, slice(None), "m2po", {}, Context())
    for res in two_rank_results:
        torch.testing.assert_close(res[case]["grad_w"], grad_w, rtol=1e-10, atol=1e-13)
        for k in BATCH_METRICS:
            assert res[case]["metrics"][k] == pytest.approx(metrics[k], rel=1e-6, abs=1e-9), k
    torch.testing.assert_close(torch.cat([r[case]["grad_lp"] for r in two_rank_results]), grad_lp, rtol=1e-10, atol=1e-13)


def test_m2po_without_the_gather_differs(two_rank_results):
    """The check above can fail: the per-rank statistic gives another mask and gradient."""
    _, grad_w, _, metrics = _one_rank("m2po", {})
    local = [res["m2po_local_only"] for res in two_rank_results]
    assert any(r["metrics"]["m2po/m2_before"] != pytest.approx(metrics["m2po/m2_before"], rel=1e-6) for r in local)
    assert not torch.allclose(local[0]["grad_w"], grad_w, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name,mode", [("vanilla", "token-mean"), ("cispo", "token-mean"), ("cpgd", "token-mean"),
                                       ("vanilla", "seq-mean-token-mean"), ("gmpo", "token-mean")])
def test_micro_batches_with_global_normaliser_sum_to_whole_batch(name, mode):
    d = _data(seed=1)
    _, grad_w, _, _ = _loss(d, slice(None), name, {"loss_agg_mode": mode}, Context())
    ctx = Context(token_count=float(d["mask"].sum()), seq_count=float(B))
    total = torch.zeros_like(grad_w)
    for rows in (slice(0, 3), slice(3, 5), slice(5, B)):  # uneven micro-batches
        _, g, _, _ = _loss(d, rows, name, {"loss_agg_mode": mode}, ctx)
        total += g
    torch.testing.assert_close(total, grad_w, rtol=1e-10, atol=1e-13)
    # and with the local normaliser it would not be equal (the test can fail)
    wrong = sum(_loss(d, rows, name, {"loss_agg_mode": mode}, Context())[1] for rows in (slice(0, 3), slice(3, 5), slice(5, B)))
    assert not torch.allclose(wrong, grad_w, rtol=1e-6)
