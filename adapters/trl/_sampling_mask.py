"""Sampling-mask replay in TRL (:mod:`stablerl.sampling_mask`): the rollout's log-probs over the full vocabulary.

``GRPOConfig(sampling_mask_replay="auto" | "true" | "false")`` (default ``auto``: on when TRL's ``top_k > 0``,
``top_p < 1`` or ``min_p > 0`` (``generation_kwargs`` overriding them) and a ratio is formed against the rollout's
log-probs: TRL's ``vllm_importance_sampling_correction``, its ``off_policy_mask_threshold``, a
``stablerl_rollout_correction`` or a stablerl loss reading ``rollout_log_prob``).

Where ``log M`` (the trainer's log-mass on the rollout's kept set) is measured, from the last hidden states of a
policy forward through the LM head, in row chunks, no gradient:

* TRL's old-log-prob pass in ``_generate_and_score_completions`` (it runs with the vLLM IS correction on, or when
  generation and optimisation steps are misaligned): that pass returns ``log pi - log M`` (the trainer's log-prob
  over the kept set) to TRL, so TRL's IS ratio (all its modes) and its ``sampling_logp_difference`` metric compare
  kept set with kept set; after the method, ``old_per_token_logps`` gets TRL's value back (the PPO ratio between two
  trainer forwards is untouched) and ``sampling_per_token_logps`` becomes ``log mu + log M`` for every later reader
  (TRL's ``off_policy_mask_threshold``, every stablerl correction or loss reading ``rollout_log_prob``);
* where TRL runs no old-log-prob pass, one extra no-grad forward of the policy (the one that generated the batch)
  at the end of ``_generate_and_score_completions``.

The kept set is a ``rollout_func``'s ``sampling_mask`` field where it returns one (one
:class:`~stablerl.sampling_mask.SamplingMask` of shape ``[len(completion)]``, or one list of kept ids per token, per
completion: vLLM >= 0.28 ``return_sampling_mask``), else recomputed with TRL's ``temperature``/``top_k``/``top_p``/
``min_p`` (TRL 1.16's ``VLLMGeneration`` drops the engine's per-token extras). The mean kept mass is logged as
``sampling_mask/kept_mass``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from accelerate.utils import is_peft_model

from stablerl.params import StableRLError
from stablerl.sampling_mask import (KEPT_MASS_METRIC, REPLAY_OPTION, SamplingMask, SamplingRule, log_kept_mass,
                                    log_replay_decision, replay_rollout_log_prob, resolve_replay)

RULE_KEYS = "TRL's top_k / top_p / min_p (generation_kwargs included)"
#: the per-completion extra field a rollout_func may return: the engine's kept sets
MASK_FIELD = "sampling_mask"
_LOGITS_PER_CHUNK = 1 << 22  # rows x positions x vocabulary of one logits chunk


def rollout_rule(args) -> SamplingRule:
    """The rollout's truncation rule from TRL's config (``generation_kwargs`` override, as they do in vLLM)."""
    extra = dict(getattr(args, "generation_kwargs", None) or {})

    def get(key, default):
        value = extra.get(key, getattr(args, key, None))
        return default if value is None else value

    top_k = int(get("top_k", 0))
    return SamplingRule(temperature=float(get("temperature", 1.0)), top_k=top_k if top_k > 0 else -1,
                        top_p=float(get("top_p", 1.0)), min_p=float(get("min_p", 0.0)))


def check_option(args) -> None:
    """``sampling_mask_replay`` is auto, true or false (the rest is decided when the trainer is built)."""
    resolve_replay(getattr(args, REPLAY_OPTION, None), rollout_rule(args), rollout_log_probs=True, key=REPLAY_OPTION,
                   framework="trl", rule_keys=RULE_KEYS)


def batch_mask(masks: list, width: int) -> SamplingMask:
    """Per-completion kept sets -> one CSR mask over TRL's right-padded ``[B, width]`` completions (padding: empty)."""
    ids, counts = [], []
    for row in masks:
        if isinstance(row, SamplingMask):
            per_token = [row.token_ids[row.offsets[i]:row.offsets[i + 1]].long() for i in range(row.offsets.numel() - 1)]
        else:
            per_token = [torch.as_tensor(list(kept), dtype=torch.long) for kept in row]
        if len(per_token) > width:
            raise StableRLError(f"{MASK_FIELD}: a completion's mask covers {len(per_token)} tokens, more than the "
                                f"batch's {width} completion positions")
        ids += per_token
        counts += [t.numel() for t in per_token] + [0] * (width - len(per_token))
    offsets = torch.zeros(len(counts) + 1, dtype=torch.long)
    offsets[1:] = torch.tensor(counts, dtype=torch.long).cumsum(0)
    token_ids = torch.cat(ids).to(torch.int32) if ids else torch.zeros(0, dtype=torch.int32)
    return SamplingMask(token_ids, offsets, (len(masks), width))


