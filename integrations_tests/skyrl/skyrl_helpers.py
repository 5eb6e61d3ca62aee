"""Helpers of the SkyRL integration tests: a SkyRL config with the stablerl keys, SkyRL's ``TrainingInputBatch``
through the entry point trainer's ``_normalize_advantages`` (SkyRL's own method, then the take-over), and a
stablerl loss summed over micro-batches as SkyRL's policy worker sums it."""

from __future__ import annotations

import torch

from stablerl.adapter import get_adapter
from stablerl.adapters.skyrl._config import config_class
from stablerl.steps import BatchRecord

MICRO_INPUTS = ("entropy", "token_ids")  # what the worker's update micro-batch feeds a stablerl loss (``_micro``)
MODES = {"token-mean": "token_mean", "seq-mean-token-mean": "sequence_mean"}


def make_config(*overrides: str):
    """SkyRL's config (with the stablerl keys) from CLI-style overrides."""
    return config_class().from_cli_overrides(list(overrides))


def normalized_batch(cfg, advantages: torch.Tensor, mask: torch.Tensor, boundaries=None):
    """``StableRayPPOTrainer._normalize_advantages`` (SkyRL's, then the take-over) on one batch: returns the
    TrainingInputBatch (advantages, loss_mask as the policy worker gets them)."""
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

    data = TrainingInputBatch({"advantages": advantages.clone().float(), "loss_mask": mask.long(),
                               "response_mask": mask.long()})
    boundaries = boundaries or [(0, advantages.shape[0])]
    return trainer_of(cfg)._normalize_advantages(data, boundaries, None)


def trainer_of(cfg):
    """``StableRayPPOTrainer`` without Ray (its batch methods read only ``cfg`` and ``stablerl_loss``)."""
    from stablerl.adapters.skyrl._trainer import StableRayPPOTrainer

    trainer = StableRayPPOTrainer.__new__(StableRayPPOTrainer)
    trainer.cfg, trainer.stablerl_loss = cfg, _stablerl_loss(cfg)
    return trainer


def with_row_inputs(cfg, data, batch: dict):
    """The batch as the entry point's trainer sends it to the policy workers: the old pass's entropy (its
    ``fwd_logprobs_values_reward``), then the loss's per-row inputs from the advantage step's record (prompt groups
    from SkyRL's uids, the per-response rewards: ``_loss_rows``)."""
    mask = batch["response_mask"]
    data["sequences"], data.metadata = batch["token_ids"].long(), {"response_length": mask.shape[1]}
    data["stablerl_old_entropy"] = batch["old_entropy"].float()
    trainer_of(cfg)._loss_rows(data, [f"uid{int(i)}" for i in batch["index"]], batch["scores"])
    return data


def _stablerl_loss(cfg):
    from stablerl import POLICY_LOSS
    from stablerl.adapters.skyrl._config import selected

    return selected(cfg.trainer.algorithm, POLICY_LOSS)


def worker_loss(cfg, batch: dict, micro: int = 0, rollout: bool = False):
    """The registered loss of ``cfg``'s policy_loss_type, called per micro-batch of ``micro`` rows as
    ``PolicyWorkerBase._forward_backward_micro`` calls it, summed (SkyRL's gradient accumulation; 0: one call with
    every row): (loss, grad)."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry
    from skyrl.backends.skyrl_train.workers.worker_utils import BaseBatchIterator

    algorithm = cfg.trainer.algorithm
    data = normalized_batch(cfg, batch["advantages"], batch["response_mask"])
    fn = PolicyLossRegistry.get(algorithm.policy_loss_type)
    leaf = batch["log_prob"].clone().requires_grad_(True)
    micro = micro or leaf.shape[0]
    algorithm.stablerl_mini_batch_rows = leaf.shape[0]  # as the entry point sets it (one mini-batch here)
    total, worker = 0.0, get_adapter("skyrl")
    worker.loss_state.clear()  # a fresh worker per call: a stateful loss (entropic) starts as the core call does
    data = with_row_inputs(cfg, data, batch)
    for start in range(0, leaf.shape[0], micro):
        rows = slice(start, start + micro)
        # the micro-batch's record as ``_micro`` makes it in the worker (test_skyrl_loss_inputs.py checks that one),
        # on the Experience SkyRL's (patched) batch_to_experience makes of the micro-batch
        experience = BaseBatchIterator.batch_to_experience(data[start:start + micro])
        worker.micro = BatchRecord(adapter=worker, response_mask=experience.action_mask.float(), host=experience,
                                   produced={k: batch[k][rows] for k in MICRO_INPUTS if k in batch})
        loss, _ = fn(leaf[rows], batch["old_log_prob"][rows], data["advantages"][rows], config=algorithm,
                     loss_mask=data["loss_mask"][rows],
                     rollout_logprobs=batch["rollout_log_prob"][rows] if rollout else None)
        total = total + loss
    worker.micro = None
    (grad,) = torch.autograd.grad(total, leaf)
    return total.detach(), grad
