"""Sampling-mask replay (stablerl.sampling_mask): the kept set is vLLM's, log M is the trainer's kept mass,
and the rollout ratio moves from the kept mass to 1."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stablerl.params import StableRLError
from stablerl.sampling_mask import (
    SamplingMask, SamplingRule, kept_mask, log_kept_mass, processed_log_probs, rollout_log_prob_over_vocab,
)


def reference_kept(row, rule):
    """One row, written from the definitions with Python lists (independent of the vectorised code)."""
    probs = torch.softmax(row.double(), -1).tolist()
    logits = row.tolist()
    keep = [True] * len(logits)
    if rule.min_p > 0:
        top = max(probs)
        keep = [k and p >= rule.min_p * top for k, p in zip(keep, probs)]
    if 0 < rule.top_k < len(logits):
        remaining = sorted((x for x, k in zip(logits, keep) if k), reverse=True)
        if len(remaining) > rule.top_k:  # fewer than k left after min_p: top_k drops nothing
            keep = [k and x >= remaining[rule.top_k - 1] for k, x in zip(keep, logits)]
    if rule.top_p < 1:
        kept_logits = [x if k else -math.inf for x, k in zip(logits, keep)]
        z = sum(math.exp(x) for x in kept_logits if x > -math.inf)
        order = sorted(range(len(logits)), key=lambda i: kept_logits[i])  # ascending
        cum = 0.0
        for j, i in enumerate(order):
            cum += math.exp(kept_logits[i]) / z if kept_logits[i] > -math.inf else 0.0
            if cum <= 1 - rule.top_p + 1e-7 and j < len(order) - 1:
                keep[i] = False
    return torch.tensor(keep)


@pytest.mark.parametrize("rule", [SamplingRule(top_p=0.8), SamplingRule(top_k=5), SamplingRule(min_p=0.05),
                                  SamplingRule(top_k=8, top_p=0.7), SamplingRule(top_k=20, top_p=0.9, min_p=0.02)])
def test_kept_set_matches_the_definitions(rule):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 32, generator=gen) * 2
    mask = kept_mask(logits, rule)
    for row, got in zip(logits, mask):
        assert torch.equal(got, reference_kept(row, rule))
    assert mask.any(-1).all()  # never empty: the most likely token is always kept
    if rule.top_k > 0:
        assert (mask.sum(-1) <= rule.top_k).all()


def test_processed_log_probs_normalise_over_the_kept_set_only():
    logits = torch.randn(3, 6, 50, generator=torch.Generator().manual_seed(1))
    rule = SamplingRule(temperature=0.7, top_p=0.8)
    lp = processed_log_probs(logits, rule)
    assert torch.allclose(lp.exp().sum(-1), torch.ones(3, 6), atol=1e-6)
    assert torch.equal(torch.isfinite(lp), kept_mask(logits / 0.7, rule))


def test_csr_mask_round_trips_and_stays_compact():
    dense = kept_mask(torch.randn(4, 16, 1000, generator=torch.Generator().manual_seed(2)), SamplingRule(top_k=10))
    csr = SamplingMask.from_dense(dense)
    assert torch.equal(csr.dense_rows(0, 64, 1000).reshape(4, 16, 1000), dense)
    assert torch.equal(csr.dense_rows(17, 30, 1000), dense.reshape(64, 1000)[17:30])
    assert csr.nbytes < dense.numel() / 20  # ~10 kept ids of 1000 per position


def _rollout(rule, seed=0, b=8, t=24, v=64, engine_noise=0.0):
    """A stand-in engine: samples with ``rule`` from logits a little off the trainer's, returns processed
    log-probs of the sampled tokens (vLLM's processed_logprobs) and its kept set."""
    gen = torch.Generator().manual_seed(seed)
    trainer_logits = torch.randn(b, t, v, generator=gen) * 2
    engine_logits = trainer_logits + engine_noise * torch.randn(b, t, v, generator=gen)
    engine_lp = processed_log_probs(engine_logits, rule)
    tokens = torch.multinomial(engine_lp.exp().reshape(-1, v), 1, generator=gen).reshape(b, t)
    rollout_lp = engine_lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    mask = SamplingMask.from_dense(kept_mask(engine_logits / rule.temperature, rule))
    scaled = trainer_logits / rule.temperature
    trainer_lp = scaled.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return scaled, tokens, rollout_lp, trainer_lp, mask


@pytest.mark.parametrize("source", ["engine_mask", "recomputed"])
def test_the_rollout_ratio_moves_from_the_kept_mass_to_one(source):
    rule = SamplingRule(temperature=1.0, top_p=0.8)
    scaled, tokens, rollout_lp, trainer_lp, mask = _rollout(rule, engine_noise=0.05)
    resp = torch.ones_like(tokens)
    before = (trainer_lp - rollout_lp).exp().mean().item()
    log_mass = log_kept_mass(scaled, tokens, resp, **({"mask": mask} if source == "engine_mask" else {"rule": rule}))
    after = (trainer_lp - rollout_log_prob_over_vocab(rollout_lp, log_mass, resp)).exp().mean().item()
    assert before < 0.9  # the kept mass, not a policy change
    assert abs(before - log_mass.exp().mean().item()) < 0.03
    assert abs(after - 1) < 0.02


def test_without_engine_noise_the_corrected_ratio_is_exactly_one():
    rule = SamplingRule(top_k=7, top_p=0.9)
    scaled, tokens, rollout_lp, trainer_lp, mask = _rollout(rule)
    resp = torch.ones_like(tokens)
    adjusted = rollout_log_prob_over_vocab(rollout_lp, log_kept_mass(scaled, tokens, resp, mask=mask), resp)
    torch.testing.assert_close(adjusted, trainer_lp, atol=1e-5, rtol=0)


def test_log_mass_carries_no_gradient_and_is_zero_off_the_mask():
    rule = SamplingRule(top_p=0.5)
    scaled, tokens, *_ = _rollout(rule, b=2, t=5)
    scaled = scaled.clone().requires_grad_(True)
    resp = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    log_mass = log_kept_mass(scaled, tokens, resp, rule=rule)
    assert not log_mass.requires_grad
    assert (log_mass[resp == 0] == 0).all() and (log_mass[resp == 1] < 0).all()


def test_bf16_logits_give_the_float32_mass_to_bf16_precision():
    rule = SamplingRule(top_p=0.8)
    scaled, tokens, *_ = _rollout(rule, b=2, t=6)
    resp = torch.ones_like(tokens)
    exact = log_kept_mass(scaled, tokens, resp, rule=rule)
    half = log_kept_mass(scaled.bfloat16(), tokens, resp, rule=rule)
    assert half.dtype == torch.float32
    assert (half - exact).abs().max() < 0.05


def test_a_mask_that_excludes_the_sampled_token_is_refused_with_the_position():
    rule = SamplingRule(top_k=1)
    scaled, tokens, *_ = _rollout(rule, b=2, t=3, v=10)
    dense = torch.zeros(2, 3, 10, dtype=torch.bool)
    dense.scatter_(-1, tokens.unsqueeze(-1), True)
    dense[1, 2] = False
    dense[1, 2, (tokens[1, 2] + 1) % 10] = True
    with pytest.raises(StableRLError, match=r"position \(1, 2\).*excludes the sampled token"):
        log_kept_mass(scaled, tokens, torch.ones_like(tokens), mask=SamplingMask.from_dense(dense))


def test_masks_of_another_shape_or_vocabulary_are_refused():
    rule = SamplingRule(top_k=3)
    scaled, tokens, *_ = _rollout(rule, b=2, t=3, v=10)
    resp = torch.ones_like(tokens)
    wide = SamplingMask(torch.tensor([12] * 6, dtype=torch.int32), torch.arange(7), (2, 3))
    with pytest.raises(StableRLError, match="another vocabulary"):
        log_kept_mass(scaled, tokens, resp, mask=wide)
    with pytest.raises(StableRLError, match="shape"):
        log_kept_mass(scaled, tokens, resp, mask=SamplingMask.from_dense(torch.ones(3, 2, 10, dtype=torch.bool)))
    with pytest.raises(StableRLError, match="exactly one of"):
        log_kept_mass(scaled, tokens, resp)


@settings(max_examples=60, deadline=None)
@given(temperature=st.floats(max_value=0.0, allow_nan=False) | st.just(float("nan")),
       top_p=st.floats(allow_nan=True).filter(lambda p: not 0 < p <= 1),
       min_p=st.floats(allow_nan=True).filter(lambda p: not 0 <= p <= 1),
       field=st.sampled_from(["temperature", "top_p", "min_p", "top_k"]))
def test_bad_rules_are_refused_naming_the_field(temperature, top_p, min_p, field):
    bad = {"temperature": temperature, "top_p": top_p, "min_p": min_p, "top_k": 2.5}[field]
    with pytest.raises(StableRLError, match=f"SamplingRule.{field}"):
        SamplingRule(**{field: bad})


@settings(max_examples=40, deadline=None)
@given(offsets=st.lists(st.integers(-3, 8), min_size=4, max_size=4))
def test_malformed_csr_offsets_are_refused(offsets):
    ok = offsets[0] == 0 and offsets[-1] == 5 and all(b >= a for a, b in zip(offsets, offsets[1:]))
    build = lambda: SamplingMask(torch.zeros(5, dtype=torch.int32), torch.tensor(offsets), (3,))  # noqa: E731
    if ok:
        build()
    else:
        with pytest.raises(StableRLError, match="offsets"):
            build()
