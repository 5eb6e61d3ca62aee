"""The framework-free API: validation, errors, degenerate inputs, and the vanilla reference."""

import numpy as np
import pytest
import torch
from conftest import make_batch

import stablerl
from stablerl import MissingInputError, StableRLError, UnknownNameError


def vanilla_reference(lp, old, adv, mask, low=0.2, high=0.28, c=3.0):
    """PPO clip + dual clip written out independently (verl's compute_policy_loss_vanilla semantics)."""
    ratio = torch.exp(torch.clamp(lp - old, -20, 20))
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clipped = torch.maximum(l1, l2)
    dual = torch.minimum(clipped, -adv * c)
    per_token = torch.where(adv < 0, dual, clipped)
    return (per_token * mask).sum() / mask.sum()


def test_vanilla_value_and_gradient_match_reference():
    b = make_batch(B=5, T=7, seed=1, dtype=torch.float64, spread=0.5)
    loss, metrics = stablerl.compute_policy_loss("vanilla", **b)
    lp2 = b["log_prob"].detach().clone().requires_grad_(True)
    ref = vanilla_reference(lp2, b["old_log_prob"], b["advantages"], b["response_mask"].double())
    (g,) = torch.autograd.grad(loss, b["log_prob"])
    (g_ref,) = torch.autograd.grad(ref, lp2)
    torch.testing.assert_close(loss.detach(), ref.detach())
    torch.testing.assert_close(g, g_ref)
    assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "clip_high", "clip_low", "ppo_kl"}
    assert all(type(v) is float for v in metrics.values())
    # the spread makes clipping happen on both sides, so the test exercises the clip
    assert metrics["pg_clipfrac"] > 0


def test_masked_tokens_get_zero_gradient_and_inputs_stay_detached():
    b = make_batch(B=4, T=6, seed=2, dtype=torch.float64)
    b["old_log_prob"] = b["old_log_prob"].clone().requires_grad_(True)
    b["advantages"] = b["advantages"].clone().requires_grad_(True)
    loss, _ = stablerl.compute_policy_loss("vanilla", **b)
    loss.backward()
    grad = b["log_prob"].grad
    assert torch.all(grad[~b["response_mask"]] == 0)
    assert grad[b["response_mask"]].abs().sum() > 0
    assert b["old_log_prob"].grad is None and b["advantages"].grad is None


def test_hyper_parameters_change_the_loss_and_are_validated():
    b = make_batch(B=4, T=6, seed=3, dtype=torch.float64, spread=0.6)
    base, _ = stablerl.compute_policy_loss("vanilla", **b)
    tight, _ = stablerl.compute_policy_loss("vanilla", clip_ratio_high=0.01, clip_ratio_low=0.01, **b)
    assert not torch.isclose(base, tight)
    with pytest.raises(UnknownNameError, match=r"did you mean 'clip_ratio_high'.*valid: clip_ratio_c, clip_ratio_high, clip_ratio_low"):
        stablerl.compute_policy_loss("vanilla", clip_ratio_hgh=0.3, **b)
    with pytest.raises(StableRLError, match="clip_ratio_c .* must be > 1"):
        stablerl.compute_policy_loss("vanilla", clip_ratio_c=0.5, **b)
    with pytest.raises(StableRLError, match="clip_ratio_low must be >= 0"):
        stablerl.compute_policy_loss("vanilla", clip_ratio_low=-0.1, **b)


def test_unknown_loss_and_estimator_names():
    b = make_batch()
    with pytest.raises(UnknownNameError, match="unknown policy loss 'vanila' \\(did you mean 'vanilla'\\?\\)"):
        stablerl.compute_policy_loss("vanila", **b)
    with pytest.raises(UnknownNameError, match="unknown advantage estimator"):
        stablerl.compute_advantage("nope", token_level_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 3), index=[0, 0])


def test_shape_dtype_and_finiteness_errors():
    b = make_batch(B=3, T=4)
    with pytest.raises(StableRLError, match=r"old_log_prob has shape \(3, 5\) but log_prob has shape \(3, 4\)"):
        stablerl.compute_policy_loss("vanilla", **{**b, "old_log_prob": torch.zeros(3, 5)})
    with pytest.raises(StableRLError, match=r"log_prob must be a \[B, T\] tensor"):
        stablerl.compute_policy_loss("vanilla", **{**b, "log_prob": torch.zeros(3)})
    with pytest.raises(StableRLError, match="floating"):
        stablerl.compute_policy_loss("vanilla", **{**b, "log_prob": torch.zeros(3, 4, dtype=torch.long)})
    bad = b["log_prob"].detach().clone()
    bad[0, 0] = float("nan")
    with pytest.raises(StableRLError, match="log_prob has non-finite values"):
        stablerl.compute_policy_loss("vanilla", **{**b, "log_prob": bad})
    # non-finite values on padding are ignored (frameworks leave garbage there)
    old = b["old_log_prob"].clone()
    old[~b["response_mask"]] = float("-inf")
    loss, _ = stablerl.compute_policy_loss("vanilla", **{**b, "old_log_prob": old})
    assert torch.isfinite(loss)


