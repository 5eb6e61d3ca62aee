"""Sampling-mask replay in OpenRLHF 0.11.2 (issue 28, part 1): the rollout ratio moves from the kept mass to 1.

A stand-in vLLM samples with ``--rollout.top_p 0.8`` (temperature 0.7) from a tiny dense Qwen3 built in code, its
weights slightly perturbed (an engine's numerics), and returns processed log-probs (normalised over the kept set, as
OpenRLHF asks vLLM for with ``--algo.advantage.is_correction_level`` on). OpenRLHF's real
``RemoteExperienceMaker.make_experience`` -> ``BaseModelActor.execute_batch`` -> ``PolicyModelActor.forward`` ->
``Actor.forward`` computes the old log-probs (Ray replaced by a pickle round trip, as in
``test_openrlhf_old_entropy.py``); then the replay buffer and the real ``ActorPPOTrainer.training_step`` with
OpenRLHF's own token-level IS correction, whose ``is_filter_ratio`` is the share of tokens outside [0.9, 1.1].
"""

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (nox -s openrlhf installs it)")

import copy  # noqa: E402

import torch  # noqa: E402

import stablerl.adapters.openrlhf as adapter  # noqa: E402
from orlhf_helpers import actor_pipeline, make_args, through_replay_buffer  # noqa: E402
from stablerl.adapters.openrlhf import Selection, _sampling_mask  # noqa: E402
from stablerl.params import StableRLError  # noqa: E402
from stablerl.sampling_mask import SamplingMask, SamplingRule, kept_mask, processed_log_probs  # noqa: E402
from test_openrlhf_old_entropy import VOCAB, _tiny_dense  # noqa: E402

RULE = SamplingRule(temperature=0.7, top_p=0.8)
ROWS, PER_BATCH = 16, 8  # two rollout batches of eight samples (two prompts x four)


def _policy(seed=3):
    model = _tiny_dense(seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)  # a peaked next-token distribution, as a trained LM's
    return model


