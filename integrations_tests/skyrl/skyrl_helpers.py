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

    from stablerl.adapters.skyrl._trainer import StableRayPPOTrainer

    data = TrainingInputBatch({"advantages": advantages.clone().float(), "loss_mask": mask.long(),
                               "response_mask": mask.long()})
    trainer = StableRayPPOTrainer.__new__(StableRayPPOTrainer)  # the method only reads these two attributes
    trainer.cfg, trainer.stablerl_loss = cfg, _stablerl_loss(cfg)
    boundaries = boundaries or [(0, advantages.shape[0])]
    return trainer._normalize_advantages(data, boundaries, None)


def _stablerl_loss(cfg):
    from stablerl import POLICY_LOSS
    from stablerl.adapters.skyrl._config import selected

    return selected(cfg.trainer.algorithm, POLICY_LOSS)


def worker_loss(cfg, batch: dict, micro: int = 0, rollout: bool = False):
    """The registered loss of ``cfg``'s policy_loss_type, called per micro-batch of ``micro`` rows as
    ``PolicyWorkerBase._forward_backward_micro`` calls it, summed (SkyRL's gradient accumulation; 0: one call with
    every row): (loss, grad)."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry

    algorithm = cfg.trainer.algorithm
    data = normalized_batch(cfg, batch["advantages"], batch["response_mask"])
    fn = PolicyLossRegistry.get(algorithm.policy_loss_type)
    leaf = batch["log_prob"].clone().requires_grad_(True)
    micro = micro or leaf.shape[0]
    algorithm.stablerl_mini_batch_rows = leaf.shape[0]  # as the entry point sets it (one mini-batch here)
    total, worker = 0.0, get_adapter("skyrl")
    worker.loss_state.clear()  # a fresh worker per call: a stateful loss (entropic) starts as the core call does
    for start in range(0, leaf.shape[0], micro):
        rows = slice(start, start + micro)
        # the micro-batch's record as ``_micro`` makes it in the worker (test_skyrl_loss_inputs.py checks that one)
        worker.micro = BatchRecord(adapter=worker, produced={k: batch[k][rows] for k in MICRO_INPUTS if k in batch})
        loss, _ = fn(leaf[rows], batch["old_log_prob"][rows], data["advantages"][rows], config=algorithm,
                     loss_mask=data["loss_mask"][rows],
                     rollout_logprobs=batch["rollout_log_prob"][rows] if rollout else None)
        total = total + loss
    worker.micro = None
    (grad,) = torch.autograd.grad(total, leaf)
    return total.detach(), grad