def test_degenerate_batches():
    b = make_batch(B=3, T=4)
    # all-masked row
    mask = b["response_mask"].clone()
    mask[1] = False
    loss, _ = stablerl.compute_policy_loss("vanilla", **{**b, "response_mask": mask})
    assert torch.isfinite(loss)
    # everything masked: zero loss, zero gradient, no NaN
    loss, metrics = stablerl.compute_policy_loss("vanilla", **{**b, "response_mask": torch.zeros_like(mask)})
    loss.backward()
    assert loss.item() == 0.0 and torch.all(b["log_prob"].grad == 0)
    assert all(np.isfinite(v) for v in metrics.values())
    # B = 0
    empty = {k: v[:0] for k, v in make_batch(B=3, T=4).items()}
    loss, _ = stablerl.compute_policy_loss("vanilla", **empty)
    assert loss.item() == 0.0


def test_bf16_inputs_close_to_fp32():
    b32 = make_batch(B=6, T=8, seed=4)
    b16 = {k: (v.detach().to(torch.bfloat16) if v.dtype.is_floating_point else v) for k, v in b32.items()}
    b16["log_prob"].requires_grad_(True)
    l32, _ = stablerl.compute_policy_loss("vanilla", **b32)
    l16, _ = stablerl.compute_policy_loss("vanilla", **b16)
    l16.backward()
    assert l16.dtype == torch.float32 and torch.isfinite(l16)
    assert b16["log_prob"].grad.dtype == torch.bfloat16
    assert abs(l16.item() - l32.item()) < 0.05 * max(1.0, abs(l32.item()))


def test_is_weights_multiply_per_token_loss():
    b = make_batch(B=3, T=4, seed=5, dtype=torch.float64)
    w = torch.full((3, 4), 0.5, dtype=torch.float64)
    base, _ = stablerl.compute_policy_loss("vanilla", **b)
    weighted, _ = stablerl.compute_policy_loss("vanilla", is_weights=w, **b)
    torch.testing.assert_close(weighted, base * 0.5)


def test_missing_declared_input_is_named():
    spec = stablerl.AlgorithmSpec(
        name="needs_entropy_probe", kind=stablerl.POLICY_LOSS, fn=lambda b, p, c: (b.log_prob * 0, {}), requires=("entropy",)
    )
    reg = stablerl.get_registry()
    reg.specs[(spec.kind, spec.name)] = spec
    try:
        with pytest.raises(MissingInputError, match="needs input 'entropy'.*verl: actor.calculate_entropy=True"):
            stablerl.compute_policy_loss("needs_entropy_probe", **make_batch())
    finally:
        del reg.specs[(spec.kind, spec.name)]


def test_spec_validation():
    with pytest.raises(ValueError, match="unknown kind"):
        stablerl.AlgorithmSpec(name="x", kind="loss", fn=lambda: None)
    with pytest.raises(ValueError, match="must say why"):
        stablerl.AlgorithmSpec(name="x", kind=stablerl.POLICY_LOSS, fn=None, status=stablerl.UNAVAILABLE)
    with pytest.raises(ValueError, match="unknown input"):
        stablerl.AlgorithmSpec(name="x", kind=stablerl.POLICY_LOSS, fn=lambda: None, requires=("logits",))


def test_list_algorithms_fields():
    specs = stablerl.list_algorithms("policy_loss")
    assert "vanilla" in [s.name for s in specs]
    v = next(s for s in specs if s.name == "vanilla")
    assert v.paper == "2503.14476" and v.status == "stable"
    assert v.defaults() == {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
    with pytest.raises(UnknownNameError, match="unknown kind"):
        stablerl.list_algorithms("loss")


def test_garbage_on_padding_never_reaches_loss_or_gradient():
    b = make_batch(B=3, T=5, seed=9, dtype=torch.float64)
    pad = ~b["response_mask"]
    lp = b["log_prob"].detach().clone()
    lp[pad] = float("nan")
    lp.requires_grad_(True)
    old = b["old_log_prob"].clone()
    old[pad] = float("inf")
    loss, metrics = stablerl.compute_policy_loss("vanilla", **{**b, "log_prob": lp, "old_log_prob": old})
    loss.backward()
    assert torch.isfinite(loss) and all(v == v for v in metrics.values())
    assert torch.isfinite(lp.grad).all() and torch.all(lp.grad[pad] == 0)
    clean, _ = stablerl.compute_policy_loss("vanilla", **b)
    torch.testing.assert_close(loss, clean)


def test_shaper_and_filter_keywords_must_be_params_or_known_inputs():
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    with pytest.raises(UnknownNameError, match=r"unknown hyper-parameter or input for 'redit' 'scal'.*did you mean 'scale'"):
        stablerl.shape_rewards("redit", scores=scores, index=[0, 0, 1, 1], scal=0.1)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    with pytest.raises(UnknownNameError, match="pass other per-response inputs as extras"):
        stablerl.filter_batch("dynamic_sampling", advantages=adv, response_mask=torch.ones(2, 2), index=[0, 0], foo=1)
    bad = adv.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(StableRLError, match="advantages has non-finite values"):
        stablerl.filter_batch("dynamic_sampling", advantages=bad, response_mask=torch.ones(2, 2), index=[0, 0], scores=scores[:2])
