"""RPG, PACS, GVPO and turn-level PPO against independent hand computations."""

import math

import pytest
import torch
from conftest import make_batch

import stablerl
from stablerl import MissingInputError, StableRLError


def vanilla_tokens(lp, old, adv, low=0.2, high=0.28, c=10.0):
    r = torch.exp(lp - old)
    l = torch.maximum(-adv * r, -adv * torch.clamp(r, 1 - low, 1 + high))
    return torch.where(adv < 0, torch.minimum(l, -adv * c), l)


@pytest.mark.parametrize(
    "divergence,term",
    [
        ("fkl", lambda lw: -lw),
        ("rkl", lambda lw: torch.exp(lw) * lw),
        ("ufkl", lambda lw: torch.exp(lw) - lw - 1),
        ("urkl", lambda lw: torch.exp(lw) * (lw - 1) + 1),
    ],
)
def test_rpg_value_and_gradient(divergence, term):
    b = make_batch(B=4, T=5, seed=21, dtype=torch.float64, spread=0.5)
    m = b["response_mask"].double()
    loss, metrics = stablerl.compute_policy_loss("rpg", divergence=divergence, kl_loss_coef=0.3, **b)
    lp = b["log_prob"].detach().clone().requires_grad_(True)
    lw = lp - b["old_log_prob"]
    ref = ((vanilla_tokens(lp, b["old_log_prob"], b["advantages"]) + 0.3 * term(lw).clamp(-10, 10)) * m).sum() / m.sum()
    torch.testing.assert_close(loss, ref)
    (g,) = torch.autograd.grad(loss, b["log_prob"])
    (g_ref,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(g, g_ref)
    assert metrics["kl_loss"] == pytest.approx(((term(lw.detach()).clamp(-10, 10) * m).sum() / m.sum()).item())


def test_rpg_zero_coef_is_vanilla_and_bad_divergence():
    b = make_batch(B=3, T=4, seed=22, dtype=torch.float64)
    a, _ = stablerl.compute_policy_loss("rpg", kl_loss_coef=0.0, **b)
    v, _ = stablerl.compute_policy_loss("vanilla", clip_ratio_c=10.0, **b)
    torch.testing.assert_close(a, v)
    with pytest.raises(StableRLError, match="divergence must be one of"):
        stablerl.compute_policy_loss("rpg", divergence="js", **b)


def pacs_reference(lp, old, mask, y, gid, beta=1.0):
    s = beta * ((lp - old) * mask).sum(-1)
    psi = torch.empty_like(s)
    w = torch.ones_like(s)
    for g in gid.unique():
        idx = (gid == g).nonzero().flatten()
        n = len(idx)
        for i in idx:
            psi[i] = s[i] - (s[idx].sum() - s[i]) / (n - 1)
        pos = int(y[idx].sum().item())
        if 0 < pos < n:
            for i in idx:
                w[i] = n / (2 * (pos if y[i] > 0 else n - pos))
    bce = torch.nn.functional.binary_cross_entropy_with_logits(psi, y, weight=w)  # weighted plain mean
    return bce


def test_pacs_value_and_gradient_through_the_baseline():
    b = make_batch(B=6, T=4, seed=23, dtype=torch.float64, spread=0.4)
    y = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    gid = torch.tensor([0, 0, 0, 1, 1, 1])
    loss, _ = stablerl.compute_policy_loss("pacs", scores=y, index=gid, **b)
    lp = b["log_prob"].detach().clone().requires_grad_(True)
    ref = pacs_reference(lp, b["old_log_prob"], b["response_mask"].double(), y, gid)
    torch.testing.assert_close(loss, ref)
    (g,) = torch.autograd.grad(loss, b["log_prob"])
    (g_ref,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(g, g_ref)


def test_pacs_on_policy_value_is_log2_with_nonzero_gradient():
    b = make_batch(B=4, T=3, seed=24, dtype=torch.float64)
    b["old_log_prob"] = b["log_prob"].detach().clone()
    y = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    loss, _ = stablerl.compute_policy_loss("pacs", scores=y, index=[0, 0, 1, 1], **b)
    assert loss.item() == pytest.approx(math.log(2))
    (g,) = torch.autograd.grad(loss, b["log_prob"])
    assert g.abs().sum() > 0
    with pytest.raises(StableRLError, match="exactly 0 or 1"):
        stablerl.compute_policy_loss("pacs", scores=torch.tensor([0.5, 0, 1, 1.0], dtype=torch.float64), index=[0, 0, 1, 1], **b)
    with pytest.raises(MissingInputError, match="needs input 'scores'"):
        stablerl.compute_policy_loss("pacs", index=[0, 0, 1, 1], **b)


def test_gvpo_value_gradient_and_group_checks():
    b = make_batch(B=4, T=5, seed=25, dtype=torch.float64, spread=0.3)
    m = b["response_mask"].double()
    R = torch.tensor([1.0, 0.0, 0.5, 2.0], dtype=torch.float64)
    gid = torch.tensor([0, 0, 1, 1])
    loss, _ = stablerl.compute_policy_loss("gvpo", scores=R, index=gid, **b)
    lp = b["log_prob"].detach().clone().requires_grad_(True)
    r_theta = 0.1 * ((lp - b["old_log_prob"]) * m).sum(-1)
    ref = 0
    for idx in ([0, 1], [2, 3]):
        rt, rr = r_theta[idx], R[idx]
        ref = ref + 0.5 * (((rt - rt.mean()) - (rr - rr.mean())) ** 2).sum() / (len(idx) - 1)  # mean NOT detached
    torch.testing.assert_close(loss, ref)
    (g,) = torch.autograd.grad(loss, b["log_prob"])
    (g_ref,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(g, g_ref)  # detaching the group mean changes nothing (residuals sum to 0)
    mean_loss, _ = stablerl.compute_policy_loss("gvpo", scores=R, index=gid, reduction="mean", **b)
    torch.testing.assert_close(mean_loss, ref / 4)
    # a group of one has nothing to contrast: it contributes 0 and is counted in the metric
    single, m = stablerl.compute_policy_loss("gvpo", scores=R, index=[0, 0, 1, 2], **b)
    first = 0.5 * ((r_theta[:2] - r_theta[:2].mean()) - (R[:2] - R[:2].mean())).pow(2).sum()
    torch.testing.assert_close(single, first)
    assert m["gvpo/singleton_fraction"] == 0.5


def test_turn_ppo_one_turn_equals_gspo_and_two_turns_by_hand():
    b = make_batch(B=3, T=6, seed=26, dtype=torch.float64, spread=0.2)
    one_turn = torch.zeros(3, 6, dtype=torch.long)
    t, _ = stablerl.compute_policy_loss("turn_ppo", turn_ids=one_turn, clip_ratio_c=None, clip_ratio_low=0.2, clip_ratio_high=0.2, **b)
    g, _ = stablerl.compute_policy_loss("gspo", clip_ratio_low=0.2, clip_ratio_high=0.2, **b)
    torch.testing.assert_close(t, g)
    # two turns with an unmasked tool segment in between (turn id -1)
    b = make_batch(B=1, T=6, seed=27, dtype=torch.float64, spread=0.3, padded=False)
    turns = torch.tensor([[0, 0, -1, 1, 1, 1]])
    mask = turns >= 0
    loss, _ = stablerl.compute_policy_loss("turn_ppo", turn_ids=turns, **{**b, "response_mask": mask})
    lp = b["log_prob"].detach().clone().requires_grad_(True)
    d = (lp - b["old_log_prob"]).detach()
    seg = torch.stack([d[0, :2].mean()] * 2 + [torch.tensor(0.0, dtype=torch.float64)] + [d[0, 3:].mean()] * 3).unsqueeze(0)
    w = torch.exp(lp - lp.detach() + seg)
    ref = (vanilla_tokens(torch.log(w), torch.zeros_like(w), b["advantages"], 0.2, 0.2, 3.0) * mask).sum() / 5
    torch.testing.assert_close(loss, ref)
    (g1,) = torch.autograd.grad(loss, b["log_prob"])
    (g2,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(g1, g2)
    assert g1[0, 2] == 0


def test_turn_ppo_without_turn_ids_takes_the_loss_masks_runs_as_turns():
    """A masked tool segment splits a response into turns: no turn ids needed (verl's agent-loop response_mask,
    TRL's tool_mask and OpenRLHF's action_ranges all leave tool/environment tokens out of the loss mask)."""
    b = make_batch(B=2, T=6, seed=27, dtype=torch.float64, spread=0.3, padded=False)
    mask = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 0, 1, 0, 1, 0]])
    turns = torch.tensor([[0, 0, -1, 1, 1, 1], [0, -1, 1, -1, 2, -1]])
    given, m1 = stablerl.compute_policy_loss("turn_ppo", turn_ids=turns, **{**b, "response_mask": mask})
    derived, m2 = stablerl.compute_policy_loss("turn_ppo", **{**b, "response_mask": mask})
    assert float(derived.detach()) == float(given.detach()) and m1 == m2
    # and it is not one turn per response: the two-turn row differs from gspo's one ratio per sequence
    one, _ = stablerl.compute_policy_loss("turn_ppo", turn_ids=torch.zeros(2, 6, dtype=torch.long), **{**b, "response_mask": mask})
    assert abs(float(one.detach()) - float(derived.detach())) > 1e-6


def test_turn_ppo_gradient_form_matters_only_for_advantages_that_vary_within_a_turn():
    """turn_ppo lets each token's gradient through its own log-prob (GSPO-token form). The unread Eq. 4 may
    instead let it through the turn mean (a third-party fork does): same value, and the same gradient while the
    advantage is constant within each turn (outcome advantages), but not with per-token (GAE) advantages."""
    b = make_batch(B=2, T=6, seed=29, dtype=torch.float64, spread=0.1, padded=False)
    turns = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    mask = torch.ones(2, 6, dtype=torch.float64)
    loose = dict(clip_ratio_low=0.9, clip_ratio_high=9.0, clip_ratio_c=None)  # no token is clipped here

    def turn_mean_form(advantages):
        lp = b["log_prob"].detach().clone().requires_grad_(True)
        d = lp - b["old_log_prob"]
        seg = torch.stack([torch.where(turns[i] == 0, d[i][turns[i] == 0].mean(), d[i][turns[i] == 1].mean())
                           for i in range(2)])  # gradient flows through the turn mean
        loss = (-advantages * torch.exp(seg) * mask).sum() / mask.sum()
        (g,) = torch.autograd.grad(loss, lp)
        return loss, g

    per_turn = torch.tensor([[1.0, 1.0, 1.0, -0.5, -0.5, -0.5], [0.3, 0.3, 2.0, 2.0, 2.0, 2.0]], dtype=torch.float64)
    per_token = torch.tensor([[1.0, -1.0, 0.5, 2.0, -0.5, 0.1], [0.3, -0.7, 2.0, 0.0, -2.0, 1.0]], dtype=torch.float64)
    for advantages, same_gradient in [(per_turn, True), (per_token, False)]:
        loss, _ = stablerl.compute_policy_loss("turn_ppo", turn_ids=turns, **{**b, "advantages": advantages}, **loose)
        (g,) = torch.autograd.grad(loss, b["log_prob"])
        ref, g_ref = turn_mean_form(advantages)
        torch.testing.assert_close(loss, ref)  # the forward value never depends on the form
        assert torch.allclose(g, g_ref) is same_gradient
    # per token, the difference is the advantage's deviation from its turn mean: e.g. row 0, token 0
    d = (b["log_prob"] - b["old_log_prob"]).detach()
    w0 = torch.exp(d[0, :3].mean())
    expected = -w0 * per_token[0, 0] / 12
    assert g[0, 0].item() == pytest.approx(expected.item(), rel=1e-12)
    assert g_ref[0, 0].item() == pytest.approx((-w0 * per_token[0, :3].mean() / 12).item(), rel=1e-12)


@pytest.mark.parametrize("name", ["rpg", "pacs", "gvpo", "turn_ppo"])
def test_degenerate_and_bf16(name):
    extra = {
        "rpg": {},
        "pacs": {"scores": torch.tensor([1.0, 0.0, 1.0, 0.0]), "index": [0, 0, 1, 1]},
        "gvpo": {"scores": torch.tensor([1.0, 0.0, 1.0, 1.0]), "index": [0, 0, 1, 1]},
        "turn_ppo": {"turn_ids": torch.zeros(4, 6, dtype=torch.long)},
    }[name]
    b = make_batch(B=4, T=6, seed=28)
    masked = {**b, "response_mask": torch.zeros_like(b["response_mask"])}
    loss, metrics = stablerl.compute_policy_loss(name, **masked, **extra)
    assert torch.isfinite(loss) and all(v == v for v in metrics.values())
    b16 = {k: (v.detach().bfloat16() if v.dtype.is_floating_point else v) for k, v in b.items()}
    b16["log_prob"].requires_grad_(True)
    l16, _ = stablerl.compute_policy_loss(name, **b16, **extra)
    l32, _ = stablerl.compute_policy_loss(name, **b, **extra)
    l16.backward()
    assert torch.isfinite(l16) and abs(l16.item() - l32.item()) < 0.05 * max(1, abs(l32.item()))
    assert torch.all(b16["log_prob"].grad[~b["response_mask"]] == 0)


def test_rspo_reweights_ratio_before_clip():
    b = make_batch(B=3, T=4, seed=29, dtype=torch.float64, spread=0.3)
    g = torch.Generator().manual_seed(0)
    old_router = -1.05 - torch.rand(3, 4, 2, 2, generator=g, dtype=torch.float64)  # + 1.0 below stays a log-prob
    same, m_same = stablerl.compute_policy_loss(
        "rspo", router_log_prob=old_router, old_router_log_prob=old_router, base="vanilla", **b
    )
    vanilla, _ = stablerl.compute_policy_loss("vanilla", **b)
    torch.testing.assert_close(same, vanilla)  # routers agree: gamma = 1, nothing changes
    assert m_same["rspo/gamma_mean"] == 1.0
    shift = torch.full_like(old_router, 0.05)  # gamma = exp(-0.05) = 0.951 (above the 0.8 floor)
    shifted, m = stablerl.compute_policy_loss(
        "rspo", router_log_prob=old_router + shift, old_router_log_prob=old_router, base="vanilla", **b
    )
    lp = b["log_prob"].detach().clone().requires_grad_(True)
    ref, _ = stablerl.compute_policy_loss("vanilla", **{**b, "log_prob": lp, "old_log_prob": b["old_log_prob"] + 0.05})
    torch.testing.assert_close(shifted, ref)
    (g1,) = torch.autograd.grad(shifted, b["log_prob"])
    (g2,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(g1, g2)
    assert m["rspo/gamma_mean"] == pytest.approx(math.exp(-0.05))
    # a large shift is floored at gamma_min and the floor fraction is logged
    _, m_floor = stablerl.compute_policy_loss(
        "rspo", router_log_prob=old_router + 1.0, old_router_log_prob=old_router, **b
    )
    assert m_floor["rspo/floor_fraction"] == 1.0
    with pytest.raises(StableRLError, match=r"\[B, T, layers, k\]"):
        stablerl.compute_policy_loss("rspo", router_log_prob=old_router[..., 0], old_router_log_prob=old_router, **b)
    with pytest.raises(MissingInputError, match="router_log_prob"):
        stablerl.compute_policy_loss("rspo", **b)


def test_empty_rows_take_no_part_in_pacs_and_gvpo():
    b = make_batch(B=4, T=5, seed=30, dtype=torch.float64, spread=0.3)
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    for name in ("pacs", "gvpo"):
        idx = [0, 0, 0, 1] if name == "pacs" else [0, 0, 0, 0]
        # a fourth response with no valid token: the loss equals the three-response batch's
        mask = b["response_mask"].clone()
        mask[3] = False
        full, _ = stablerl.compute_policy_loss(name, scores=scores, index=idx, **{**b, "response_mask": mask})
        three = {k: v[:3] for k, v in b.items()}
        ref, _ = stablerl.compute_policy_loss(name, scores=scores[:3], index=idx[:3], **{**three, "response_mask": mask[:3]})
        torch.testing.assert_close(full, ref)
        empty, _ = stablerl.compute_policy_loss(name, scores=scores, index=idx, **{**b, "response_mask": torch.zeros_like(mask)})
        assert empty.item() == 0.0
