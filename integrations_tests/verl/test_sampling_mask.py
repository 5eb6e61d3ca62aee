"""Sampling-mask replay in verl 0.9.1 (issue 28, part 1): the rollout ratio moves from the kept mass to 1.

A stand-in rollout engine samples with ``top_p=0.8`` (temperature 0.7) from a tiny model built in code whose weights
differ slightly from the trainer's (an engine's numerics) and returns processed log-probs (normalised over the kept
set, vLLM's ``processed_logprobs``). verl's own legacy ``RayPPOTrainer._compute_old_log_prob`` then runs on that
batch, its worker group answering ``compute_log_prob`` with verl's FSDP engine (``infer_batch``: verl's
``prepare_model_inputs``, forward, ``prepare_model_outputs``; the stablerl engine subclass adds ``log M``) on CPU, as
in ``test_routing_replay_fsdp.py``. Off, ``exp(old - rollout)`` is the kept mass; on, 1 within the engine's noise.
"""

from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("verl")

from stablerl.params import StableRLError  # noqa: E402
from stablerl.sampling_mask import (KEPT_MASS_METRIC, SamplingMask, SamplingRule, kept_mask,  # noqa: E402
                                    processed_log_probs)
from tiny_moe import VOCAB, tiny_moe  # noqa: E402

B, P, R = 24, 4, 20
RULE = SamplingRule(temperature=0.7, top_p=0.8)


def _policy():
    model = tiny_moe(seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)  # a peaked next-token distribution, as a trained LM's
    return model


