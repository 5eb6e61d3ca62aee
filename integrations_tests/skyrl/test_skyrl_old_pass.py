"""The old-log-prob pass's entropy and sum_pi_squared in SkyRL's policy worker (``_micro.old_pass``), and the loss's
per-row inputs (prompt groups, scores, that entropy) carried to the update micro-batch: SkyRL's own
``PolicyWorkerBase.forward`` on SkyRL's ``HFModelWrapper`` around a tiny model built in code, checked against an
independent forward; the entry point trainer's ``_execute_forward_pass`` / ``fwd_logprobs_values_reward`` putting
them into the batch."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "moe"))
sys.path.insert(0, str(Path(__file__).parents[1] / "parity"))
from moe_models import build_moe, left_padded_batch  # noqa: E402

import parity_matrix as M  # noqa: E402
import skyrl_helpers as H  # noqa: E402
import stablerl  # noqa: E402

B, T, RESPONSE, TEMPERATURE = 4, 10, 5, 0.7
KEYS = ("stablerl_old_entropy", "stablerl_sum_pi_squared")


def _old_pass(worker_class, *overrides):
    """SkyRL's old-log-prob pass (2 micro-batches) with the algorithms ``overrides`` select: (model, ids, mask, out)."""
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.backends.skyrl_train.workers.model_wrapper import HFModelWrapper

    algorithm = H.make_config(*overrides).trainer.algorithm
    algorithm.temperature = TEMPERATURE
    model = build_moe("qwen3_moe")
    worker = worker_class.__new__(worker_class)  # SkyRL's worker methods on a model without Ray / FSDP
    worker.model = HFModelWrapper(model, bf16=False)
    worker.cfg = SimpleNamespace(algorithm=algorithm, micro_forward_batch_size_per_gpu=2, max_tokens_per_microbatch=0)
    ids, mask = left_padded_batch(B, T)
    batch = TrainingInputBatch({"sequences": ids, "attention_mask": mask})
    batch.metadata = {"response_length": RESPONSE}
    return model, ids, mask, worker_class.forward(worker, batch)


def test_old_pass_returns_entropy_and_sum_pi_squared_of_the_tempered_policy(worker_class):
    model, ids, mask, out = _old_pass(worker_class, "trainer.algorithm.policy_loss_type=erc",
                                      "trainer.algorithm.advantage_estimator=optimal_token_baseline")
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, position_ids=position_ids).logits.float() / TEMPERATURE
    logp = torch.log_softmax(logits, -1)[:, -RESPONSE - 1: -1]
    want = {"stablerl_old_entropy": -(logp.exp() * logp).sum(-1), "stablerl_sum_pi_squared": logp.exp().pow(2).sum(-1)}
    valid = mask[:, -RESPONSE - 1: -1].bool()
    for key in KEYS:
        got = torch.stack([o[key] for o in out.loss_fn_outputs])
        assert got.shape == (B, RESPONSE), key
        torch.testing.assert_close(got[valid], want[key][valid], rtol=1e-5, atol=1e-6)
    # a real distribution at 0.7: not uniform, not one-hot
    assert 0.1 < float(want["stablerl_old_entropy"][valid].min())
    assert float(want["stablerl_sum_pi_squared"][valid].max()) < 0.99
    # the pass's own result is unchanged, and without an algorithm reading them there are no extras (no extra cost)
    _, _, _, plain = _old_pass(worker_class, "trainer.algorithm.policy_loss_type=gmpo")
    assert [o["logprobs"] for o in plain.loss_fn_outputs] == [o["logprobs"] for o in out.loss_fn_outputs]
    assert not any(key in o for o in plain.loss_fn_outputs for key in KEYS)


def test_only_the_statistic_read_is_computed(worker_class):
    *_, out = _old_pass(worker_class, "trainer.algorithm.stablerl_batch_filter=d3s")
    assert "stablerl_old_entropy" in out.loss_fn_outputs[0] and "stablerl_sum_pi_squared" not in out.loss_fn_outputs[0]


def test_trainer_puts_the_old_pass_statistics_into_the_batch(worker_class):
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.train.trainer import RayPPOTrainer

    *_, out = _old_pass(worker_class, "trainer.algorithm.advantage_estimator=empg")

    class Dispatch:  # SkyRL's WorkerDispatch answering with the worker's output
        def forward(self, *args, **kwargs):
            return out

        forward_from_staged = forward

    trainer = H.trainer_of(H.make_config("trainer.algorithm.advantage_estimator=empg"))
    trainer.dispatch = Dispatch()
    trainer._execute_forward_pass("policy", None, "logprobs", None)
    fwd = RayPPOTrainer.fwd_logprobs_values_reward
    try:
        RayPPOTrainer.fwd_logprobs_values_reward = lambda self, data: data
        batch = trainer.fwd_logprobs_values_reward(TrainingInputBatch({"sequences": torch.zeros(B, T)}))
    finally:
        RayPPOTrainer.fwd_logprobs_values_reward = fwd
    assert torch.equal(batch["stablerl_old_entropy"], torch.stack([o["stablerl_old_entropy"] for o in out.loss_fn_outputs]))
    assert "stablerl_sum_pi_squared" not in batch and trainer.stablerl_old_pass is None


@pytest.fixture
def registered():
    import stablerl.adapters.skyrl as adapter

    adapter.instrument()
    yield
    adapter.uninstrument()


def test_loss_rows_reach_the_micro_batch_and_groups_must_be_whole(registered):
    """pacs through the registered loss per micro-batch of 4 rows (whole groups: the core call's numbers), then of 3
    (a group split: refused, naming the settings)."""
    b = M.loss_batch()
    cfg = H.make_config("trainer.algorithm.policy_loss_type=pacs", "trainer.algorithm.stablerl_reduction=true")
    loss, grad = H.worker_loss(cfg, b, micro=4)
    ref, ref_grad = M.core_loss("pacs", b, "token-mean")
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(stablerl.StableRLError, match="split across micro-batches.*micro_train_batch_size_per_gpu"):
        H.worker_loss(cfg, b, micro=3)


def test_micro_batch_without_the_rows_names_the_input(registered):
    """erc's old entropy absent from the micro-batch (not the entry point's trainer): core's error names it."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry

    from stablerl.adapter import get_adapter
    from stablerl.steps import BatchRecord

    b = M.loss_batch()
    cfg = H.make_config("trainer.algorithm.policy_loss_type=erc", "trainer.algorithm.stablerl_reduction=true")
    data = H.normalized_batch(cfg, b["advantages"], b["response_mask"])
    worker = get_adapter("skyrl")
    worker.micro = BatchRecord(adapter=worker, response_mask=b["response_mask"].float(), host=SimpleNamespace(info={}),
                               produced={"entropy": b["entropy"]})
    try:
        with pytest.raises(stablerl.MissingInputError, match="old_entropy"):
            PolicyLossRegistry.get("erc")(b["log_prob"], b["old_log_prob"], data["advantages"],
                                          config=cfg.trainer.algorithm, loss_mask=data["loss_mask"])
    finally:
        worker.micro = None
