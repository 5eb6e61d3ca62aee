"""The loss step of a stablerl policy loss in TRL's ``_compute_loss``.

TRL's loss types are a string switch with no smaller hook, so TRL's own ``_compute_loss`` runs with zero advantages
under the TRL built-in whose normaliser equals ``stablerl_loss_agg_mode`` (``loss_type`` rebound for that call,
through the trainer's :class:`~stablerl.patching.PatchLedger`): TRL contributes exactly the surroundings (forward
with entropies, MoE aux loss, KL, entropy bonus, GA scaling, metrics) and a zero policy term. The stablerl loss is
computed from that same forward's log-probs and entropies (recorded in the micro-batch's
:class:`~stablerl.adapters.trl._records.LossBatch`), with TRL's masks and vLLM IS ratio as per-token weights, its
declared inputs read through the adapter's providers (``BatchRecord.declared``), and added.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

import stablerl
from stablerl.contracts import POLICY_LOSS
from stablerl.frameworks import check_supplied_inputs, top_entropy_on
from stablerl.params import StableRLError

from ._adapter import TRLAdapter
from ._config import check_extra_loss_inputs
from ._records import LossBatch
from ._rollout import trained_mask

# The TRL built-in whose aggregation equals each stablerl loss_agg_mode. TRL's _compute_loss runs
# under it (with zero advantages) so that the KL term is normalised like the stablerl loss.
_HOST_LOSS_TYPE = {
    "token-mean": "dapo",  # sum / (tokens of the accumulation window over every process)
    "seq-mean-token-mean": "grpo",  # mean over sequences of the per-sequence token mean, / GA
    "seq-mean-token-sum": "luspo",  # mean over sequences of the per-sequence token sum, / GA
    "seq-mean-token-sum-norm": "dr_grpo",  # sum / (B * max_completion_length), / GA
}
# Metrics the host loss type logs about its own (here: zero-advantage) clipping; they are removed.
_HOST_CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                      "clip_ratio/high_max")


class PolicyLossStep:
    """One trainer's stablerl policy loss (``settings``: what the trainer's ``__init__`` resolved: the loss, its
    effective hyper-parameters and call options, the aggregation, the rollout correction)."""

    def __init__(self, trainer, loss: Optional[str], *, params: dict, call_options: dict, agg_mode: str,
                 correction: Optional[str], correction_params: dict):
        self.trainer, self.loss = trainer, loss
        self.spec = stablerl.get_spec(POLICY_LOSS, loss) if loss else None
        self.params, self.call_options, self.agg_mode = params, call_options, agg_mode
        self.correction, self.correction_params = correction, correction_params

    def compute(self, parent, model, inputs):
        """``parent``: TRL's ``_compute_loss``. Its loss, the stablerl policy term and a controller's loss term."""
        t = self.trainer
        driver = t._stablerl_loop.driver
        penalty = driver is not None and driver.penalty is not None
        if self.loss is None and not penalty:
            return parent(model, inputs)
        record = LossBatch(TRLAdapter(), host=inputs)
        t._stablerl_pass = record
        try:
            loss = parent(model, inputs) if self.loss is None else self._with_surroundings(parent, model, inputs, record)
        finally:
            t._stablerl_pass = None
        if penalty and record.entropies is not None:
            mode = t._mode()
            term, metrics = t._stablerl_loop.loss_term(record.entropies, trained_mask(inputs),
                                                       self.context(inputs, record.entropies.size(0), mode))
            t._stablerl_log(mode, metrics)
            loss = loss + term
        return loss

    def _with_surroundings(self, parent, model, inputs, record: LossBatch):
        t = self.trainer
        mode = t._mode()
        metrics = t._metrics[mode]
        before = {k: len(metrics[k]) for k in _HOST_CLIP_METRICS if k in metrics}
        policy_loss_logged = len(metrics["policy_loss"]) if "policy_loss" in metrics else 0
        # TRL's own _compute_loss with zero advantages: its policy term is exactly 0, everything around it is TRL's
        surroundings_inputs = dict(inputs)
        surroundings_inputs["advantages"] = torch.zeros_like(inputs["advantages"])
        ledger = t._stablerl_ledger
        ledger.set_attr("loss_type", t, "loss_type", _HOST_LOSS_TYPE[self.agg_mode])
        try:
            surroundings = parent(model, surroundings_inputs)
        finally:
            ledger.restore("loss_type")
        record.capture = False  # a controller's term reads this forward's entropies too, nothing after it
        for key in _HOST_CLIP_METRICS:  # clip statistics of the zero-advantage host loss mean nothing
            if key in metrics:
                del metrics[key][before.get(key, 0):]
                if not metrics[key]:
                    del metrics[key]
        loss, loss_value = t._stablerl_policy_loss(inputs, record.logps, record.entropies, mode,
                                                   router_log_prob=record.router_log_prob)
        if "policy_loss" in metrics and len(metrics["policy_loss"]) > policy_loss_logged:
            # TRL logs its (KL-inclusive) policy loss only when the entropy bonus is on; add ours to it
            metrics["policy_loss"][-1] += t.accelerator.gather(loss_value).nanmean().item()
        return surroundings + loss

    def context(self, inputs: dict, rows: int, mode: str, **kwargs) -> "stablerl.Context":
        """A loss-side Context: the tokens (``token_count``) and sequences (``seq_count``) of the accumulation window
        over every process, and an all-reduce across them."""
        t = self.trainer
        n = t.accelerator.num_processes
        ga = t.current_gradient_accumulation_steps if mode == "train" else 1
        token_count = inputs["num_items_in_batch"].to(torch.float32)  # tokens of the generation batch, all processes
        if mode == "train":  # the generation batch spans steps_per_generation micro-batches
            token_count = token_count * ga / t.args.steps_per_generation
        common = dict(step=int(t.state.global_step), total_steps=int(t.state.max_steps or 0) or None,
                      token_count=token_count, seq_count=rows * n * ga, **kwargs)
        if n > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            return stablerl.torch_distributed_context(dp_size=n, **common)
        return stablerl.Context(dp_size=n, **common)

    def _supplied(self, inputs, logps) -> dict[str, Any]:
        declared = check_extra_loss_inputs(getattr(self.trainer.args, "stablerl_extra_loss_inputs", None))
        if not declared:
            return {}
        return check_supplied_inputs(self.spec, declared, dict(self.trainer.stablerl_loss_inputs(inputs, logps) or {}),
                                     declared_in="stablerl_extra_loss_inputs", supplied_by="stablerl_loss_inputs")

    def policy_loss(self, inputs, logps, entropies, mode, router_log_prob=None):
        """The stablerl policy term on TRL's micro-batch ``inputs``: ``(loss, value for TRL's policy_loss metric)``."""
        t, spec = self.trainer, self.spec
        mask = trained_mask(inputs)
        valid = mask.bool()  # what core reads: a bool mask costs it no cast and no compare
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        sampling = inputs.get("sampling_per_token_logps")
        supplied = self._supplied(inputs, logps)

        # TRL's per-token multipliers, in TRL's order: off-policy sequence mask, entropy mask, vLLM IS ratio
        weights = []
        if t.off_policy_mask_threshold is not None or t.top_entropy_quantile < 1.0:
            mask = mask.to(logps.dtype)  # TRL's own masks take a float mask (a cast only when one is on)
        if t.off_policy_mask_threshold is not None:
            weights.append(t.get_off_policy_mask(
                advantages=advantages, per_token_logps=logps, sampling_per_token_logps=old if sampling is None else sampling,
                mask=mask, off_policy_threshold=t.off_policy_mask_threshold))
        if t.top_entropy_quantile < 1.0:
            weights.append(t.get_high_entropy_mask(entropies, mask, 1 - t.top_entropy_quantile).to(logps.dtype))
        use_vllm_is = bool(t.use_vllm and t.vllm_importance_sampling_correction)
        rollout_log_prob = None
        if self.correction or (use_vllm_is and "rollout_log_prob" in spec.requires):
            # the algorithm corrects for the sampler itself (like TRL's vespo): the sampler's log-probs, where NaN (a
            # token vLLM did not score) means no mismatch; TRL's ratio is not applied on top (one correction, never two)
            if sampling is None:
                raise StableRLError(f"stablerl_rollout_correction={self.correction!r}: this batch has no "
                                    "sampling log-probs (the rollout_func returned no logprobs?)")
            unscored = old if use_vllm_is else supplied.get("old_log_prob", old)
            rollout_log_prob = torch.where(torch.isnan(sampling), unscored, sampling)
        elif use_vllm_is:
            weights.append(inputs["importance_sampling_ratio"])
        elif "rollout_log_prob" in spec.requires and not t.use_vllm and t.rollout_func is None:
            # TRL generates with the policy itself: the behaviour log-probs are the generating weights' (TRL's
            # old-log-prob pass at generation; without it the batch is on-policy and they are the detached current)
            rollout_log_prob = old
        is_weights = functools.reduce(lambda a, w: a * w.to(logps.dtype), weights, torch.ones_like(logps)).detach() \
            if weights else None

        old = supplied.pop("old_log_prob", old)
        rollout_log_prob = supplied.pop("rollout_log_prob", rollout_log_prob)
        # the inputs the loss declares, through the adapter's providers (those the user's subclass supplies first)
        record = LossBatch(TRLAdapter(), response_mask=valid, index=inputs.get("stablerl_index"),
                           scores=inputs.get("stablerl_scores"), host=inputs, produced=dict(supplied), logps=logps,
                           entropies=entropies, router_log_prob=router_log_prob, rollout_log_prob=rollout_log_prob,
                           sampling_mask=t._stablerl_replay.kept_set() if t._stablerl_replay else None,
                           policy_version=getattr(t, "_stablerl_policy_version", None))
        # (required ones only: an optional input stays the loss's default, as before the providers)
        extra: dict[str, Any] = {**supplied, **record.declared(spec, skip=("entropy", "rollout_log_prob"), optional=False)}
        if self.correction:
            extra["rollout_correction"] = self.correction
            if self.correction_params:
                extra["rollout_correction_params"] = self.correction_params
        ctx = self.context(inputs, logps.size(0), mode, loss_scale_factor=float(t.max_completion_length),
                           state=t._stablerl_store.slot(POLICY_LOSS, self.loss))
        loss, metrics = stablerl.compute_policy_loss(
            self.loss, log_prob=logps, old_log_prob=old, advantages=advantages.expand_as(logps),
            response_mask=valid, rollout_log_prob=rollout_log_prob,
            # only to a loss that reads it (or masks by it: stablerl_loss_params' top_entropy_quantile < 1), so the
            # others skip core's clean-up pass over it
            entropy=entropies if "entropy" in spec.reads or top_entropy_on(self.call_options) else None,
            ctx=ctx, is_weights=is_weights, **extra,
            # stablerl_loss_agg_mode, unless stablerl_loss_params names a registered aggregation (delta_l)
            **{"loss_agg_mode": self.agg_mode, **self.call_options}, **self.params)
        t._stablerl_log(mode, metrics)
        # for TRL's `policy_loss` metric, in the host loss type's convention (dapo: as is; others: before /GA)
        ga = t.current_gradient_accumulation_steps if mode == "train" else 1
        return loss, loss.detach() * (1 if self.agg_mode == "token-mean" else ga)


__all__ = ["PolicyLossStep"]
