"""The update micro-batch's ``token_ids`` and the training forward's ``entropy`` for a stablerl loss in SkyRL's policy
worker (``_micro``): SkyRL's own ``PolicyWorkerBase._forward_backward_micro`` on SkyRL's ``HFModelWrapper`` around a
tiny model built in code, up to its loss call; checked against an independent forward and against
``stablerl.compute_policy_loss`` called directly."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "moe"))
from moe_models import VOCAB, build_moe, left_padded_batch  # noqa: E402

import skyrl_helpers as H  # noqa: E402
import stablerl  # noqa: E402
from stablerl.adapter import get_adapter  # noqa: E402
from stablerl.adapters.skyrl._loss import StableSkyRLLoss  # noqa: E402

B, T, RESPONSE = 4, 10, 5


class _Stop(Exception):
    """Raised after the loss call: the test stops SkyRL's update before its backward / optimizer."""


def _run_update(cls, algorithm, loss_fn, old, advantages, loss_mask):
    """One update micro-batch (all rows) through SkyRL's ``_forward_backward_micro`` up to its loss call."""
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.backends.skyrl_train.workers.model_wrapper import HFModelWrapper
    from skyrl.backends.skyrl_train.workers.worker_utils import BaseBatchIterator

    model = build_moe("qwen3_moe")
    worker = cls.__new__(cls)  # SkyRL's worker methods on a model without Ray / FSDP
    worker.model = HFModelWrapper(model, bf16=False)
    worker.cfg = SimpleNamespace(algorithm=algorithm, micro_forward_batch_size_per_gpu=B, max_tokens_per_microbatch=0)
    seen = {}

    def loss(log_probs, *args, **kwargs):
        record = get_adapter("skyrl").micro
        seen.update(log_probs=log_probs.detach(), token_ids=record.input(stablerl.POLICY_LOSS, "token_ids"),
                    entropy=record.input(stablerl.POLICY_LOSS, "entropy"))
        seen["loss"] = loss_fn(log_probs, *args, **kwargs)[0].detach() if loss_fn else None
        raise _Stop

    worker.policy_loss_fn = loss
    ids, mask = left_padded_batch(B, T)
    batch = TrainingInputBatch({"sequences": ids, "attention_mask": mask, "action_log_probs": old,
                                "advantages": advantages, "loss_mask": loss_mask})
    batch.metadata = {"response_length": RESPONSE}
    with pytest.raises(_Stop):
        cls._forward_backward_micro(worker, BaseBatchIterator.batch_to_experience(batch), 1.0)
    assert get_adapter("skyrl").micro is None  # the record lives for one micro-batch
    return model, ids, mask, seen


def _independent(model, ids, mask):
    """Response tokens and per-token entropy of the policy at those tokens, from the model's logits directly (0
    where the predicting position is padding, as SkyRL masks it)."""
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, position_ids=position_ids).logits.float()
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    return ids[:, -RESPONSE:], (entropy * mask)[:, -RESPONSE - 1: -1]


def test_token_ids_and_entropy_come_from_the_update_forward(worker_class):
    algorithm = SimpleNamespace(stablerl_routing_replay=None, temperature=1.0, use_entropy_loss=False,
                                policy_loss_type="test")
    zeros = torch.zeros(B, RESPONSE)
    model, ids, mask, seen = _run_update(worker_class, algorithm, None, zeros, zeros, torch.ones(B, RESPONSE))
    tokens, entropy = _independent(model, ids, mask)
    assert torch.equal(seen["token_ids"], tokens)
    assert seen["entropy"].shape == (B, RESPONSE) and not seen["entropy"].requires_grad
    torch.testing.assert_close(seen["entropy"], entropy, rtol=1e-5, atol=1e-5)
    assert float(entropy[mask[:, -RESPONSE - 1: -1] > 0].min()) > 0.1  # a real distribution, not a placeholder


def test_steer_loss_in_the_worker_equals_compute_policy_loss(worker_class):
    cfg = H.make_config("trainer.algorithm.policy_loss_type=steer", "trainer.algorithm.stablerl_reduction=true")
    algorithm = cfg.trainer.algorithm
    algorithm.stablerl_routing_replay, algorithm.use_entropy_loss = None, False
    g = torch.Generator().manual_seed(3)
    old = -float(torch.log(torch.tensor(float(VOCAB)))) + 0.3 * torch.randn(B, RESPONSE, generator=g)
    advantages = torch.randn(B, RESPONSE, generator=g)
    response = left_padded_batch(B, T)[1][:, -RESPONSE:].float()
    d = int(response.sum())  # token_mean: the take-over's 1/D on every valid token
    model, ids, mask, seen = _run_update(worker_class, algorithm, StableSkyRLLoss("steer"), old, advantages,
                                         response / d)
    _, entropy = _independent(model, ids, mask)
    want, _ = stablerl.compute_policy_loss(
        "steer", log_prob=seen["log_probs"], old_log_prob=old, advantages=advantages,
        response_mask=response, entropy=entropy, loss_agg_mode="token-mean",
        ctx=stablerl.Context(token_count=d, dp_size=1, loss_scale_factor=algorithm.max_seq_len))
    without, _ = stablerl.compute_policy_loss(
        "steer", log_prob=seen["log_probs"], old_log_prob=old, advantages=advantages,
        response_mask=response, entropy=torch.zeros_like(entropy), loss_agg_mode="token-mean",
        ctx=stablerl.Context(token_count=d, dp_size=1, loss_scale_factor=algorithm.max_seq_len))
    torch.testing.assert_close(seen["loss"], want, rtol=1e-5, atol=1e-6)
    assert abs(float(want) - float(without)) > 1e-4  # the entropy changes steer's loss: the check can fail


def test_entropy_losses_reach_skyrl():
    from stablerl.frameworks import SELECTABLE, get_framework, reach

    skyrl = get_framework("skyrl")
    for name in ("steer", "entropic"):
        assert reach(skyrl, stablerl.get_spec(stablerl.POLICY_LOSS, name))[0] == SELECTABLE, name
    assert "token_ids" in skyrl.feedable[stablerl.POLICY_LOSS] and "entropy" in skyrl.feedable[stablerl.POLICY_LOSS]
    # the old-log-prob pass's entropy at the advantage step (``_micro.old_pass``, test_skyrl_old_pass.py)
    assert "entropy" in skyrl.feedable[stablerl.ADVANTAGE_ESTIMATOR]
