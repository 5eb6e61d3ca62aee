"""The adapters' shared sampling-mask replay glue (stablerl.sampling_mask): the auto/true/false decision, log M at
rows of a packed logits tensor, and the replayed rollout log-prob with its kept-mass metric."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stablerl.params import StableRLError
from stablerl.sampling_mask import (KEPT_MASS_METRIC, SamplingMask, SamplingRule, concat_positions, kept_mask,
                                    log_kept_mass, log_kept_mass_rows, replay_rollout_log_prob, resolve_replay)

TOP_P = SamplingRule(top_p=0.8)
FULL = SamplingRule()


@pytest.mark.parametrize("value, rule, rollout, masks, on", [
    ("auto", TOP_P, True, False, True), (None, TOP_P, True, False, True), ("auto", FULL, True, False, False),
    ("auto", TOP_P, False, False, False), ("auto", FULL, True, True, True), ("false", TOP_P, True, False, False),
    (False, TOP_P, True, False, False), ("true", FULL, True, False, True), (True, TOP_P, True, False, True),
    ("auto", SamplingRule(top_k=5), True, False, True), ("auto", SamplingRule(min_p=0.1), True, False, True)])
def test_the_decision(value, rule, rollout, masks, on):
    d = resolve_replay(value, rule, rollout_log_probs=rollout, key="x.sampling_mask_replay", framework="fw",
                       engine_masks=masks)
    assert d.on is on
    assert d.rule == (None if masks and on else rule)  # the engine's masks, when they are there
    assert d.line().startswith(f"stablerl/fw: sampling-mask replay {'on' if on else 'off'} (")


def test_true_without_rollout_log_probs_is_an_error():
    with pytest.raises(StableRLError, match=r"x.key=true, but this run forms no ratio against rollout log-probs"):
        resolve_replay("true", TOP_P, rollout_log_probs=False, key="x.key")


@settings(max_examples=40, deadline=None)
@given(st.text(max_size=12).filter(lambda s: s.strip().lower() not in (
    "auto", "true", "1", "yes", "on", "false", "0", "no", "off")))
def test_a_bad_value_names_the_key(value):
    with pytest.raises(StableRLError, match=r"my\.key must be auto, true or false, got"):
        resolve_replay(value, TOP_P, rollout_log_probs=True, key="my.key")


def _packed(n=300, v=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 3
    rows = torch.randperm(n, generator=g)[: n - 17]  # more than one chunk (256), out of order
    ids = torch.randint(0, v, (rows.numel(),), generator=g)
    temperature = 0.5 + torch.rand(rows.numel(), generator=g)
    return logits, rows, ids, temperature


def test_rows_equal_log_kept_mass_on_the_gathered_scaled_logits():
    logits, rows, ids, temperature = _packed()
    scaled = (logits[rows] / temperature.unsqueeze(-1)).unsqueeze(0)
    ones = torch.ones(1, rows.numel(), dtype=torch.bool)
    want = log_kept_mass(scaled, ids.unsqueeze(0), ones, rule=TOP_P)[0]
    got = log_kept_mass_rows(logits, rows, ids, rule=TOP_P, temperature=temperature)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert (got <= 1e-6).all() and (got < -1e-3).any()
    # the engine's masks (CSR over the rows, in order), split across chunks: the same numbers
    mask = SamplingMask.from_dense(kept_mask(scaled[0], TOP_P).scatter(-1, ids.unsqueeze(-1), True))
    torch.testing.assert_close(log_kept_mass_rows(logits, rows, ids, mask=mask, temperature=temperature), want,
                               rtol=0, atol=1e-6)


def test_rows_reject_bad_shapes_and_a_mask_without_the_sampled_token():
    logits, rows, ids, _ = _packed(n=20)
    with pytest.raises(StableRLError, match=r"logits \[N, V\], rows \[n\] and token_ids \[n\]"):
        log_kept_mass_rows(logits.unsqueeze(0), rows, ids, rule=TOP_P)
    dense = torch.ones(rows.numel(), logits.shape[1], dtype=torch.bool)
    dense[1, ids[1]] = False
    with pytest.raises(StableRLError, match=rf"excludes the sampled token {int(ids[1])}"):
        log_kept_mass_rows(logits, rows, ids, mask=SamplingMask.from_dense(dense))
    with pytest.raises(StableRLError, match=r"SamplingMask has shape \(2,\) for 3 response positions"):
        log_kept_mass_rows(logits, rows[:3], ids[:3], mask=SamplingMask.from_dense(dense[:2]))


def test_replayed_rollout_log_prob_and_the_metric():
    mu = -torch.rand(2, 5)
    log_m = torch.log(torch.tensor([[0.8, 0.9, 0.7, 0.5, 0.6], [0.95, 0.85, 0.75, 1.0, 0.9]]))
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    metrics = {}
    out = replay_rollout_log_prob(mu, log_m, mask, metrics)
    torch.testing.assert_close(out[mask], (mu + log_m)[mask])
    assert torch.equal(out[~mask], mu[~mask])
    assert metrics[KEPT_MASS_METRIC] == pytest.approx((0.8 + 0.9 + 0.7 + 0.95 + 0.85 + 0.75 + 1.0) / 7, rel=1e-6)
    bf16 = replay_rollout_log_prob(mu.bfloat16(), log_m, mask)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float()[mask], (mu.bfloat16().float() + log_m)[mask], atol=1e-2, rtol=0)


def test_concat_positions_keeps_the_chosen_positions_in_row_order():
    g = torch.Generator().manual_seed(4)
    dense = [torch.rand(6, 10, generator=g) < 0.5, torch.rand(4, 10, generator=g) < 0.5]
    keep = [torch.tensor([0, 1, 1, 0, 1, 0], dtype=torch.bool), torch.tensor([1, 1, 0, 0], dtype=torch.bool)]
    out = concat_positions([SamplingMask.from_dense(d) for d in dense], keep)
    want = torch.cat([d[k] for d, k in zip(dense, keep)])
    assert out.shape == (5,) and torch.equal(out.dense_rows(0, 5, 10), want)
    with pytest.raises(StableRLError, match=r"src: row 1 must be a SamplingMask of shape \[>= 5\]"):
        concat_positions([SamplingMask.from_dense(dense[0]), SamplingMask.from_dense(dense[1])],
                         [keep[0], torch.ones(5, dtype=torch.bool)], "src")
    with pytest.raises(StableRLError, match=r"src: 1 masks for 2 rows"):
        concat_positions([SamplingMask.from_dense(dense[0])], keep, "src")
