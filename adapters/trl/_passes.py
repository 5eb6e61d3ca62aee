"""TRL's log-prob forwards (``_get_per_token_logps_and_entropies``), seen from the adapter: which pass a call is
(TRL's old-log-prob pass over a fresh generation batch, the training forward of ``_compute_loss``), what the
adapter records there into the batch's record, and the one extra no-grad forward over a rollout that an
algorithm reading the generating policy's statistics needs (empg's entropy, optimal_token_baseline's
``sum_pi_squared``) where TRL runs no pass of its own.

Patched on the trainer's objects, through the trainer's :class:`~stablerl.patching.PatchLedger`: ``model.forward``
of the policy (its base model under PEFT) becomes TRL's fused LM head asked also for ``log_sum_sq_probs``, with a
recorder, when a selected estimator reads ``sum_pi_squared``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
from accelerate.utils import is_peft_model
from trl.trainer.utils import add_fused_lm_head

from stablerl.params import StableRLError

from ._config import TRL_GRPOTrainer

_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "token_type_ids",
                    "mm_token_type_ids", "image_position_ids", "spatial_shapes")


class ForwardPasses:
    """One trainer's view of TRL's log-prob forwards (see the module docstring)."""

    def __init__(self, trainer, routing, *, sum_sq: bool = False):
        self.trainer, self.routing = trainer, routing
        self._sum_sq: Optional[tuple[list, int]] = None  # (chunks, logits_to_keep) while a pass records
        if sum_sq:
            self._add_sum_sq_output()

    def forward(self, parent, model, input_ids, logits_to_keep, kwargs: dict):
        """TRL's forward (``parent(**kwargs)``) with what the adapter records in it."""
        t = self.trainer
        batch, loss_pass = t._stablerl_batch, t._stablerl_pass
        # TRL's old-log-prob pass is the first pass of the policy while a batch is generated (the ref pass of a PEFT
        # policy comes after it); it asks for no entropies: for erc it computes them too
        old_pass = bool(batch is not None and batch.old_pass_pending and not kwargs.get("compute_entropy")
                        and t.accelerator.unwrap_model(model) is t.accelerator.unwrap_model(t.model))
        if old_pass:
            batch.old_pass_pending = False
            if batch.record_old_entropy:
                kwargs["compute_entropy"] = True
        training = batch is None and loss_pass is not None and loss_pass.capture and kwargs.get("compute_entropy")
        fn = functools.partial(parent, **kwargs)
        replay = getattr(t, "_stablerl_replay", None)
        if old_pass and replay is not None and replay.on:  # sampling-mask replay: log M in this same forward
            fn = functools.partial(replay.old_pass, fn, model, input_ids, logits_to_keep, batch)
        if old_pass and batch.sum_sq_chunks is not None:  # optimal_token_baseline: log sum pi^2 of the same forward
            fn = functools.partial(self._with_sum_sq, fn, batch.sum_sq_chunks, logits_to_keep)
        if self.routing.mode is None:
            out = fn()
        else:
            out = self.routing.forward(fn, model, input_ids, logits_to_keep, batch=batch, old_pass=old_pass,
                                       loss_pass=loss_pass if training else None)
        if old_pass and batch.record_old_entropy:
            batch.old_entropy = out[1].detach()
        if training:  # the training forward inside _compute_loss
            loss_pass.logps, loss_pass.entropies = out[0], out[1]
        return out

    # -- one extra forward over a rollout ---------------------------------------------------------------

    def rollout_forward(self, out: dict, mode: str, needed_by: str, compute_entropy: bool = False):
        """TRL's ``(logps, entropies, aux)`` ``[n, T]`` of the generating policy on this process's rollout (TRL's
        temperature, native MoE routing): one extra no-grad forward, for text-only batches. TRL's own method, bound
        at import (``trl.GRPOTrainer`` may be this adapter's subclass by now)."""
        multimodal = [k for k in _MULTIMODAL_KEYS if k in out]
        if multimodal:
            raise StableRLError(f"{needed_by} needs an extra forward pass over the rollout, which stablerl runs for "
                                f"text-only batches; this batch has {multimodal}")
        t = self.trainer
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        bs = t.args.per_device_train_batch_size if mode == "train" else t.args.per_device_eval_batch_size
        with torch.no_grad():
            return TRL_GRPOTrainer._get_per_token_logps_and_entropies(
                t, t.model, ids, attention, out["completion_ids"].size(1), batch_size=bs, compute_entropy=compute_entropy)

    def old_pass_stats(self, batch, needed_by: str) -> dict[str, torch.Tensor]:
        """``old_log_prob`` and ``sum_pi_squared`` ``[n, T]`` of this process's rollout, from one forward of the policy
        through TRL's fused LM head: TRL's old-log-prob pass where TRL ran one (recorded in ``batch``), else one
        extra no-grad forward (the current policy, which is the one that generated the batch)."""
        out = batch.host
        if not self.trainer._stablerl_rollout.selection.reads("sum_pi_squared"):  # old_log_prob alone (distillation)
            old = out.get("old_per_token_logps")
            if old is None:  # TRL ran no old-log-prob pass: the generating policy is the current one
                old = self.rollout_forward(out, batch.mode, f"{needed_by} (old_log_prob)")[0]
            return {"old_log_prob": old.detach()}
        if batch.sum_sq_chunks is not None:
            if not batch.sum_sq_chunks or out.get("old_per_token_logps") is None:
                raise StableRLError(f"{needed_by} needs the old-log-prob pass's sum_pi_squared, but TRL's old-log-prob "
                                    "pass did not run through _get_per_token_logps_and_entropies")
            old, chunks = out["old_per_token_logps"], batch.sum_sq_chunks
        else:
            chunks = []
            with self._recording_sum_sq(chunks, out["completion_ids"].size(1)):
                old = self.rollout_forward(out, batch.mode, f"{needed_by} (old_log_prob and sum_pi_squared)")[0]
        sum_sq = torch.cat(chunks).exp()
        if sum_sq.shape != old.shape:
            raise StableRLError(f"sum_pi_squared of shape {tuple(sum_sq.shape)} for old log-probs of shape "
                                f"{tuple(old.shape)}: TRL's fused LM head returned another layout")
        return {"old_log_prob": old.detach(), "sum_pi_squared": sum_sq}

    # -- log sum pi^2 from TRL's fused LM head ---------------------------------------------------------

    def _fused_head_model(self):
        """The model TRL's ``add_fused_lm_head`` patched (the base model of a PEFT policy)."""
        model = self.trainer.model
        return model.get_base_model() if is_peft_model(model) else model

    def _add_sum_sq_output(self) -> None:
        """TRL's fused LM head on the policy again (as ``GRPOTrainer.__init__`` adds it: TRL's temperature and
        ``cast_lm_head_to_fp32``), with TRL's ``log_sum_sq_probs`` output (log sum_v pi(v)^2 of each scored token)
        besides log-probs and entropies; the new head replaces the fused path, the model's own forward is kept. The
        new ``model.forward`` (with a recorder) goes into the trainer's ledger."""
        t, model = self.trainer, self._fused_head_model()
        previous = model.__dict__.get("forward")
        if previous is None:
            raise StableRLError("the policy has no fused LM head (TRL's add_fused_lm_head): sum_pi_squared needs it")
        add_fused_lm_head(model, temperature=t.temperature, cast_lm_head_to_fp32=t.args.cast_lm_head_to_fp32,
                          outputs=("log_probs", "entropy", "log_sum_sq_probs"))
        fused = model.__dict__["forward"]
        model.forward = previous  # recorded below, so that the ledger restores TRL's head

        @functools.wraps(fused)
        def recording(*args, **kwargs):
            output = fused(*args, **kwargs)
            if self._sum_sq is not None and kwargs.get("fused_lm_head"):
                chunks, logits_to_keep = self._sum_sq
                chunks.append(output.log_sum_sq_probs[:, -logits_to_keep:].detach())
            return output

        t._stablerl_ledger.set_attr("model.forward", model, "forward", recording)

    @contextlib.contextmanager
    def _recording_sum_sq(self, chunks: list, logits_to_keep: int):
        """While open, every fused-head forward of the policy appends its ``log_sum_sq_probs`` (sliced as TRL slices
        its log-probs) to ``chunks``, in TRL's chunk order."""
        self._sum_sq = (chunks, logits_to_keep)
        try:
            yield
        finally:
            self._sum_sq = None

    def _with_sum_sq(self, fn, chunks: list, logits_to_keep: int):
        chunks.clear()  # the last run's (a replayed forward runs once; kept exact if one ever re-ran)
        with self._recording_sum_sq(chunks, logits_to_keep):
            return fn()


__all__ = ["ForwardPasses"]
