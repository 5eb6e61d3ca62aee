"""BAPO's bound search on 2 data-parallel ranks (torch.distributed, gloo, CPU) equals 1 rank with the
whole batch: same bounds, same pos/neg ratio, same loss and gradient (after the framework's DP mean).
"""

import pytest
import torch

import stablerl
from conftest import make_batch
from stablerl.testing import launch_gloo

WORLD = 2


def bapo_batch():
    # responses 0-3 have positive, 4-7 negative advantages: each half alone would pick other bounds
    b = make_batch(8, 12, seed=1, dtype=torch.float64, spread=0.7)
    adv = b["advantages"].abs()
    adv[4:] = -0.9 * adv[4:]
    b["advantages"] = adv
    return b


def run_bapo(b, ctx=None):
    lp = b["log_prob"].detach().clone().requires_grad_(True)
    loss, metrics = stablerl.compute_policy_loss(
        "bapo",
        log_prob=lp,
        old_log_prob=b["old_log_prob"],
        advantages=b["advantages"],
        response_mask=b["response_mask"],
        ctx=ctx,
    )
    loss.backward()
    return loss.detach(), lp.grad, metrics


def _rank(rank, world):
    full = bapo_batch()
    rows = slice(rank * 4, rank * 4 + 4)
    part = {k: v[rows] for k, v in full.items()}
    n_tokens = float(full["response_mask"].sum())  # global token count (the adapter's job)
    ctx = stablerl.torch_distributed_context(token_count=n_tokens)
    loss, grad, metrics = run_bapo(part, ctx)
    return {"loss": loss, "grad": grad, "metrics": metrics, "dp_size": ctx.dp_size}


def test_bapo_two_ranks_equal_one_rank():
    res = launch_gloo(_rank, WORLD)

    full = bapo_batch()
    loss, grad, metrics = run_bapo(full)
    # the search must move, and stop inside the upper range, for the check to mean something
    assert metrics["bapo/c_low"] == pytest.approx(0.9) and 1.2 < metrics["bapo/c_high"] < 3.0
    for r in res:
        assert r["dp_size"] == WORLD
        for k in ("bapo/c_low", "bapo/c_high"):
            assert r["metrics"][k] == metrics[k]
        assert r["metrics"]["bapo/pos_neg_ratio"] == pytest.approx(metrics["bapo/pos_neg_ratio"], rel=1e-6)
    # the frameworks average gradients over DP ranks; each rank's loss carries the factor dp_size
    assert torch.allclose(sum(r["loss"] for r in res) / WORLD, loss, rtol=1e-12, atol=1e-12)
    assert torch.allclose(torch.cat([r["grad"] for r in res]) / WORLD, grad, rtol=1e-12, atol=1e-14)

    # without the all-reduce each half would choose its own bounds (what the test guards against)
    local = [run_bapo({k: v[s] for k, v in full.items()})[2] for s in (slice(0, 4), slice(4, 8))]
    assert any((m["bapo/c_low"], m["bapo/c_high"]) != (metrics["bapo/c_low"], metrics["bapo/c_high"]) for m in local)