def _rollout(model, seed=0, noise=0.01):
    """The stand-in vLLM: OpenRLHF Experiences (as SamplesGenerator builds them, rollout_log_probs over the shifted
    sequence) sampled with RULE from a perturbed copy of ``model``, with the kept sets it used (one SamplingMask per
    row over the action width)."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    engine = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in engine.parameters():
            p.add_(noise * p.abs().mean() * torch.randn(p.shape, generator=g))
    singles, masks = [], []
    for i in range(ROWS):
        p, r = int(torch.randint(2, 5, (1,), generator=g)), int(torch.randint(10, 21, (1,), generator=g))
        ids = torch.randint(2, VOCAB, (p,), generator=g)
        lps, kept = [], []
        for _ in range(r):
            with torch.no_grad():
                logits = engine(input_ids=ids.unsqueeze(0)).logits[0, -1]
            lp = processed_log_probs(logits, RULE)
            tok = int(torch.multinomial(lp.exp(), 1, generator=g))
            lps.append(float(lp[tok]))
            kept.append(kept_mask(logits.float() / RULE.temperature, RULE))
            ids = torch.cat([ids, torch.tensor([tok])])
        n = p + r
        action = torch.zeros(n - 1, dtype=torch.bool)
        action[p - 1:] = True
        rollout_lp = torch.zeros(n - 1)
        rollout_lp[p - 1:] = torch.tensor(lps)
        dense = torch.zeros(n - 1, VOCAB, dtype=torch.bool)
        dense[p - 1:] = torch.stack(kept)
        masks.append(dense)
        singles.append(Experience(
            sequences=ids.unsqueeze(0), attention_mask=torch.ones(1, n, dtype=torch.long),
            action_mask=action.unsqueeze(0), rollout_log_probs=rollout_lp.unsqueeze(0), prompts=[f"p{i}"],
            labels=[""], images=[None], mm_train_inputs=[None], index=[i], rewards=torch.tensor([float(i % 3)]),
            response_length=torch.tensor([float(r)]), truncated=torch.tensor([False]),
            total_length=torch.tensor([float(n)]), info={}))
    return singles, masks


def _batches(singles, masks=None):
    """The two rollout batches (fresh copies: make_experience writes into them), the engine's kept sets attached to
    each batch's action_mask when ``masks``."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    out = []
    for b in range(ROWS // PER_BATCH):
        rows = range(b * PER_BATCH, (b + 1) * PER_BATCH)
        batch = Experience.concat_experiences([copy.deepcopy(singles[i]) for i in rows], 0)
        if masks is not None:
            width = batch.action_mask.shape[1]
            per_row = []
            for i in rows:  # concat pads on the right: a row's first positions align
                dense = torch.zeros(width, VOCAB, dtype=torch.bool)
                dense[:masks[i].shape[0]] = masks[i]
                per_row.append(SamplingMask.from_dense(dense))
            setattr(batch.action_mask, _sampling_mask.MASK_ATTR, per_row)
        out.append(batch)
    return out


def _setup(monkeypatch, model, replay="auto", top_p=RULE.top_p, is_level="token", packing=False):
    args = make_args(estimator="group_norm", n_samples=4, is_level=is_level, is_mode="mask", is_threshold=(0.9, 1.1))
    args.rollout.top_p, args.rollout.temperature = top_p, RULE.temperature
    args.stablerl = Selection(sampling_replay=_sampling_mask.decide(args, replay))
    return actor_pipeline(monkeypatch, args, model, packing, RULE.temperature)


def _ratio_stats(experiences):
    ratio = torch.cat([(e.action_log_probs.float() - e.rollout_log_probs.float()).exp()[e.action_mask.bool()]
                       for e in experiences])
    return float(ratio.mean()), float(((ratio < 0.9) | (ratio > 1.1)).float().mean())


def _is_filter_ratio(run, experiences):
    """OpenRLHF's own token-level IS correction (mask mode, band [0.9, 1.1]) in a real training step: its
    is_filter_ratio is the share of tokens outside the band (lr 0: the policy is the old one)."""
    batch = through_replay_buffer(experiences, list(range(ROWS)), run.args.ds.packing_samples)
    status = run.trainer.training_step(batch, 0.0, 0, dict(dp_size=1, batch_num_tokens=float(batch.action_mask.sum()),
                                                           global_batch_size=float(ROWS)))
    metrics = status["metrics"]
    return float(metrics["is_filter_ratio"]), float(metrics["vllm_kl"])


@pytest.fixture(scope="module")
def rollout():
    model = _policy()
    singles, masks = _rollout(model)
    return model, singles, masks


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_the_rollout_ratio_moves_from_the_kept_mass_to_one(monkeypatch, rollout, packing, capsys):
    model, singles, _ = rollout
    off = _setup(monkeypatch, model, replay="false", packing=packing)
    before = off.maker.make_experience(_batches(singles))
    filtered_before, kl_before = _is_filter_ratio(off, before)
    on = _setup(monkeypatch, model, replay="auto", packing=packing)
    assert "log_kept_mass" in adapter.OpenRLHFAdapter().worker(on.actor).old_pass_stats
    after = on.maker.make_experience(_batches(singles))
    for b, a in zip(before, after):  # the PPO anchor stays OpenRLHF's
        torch.testing.assert_close(a.action_log_probs, b.action_log_probs)
        assert _sampling_mask.METRIC in a.info and "stablerl_log_kept_mass" not in a.info
    kept = torch.cat([a.info[_sampling_mask.METRIC] for a in after])
    (mean_before, out_before), (mean_after, out_after) = _ratio_stats(before), _ratio_stats(after)
    filtered_after, kl_after = _is_filter_ratio(on, after)
    print(f"\nopenrlhf ({'packed' if packing else 'padded'}) top_p=0.8: mean ratio {mean_before:.3f} -> "
          f"{mean_after:.3f}; outside [0.9, 1.1] {out_before:.1%} -> {out_after:.1%}; OpenRLHF is_filter_ratio "
          f"{filtered_before:.1%} -> {filtered_after:.1%}, vllm_kl {kl_before:.3f} -> {kl_after:.4f}; kept mass "
          f"{float(kept.mean()):.3f}")
    assert mean_before < 0.9 and out_before > 0.4  # before: the kept mass, not a policy change
    assert float(kept.mean()) == pytest.approx(mean_before, abs=0.03)  # per-row means of M vs the token mean
    assert mean_after == pytest.approx(1.0, abs=0.02) and out_after < 0.1 and out_after < out_before / 4
    # OpenRLHF's own IS correction sees the same: the band drops most tokens before, few after
    assert filtered_before == pytest.approx(out_before, abs=1e-6) and filtered_after == pytest.approx(out_after, abs=1e-6)
    assert kl_before > 0.1 and abs(kl_after) < 0.02


def test_the_engines_masks_and_a_wrong_mask(monkeypatch, rollout):
    """The rows' engine masks (attached to the action_mask tensor) replace the recomputed rule: log M equals a plain
    forward's mass on them; a kept set that excludes a sampled token raises, naming it."""
    model, singles, masks = rollout
    run = _setup(monkeypatch, model)
    after = run.maker.make_experience(_batches(singles, masks))
    mean, outside = _ratio_stats(after)
    assert mean == pytest.approx(1.0, abs=0.02) and outside < 0.1
    for b, e in enumerate(after):  # reference: log M of every row from a plain forward over the engine's kept sets
        for j in range(PER_BATCH):
            i = b * PER_BATCH + j
            n = singles[i].sequences.shape[1]
            with torch.no_grad():
                logits = model(input_ids=singles[i].sequences).logits[0, :-1].float() / RULE.temperature
            act = singles[i].action_mask[0]
            ref = logits.masked_fill(~masks[i], float("-inf")).logsumexp(-1) - logits.logsumexp(-1)
            got = e.rollout_log_probs[j, :n - 1] - singles[i].rollout_log_probs[0]
            torch.testing.assert_close(got[act], ref[act], atol=2e-5, rtol=0)
    bad = [m.clone() for m in masks]
    seq = singles[5].sequences[0]
    p = int((~singles[5].action_mask[0]).sum()) + 1
    bad[5][p + 1, int(seq[p + 2])] = False  # row 5's third response token is not in its kept set
    with pytest.raises(StableRLError, match=r"excludes the sampled token " + str(int(seq[p + 2]))):
        run.maker.make_experience(_batches(singles, bad))


@pytest.mark.parametrize("value, top_p, level, on", [
    ("auto", 0.8, "token", True), ("auto", 1.0, "token", False), ("auto", 0.8, "off", False), (None, 0.8, "seq", True),
    ("false", 0.8, "token", False), ("true", 1.0, "token", True)])
def test_auto_switches_with_the_rollout_rule(value, top_p, level, on):
    args = make_args(is_level=level)
    args.rollout.top_p, args.rollout.temperature = top_p, 0.7
    decision = _sampling_mask.decide(args, value)
    assert decision.on is on
    assert ("log_kept_mass" in Selection(sampling_replay=decision).old_pass_stats()) is on
    if on:
        assert decision.rule == SamplingRule(temperature=0.7, top_p=top_p)


def test_errors_name_the_flag():
    args = make_args(is_level="off")
    args.rollout.top_p = 0.8
    with pytest.raises(StableRLError, match=r"--algo.advantage.sampling_mask_replay=true, but this run forms no ratio "
                       r".*is_correction_level token\|seq"):
        _sampling_mask.decide(args, "true")
    with pytest.raises(StableRLError, match=r"sampling_mask_replay must be auto, true or false, got 'yes please'"):
        _sampling_mask.decide(args, "yes please")


def test_the_provider_is_declared():
    from stablerl.frameworks import get_framework

    spec = get_framework("openrlhf")
    assert "sampling_mask" in spec.feedable["policy_loss"]
    assert "is_correction_level" in spec.conditions["policy_loss"]["sampling_mask"]
