"""Real GRPO training through TRL 1.16 on CPU for every registered stablerl policy loss and
advantage estimator: a tiny Qwen2-style model and a word-level tokenizer built in code, 2 optimizer
steps each with num_iterations=2 and gradient accumulation 2 (so the ratio is not 1).
Checks: every logged loss is finite, the parameters moved, the loss's metrics reach TRL's logs.
Algorithms that declare inputs TRL cannot provide (or are listed as unavailable) are skipped with
the reason."""

import math

import pytest
import torch

import trl_helpers as H  # noqa: I001

import stablerl
from stablerl.adapters.trl import GRPOConfig, GRPOTrainer
from stablerl.adapters.trl.trainer import TRL_LOSS_TYPES, loss_inputs_trl_can_feed
from stablerl.frameworks import get_framework

TRL = get_framework("trl")  # the declaration: what TRL can feed, and why not the rest

LOSSES = stablerl.list_algorithms("policy_loss")
# hyper-parameters that let an algorithm act on a random tiny model within 2 steps
LOSS_PARAMS = {"gtpo": {"ent_threshold": 10.0}}  # GTPO zeroes A where the mean entropy > 0.7 (random model: ~2.7)
ESTIMATORS = stablerl.list_algorithms("advantage_estimator")
# TRL gives estimators no cross-round sampling counts: Reinforce-Ada runs on in-batch statistics
ESTIMATOR_PARAMS = {"reinforce_ada": {"global_stat_est": False}}


def _skip_reason(spec, feedable):
    if spec.status == stablerl.UNAVAILABLE:
        return f"{spec.name}: listed as unavailable ({spec.notes[:120]})"
    missing = [r for r in spec.requires if r not in feedable]
    if missing:
        return f"{spec.name} needs {', '.join(missing)}: " + "; ".join(TRL.why(spec.kind, m) for m in missing)
    return None


def _check_run(trainer, rec, initial):
    assert len(rec.logs) == 2
    for log in rec.logs:
        assert math.isfinite(log["loss"]), log
    assert rec.params and not torch.equal(rec.params[-1], initial), "parameters were not updated"
    assert all(torch.isfinite(p).all() for p in rec.params)


@pytest.mark.parametrize("spec", LOSSES, ids=[s.name for s in LOSSES])
def test_every_policy_loss_trains(spec, tmp_path):
    reason = _skip_reason(spec, loss_inputs_trl_can_feed(use_vllm_is=False))
    if reason:
        pytest.skip(reason)
    loss_type = ("stablerl_" + spec.name) if spec.name in TRL_LOSS_TYPES else spec.name
    extra = {}
    if "index" in spec.requires:  # whole prompt groups per micro-batch: no split of the generation batch
        extra = dict(gradient_accumulation_steps=1)
    args = GRPOConfig(**H.base_kwargs(tmp_path, loss_type=loss_type, stablerl_loss_params=LOSS_PARAMS.get(spec.name),
                                      **extra))
    # binary reward: some losses use the scores as labels
    trainer, rec, initial = H.train(GRPOTrainer, args, reward=H.binary_digit_reward)
    _check_run(trainer, rec, initial)
    assert trainer._stablerl_loss == spec.name
    logged = set().union(*(log.keys() for log in rec.logs))
    if spec.metrics:  # the loss's metrics reach TRL's logs (spec.metrics may list several variants' keys)
        assert any("stablerl/" + m in logged for m in spec.metrics), f"none of {spec.metrics} logged"
    assert not any(k.startswith("clip_ratio/") for k in logged), "host loss type's clip metrics leaked"


@pytest.mark.parametrize("spec", ESTIMATORS, ids=[s.name for s in ESTIMATORS])
def test_every_advantage_estimator_trains(spec, tmp_path):
    reason = _skip_reason(spec, TRL.feedable[spec.kind])
    if reason:
        pytest.skip(reason)
    extra = {}
    if "teacher_log_prob" in spec.requires:  # on-policy distillation: a teacher checkpoint built in code
        H.tiny_model(seed=7).save_pretrained(tmp_path / "teacher")
        H.TOKENIZER.save_pretrained(tmp_path / "teacher")
        extra = dict(stablerl_teacher_model=str(tmp_path / "teacher"))
    args = GRPOConfig(**H.base_kwargs(tmp_path, loss_type="dapo", advantage_estimator=spec.name,
                                      stablerl_advantage_params=ESTIMATOR_PARAMS.get(spec.name), **extra))
    trainer, rec, initial = H.train(GRPOTrainer, args)
    _check_run(trainer, rec, initial)
    assert any("stablerl/advantages/mean" in log for log in rec.logs)


def test_stablerl_loss_and_estimator_together(tmp_path):
    """The issue's headline configuration: an M2PO loss with QAE advantages (parameters from the config)."""
    names = stablerl.get_registry().names("policy_loss")
    if "m2po" not in names or "qae" not in stablerl.get_registry().names("advantage_estimator"):
        pytest.skip("m2po or qae not registered")
    args = GRPOConfig(**H.base_kwargs(tmp_path, loss_type="m2po", advantage_estimator="qae",
                                      stablerl_loss_params='{"m2_threshold": 0.05}',
                                      stablerl_advantage_params={"quantile_k": 0.6}))
    assert args.stablerl_loss_params == {"m2_threshold": 0.05}
    trainer, rec, initial = H.train(GRPOTrainer, args)
    _check_run(trainer, rec, initial)


def test_per_token_advantages_follow_rows_through_trl_shuffles(tmp_path):
    """stablerl advantages are [B, T] and stay with their rows when TRL shuffles and splits the batch:
    within every micro-batch, each row's advantage is constant over its completion tokens and zero
    on padding."""
    seen = []

    class Spy(GRPOTrainer):
        def _compute_loss(self, model, inputs):
            seen.append((inputs["advantages"].clone(), inputs["completion_mask"].clone()))
            return super()._compute_loss(model, inputs)

    args = GRPOConfig(**H.base_kwargs(tmp_path, loss_type="vanilla", advantage_estimator="rloo"))
    H.train(Spy, args)
    assert seen
    for adv, mask in seen:
        assert adv.shape == mask.shape
        assert torch.all(adv[mask == 0] == 0)
        for row, m in zip(adv, mask):
            if m.any():
                assert torch.allclose(row[m.bool()], row[m.bool()][0].expand(int(m.sum())))


def test_moe_router_aux_loss_is_kept(tmp_path):
    """A stablerl loss on a tiny Qwen3-MoE model: TRL's load-balancing aux loss (on by default for
    MoE) is still added and logged."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = H.TOKENIZER
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=None, max_position_embeddings=64,
    )
    model = Qwen3MoeForCausalLM(config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = tok.pad_token_id, tok.eos_token_id
    args = GRPOConfig(**H.base_kwargs(tmp_path, loss_type="vanilla"))
    trainer, rec, initial = H.train(GRPOTrainer, args, model=model, reward=H.binary_digit_reward)
    assert trainer.aux_loss_enabled
    _check_run(trainer, rec, initial)
    assert all(log["aux_loss"] > 0 for log in rec.logs)