def _rollout(model, rule=RULE, seed=0, noise=0.01):
    """The stand-in engine: the trainer's weights with a small perturbation, sampling with ``rule``; returns verl's
    legacy batch fields, the rollout's processed log-probs and the kept sets it used (CSR, per row)."""
    engine = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in engine.parameters():
            p.add_(noise * p.abs().mean() * torch.randn(p.shape, generator=g))
    prompt_lens = torch.randint(2, P + 1, (B,), generator=g)
    resp_lens = torch.randint(R // 2, R + 1, (B,), generator=g)
    prompts = torch.zeros(B, P, dtype=torch.long)
    responses = torch.zeros(B, R, dtype=torch.long)
    rollout_lp = torch.zeros(B, R)
    kept_rows = []
    for i in range(B):
        ids = torch.randint(3, VOCAB, (int(prompt_lens[i]),), generator=g)
        prompts[i, P - len(ids):] = ids
        kept = torch.zeros(R, VOCAB, dtype=torch.bool)
        for t in range(int(resp_lens[i])):
            with torch.no_grad():
                logits = engine(input_ids=ids.unsqueeze(0)).logits[0, -1]
            lp = processed_log_probs(logits, rule)
            tok = int(torch.multinomial(lp.exp(), 1, generator=g))
            responses[i, t], rollout_lp[i, t] = tok, lp[tok]
            kept[t] = kept_mask(logits.float() / rule.temperature, rule)
            ids = torch.cat([ids, torch.tensor([tok])])
        kept_rows.append(SamplingMask.from_dense(kept))
    pmask = (torch.arange(P).unsqueeze(0) >= P - prompt_lens.unsqueeze(1)).long()
    rmask = (torch.arange(R).unsqueeze(0) < resp_lens.unsqueeze(1)).long()
    attn = torch.cat([pmask, rmask], 1)
    fields = dict(prompts=prompts, responses=responses, input_ids=torch.cat([prompts, responses], 1),
                  attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp_min(0), response_mask=rmask.float(),
                  rollout_log_probs=rollout_lp * rmask)
    return fields, kept_rows


def _data_proto(fields, masks=None, temperature=RULE.temperature):
    import numpy as np
    from verl import DataProto

    non_tensors = {}
    if masks is not None:
        arr = np.empty(len(masks), dtype=object)
        arr[:] = masks
        non_tensors["sampling_mask"] = arr
    return DataProto.from_dict(tensors={k: v.clone() for k, v in fields.items()}, non_tensors=non_tensors,
                               meta_info={"temperature": temperature})


class _WorkerGroup:
    """``compute_log_prob`` as verl's engine worker answers it (``TrainingWorker.infer_batch``'s defaults, the
    engine's ``infer_batch``, the model outputs as a TensorDict), around a real verl FSDP engine on CPU."""

    def __init__(self, engine, micro=6):
        self.engine, self.micro = engine, micro

    def compute_log_prob(self, batch_td):
        from verl.utils import tensordict_utils as tu

        tu.assign_non_tensor(batch_td, use_remove_padding=self.engine.use_remove_padding, use_dynamic_bsz=False,
                             micro_batch_size_per_gpu=self.micro, use_fused_kernels=False)
        out = self.engine.infer_batch(batch_td)
        return tu.get_tensordict(tensor_dict=out["model_output"], non_tensor_dict={"metrics": {"mfu": 0.0}})


def _trainer(engine, replay="auto", top_p=RULE.top_p, top_k=-1, calculate_log_probs=True):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = RayPPOTrainer.__new__(RayPPOTrainer)  # _compute_old_log_prob reads only these attributes
    algorithm = {} if replay is None else {"sampling_mask_replay": replay}
    trainer.config = OmegaConf.create({
        "actor_rollout_ref": {"actor": {"calculate_sum_pi_squared": False},
                              "rollout": {"temperature": RULE.temperature, "top_p": top_p, "top_k": top_k,
                                          "calculate_log_probs": calculate_log_probs}},
        "algorithm": algorithm})
    trainer.actor_rollout_wg = _WorkerGroup(engine)
    return trainer


def _ratio_stats(batch):
    mask = batch.batch["response_mask"].bool()
    ratio = (batch.batch["old_log_probs"] - batch.batch["rollout_log_probs"]).exp()[mask]
    return float(ratio.mean()), float(((ratio < 0.9) | (ratio > 1.1)).float().mean())


def _old_pass(trainer, batch):
    """What RayPPOTrainer.fit does around the old-log-prob pass (decoupled mode)."""
    old_log_prob, _ = trainer._compute_old_log_prob(batch)
    old_log_prob.batch.pop("entropys")
    return batch.union(old_log_prob)


@pytest.fixture(scope="module")
def rollout():
    model = _policy()
    fields, masks = _rollout(model)
    return model, fields, masks


@pytest.fixture
def engine_for(make_engine):
    def make(model, use_remove_padding=True):
        return make_engine(None, model, use_remove_padding=use_remove_padding)

    return make


@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["packed", "padded"])
def test_the_rollout_ratio_moves_from_the_kept_mass_to_one(adapter, engine_for, rollout, use_remove_padding, capsys,
                                                          monkeypatch):
    import stablerl.sampling_mask as sm
    from stablerl.adapters.verl._ledger import verl_adapter

    monkeypatch.setattr(sm, "_LOGGED_DECISIONS", set())  # the decision line is printed once per process

    model, fields, _ = rollout
    engine = engine_for(model, use_remove_padding)
    before = _old_pass(_trainer(engine, replay="false"), _data_proto(fields))
    metrics = verl_adapter().state.metrics
    metrics.clear()
    after = _old_pass(_trainer(engine, replay="auto"), _data_proto(fields))
    torch.testing.assert_close(after.batch["old_log_probs"], before.batch["old_log_probs"])  # the PPO anchor: verl's
    mask = before.batch["response_mask"].bool()
    kept_mass = (before.batch["old_log_probs"] - before.batch["rollout_log_probs"]).exp()[mask].mean()
    (mean_before, out_before), (mean_after, out_after) = _ratio_stats(before), _ratio_stats(after)
    print(f"\nverl ({'packed' if use_remove_padding else 'padded'}) top_p=0.8: mean ratio {mean_before:.3f} -> "
          f"{mean_after:.3f}; outside [0.9, 1.1] {out_before:.1%} -> {out_after:.1%}; kept mass "
          f"{metrics[KEPT_MASS_METRIC]:.3f}")
    # before: the ratio is the kept mass (not a policy change), well below 1 and mostly outside the band
    assert metrics[KEPT_MASS_METRIC] == pytest.approx(mean_before, abs=0.02)
    assert mean_before == pytest.approx(float(kept_mass)) and mean_before < 0.9 and out_before > 0.4
    # after: 1 within the engine's noise, and few tokens outside [0.9, 1.1]
    assert mean_after == pytest.approx(1.0, abs=0.02) and out_after < 0.1 and out_after < out_before / 4
    # the replayed log-prob is log mu + log M on response tokens, untouched elsewhere
    assert torch.equal(after.batch["rollout_log_probs"][~mask], before.batch["rollout_log_probs"][~mask])
    # log M <= 0: the full-vocabulary log-prob is below the kept-set one
    assert (after.batch["rollout_log_probs"][mask] <= before.batch["rollout_log_probs"][mask] + 1e-6).all()
    assert after.meta_info["stablerl_sampling_replayed"]["top_p"] == 0.8
    # the sampling_mask provider at compute_advantage: the rule the batch was replayed with (None: not replayed)
    from types import SimpleNamespace

    provider = verl_adapter().providers[("advantage_estimator", "sampling_mask")]
    assert provider(verl_adapter(), SimpleNamespace(host=after)) == RULE
    assert provider(verl_adapter(), SimpleNamespace(host=before)) is None
    assert "sampling-mask replay on (auto:" in capsys.readouterr().err


