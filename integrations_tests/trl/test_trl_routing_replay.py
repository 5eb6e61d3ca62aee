"""MoE routing replay through the stablerl TRL trainer (``routing_replay="R3"`` / ``"R2"``), real TRL 1.16
GRPO on CPU in fp32 with a tiny Qwen3-MoE (2 MoE layers, 8 experts, top-2) built in code.

Evidence: with R3 the training forwards use exactly the experts of HF ``generate`` (and their log-probs
equal a plain forward under ``routing_replay.replay``); without replay the routes drift from the
rollout's after an optimizer step, with replay they do not; R3 and R2 train (router gradient non-zero);
gradient checkpointing gives the same losses. Run with -s to see the measured numbers.
"""

import math

import pytest
import torch

import trl_helpers as H  # noqa: I001

from stablerl import StableRLError, UnknownNameError
from stablerl import routing_replay as rr
from stablerl.adapters.trl import GRPOConfig, GRPOTrainer


def tiny_moe(seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = H.TOKENIZER
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=64, tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
    )
    model = Qwen3MoeForCausalLM(cfg)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = None
    return model


class Probe(GRPOTrainer):
    """Records, for every log-prob forward, the experts the routers actually used (a capture inside the
    adapter's replay sees the replayed experts) next to the routes the adapter meant to replay."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        rollout = self._rr_rollout is not None
        with rr.capture(self.accelerator.unwrap_model(model)) as cap:
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args,
                                                             **kwargs)
        parts = [r.batch_tensor()[0] for r in cap.routes_list()]
        used = rr.Routes.from_batch_tensor(torch.cat(parts), num_experts=8)
        meant = (self._rr_rollout["routes"] if rollout else self._rr_current) if self._rr_mode else None
        self.calls.append(dict(phase="rollout" if rollout else "train", step=self.state.global_step, used=used,
                               meant=meant, input_ids=input_ids.detach().clone(),
                               attention_mask=attention_mask.detach().clone(), logits_to_keep=logits_to_keep,
                               logps=out[0].detach().clone()))
        return out


class NoReplay:
    """Stands in for routing_replay.replay: routes are recorded and aligned, but nothing is forced."""

    def __init__(self, model, routes, families=None):
        self.calls = []

    def set_routes(self, routes):
        pass

    def remove(self):
        pass


def run(tmp_path, model=None, trainer_cls=Probe, **overrides):
    kw = dict(max_completion_length=6, max_steps=1, learning_rate=0.0, routing_replay="R3")
    kw.update(overrides)
    args = GRPOConfig(**H.base_kwargs(tmp_path, **kw))
    model = model if model is not None else tiny_moe()
    grads = []
    model.model.layers[0].mlp.gate.weight.register_hook(lambda g: grads.append(float(g.norm())))
    trainer, rec, initial = H.train(trainer_cls, args, model=model, reward=H.binary_digit_reward)
    return trainer, rec, initial, grads


def attended_fraction_valid(routes, attention_mask):
    """Fraction of attended tokens whose route is valid in every layer (i.e. really replayed)."""
    tv = routes.token_valid.view(routes.batch_shape)
    m = attention_mask.bool().cpu()
    return float((tv & m).sum()) / float(m.sum())


def logps_under_replay(model, call):
    """Independent check: a plain HF forward under routing_replay.replay, log-softmax of the completion tokens."""
    ids, mask, C = call["input_ids"], call["attention_mask"], call["logits_to_keep"]
    with torch.no_grad(), rr.replay(model, call["meant"]):
        logits = model(input_ids=ids, attention_mask=mask).logits
    lp = torch.log_softmax(logits[:, -C - 1:-1].float(), dim=-1)
    return lp.gather(-1, ids[:, -C:].unsqueeze(-1)).squeeze(-1), mask[:, -C:].bool()


def test_r3_training_forward_uses_the_generation_routes(tmp_path):
    trainer, rec, initial, _ = run(tmp_path)  # lr = 0, num_iterations=2, GA=2: old log-prob pass + 2 micro-batches
    rollout = [c for c in trainer.calls if c["phase"] == "rollout"]
    train = [c for c in trainer.calls if c["phase"] == "train"]
    assert len(rollout) == 1 and len(train) == 2
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    for call in rollout + train:
        meant = call["meant"]
        assert meant is not None and meant.batch_shape == tuple(call["input_ids"].shape)
        assert rr.mismatch_fraction(meant, call["used"]) == 0.0
        # the routes cover the real tokens: only padding and the last sampled token are routed natively
        assert attended_fraction_valid(meant, call["attention_mask"]) > 0.85
        ref, mask = logps_under_replay(model, call)
        assert torch.allclose(call["logps"][mask], ref[mask], atol=1e-5, rtol=0), (call["logps"] - ref).abs().max()
    # the micro-batches are shuffled rows of the generation batch: their routes are rows of the rollout's
    gen_rows = {tuple(r.indices.flatten().tolist()) for r in rollout[0]["meant"].split(1)}
    for call in train:
        assert all(tuple(r.indices.flatten().tolist()) in gen_rows for r in call["meant"].split(1))
    assert not trainer._rr_handles  # released after backward
    assert math.isfinite(rec.logs[0]["loss"])


def _drift(tmp_path, monkeypatch, replay):
    if not replay:
        monkeypatch.setattr(rr, "replay", NoReplay)
    # GA=1, num_iterations=2: step 1 trains at the rollout's weights, step 2 re-uses the batch after one update
    trainer, rec, initial, _ = run(tmp_path, gradient_accumulation_steps=1, max_steps=2, learning_rate=0.02)
    monkeypatch.undo()
    train = [c for c in trainer.calls if c["phase"] == "train"]
    assert [c["step"] for c in train] == [0, 1]
    return [rr.mismatch_fraction(c["meant"], c["used"]) for c in train]


def test_routes_drift_after_an_update_without_replay_not_with(tmp_path, monkeypatch):
    native = _drift(tmp_path / "native", monkeypatch, replay=False)
    replayed = _drift(tmp_path / "replay", monkeypatch, replay=True)
    print(f"\nrouting decisions differing from generate's: without replay {native[0]:.4f} before / {native[1]:.4f} "
          f"after one optimizer step (lr 0.02); with R3 replay {replayed[0]:.4f} / {replayed[1]:.4f}")
    # same weights: the aligned generate routes are the training forward's own (alignment is right)
    assert native[0] <= 0.01
    assert native[1] > 0.02  # one Adam step moves the routers
    assert replayed == [0.0, 0.0]


@pytest.mark.parametrize("mode", ["R3", "R2"])
def test_trains_with_replay(tmp_path, mode):
    trainer, rec, initial, grads = run(tmp_path, routing_replay=mode, max_steps=2, learning_rate=5e-3)
    assert len(rec.logs) == 2 and all(math.isfinite(log["loss"]) for log in rec.logs)
    assert not torch.equal(rec.params[-1], initial) and torch.isfinite(rec.params[-1]).all()
    assert grads and min(grads) > 0.0  # the router keeps its gradient under replay
    train = [c for c in trainer.calls if c["phase"] == "train"]
    rollout = [c for c in trainer.calls if c["phase"] == "rollout"]
    assert len(train) == 4 and len(rollout) == 1  # 2 steps x GA 2, one generation (num_iterations=2)
    if mode == "R2":  # recorded in the old-log-prob pass (nothing replayed there), replayed in every update
        assert rollout[0]["meant"] is rollout[0]["meant"] and rollout[0]["used"].batch_shape[0] == 16
    for c in train:
        assert c["meant"] is not None and rr.mismatch_fraction(c["meant"], c["used"]) == 0.0
    # R2's routes are the old pass's native routes, R3's the rollout's
    assert trainer._rr_mode == mode


def test_r2_without_old_pass_records_in_the_training_forward(tmp_path):
    # num_iterations=1 and steps_per_generation == GA: TRL computes no old log-probs
    trainer, rec, initial, grads = run(tmp_path, routing_replay="R2", num_iterations=1, max_steps=1,
                                       learning_rate=5e-3)
    assert [c["phase"] for c in trainer.calls] == ["train", "train"]
    assert all(c["meant"] is None for c in trainer.calls)  # native forward, recorded
    assert all("stablerl_routes" in b for b in trainer._buffered_inputs)
    assert math.isfinite(rec.logs[0]["loss"]) and grads and min(grads) > 0


def test_gradient_checkpointing_replays_in_recomputation(tmp_path, monkeypatch):
    handles = []
    real = rr.replay

    def recording(model, routes, families=None):
        h = real(model, routes, families)
        handles.append(h)
        return h

    losses = {}
    for gc in (False, True):
        handles.clear()
        monkeypatch.setattr(rr, "replay", recording)
        trainer, rec, initial, grads = run(tmp_path / str(gc), gradient_checkpointing=gc, max_steps=2,
                                           learning_rate=5e-3, trainer_cls=GRPOTrainer)
        monkeypatch.undo()
        losses[gc] = ([log["loss"] for log in rec.logs], rec.params[-1], grads)
        train_calls = [h.calls for h in handles if h.calls and max(h.calls) != min(h.calls) or h.calls[0] in (1, 2)]
        # training forwards: one chunk each; under checkpointing the routers fire again in backward
        assert any(c == ([2, 2] if gc else [1, 1]) for c in train_calls), [h.calls for h in handles]
        assert not any(h.active for h in handles)
    (l0, p0, g0), (l1, p1, g1) = losses[False], losses[True]
    assert all(math.isfinite(x) for x in l1)
    assert l0 == pytest.approx(l1, abs=1e-6)
    assert torch.allclose(p0, p1, atol=1e-6) and g0 == pytest.approx(g1, rel=1e-5)


def test_errors(tmp_path):
    with pytest.raises(UnknownNameError, match="R3"):
        GRPOConfig(**H.base_kwargs(tmp_path, routing_replay="R4"))
    args = GRPOConfig(**H.base_kwargs(tmp_path, routing_replay="r2"))
    assert args.routing_replay == "R2"
    with pytest.raises(StableRLError, match="needs a Mixture-of-Experts model"):
        GRPOTrainer(model=H.tiny_model(), reward_funcs=H.binary_digit_reward, args=args,
                    train_dataset=H.build_dataset(8), processing_class=H.TOKENIZER)
    vargs = GRPOConfig(**H.base_kwargs(tmp_path, routing_replay="R3", use_vllm=True))
    with pytest.raises(StableRLError, match="routed_experts"):
        GRPOTrainer(model=tiny_moe(), reward_funcs=H.binary_digit_reward, args=vargs,
                    train_dataset=H.build_dataset(8), processing_class=H.TOKENIZER)
