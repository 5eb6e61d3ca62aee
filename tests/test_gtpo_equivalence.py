"""GTPO (arXiv 2508.03772) conflict runs, token weights and loss against a per-token brute force.

The plugin finds conflict tokens with one vectorised pass per group slot (or one sort for large
groups); this checks both paths, on masks with holes, empty rows, groups of one, all-zero
advantages, garbage on padding and token ids near 2**31, against loops that follow the formula.
"""

from __future__ import annotations

import pytest
import torch

import stablerl
import stablerl.plugins.gtpo as gtpo
from stablerl.contracts import PolicyLossBatch

F64 = torch.float64


def ref_runs(ids, valid, gid, pos, neg):
    """Leading and trailing conflict runs by loops: (i, t) conflicts when a positive and a negative
    completion of i's group both hold ids[i, t] at the same position (from the start for the leading
    run, from the last valid token for the trailing run); a masked position ends a run."""
    B, T = valid.shape
    ok = [[bool(valid[i, t]) and bool(pos[i] or neg[i]) for t in range(T)] for i in range(B)]
    end = [max([t + 1 for t in range(T) if valid[i, t]], default=0) for i in range(B)]

    def shared(i, t, other_t):
        signs = set()
        for j in range(B):
            tj = other_t(j)
            if gid[j] == gid[i] and tj is not None and 0 <= tj < T and ok[j][tj] and ids[j, tj] == ids[i, t]:
                signs.add("+" if pos[j] else "-")
        return ok[i][t] and signs == {"+", "-"}

    fwd = torch.zeros(B, T, dtype=torch.bool)
    bwd = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        for t in range(T):
            if not shared(i, t, lambda j: t):
                break
            fwd[i, t] = True
        for s in range(end[i]):
            t = end[i] - 1 - s
            if not shared(i, t, lambda j: end[j] - 1 - s if s < end[j] else None):
                break
            bwd[i, t] = True
    return fwd, bwd