def test_the_engines_masks_replay_exactly_and_a_wrong_mask_raises(adapter, engine_for, rollout):
    """The batch's per-row engine masks (the rollout's own kept sets) give the same result as the recomputed rule up
    to the engine's noise; a mask whose kept set excludes a sampled token is an error naming it."""
    model, fields, masks = rollout
    engine = engine_for(model)
    by_rule = _old_pass(_trainer(engine, replay="auto"), _data_proto(fields))
    by_mask = _old_pass(_trainer(engine, replay="auto"), _data_proto(fields, masks))
    mean, outside = _ratio_stats(by_mask)
    assert mean == pytest.approx(1.0, abs=0.02) and outside < 0.1
    # reference: log M from a plain forward of the trainer's model over the engine's kept sets
    log_m = by_mask.batch["rollout_log_probs"] - fields["rollout_log_probs"]
    for i in range(B):
        valid = fields["attention_mask"][i].bool()
        p, r = int(valid[:P].sum()), int(valid[P:].sum())
        with torch.no_grad():
            logits = model(input_ids=fields["input_ids"][i][valid].unsqueeze(0)).logits[0].float() / RULE.temperature
        rows = logits[p - 1:p + r - 1]
        kept = masks[i].dense_rows(0, r, VOCAB)
        ref = rows.masked_fill(~kept, float("-inf")).logsumexp(-1) - rows.logsumexp(-1)
        torch.testing.assert_close(log_m[i, :r], ref, atol=2e-5, rtol=0)
    # the recomputed rule differs from the engine's kept sets only where the engine's numerics moved a token across
    # the top-p edge
    same = (by_mask.batch["rollout_log_probs"] - by_rule.batch["rollout_log_probs"]).abs() < 1e-5
    same = same[fields["response_mask"].bool()]
    assert 0.5 < float(same.float().mean()) < 1  # the engine's masks were used, not the rule
    # a wrong mask: row 2's kept set without its third sampled token
    dense = masks[2].dense_rows(0, R, VOCAB)
    dense[2, int(fields["responses"][2, 2])] = False
    bad = list(masks)
    bad[2] = SamplingMask.from_dense(dense)
    with pytest.raises(StableRLError, match=r"excludes the sampled token " + str(int(fields["responses"][2, 2]))):
        _old_pass(_trainer(engine, replay="auto"), _data_proto(fields, bad))


@pytest.mark.parametrize("replay, top_p, top_k, on", [
    ("auto", 0.8, -1, True), ("auto", 1.0, -1, False), ("auto", 1.0, 5, True), (None, 0.8, -1, True),
    ("false", 0.8, -1, False), ("true", 1.0, -1, True)])
def test_auto_switches_with_the_rollout_rule(adapter, engine_for, rollout, replay, top_p, top_k, on):
    model, fields, _ = rollout
    batch = _old_pass(_trainer(engine_for(model), replay=replay, top_p=top_p, top_k=top_k), _data_proto(fields))
    replayed = not torch.equal(batch.batch["rollout_log_probs"], fields["rollout_log_probs"])
    assert replayed is (on and (top_p < 1 or top_k > 0))  # true with a full-vocabulary rule: on, log M = 0
    assert ("stablerl_sampling_replayed" in batch.meta_info) is on


def test_start_up_decisions(adapter):
    from stablerl.adapters.verl import _sampling_mask as sm

    def config(**algorithm):
        return OmegaConf.create({"actor_rollout_ref": {"rollout": {"temperature": 1.0, "top_p": 0.9, "top_k": -1,
                                                                   "calculate_log_probs": True}},
                                 "algorithm": algorithm})

    assert sm.startup(config()).on and sm.startup(config()).rule == SamplingRule(top_p=0.9)
    off = sm.startup(config(rollout_correction={"bypass_mode": True}))
    assert not off.on and "bypass_mode" in off.reason
    with pytest.raises(StableRLError, match=r"algorithm.sampling_mask_replay=true: .*bypass_mode"):
        sm.startup(config(sampling_mask_replay="true", rollout_correction={"bypass_mode": True}))
    v1 = sm.startup(config(), v1=True)
    assert not v1.on and "trainer.use_v1=false" in v1.reason
    with pytest.raises(StableRLError, match=r"sampling_mask_replay must be auto, true or false, got 'maybe'"):
        sm.startup(config(sampling_mask_replay="maybe"))
    cfg = config(sampling_mask_replay="true")
    cfg.actor_rollout_ref.rollout.calculate_log_probs = False
    with pytest.raises(StableRLError, match=r"=true, but this run forms no ratio against rollout log-probs"):
        sm.startup(cfg)


def test_the_provider_is_declared(adapter):
    from stablerl.frameworks import get_framework

    spec = get_framework("verl")
    assert "sampling_mask" in spec.feedable["policy_loss"]
    assert "bypass_mode=false" in spec.conditions["policy_loss"]["sampling_mask"]
