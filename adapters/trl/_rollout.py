"""The advantage step's call site in TRL's ``_generate_and_score_completions``: TRL's generation batch into one
:class:`~stablerl.adapters.trl._records.GenerationBatch` (the rewards TRL gathered over processes, every process's
masks, RepeatSampler's contiguous prompt groups), core's :class:`~stablerl.steps.AdvantageStep` on it (shaper ->
estimator -> filter), and the result back into TRL's output dict, sliced as TRL slices its own.

TRL's batch has a fixed size and layout, so a filter's dropped rows and tokens get advantage 0 and loss mask 0
(``tool_mask``, which multiplies ``completion_mask`` in the loss only: attention is unchanged), and
``num_items_in_batch`` becomes the kept tokens. The built-in computation of TRL still runs (its logged
``advantages`` metrics keep TRL's values).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import stablerl
from stablerl.contracts import ADVANTAGE_ESTIMATOR, BATCH_FILTER
from stablerl.steps import AdvantageSelection, AdvantageStep

from ._adapter import USER_INPUTS, TRLAdapter
from ._records import GenerationBatch

_WHY_NO_RESAMPLING = (
    "TRL's generation batch has a fixed size and layout (each process's slice, split into micro-batches), so only "
    "filters that keep or drop rows can run in TRL (shuffle_r1: use shuffle=False for its pairwise sampling alone)")


def trained_mask(batch: dict) -> torch.Tensor:
    """TRL's loss mask: ``completion_mask`` x ``tool_mask`` (a batch filter's kept tokens go into ``tool_mask``)."""
    return batch["completion_mask"] if "tool_mask" not in batch else batch["completion_mask"] * batch["tool_mask"]


class AdvantageCallSite:
    """One trainer's advantage step. ``selection``: the stablerl estimator / shaper / filter; ``loss_reads``: the
    inputs of the selected policy loss (groups, scores and the old pass's entropy travel with the rows for it)."""

    def __init__(self, trainer, passes, selection: AdvantageSelection, loss_reads=()):
        self.trainer, self.passes, self.selection = trainer, passes, selection
        self.loss_reads = set(loss_reads)
        self.needs_rows = bool(self.loss_reads & {"index", "scores"})
        self.step = AdvantageStep(selection, ctx=self.ctx, filter_key="batch_filter",
                                  why_no_resampling=_WHY_NO_RESAMPLING)

    def ctx(self, kind: str, name: str) -> "stablerl.Context":
        t = self.trainer
        store = t._stablerl_store
        if kind == ADVANTAGE_ESTIMATOR:
            return stablerl.Context(step=int(t.state.global_step), state=store.slot(kind, name))
        # shapers and filters: one generator, seeded alike on every process (they run on the gathered batch, so
        # every process draws the same numbers); saved with the checkpoint
        return stablerl.Context(step=int(t.state.global_step), total_steps=int(t.state.max_steps or 0) or None,
                                generator=t._stablerl_loop.rng, state=store.slot(kind, name))

    def gathered(self, local: torch.Tensor, device=None) -> torch.Tensor:
        """``[n, T]`` of this process -> ``[N, T_max]`` of every process (TRL's row order), float."""
        acc = self.trainer.accelerator
        return acc.gather(acc.pad_across_processes(local.float(), dim=1, pad_index=0)).to(device)

    # -- the generation batch ------------------------------------------------------------------------

    def trl_runs_old_pass(self) -> bool:
        """TRL's own condition for its old-log-prob pass in ``_generate_and_score_completions``."""
        t = self.trainer
        every = t.args.steps_per_generation * t.num_iterations
        return t.args.gradient_accumulation_steps % every != 0 or bool(t.use_vllm and t.vllm_importance_sampling_correction)

    def begin(self, mode: str) -> GenerationBatch:
        """The record of a generation batch about to be generated and scored: what TRL's old-log-prob pass, where
        TRL runs one, records into it (erc's old entropy, optimal_token_baseline's log sum pi^2)."""
        old_pass = self.trl_runs_old_pass()
        return GenerationBatch(TRLAdapter(), site=self, mode=mode, old_pass_pending=old_pass,
                               record_old_entropy=old_pass and "old_entropy" in self.loss_reads,
                               sum_sq_chunks=[] if old_pass and self.selection.reads("sum_pi_squared") else None,
                               record_routes=self.trainer._stablerl_routing.mode == "R2" and old_pass)

    def rewards(self, batch: Optional[GenerationBatch], rewards_per_func: torch.Tensor, inputs: list) -> torch.Tensor:
        """TRL's ``_calculate_rewards`` result ``[N, n_funcs]`` (gathered over processes) into the batch's record, with
        the per-completion inputs of shapers and filters (before TRL flushes its log_extra values)."""
        if batch is not None:
            batch.rewards_per_func = rewards_per_func
            if self.selection.reward_shaper or self.selection.batch_filter:
                batch.user_inputs = self.user_inputs(inputs)
        return rewards_per_func

    def user_inputs(self, inputs: list) -> dict[str, Any]:
        """Per-completion user inputs (``correct``, ...) of every process, in TRL's row order: what reward functions
        passed to TRL's ``log_extra(name, values)``, else the rows' fields. Every process joins every gather."""
        from accelerate.utils import gather_object

        t, n, found = self.trainer, len(inputs), {}
        for name in USER_INPUTS:
            local = t._pending_extra_logs.get(name) if hasattr(t, "_pending_extra_logs") else None
            if local is not None and len(local) != n:
                raise stablerl.StableRLError(
                    f"log_extra({name!r}, ...) got {len(local)} values for {n} completions on this process: call it "
                    "from exactly one reward function, with one value per completion")
            if local is None and n and all(name in row for row in inputs):
                local = [row[name] for row in inputs]
            parts = gather_object([None if local is None else list(local)])
            if all(p is None for p in parts):
                continue
            if any(p is None for p in parts):
                raise stablerl.StableRLError(f"input {name!r} was given on some processes only")
            found[name] = [v for p in parts for v in p]
        return found

    def finish(self, batch: GenerationBatch, out: dict) -> dict:
        """After TRL's ``_generate_and_score_completions``: the rows' extra keys and the stablerl advantage step."""
        t = self.trainer
        batch.host = out
        batch.sampling_mask = t._stablerl_replay.kept_set(batch) if t._stablerl_replay else None
        if batch.record_old_entropy:
            if batch.old_entropy is None:
                raise stablerl.StableRLError(
                    f"policy loss {t._stablerl_loss!r} needs the old-log-prob pass's entropies, but TRL's "
                    "old-log-prob pass did not run through _get_per_token_logps_and_entropies")
            out["stablerl_old_entropy"] = batch.old_entropy
        if not (self.selection.active or self.needs_rows):
            return out
        per_func = batch.rewards_per_func
        device = per_func.device
        # TRL's reward: weighted sum of the reward functions; rows every function declined are unscorable
        rewards = (per_func * t.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
        batch.unscorable = torch.isnan(per_func).all(dim=1)
        batch.scores = torch.where(batch.unscorable, torch.zeros_like(rewards), rewards)
        n = out["completion_ids"].size(0)
        batch.rows = slice(t.accelerator.process_index * n, (t.accelerator.process_index + 1) * n)  # TRL's slice
        G = t.num_generations if batch.mode == "train" else t.num_generations_eval
        batch.index = torch.arange(rewards.numel(), device=device) // G  # RepeatSampler: contiguous groups of G
        batch.response_mask = self.gathered(trained_mask(out), device)
        if self.selection.active:
            self.run(batch, out, extras={"reward_components": per_func.to(device),
                                         "reward_weights": t.reward_weights.to(device)})
        if self.needs_rows:  # extra batch-first keys travel with their rows through TRL's shuffles
            out["stablerl_index"] = batch.index[batch.rows].clone()
            out["stablerl_scores"] = batch.scores[batch.rows].clone()
        return out

    def run(self, batch: GenerationBatch, out: dict, extras: Optional[dict] = None) -> dict:
        """Core's advantage step on ``batch`` (its rewards, masks and groups gathered over processes); the result
        goes into ``out`` (TRL's output dict) for this process's rows."""
        t, sel, rows = self.trainer, self.selection, batch.rows
        width = out["completion_ids"].size(1)
        local_adv = out["advantages"]
        trl_rows = None
        if sel.estimator is None and local_adv.dim() == 1:  # TRL's own advantages (one per completion), filtered
            trl_rows = t.accelerator.gather(local_adv.float()).to(batch.response_mask.device)

        def trls_own(record):  # TRL's advantages on the gathered [N, T] layout
            rows_or_tokens = trl_rows.unsqueeze(-1) if trl_rows is not None else self.gathered(
                local_adv, record.response_mask.device)
            return rows_or_tokens * record.response_mask

        result = self.step.run(batch, estimate=None if sel.estimator else trls_own, extras=extras)
        metrics = dict(result.metrics)
        if sel.reward_shaper:
            metrics["shaped_reward/mean"] = result.scores.float().mean().item()
        if trl_rows is not None and result.filter_result.advantages is None:
            out["advantages"] = torch.where(result.dropped, torch.zeros_like(trl_rows), trl_rows)[rows].to(
                local_adv.dtype).contiguous()
        else:
            out["advantages"] = result.advantages[rows, :width].to(torch.float32).contiguous()
        if sel.batch_filter:
            kept = result.response_mask
            keep = kept[rows, :width].to(out["completion_mask"].device, out["completion_mask"].dtype)
            out["tool_mask"] = keep if "tool_mask" not in out else out["tool_mask"] * keep
            old_items = out["num_items_in_batch"]
            out["num_items_in_batch"] = kept.sum().clamp(min=1).to(old_items.device, old_items.dtype)
        t._stablerl_log(batch.mode, metrics, gathered=True)
        return out

    # -- the generating policy's statistics (the providers' extra passes) ------------------------------

    def rollout_entropy(self, batch: GenerationBatch) -> torch.Tensor:
        """Per-token entropies ``[n, T]`` of the generating policy (TRL computes entropies only in ``_compute_loss``):
        one extra forward per rollout, shared by an estimator (empg) and a batch filter that both read them."""
        sel, readers = self.selection, []
        if sel.estimator and "entropy" in stablerl.get_spec(ADVANTAGE_ESTIMATOR, sel.estimator).requires:
            readers.append(f"advantage_estimator={sel.estimator!r}")
        if sel.batch_filter and "entropy" in stablerl.get_spec(BATCH_FILTER, sel.batch_filter).requires:
            readers.append(f"batch_filter={sel.batch_filter!r}")
        return self.passes.rollout_forward(batch.host, batch.mode, " and ".join(readers) + " (the rollout's entropies)",
                                           compute_entropy=True)[1]

    def old_pass_stats(self, batch: GenerationBatch) -> dict[str, torch.Tensor]:
        return self.passes.old_pass_stats(batch, f"advantage_estimator={self.selection.estimator!r}")


__all__ = ["AdvantageCallSite", "trained_mask"]
