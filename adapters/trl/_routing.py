"""MoE routing replay in TRL (``GRPOConfig(routing_replay="R2" | "R3")``): the trainer's collaborator. The
mechanics (capture, replay, routes layouts) are :mod:`stablerl.routing_replay`'s; this is where TRL's passes meet
them: R3 records the routes around HF ``generate`` (or takes a rollout_func's vLLM ``routed_experts``), R2 in TRL's
old-log-prob pass; the routes travel with their rows (``stablerl_routes``) and are replayed in every forward of
the batch. Per generation batch, the routes live in its :class:`~stablerl.adapters.trl._records.GenerationBatch`.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from stablerl import routing_replay as rr
from stablerl.params import StableRLError

from ._config import TRL_GRPOTrainer, routing_replay_mode

R3_VLLM_MESSAGE = (
    "routing_replay='R3' with use_vllm=True: TRL 1.16's vLLM path (VLLMGeneration) does not ask vLLM for the routed "
    "experts, so the rollout's routes never reach the trainer. Pass a rollout_func (it may drive a VLLMGeneration "
    "subclass) that runs vLLM with enable_return_routed_experts=True and returns, next to prompt_ids/completion_ids/"
    "logprobs, a 'routed_experts' list holding each completion's RequestOutput.outputs[i].routed_experts (stablerl "
    "converts them with stablerl.routing_replay.Routes.from_vllm). Otherwise use routing_replay='R2' (routes of the "
    "training engine's old-log-prob pass) or use_vllm=False (R3 recorded around HF generate)."
)


def check_rollout(args, kwargs) -> None:
    """R3 needs a rollout whose routes reach the trainer: HF generate, or a rollout_func returning them (checked on
    ``GRPOTrainer.__init__``'s arguments, before TRL builds or imports vLLM)."""
    try:
        bound = inspect.signature(TRL_GRPOTrainer.__init__).bind_partial(None, *args, **kwargs).arguments
    except TypeError:
        return  # TRL reports its own signature error
    cfg = bound.get("args")
    if cfg is None or routing_replay_mode(cfg) != "R3":
        return
    if getattr(cfg, "use_transformers_continuous_batching", False):
        raise StableRLError("routing_replay='R3' does not support use_transformers_continuous_batching (generate_batch "
                            "gives no per-step batch layout); use the regular HF generate path or routing_replay='R2'")
    if getattr(cfg, "use_vllm", False) and bound.get("rollout_func") is None:
        raise StableRLError(R3_VLLM_MESSAGE)


class RoutingReplay:
    """One trainer's routing replay. ``mode``: ``"R2"``, ``"R3"`` or None (off: every method passes through);
    ``router_lp``: also record the router log-probs at the replayed experts (a loss that reads them: rspo)."""

    def __init__(self, trainer, mode: Optional[str], router_lp: bool = False):
        self.trainer, self.mode, self.router_lp = trainer, mode, bool(mode and router_lp)
        self.current: Optional[rr.Routes] = None  # the routes of the micro-batch in compute_loss
        self.handles: list = []  # replays kept on until after backward
        if mode is None:
            return
        routers = rr.require_routers(trainer.accelerator.unwrap_model(trainer.model), needed_by=f"routing_replay={mode!r}")
        self.num_experts = max(r.num_experts for r in routers)
        self.layer_ids = tuple(r.layer_id for r in routers)
        if mode == "R3" and trainer.tools:
            raise StableRLError("routing_replay='R3' does not support tool calling (multi-turn generation splits the "
                                "rollout into several generate calls); use routing_replay='R2'")

    def _unwrap(self, model):
        return self.trainer.accelerator.unwrap_model(model)

    def release(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def routes(self, indices: torch.Tensor, valid: Optional[torch.Tensor] = None) -> rr.Routes:
        return rr.Routes.from_batch_tensor(indices, num_experts=self.num_experts, layer_ids=self.layer_ids, valid=valid)

    # -- the rollout: routes of generate (R3) --------------------------------------------------------------

    def generate_single_turn(self, parent, batch, prompt_ids, *args, **kwargs):
        """TRL's ``_generate_single_turn`` (``parent``), under a capture of the routers for R3 around HF generate."""
        t = self.trainer
        if self.mode != "R3" or t.use_vllm or t.use_transformers_continuous_batching or batch is None:
            return parent(prompt_ids, *args, **kwargs)
        with rr.capture(self._unwrap(t.model)) as cap:
            completion_ids, logprobs = parent(prompt_ids, *args, **kwargs)
        # generate: [left-padded prompt (P) | C_gen - 1 forwarded tokens]; +1 invalid column for the last token
        routes = cap.routes().extend(1)
        width = max(len(p) for p in prompt_ids)
        if t.pad_to_multiple_of:
            width = -(-width // t.pad_to_multiple_of) * t.pad_to_multiple_of
        seqs = [row.slice_tokens(width - len(p), width + len(c))
                for row, p, c in zip(routes.sequences(), prompt_ids, completion_ids)]
        batch.generated_routes = (seqs, [len(p) for p in prompt_ids])
        return completion_ids, logprobs

    def generated(self, batch, out):
        """TRL's ``_generate`` output: a rollout_func's vLLM ``routed_experts`` (R3), one array per completion."""
        if self.mode != "R3" or self.trainer.rollout_func is None or batch is None:
            return out
        prompt_ids, completion_ids, extra_fields = out[0], out[1], out[5]
        experts = extra_fields.pop("routed_experts", None)
        if experts is None or len(experts) != len(completion_ids):
            raise StableRLError("routing_replay='R3' with a rollout_func: its output needs a 'routed_experts' list "
                                "with one vLLM routed_experts array per completion. " + R3_VLLM_MESSAGE)
        model = self._unwrap(self.trainer.model)
        seqs = [rr.Routes.from_vllm(e, model=model, num_tokens=len(p) + len(c))
                for e, p, c in zip(experts, prompt_ids, completion_ids)]
        batch.generated_routes = (seqs, [len(p) for p in prompt_ids])
        return out

    def _batch_routes(self, batch, prompt_width: int, completion_width: int) -> Optional[rr.Routes]:
        """Routes of the generation batch in TRL's [left-padded prompt | right-padded completion] layout."""
        if batch.routes is None and self.mode == "R3":
            if batch.generated_routes is None:
                raise StableRLError("routing_replay='R3': the rollout recorded no routes")
            seqs, prompt_lengths = batch.generated_routes
            batch.routes = rr.Routes.pad_prompt_response(seqs, prompt_lengths, prompt_width, completion_width)
        return batch.routes

    def finish(self, batch, out: dict) -> None:
        """The batch's routes (and rspo's old router log-probs) into TRL's output, batch-first: TRL shuffles and
        splits them with their rows."""
        if self.mode is None:
            return
        routes = self._batch_routes(batch, out["prompt_ids"].size(1), out["completion_ids"].size(1))
        if batch.router_log_prob is not None:  # [B, C, L, k] fp32, old policy at the replayed experts
            out["stablerl_old_router_log_prob"] = batch.router_log_prob
        if routes is not None:  # on the CPU
            indices, valid = routes.batch_tensor()
            out["stablerl_routes"] = indices.cpu()
            if valid is not None:
                out["stablerl_routes_valid"] = valid.cpu()

    # -- the forwards --------------------------------------------------------------------------------------

    def _replayed(self, model, routes: rr.Routes, input_ids, fn, keep: bool):
        """Run ``fn`` (TRL's chunked forward) with ``routes`` replayed, each chunk getting its rows; kept until after
        backward when ``keep`` (gradient checkpointing re-runs the routers there: released in training_step)."""
        target = self._unwrap(model)
        handle = rr.replay(target, None)
        out = rr.replay_row_chunks(handle, target, routes, input_ids.shape, fn, keep=keep)
        if keep:
            self.handles.append(handle)
        return out

    def _recording(self, fn, model, logits_to_keep, batch, into):
        """``fn`` under a capture: R2's routes (into ``batch``) and/or, for rspo, the router log-probs at the experts
        used, ``[B, C, L, k]`` at the positions that predict the completion tokens (into ``into.router_log_prob``)."""
        def run():
            with rr.capture(self._unwrap(model), record_log_probs=into is not None) as cap:
                out = fn()
            if batch is not None:  # one part per TRL chunk
                batch.routes = self.routes(torch.cat([r.batch_tensor()[0] for r in cap.routes_list()]))
            if into is not None:
                lp = torch.cat(cap.log_probs_list(device=self.trainer.accelerator.device, batch_first=True))
                into.router_log_prob = lp[:, lp.size(1) - logits_to_keep - 1: lp.size(1) - 1]
            return out

        return run

    def forward(self, fn, model, input_ids, logits_to_keep, *, batch=None, old_pass=False, loss_pass=None):
        """One of TRL's log-prob forwards with the routes replayed: a pass over a fresh generation batch (``batch``;
        ``old_pass``: TRL's old-log-prob pass, which records R2's routes and rspo's old router log-probs) or a
        training / eval forward (``loss_pass``: the training forward's record, for rspo's router log-probs)."""
        if batch is None:
            if loss_pass is not None and self.router_lp:
                fn = self._recording(fn, model, logits_to_keep, None, loss_pass)
            return fn() if self.current is None else self._replayed(model, self.current, input_ids, fn,
                                                                     keep=torch.is_grad_enabled())
        routes = self._batch_routes(batch, input_ids.size(1) - logits_to_keep, logits_to_keep)
        if old_pass:
            record = routes is None and batch.record_routes  # R2
            if record or self.router_lp:
                fn = self._recording(fn, model, logits_to_keep, batch if record else None,
                                     batch if self.router_lp else None)
        return fn() if routes is None else self._replayed(model, routes, input_ids, fn, keep=False)

    def compute_loss(self, parent, model, inputs, **kwargs):
        """HF's ``compute_loss`` (``parent``) with the micro-batch's routes replayed (R2 without TRL's old-log-prob
        pass: this first training forward records them, and they travel with the micro-batch)."""
        if self.mode is None:
            return parent(model, inputs, **kwargs)
        self.release()
        t = inputs.get("stablerl_routes")
        routes = None if t is None else self.routes(t, inputs.get("stablerl_routes_valid"))
        cap = None
        if routes is None and self.mode == "R2":
            cap = rr.capture(self._unwrap(model))
        self.current = routes
        try:
            loss = parent(model, inputs, **kwargs)
        finally:
            self.current = None
            if cap is not None:
                cap.stop()
            if not self.trainer.model.training:
                self.release()
        if cap is not None and cap.passes:
            inputs["stablerl_routes"] = cap.routes().batch_tensor()[0].cpu()
        return loss


__all__ = ["RoutingReplay", "R3_VLLM_MESSAGE", "check_rollout"]
