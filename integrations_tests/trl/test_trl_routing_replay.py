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

import stablerl

from stablerl import StableRLError, UnknownNameError
from stablerl import routing_replay as rr
from stablerl.adapters.trl import GRPOConfig, GRPOTrainer
from stablerl.tools.demo import DIGITS


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
        batch, routing = self._stablerl_batch, self._stablerl_routing
        rollout = batch is not None and routing.mode is not None
        with rr.capture(self.accelerator.unwrap_model(model)) as cap:
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args,
                                                             **kwargs)
        parts = [r.batch_tensor()[0] for r in cap.routes_list()]
        used = rr.Routes.from_batch_tensor(torch.cat(parts), num_experts=8)
        meant = (batch.routes if rollout else routing.current) if routing.mode else None
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


def prompts_of_varied_length(n=64, seed=0):
    """``copy <d> ... :`` prompts of 3 to 6 words, so TRL left-pads the prompts of a batch."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_dict({"prompt": [" ".join(["copy"] + rng.choices(DIGITS, k=rng.randint(1, 4)) + [":"])
                                         for _ in range(n)]})


def run(tmp_path, model=None, trainer_cls=Probe, **overrides):
    kw = dict(max_completion_length=6, max_steps=1, learning_rate=0.0, routing_replay="R3")
    kw.update(overrides)
    args = GRPOConfig(**H.base_kwargs(tmp_path, **kw))
    model = model if model is not None else tiny_moe()
    initial = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    grads = []
    model.model.layers[0].mlp.gate.weight.register_hook(lambda g: grads.append(float(g.norm())))
    rec = H.Recorder(model)
    trainer = trainer_cls(model=model, reward_funcs=H.binary_digit_reward, args=args,
                          train_dataset=prompts_of_varied_length(), processing_class=H.TOKENIZER, callbacks=[rec])
    trainer.train()
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
    prompt_lengths = rollout[0]["attention_mask"][:, : -rollout[0]["logits_to_keep"]].sum(1)
    assert prompt_lengths.min() < prompt_lengths.max()  # left padding is exercised
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    for call in rollout + train:
        meant = call["meant"]
        assert meant is not None and meant.batch_shape == tuple(call["input_ids"].shape)
        assert rr.mismatch_fraction(meant, call["used"]) == 0.0
        # the routes cover the real tokens: only padding and the last sampled token are routed natively
        assert attended_fraction_valid(meant, call["attention_mask"]) > 0.85
        # lr = 0: a native forward routes exactly like generate did, so the aligned routes are the right ones
        with torch.no_grad(), rr.capture(model) as cap:
            model(input_ids=call["input_ids"], attention_mask=call["attention_mask"])
        assert rr.mismatch_fraction(meant, cap.routes()) <= 0.01
        ref, mask = logps_under_replay(model, call)
        assert torch.allclose(call["logps"][mask], ref[mask], atol=1e-5, rtol=0), (call["logps"] - ref).abs().max()
    # the micro-batches are shuffled rows of the generation batch: their routes are rows of the rollout's
    gen_rows = {tuple(r.indices.flatten().tolist()) for r in rollout[0]["meant"].split(1)}
    for call in train:
        assert all(tuple(r.indices.flatten().tolist()) in gen_rows for r in call["meant"].split(1))
    assert not trainer._stablerl_routing.handles  # released after backward
    assert math.isfinite(rec.logs[0]["loss"])


def _drift(tmp_path, monkeypatch, replay, lr):
    if not replay:
        monkeypatch.setattr(rr, "replay", NoReplay)
    # GA=1, num_iterations=2: step 1 trains at the rollout's weights, step 2 re-uses the batch after one update
    trainer, rec, initial, _ = run(tmp_path, gradient_accumulation_steps=1, max_steps=2, learning_rate=lr)
    monkeypatch.undo()
    train = [c for c in trainer.calls if c["phase"] == "train"]
    assert [c["step"] for c in train] == [0, 1]
    return [rr.mismatch_fraction(c["meant"], c["used"]) for c in train]


def test_routes_drift_after_an_update_without_replay_not_with(tmp_path, monkeypatch):
    small = _drift(tmp_path / "native_small", monkeypatch, replay=False, lr=1e-3)
    native = _drift(tmp_path / "native", monkeypatch, replay=False, lr=0.02)
    replayed = _drift(tmp_path / "replay", monkeypatch, replay=True, lr=0.02)
    print(f"\nrouting decisions differing from generate's, before / after one Adam step: without replay "
          f"{small[0]:.4f} / {small[1]:.4f} (lr 1e-3), {native[0]:.4f} / {native[1]:.4f} (lr 0.02); "
          f"with R3 replay {replayed[0]:.4f} / {replayed[1]:.4f} (lr 0.02)")
    # same weights: the aligned generate routes are the training forward's own (the alignment is right)
    assert native[0] <= 0.01 and small[0] <= 0.01
    assert native[1] > 0.05 and small[1] > 0.0  # one Adam step moves the routers
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
    assert trainer._stablerl_routing.mode == mode


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
        handles.append((torch.is_grad_enabled(), h))  # grad enabled: a training forward (else old-log-prob pass)
        return h

    losses = {}
    for gc in (False, True):
        handles.clear()
        monkeypatch.setattr(rr, "replay", recording)
        trainer, rec, initial, grads = run(tmp_path / str(gc), gradient_checkpointing=gc, max_steps=2,
                                           learning_rate=5e-3, trainer_cls=GRPOTrainer)
        monkeypatch.undo()
        losses[gc] = ([log["loss"] for log in rec.logs], rec.params[-1], grads)
        train_calls = [h.calls for grad, h in handles if grad]
        # 4 training forwards of one chunk each; under checkpointing the routers fire again in backward
        assert train_calls == [[2, 2] if gc else [1, 1]] * 4, train_calls
        assert not any(h.active for _, h in handles)
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


def test_r3_from_a_rollout_func_returning_vllm_routes(tmp_path):
    """The vLLM route: a rollout_func returns vLLM-format routed_experts ([tokens - 1, layers, k] uint8, the
    last sampled token missing); here produced by HF generate one request at a time."""
    model = tiny_moe()
    tok = H.TOKENIZER

    def rollout_func(prompts, trainer):
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": None, "routed_experts": []}
        for text in prompts:
            p = tok(text)["input_ids"]
            x = torch.tensor([p])
            with torch.no_grad(), rr.capture(model) as cap:
                seq = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=5, do_sample=True)
            c = seq[0, len(p):].tolist()
            if tok.eos_token_id in c:
                c = c[: c.index(tok.eos_token_id) + 1]
            arr = cap.routes().to_token_layer_slot(2)[: len(p) + len(c) - 1].numpy().astype("uint8")
            out["prompt_ids"].append(p)
            out["completion_ids"].append(c)
            out["routed_experts"].append(arr)
        return out

    args = GRPOConfig(**H.base_kwargs(tmp_path, max_completion_length=5, max_steps=1, learning_rate=0.0,
                                      routing_replay="R3"))
    trainer = Probe(model=model, reward_funcs=H.binary_digit_reward, args=args, train_dataset=prompts_of_varied_length(),
                    processing_class=tok, rollout_func=rollout_func)
    trainer.train()
    assert [c["phase"] for c in trainer.calls] == ["rollout", "train", "train"]
    m = trainer.accelerator.unwrap_model(trainer.model).eval()
    for call in trainer.calls:
        assert rr.mismatch_fraction(call["meant"], call["used"]) == 0.0
        assert attended_fraction_valid(call["meant"], call["attention_mask"]) > 0.8
        with torch.no_grad(), rr.capture(m) as cap:  # lr = 0: the rollout's routes are the native ones
            m(input_ids=call["input_ids"], attention_mask=call["attention_mask"])
        assert rr.mismatch_fraction(call["meant"], cap.routes()) <= 0.01


def test_r3_rollout_func_without_routes_is_an_error(tmp_path):
    def rollout_func(prompts, trainer):
        ids = [H.TOKENIZER(t)["input_ids"] for t in prompts]
        return {"prompt_ids": ids, "completion_ids": [[5, 6] for _ in ids], "logprobs": None}

    args = GRPOConfig(**H.base_kwargs(tmp_path, max_completion_length=2, max_steps=1, routing_replay="R3"))
    trainer = GRPOTrainer(model=tiny_moe(), reward_funcs=H.binary_digit_reward, args=args,
                          train_dataset=prompts_of_varied_length(), processing_class=H.TOKENIZER,
                          rollout_func=rollout_func)
    with pytest.raises(StableRLError, match="routed_experts"):
        trainer.train()


class RouterLogProbProbe(GRPOTrainer):
    """Keeps the router log-probs handed to the rspo loss."""

    def _stablerl_policy_loss(self, inputs, logps, entropies, mode, router_log_prob=None):
        self.__dict__.setdefault("seen", []).append(
            (router_log_prob.detach().clone(), inputs.get("stablerl_old_router_log_prob"), logps.shape))
        return super()._stablerl_policy_loss(inputs, logps, entropies, mode, router_log_prob=router_log_prob)


@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_rspo_gets_router_log_probs(tmp_path, mode):
    # lr = 0: the training forward's router log-probs at the replayed experts equal the old pass's -> gamma = 1
    trainer, rec, _, _ = run(tmp_path / "lr0", routing_replay=mode, loss_type="rspo",
                             trainer_cls=RouterLogProbProbe)
    for cur, old, shape in trainer.seen:
        assert cur.shape == (*shape, 2, 2) and old is not None and old.shape == cur.shape
        assert bool((cur <= 0).all()) and torch.allclose(cur, old, atol=1e-5)
    assert rec.logs[0]["stablerl/rspo/gamma_mean"] == pytest.approx(1.0, abs=1e-5)
    # lr > 0: the router moves between the old pass and the second step -> gamma < 1, training goes on
    trainer, rec, initial, grads = run(tmp_path / "lr", routing_replay=mode, loss_type="rspo", max_steps=2,
                                       learning_rate=0.02)
    gammas = [log["stablerl/rspo/gamma_mean"] for log in rec.logs]
    print(f"\nrspo with {mode}: gamma_mean per step {gammas}")
    assert gammas[0] == pytest.approx(1.0, abs=1e-3) and gammas[1] < 0.9999
    assert all(math.isfinite(log["loss"]) for log in rec.logs) and min(grads) > 0
    assert not torch.equal(rec.params[-1], initial)


def test_rspo_needs_routing_replay(tmp_path):
    with pytest.raises(stablerl.MissingInputError, match="routing_replay"):
        GRPOConfig(**H.base_kwargs(tmp_path, loss_type="rspo"))
