"""The records TRL's batches travel in: what TRL produced for one generation batch (:class:`GenerationBatch`) and
for one micro-batch of ``_compute_loss`` (:class:`LossBatch`), both :class:`stablerl.steps.BatchRecord`\\ s read by
the adapter's providers. The trainer holds the record of the batch under way (``GRPOTrainer._stablerl_batch`` /
``_stablerl_pass``) while TRL's own method runs, and nothing else in between."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from stablerl.steps import BatchRecord

from ._adapter import USER_INPUTS

_HOW_TO_PROVIDE = (
    "have a reward function call TRL's log_extra({name!r}, values) with one value per completion it was given "
    "(TRL passes log_extra to every reward function), or return {name!r} from a rollout_func as an extra field "
    "(one value per completion), or give the dataset a {name!r} column"
)


@dataclass
class GenerationBatch(BatchRecord):
    """One generation batch: armed while TRL's ``_generate_and_score_completions`` runs (its old-log-prob pass
    records into it), then the advantage step's record on the gathered ``[N, T]`` layout.

    ``site``: the trainer's :class:`~stablerl.adapters.trl._rollout.AdvantageCallSite` (gathers, runs the extra
    forward); ``rows``: this process's rows of the gathered batch."""

    site: Any = None
    mode: str = "train"
    rows: Optional[slice] = None
    rewards_per_func: Optional[torch.Tensor] = None  # [N, n_funcs], gathered by TRL's _calculate_rewards
    user_inputs: dict = field(default_factory=dict)  # correct, flawed, ...: every process's, in TRL's row order
    # the old-log-prob pass (TRL's first pass of the policy over the batch): what it records, what it recorded
    old_pass_pending: bool = False
    record_old_entropy: bool = False
    old_entropy: Optional[torch.Tensor] = None
    sum_sq_chunks: Optional[list] = None  # log sum pi^2 of each fused-head chunk, while recording
    # routing replay: the routes generate recorded (per sequence, prompt lengths), the batch's [B, P+C] routes,
    # whether the old pass records them (R2), the old pass's router log-probs (rspo)
    generated_routes: Optional[tuple] = None
    routes: Any = None
    record_routes: bool = False
    router_log_prob: Optional[torch.Tensor] = None
    # the generating policy's statistics, [n, T] of this process: computed once per batch
    entropy: Optional[torch.Tensor] = None
    old_stats: Optional[dict] = None
    # sampling-mask replay: a rollout_func's kept sets (one per completion), log M [n, C] of this process's rows,
    # and TRL's old log-probs (the old-log-prob pass returned them over the kept set)
    engine_masks: Optional[list] = None
    log_mass: Optional[torch.Tensor] = None
    old_logps: Optional[torch.Tensor] = None
    sampling_mask: Any = None  # what the sampling_mask provider gives: the engine's masks or TRL's SamplingRule

    def gathered(self, local: torch.Tensor) -> torch.Tensor:
        return self.site.gathered(local, self.response_mask.device)

    def rollout_entropy(self) -> torch.Tensor:
        if self.entropy is None:
            self.entropy = self.site.rollout_entropy(self)
        return self.entropy

    def old_pass_stats(self) -> dict:
        if self.old_stats is None:
            self.old_stats = self.site.old_pass_stats(self)
        return self.old_stats

    def _how_to_provide(self, kind: str, name: str) -> str:
        return _HOW_TO_PROVIDE.format(name=name) if name in USER_INPUTS else super()._how_to_provide(kind, name)


@dataclass
class LossBatch(BatchRecord):
    """One micro-batch of ``_compute_loss`` (``host``: TRL's inputs dict): what the training forward produced."""

    logps: Optional[torch.Tensor] = None
    entropies: Optional[torch.Tensor] = None
    router_log_prob: Optional[torch.Tensor] = None  # at the replayed experts (routing replay, for rspo)
    rollout_log_prob: Optional[torch.Tensor] = None
    sampling_mask: Any = None  # the kept-set rule replayed into rollout_log_prob (sampling_mask_replay on)
    policy_version: Optional[int] = None  # the generation round of the batch being trained (A-3PO's current version)
    capture: bool = True  # whether the next training forward is this pass's


__all__ = ["GenerationBatch", "LossBatch"]