class SamplingMaskReplay:
    """One trainer's replay (see the module docstring). ``reads_rollout``: whether something forms a ratio against
    the rollout's log-probs in this run."""

    def __init__(self, trainer, reads_rollout: bool):
        args = trainer.args
        self.trainer, self.rule = trainer, rollout_rule(args)
        self.value = getattr(args, REPLAY_OPTION, None)
        # (a host that runs only the loss, stablerl bench's, has neither attribute)
        rollout = getattr(trainer, "use_vllm", False) or getattr(trainer, "rollout_func", None) is not None
        self.rollout_log_probs = bool(rollout and reads_rollout)
        self.decision = self._decide(engine_masks=False)
        log_replay_decision(self.decision)

    def _decide(self, engine_masks: bool):
        return resolve_replay(self.value, self.rule, rollout_log_probs=self.rollout_log_probs, key=REPLAY_OPTION,
                              framework="trl", engine_masks=engine_masks, rule_keys=RULE_KEYS)

    @property
    def on(self) -> bool:
        return self.decision.on

    # -- the rollout: the engine's kept sets (a rollout_func's extra field) -----------------------------

    def generated(self, batch, out):
        """TRL's ``_generate`` output: a rollout_func's ``sampling_mask`` field into the batch's record."""
        extra_fields = out[5] if len(out) > 5 else None
        if batch is None or not isinstance(extra_fields, dict) or MASK_FIELD not in extra_fields:
            return out
        masks = extra_fields.pop(MASK_FIELD)
        if masks is None or len(masks) != len(out[1]):
            raise StableRLError(f"a rollout_func's {MASK_FIELD!r} field needs one kept-set mask per completion "
                                f"({len(out[1])}), got {None if masks is None else len(masks)}")
        if not self.on:
            decision = self._decide(engine_masks=True)
            if decision.on:
                self.decision = decision
                log_replay_decision(decision)
        batch.engine_masks = list(masks)
        return out

    def kept_set(self, batch=None):
        """What the ``sampling_mask`` providers give: the batch's engine masks, else TRL's rule; None when off."""
        if not self.on:
            return None
        masks = getattr(batch, "engine_masks", None) if batch is not None else None
        return masks if masks is not None else self.rule

    # -- log M from the last hidden states of a policy forward -----------------------------------------

    def _base(self, model):
        base = self.trainer.accelerator.unwrap_model(model)
        return base.get_base_model() if is_peft_model(base) else base

    @contextlib.contextmanager
    def _hidden(self, model):
        """Collects the backbone's last hidden states of every forward of ``model`` while open (TRL's chunks)."""
        base = self._base(model)
        backbone = getattr(base, base.base_model_prefix)
        chunks: list = []

        def hook(module, inputs, output):
            h = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
            chunks.append(h.detach())

        handle = backbone.register_forward_hook(hook)
        try:
            yield chunks
        finally:
            handle.remove()

    def _log_mass(self, model, chunks: list, completion_ids: torch.Tensor, masks: Optional[list]) -> torch.Tensor:
        """``log M`` ``[B, C]`` from the collected hidden states (the positions that predict the completion)."""
        base = self._base(model)
        text = base.config.get_text_config()
        for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                     "logits_scaling"):
            if getattr(text, attr, None) not in (None, 1, 1.0):
                raise StableRLError(f"{REPLAY_OPTION}: the model's {attr}={getattr(text, attr)} transforms the logits "
                                    "after the LM head, which the kept-mass computation does not replicate; set "
                                    f"{REPLAY_OPTION}=false")
        head = base.get_output_embeddings()
        b, c = completion_ids.shape
        hidden = torch.cat(chunks, dim=0)[:, -c - 1:-1]
        if hidden.size(0) != b:
            raise StableRLError(f"{REPLAY_OPTION}: the forward saw {hidden.size(0)} rows for {b} completions")
        mask = batch_mask(masks, c) if masks is not None else None
        valid = torch.ones(b, c, dtype=torch.bool, device=completion_ids.device)
        if mask is not None:  # the engine's kept sets: empty rows are padding
            valid = (mask.offsets[1:] > mask.offsets[:-1]).view(b, c).to(completion_ids.device)
        rows = max(1, _LOGITS_PER_CHUNK // max(1, c * head.weight.size(0)))
        out = []
        with torch.no_grad():
            for start in range(0, b, rows):
                end = min(start + rows, b)
                logits = torch.nn.functional.linear(hidden[start:end].float(), head.weight.float(),
                                                    None if head.bias is None else head.bias.float())
                logits = logits / self.trainer.temperature
                part_mask = None
                if mask is not None:
                    lo, hi = int(mask.offsets[start * c]), int(mask.offsets[end * c])
                    part_mask = SamplingMask(mask.token_ids[lo:hi], mask.offsets[start * c:end * c + 1] - lo,
                                             (end - start, c))
                out.append(log_kept_mass(logits, completion_ids[start:end].to(logits.device),
                                         valid[start:end].to(logits.device), mask=part_mask,
                                         rule=None if part_mask is not None else self.rule))
        return torch.cat(out).to(completion_ids.device)

    # -- TRL's old-log-prob pass, or one extra forward ----------------------------------------------------

    def old_pass(self, fn, model, input_ids, logits_to_keep: int, batch):
        """TRL's old-log-prob pass ``fn`` with ``log M`` measured in it: returns ``log pi - log M`` to TRL (its IS
        ratio compares the kept sets); :meth:`finish` restores TRL's old log-probs."""
        with self._hidden(model) as chunks:
            out = fn()
        batch.log_mass = self._log_mass(model, chunks, input_ids[:, -logits_to_keep:],
                                        getattr(batch, "engine_masks", None))
        batch.old_logps = out[0]
        return (out[0] - batch.log_mass.to(out[0].dtype), *out[1:])

    def finish(self, batch, out: dict, passes) -> None:
        """After TRL's ``_generate_and_score_completions``: TRL's old log-probs back, the rollout's log-probs over the
        full vocabulary, the kept-mass metric. Without TRL's old-log-prob pass: one extra forward measures ``log M``."""
        sampling = out.get("sampling_per_token_logps")
        if not self.on or sampling is None:
            return
        if batch.log_mass is None:
            model = self.trainer.model
            with self._hidden(model) as chunks:
                passes.rollout_forward(out, batch.mode, f"{REPLAY_OPTION} (the trainer's kept mass)")
            batch.log_mass = self._log_mass(model, chunks, out["completion_ids"], getattr(batch, "engine_masks", None))
        elif "old_per_token_logps" in out:
            out["old_per_token_logps"] = batch.old_logps
        metrics: dict[str, Any] = {}
        out["sampling_per_token_logps"] = replay_rollout_log_prob(sampling, batch.log_mass, out["completion_mask"],
                                                                  metrics)
        if metrics:
            self.trainer._stablerl_log(batch.mode, metrics, prefix="")
        else:
            self.trainer._stablerl_log(batch.mode, {KEPT_MASS_METRIC: float("nan")}, prefix="")


__all__ = ["SamplingMaskReplay", "rollout_rule", "check_option", "batch_mask", "MASK_FIELD", "RULE_KEYS"]
