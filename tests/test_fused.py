"""The fused path (stablerl.fused) gives the eager path's loss, metrics and gradient.

Every loss with a fused form is run both ways (``fused=False`` / ``fused=True``) on inputs built to
hit autograd's corner cases: ratios on and next to the clip bounds (autograd splits the gradient of
``maximum``/``minimum`` in half on ties and ``clamp`` passes it on its closed range), log-ratios
beyond the +-20 clamp, zero, tiny and large advantages, per-token and per-sequence advantages,
three built-in aggregations, IS weights, fp32/fp64/bf16/fp16 inputs. Loss, metrics and gradient
must be equal as values (``torch.equal``; the sign of a zero may differ on a valid token, see
stablerl.fused), and the gradient exactly +0.0 on padding.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stablerl
from stablerl import StableRLError
from stablerl.fused import FUSED_ENV, sign_of, sign_of_
from stablerl.ops import clamp_passes_at_bounds
from stablerl.primitives import ppo_clip_fused

FUSED_LOSSES = [s.name for s in stablerl.list_algorithms("policy_loss") if s.fused is not None]
MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


def test_the_ratio_losses_have_a_fused_form():
    assert {"vanilla", "gspo", "gmpo", "cispo", "sapo", "bapo", "a3po", "decoupled_ppo"} <= set(FUSED_LOSSES)


def corner_inputs(B=8, T=300, dtype=torch.float32, seed=0, per_sequence=False, beyond_clamp=True):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    # log-ratios dense around the log of every bound a loss uses (PPO 0.8/1.28, dual clip 3, GSPO
    # 1 -+ 3e-4/4e-4, GMPO's log-space +-0.4), steps of about one fp32 ulp, so that some ratios
    # land exactly on a bound and some products tie after rounding; plus +-25 (beyond the clamp)
    centres = torch.tensor([math.log(0.8), math.log(1.28), math.log(3.0), math.log(1 - 3e-4), math.log(1 + 4e-4),
                            -0.4, 0.4, 0.0], dtype=torch.float64)
    k = torch.randint(-40, 41, (B, T), generator=g, dtype=torch.float64) * 6e-8
    pick = centres[torch.randint(0, len(centres), (B, T), generator=g)]
    noise = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    lr = torch.where(torch.rand(B, T, generator=g) < 0.7, pick + k, noise)
    if beyond_clamp:  # else every log-ratio is within +-20 (the fused forms' common path)
        lr[0, :3] = torch.tensor([25.0, -25.0, 20.0])
    lp = old + lr
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T) < lengths[:, None]
    row_adv = torch.tensor([1.0, -1.0, 0.0, 1e-30, -3.5, 7e3, 1.7, -1.7])[:B]
    if per_sequence:
        adv = row_adv.to(dtype)
    else:
        adv = row_adv[:, None].expand(B, T).clone()
        adv[1, ::7] = 0.0  # zero advantages inside a row
        adv = (adv * mask).to(dtype)
    # garbage on padding: the clean-up must keep it out of both paths
    lp = torch.where(mask, lp, torch.full_like(lp, float("nan"))).to(dtype)
    return dict(log_prob=lp, old_log_prob=old.to(dtype), advantages=adv, response_mask=mask)


def test_corner_inputs_hit_the_ties():
    # ratios exactly on a bound, and rounding ties -A r == -A clamp(r) with r out of range (where
    # autograd gives each branch half the gradient; |A| = 1.7 makes -A r cross a binade, where a
    # 1-ulp step of r is less than 1 ulp of the product)
    i = corner_inputs()
    m, A = i["response_mask"], i["advantages"]
    r = torch.exp(torch.where(m, i["log_prob"] - i["old_log_prob"], 0.0))
    assert int(((r == torch.tensor(1.28)) & m).sum()) > 0
    cl = torch.clamp(r, 0.8, 1.28)
    assert int((((-A * r) == (-A * cl)) & (cl != r) & (A != 0) & m).sum()) > 0


def declared_inputs(name, inputs):
    """The extra inputs a loss requires (decoupled_ppo, a3po: behaviour log-probs, policy versions)."""
    requires = stablerl.get_spec("policy_loss", name).requires
    old = inputs["old_log_prob"]
    B, T = old.shape
    g = torch.Generator().manual_seed(7)
    extra = {
        "rollout_log_prob": (old.double() + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)).to(old.dtype),
        "versions": (4 - torch.randint(0, 4, (B, 1), generator=g)).expand(B, T).contiguous(),
        "policy_version": 4,
    }
    return {k: extra[k] for k in requires}


def run(name, inputs, fused, **kw):
    lp = inputs["log_prob"].detach().clone().requires_grad_(True)
    kw = {**declared_inputs(name, inputs), **kw}
    loss, metrics = stablerl.compute_policy_loss(name, **{**inputs, "log_prob": lp}, fused=fused, **kw)
    loss.backward()
    return loss.detach(), metrics, lp.grad


def assert_same(name, inputs, **kw):
    l0, m0, g0 = run(name, inputs, False, **kw)
    l1, m1, g1 = run(name, inputs, True, **kw)
    assert torch.equal(l0, l1), (name, l0, l1)
    assert m0 == m1, {k: (m0[k], m1[k]) for k in m0 if m0[k] != m1.get(k)}
    assert g1.dtype == g0.dtype
    diff = g0.double() - g1.double()
    assert torch.equal(g0, g1), (name, diff.abs().max().item(), int((diff != 0).sum()))
    # padding (garbage in log_prob there): exactly +0.0, as the eager path's clean-up gives
    pad = ~inputs["response_mask"]
    assert torch.equal(g1[pad].float().view(torch.int32), torch.zeros(int(pad.sum()), dtype=torch.int32))


@pytest.mark.filterwarnings("ignore:.*always aggregates with")  # gmpo, sapo: their own aggregation
@pytest.mark.parametrize("name", FUSED_LOSSES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_sequence", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("beyond_clamp", [True, False])
def test_fused_equals_eager_on_corner_cases(name, dtype, per_sequence, mode, beyond_clamp):
    inputs = corner_inputs(dtype=dtype, per_sequence=per_sequence, beyond_clamp=beyond_clamp)
    assert_same(name, inputs, loss_agg_mode=mode)


@pytest.mark.parametrize("name", FUSED_LOSSES)
@pytest.mark.parametrize("per_sequence", [False, True])
def test_fused_equals_eager_with_is_weights_and_hyper_parameters(name, per_sequence):
    # per-sequence advantages with IS weights: gspo's token form with a [B, 1] ratio
    inputs = corner_inputs(seed=3, per_sequence=per_sequence)
    w = torch.rand(inputs["log_prob"].shape, generator=torch.Generator().manual_seed(1)) * 2
    spec = stablerl.get_spec("policy_loss", name)
    # dual clip near the range (for the losses that have these hyper-parameters)
    names = spec.params.field_names()
    params = {k: v for k, v in {"clip_ratio_low": 0.1, "clip_ratio_high": 0.5, "clip_ratio_c": 1.3}.items()
              if k in names and "clip_ratio_c" in names}
    if "rollout_log_prob" in spec.requires:  # decoupled_ppo, a3po: their own behaviour weight, no is_weights
        with pytest.raises(StableRLError, match="do not also pass is_weights"):
            run(name, inputs, True, is_weights=w)
        assert_same(name, inputs, behave_imp_weight_cap=1.1, behave_imp_weight_floor=0.9, **params)
        assert_same(name, inputs, behave_imp_weight_mode="clamp", behave_imp_weight_cap=1.1, **params)
    else:
        assert_same(name, inputs, is_weights=w, **params)
    if "clip_ratio_c" in spec.params.field_names():
        assert_same(name, inputs, clip_ratio_c=None)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(FUSED_LOSSES), st.integers(0, 2**31 - 1), st.integers(1, 5), st.integers(1, 40),
       st.booleans())
def test_fused_equals_eager_on_random_batches(name, seed, B, T, per_sequence):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 2
    lp = old + torch.randn(B, T, generator=g) * torch.rand((), generator=g)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[:, 0] = True
    adv = torch.randn(B, generator=g).round(decimals=1)
    if not per_sequence:
        adv = adv[:, None] * mask
    assert_same(name, dict(log_prob=lp, old_log_prob=old, advantages=adv, response_mask=mask))


def _graph_has(loss, cls_name):
    seen, todo = set(), [loss.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if type(fn).__name__ == cls_name:
            return True
        todo.extend(f for f, _ in fn.next_functions)
    return False


def test_switched_by_keyword_and_environment(monkeypatch):
    inputs = corner_inputs()
    lp = inputs["log_prob"].clone().requires_grad_(True)
    args = {**inputs, "log_prob": lp}
    assert _graph_has(stablerl.compute_policy_loss("vanilla", **args)[0], "_FusedBackward")
    assert not _graph_has(stablerl.compute_policy_loss("vanilla", **args, fused=False)[0], "_FusedBackward")
    monkeypatch.setenv(FUSED_ENV, "0")
    assert not _graph_has(stablerl.compute_policy_loss("vanilla", **args)[0], "_FusedBackward")
    assert _graph_has(stablerl.compute_policy_loss("vanilla", **args, fused=True)[0], "_FusedBackward")


def test_not_used_where_unsafe_and_values_unchanged():
    inputs = corner_inputs()
    # no gradient wanted: the eager path (no graph either way)
    with torch.no_grad():
        loss, _ = stablerl.compute_policy_loss("vanilla", **inputs)
    assert loss.grad_fn is None
    # torch.func: the eager path, same gradient as the fused one
    lp = inputs["log_prob"]

    def f(x):
        return stablerl.compute_policy_loss("vanilla", **{**inputs, "log_prob": x})[0]

    g_func = torch.func.grad(f)(lp)
    _, _, g_fused = run("vanilla", inputs, True)
    assert torch.equal(g_func, g_fused)


def test_second_derivative_is_refused_not_silently_zero():
    inputs = corner_inputs()
    lp = inputs["log_prob"].clone().requires_grad_(True)
    loss, _ = stablerl.compute_policy_loss("vanilla", **{**inputs, "log_prob": lp})
    (g,) = torch.autograd.grad(loss, lp, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad|trying to differentiate"):
        torch.autograd.grad(g.sum(), lp)


def test_validation_unchanged_on_the_fused_path():
    inputs = corner_inputs()
    bad = inputs["old_log_prob"].clone()
    bad[0, 0] = float("nan")
    lp = inputs["log_prob"].clone().requires_grad_(True)
    with pytest.raises(StableRLError, match="old_log_prob has non-finite values"):
        stablerl.compute_policy_loss("vanilla", **{**inputs, "log_prob": lp, "old_log_prob": bad})


def test_sign_of_is_torch_sign():
    x = torch.tensor([0.0, 1e-45, -1e-45, 1e-38, 3e38, -3e38, 2.5, -7.0, float("inf"), float("-inf")])
    for dtype in (torch.float32, torch.float64):
        assert torch.equal(sign_of(x.to(dtype)), torch.sign(x.to(dtype)))
        assert torch.equal(sign_of_(x.to(dtype).clone()), torch.sign(x.to(dtype)))
    assert torch.equal(sign_of(torch.tensor([5e-324, -5e-324], dtype=torch.float64)), torch.tensor([1.0, -1.0], dtype=torch.float64))


@settings(max_examples=40, deadline=None)
@given(st.integers(-3, 40), st.lists(st.integers(-5, 40), min_size=1, max_size=50),
       st.sampled_from([torch.int64, torch.int32, torch.float32]))
def test_a3po_alpha_table_equals_the_per_token_formula(policy_version, values, vdtype):
    from stablerl.plugins.decoupled import a3po_alpha, a3po_alpha_as

    versions = torch.tensor(values).to(vdtype).reshape(1, -1)
    for dtype in (torch.float32, torch.float64):
        assert torch.equal(a3po_alpha_as(versions, policy_version, dtype),
                           a3po_alpha(versions, policy_version).to(dtype))


def test_fused_equals_eager_where_gspo_s_clamp_at_10_ties():
    # rows whose mean log-ratio is exactly 10 (GSPO's clamp bound): torch <= 2.13 passes the gradient
    # there, torch >= 2.14 stops it; the fused form follows the installed torch (clamp_pass_mask)
    B, T = 3, 4
    old = torch.full((B, T), -2.0)
    lp = old + torch.tensor([[10.0] * T, [9.5, 10.5, 10.0, 10.0], [0.1, -0.2, 0.05, 0.0]])
    inputs = dict(log_prob=lp, old_log_prob=old, advantages=torch.tensor([[1.0], [-2.0], [0.5]]).expand(B, T).clone(),
                  response_mask=torch.ones(B, T, dtype=torch.bool))
    assert_same("gspo", inputs)
    _, _, grad = run("gspo", inputs, True)
    assert (grad[:2] == 0).all() != clamp_passes_at_bounds()  # the tied rows: 0 exactly when the clamp stops it
    assert (grad[2] != 0).all()


@pytest.mark.parametrize("dual_c", [None, 3.0])
def test_ppo_clip_fused_factor_equals_autograd_at_explicit_number_bounds(dual_c):
    # BAPO's path: bounds given as numbers; ratios exactly on them, inside, outside, both advantage signs
    lower, upper = 0.625, 1.375  # exact in every float dtype
    ratio = torch.tensor([lower, upper, 1.0, 0.5, 2.0, lower, upper, 4.0], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -2.0, 3.0, -1.5, -0.5, -1.0], dtype=torch.float64)
    mask = torch.ones_like(ratio)
    r = ratio.clone().requires_grad_(True)
    loss = torch.maximum(-adv * r, -adv * torch.clamp(r, lower, upper))
    if dual_c is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -adv * dual_c), loss)
    upstream = torch.linspace(0.5, 2.0, len(ratio), dtype=torch.float64)
    (expected,) = torch.autograd.grad(loss, r, upstream)
    fused_loss, _, neg_adv, factor = ppo_clip_fused(ratio, adv, mask, 0.0, 0.0, dual_c, bounds=(lower, upper))
    assert torch.equal(fused_loss, loss.detach())
    assert torch.equal((upstream * neg_adv) * factor, expected)
    at_bound = float(factor[0])  # A > 0 on the lower bound: maximum ties, half through the clamp
    assert at_bound == (1.0 if clamp_passes_at_bounds() else 0.5)