def _case(seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    B, T = r(1, 14), r(1, 10)
    ids = torch.randint(0, r(1, 4), (B, T), generator=g)
    if seed % 5 == 0:
        ids = ids + 2**31 - 4  # the largest ids allowed
    if seed % 3 == 0:
        valid = torch.arange(T) < torch.randint(0, T + 1, (B,), generator=g)[:, None]  # right padding
    else:
        valid = torch.rand(B, T, generator=g) < 0.8  # holes
    valid[r(0, B)] = seed % 4 == 0 and valid[0].any()  # sometimes an empty row
    size = [1, 2, 4, B][seed % 4]  # groups of one ... one group
    gid = torch.tensor([k // size for k in range(B)])
    sign = torch.randint(-1, 2, (B,), generator=g)
    has = valid.any(-1)
    return ids, valid, gid, (sign > 0) & has, (sign < 0) & has


@pytest.mark.parametrize("max_side", [32, 0])  # the per-slot pass, and the sort
def test_conflict_runs_match_brute_force(monkeypatch, max_side):
    monkeypatch.setattr(gtpo, "SLOT_LOOP_MAX_SIDE", max_side)
    with_conflicts = 0
    for seed in range(300):
        ids, valid, gid, pos, neg = _case(seed)
        fwd, bwd = gtpo.conflict_runs(ids, valid, gid, pos, neg)
        ref_fwd, ref_bwd = ref_runs(ids, valid, gid, pos, neg)
        assert torch.equal(fwd, ref_fwd), seed
        assert torch.equal(bwd, ref_bwd), seed
        with_conflicts += bool((fwd | bwd).any())
    assert with_conflicts > 100  # the cases do exercise conflicts


def test_slot_and_sort_paths_agree_on_large_groups(monkeypatch):
    g = torch.Generator().manual_seed(7)
    B, T = 96, 300
    ids = torch.randint(0, 3, (B, T), generator=g)
    valid = torch.arange(T) < torch.randint(0, T + 1, (B,), generator=g)[:, None]
    gid = torch.arange(B) // 48  # two groups of 48: above SLOT_LOOP_MAX_SIDE on at least one side
    sign = torch.randint(-1, 2, (B,), generator=g)
    args = (ids, valid, gid, (sign > 0) & valid.any(-1), (sign < 0) & valid.any(-1))
    out = {}
    for max_side in (0, 10**9):
        monkeypatch.setattr(gtpo, "SLOT_LOOP_MAX_SIDE", max_side)
        out[max_side] = gtpo.conflict_runs(*args)
    assert torch.equal(out[0][0], out[10**9][0]) and torch.equal(out[0][1], out[10**9][1])
    assert int(out[0][0].sum()) > 50 and int(out[0][1].sum()) > 50


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count", ["union", "max_run"])
def test_loss_and_grad_match_the_formula(dtype, count):
    """loss = mean_i (1/L_i) sum_t -(A'_i delta_t)/n_i over the completions with a valid token, with the
    brute-force runs; d loss/d lp likewise."""
    tol = {F64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-5}[dtype]  # bf16 inputs are computed in fp32
    grad_rtol = {F64: 1e-11, torch.float32: 1e-4, torch.bfloat16: 8e-3}[dtype]  # the gradient comes back in dtype
    for seed in range(40):
        ids, valid, gid, _, _ = _case(seed)
        B, T = valid.shape
        g = torch.Generator().manual_seed(1000 + seed)
        adv = torch.randint(-1, 2, (B,), generator=g).to(F64) * torch.rand(B, generator=g, dtype=F64)
        if seed % 6 == 0:
            adv.zero_()  # all rewards equal: no active completion
        H = torch.rand(B, T, generator=g, dtype=F64)
        pad = ~valid
        lp = (-torch.rand(B, T, generator=g, dtype=F64)).masked_fill(pad, float("nan"))
        A = adv[:, None].expand(B, T).masked_fill(pad, float("inf"))
        Hin = H.masked_fill(pad, float("nan"))
        ids_in = ids.masked_fill(pad, -3)  # garbage ids on padding are ignored
        x = lp.to(dtype).requires_grad_(True)
        loss, metrics = stablerl.compute_policy_loss(
            "gtpo", log_prob=x, old_log_prob=lp.to(dtype), advantages=A.to(dtype), response_mask=valid,
            token_ids=ids_in, index=gid.tolist(), entropy=Hin.to(dtype), conflict_count=count,
        )
        (grad,) = torch.autograd.grad(loss, x)

        # the formula, with A and H as the plugin sees them (rounded to the compute dtype)
        cd = F64 if dtype == F64 else torch.float32
        a_seq = adv.to(dtype).to(cd).to(F64)
        h = H.to(dtype).to(cd).to(F64)
        has = valid.any(-1)
        n_seq = max(int(has.sum()), 1)
        fwd, bwd = ref_runs(ids, valid, gid, (a_seq > 0) & has, (a_seq < 0) & has)
        want_grad = torch.zeros(B, T, dtype=F64)
        total = 0.0
        for i in range(B):
            L = int(valid[i].sum())
            if L == 0:
                continue
            h_bar = float(h[i][valid[i]].sum()) / L
            a_mod = 0.0 if h_bar > 0.7 else float(a_seq[i]) - 0.1 * h_bar
            w = 2.0 if a_seq[i] > 0 else 0.0
            n_run = int((fwd[i] | bwd[i]).sum()) if count == "union" else max(int(fwd[i].sum()), int(bwd[i].sum()))
            n = max(n_run, 1)
            for t in range(T):
                if valid[i, t]:
                    delta = (w if fwd[i, t] else 1.0) * (w if bwd[i, t] else 1.0)
                    want_grad[i, t] = -a_mod * delta / n / L / n_seq
                    total += want_grad[i, t].item()
        assert loss.item() == pytest.approx(total, rel=tol, abs=tol), seed
        torch.testing.assert_close(grad.to(F64), want_grad, rtol=grad_rtol, atol=tol)
        assert float(metrics["gtpo/conflict_tokens"]) == int((fwd | bwd).sum())


def test_gtpo_terms_rejects_out_of_range_ids_on_valid_tokens_only():
    B, T = 2, 3
    mask = torch.ones(B, T)
    mask[1, 2] = 0
    batch = dict(log_prob=torch.zeros(B, T), old_log_prob=torch.zeros(B, T), advantages=torch.ones(B, T),
                 response_mask=mask, entropy=torch.zeros(B, T), index=torch.tensor([0, 0]))
    ok_ids = torch.tensor([[1, 2, 3], [1, 2, 2**40]])  # out of range on padding only
    gtpo.gtpo_terms(PolicyLossBatch(**batch, token_ids=ok_ids), gtpo.GTPOParams())
    with pytest.raises(stablerl.StableRLError, match=r"token_ids must be in \[0, 2\*\*31\)"):
        gtpo.gtpo_terms(PolicyLossBatch(**batch, token_ids=torch.tensor([[1, 2, 2**31], [1, 2, 3]])), gtpo.GTPOParams())
