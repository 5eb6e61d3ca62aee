"""Sampling-mask replay in OpenRLHF 0.11.2 (:mod:`stablerl.sampling_mask`): vLLM's log-probs over the full vocabulary.

``--algo.advantage.sampling_mask_replay auto|true|false`` (no-wrapper route: ``$STABLERL_SAMPLING_MASK_REPLAY``;
default ``auto``: on when ``--rollout.top_p < 1`` (or a ``top_k > 0`` in the generate kwargs) and
``--algo.advantage.is_correction_level`` is not ``off``, the only setting under which OpenRLHF collects vLLM's
(processed) log-probs). The actor's old-log-prob pass (``Actor.forward`` in ``PolicyModelActor.forward``, patched in
``_inputs``) also returns ``log M``, the trainer's log-mass on the rollout's kept set, from the temperature-scaled
logits it computed the log-probs from, at the action positions only (chunked, no ``[B, T, V]`` store). It rides back
on the CPU log-prob tensor as the other old-pass statistics do; ``make_experience`` (driver) then replaces each
experience's ``rollout_log_probs`` by ``rollout_log_probs + log M`` before the replay buffer, so OpenRLHF's
``is_correction`` (its TIS / ICEPOP / seq-mask-TIS and ``vllm_kl``) and every stablerl loss reading
``rollout_log_prob`` compare over the same kept set; ``action_log_probs`` (the PPO ratio's anchor) stay OpenRLHF's.
Each row's mean kept mass is logged as ``sampling_mask/kept_mass`` (``experience.info``).

The kept set is recomputed with the rollout's rule, or taken from the engine where a custom rollout attaches one
``SamplingMask`` of shape ``[A]`` per row to the experience's ``action_mask`` tensor (attribute
:data:`MASK_ATTR`: a list, one per row; it travels with the tensor as the old-pass statistics do).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from stablerl.params import StableRLError
from stablerl.sampling_mask import (ReplayDecision, SamplingRule, concat_positions, log_kept_mass_rows,
                                    replay_rollout_log_prob, resolve_replay)

from ._flags import IS_CORRECTION_FLAG, SAMPLING_REPLAY_FLAG

#: ``experience.info`` key of the per-row mean kept mass (OpenRLHF logs every info key's mean)
METRIC = "sampling_mask/kept_mass"
#: attribute of a samples' ``action_mask`` tensor with the engine's kept sets (one SamplingMask [A] per row)
MASK_ATTR = "stablerl_sampling_mask"
RULE_KEYS = "--rollout.top_p / --rollout.temperature (and a top_k in the generate kwargs)"


def rollout_rule(args) -> SamplingRule:
    """The rollout's sampling rule from OpenRLHF's generation args (``--rollout.top_p``, ``--rollout.temperature``;
    OpenRLHF passes no top_k / min_p to vLLM unless a caller adds them)."""
    rollout = getattr(args, "rollout", None)
    return SamplingRule(temperature=float(getattr(rollout, "temperature", 1.0) or 1.0),
                        top_k=int(getattr(rollout, "top_k", -1) or -1), top_p=float(getattr(rollout, "top_p", 1.0)),
                        min_p=float(getattr(rollout, "min_p", 0.0) or 0.0))


def decide(args, value: Optional[Any], key: str = SAMPLING_REPLAY_FLAG) -> ReplayDecision:
    """The decision for OpenRLHF ``args`` and the user's ``value`` (None: ``auto``)."""
    level = getattr(getattr(getattr(args, "algo", None), "advantage", None), "is_correction_level", "off")
    try:
        return resolve_replay(value, rollout_rule(args), rollout_log_probs=level not in (None, "off"), key=key,
                              framework="openrlhf", rule_keys=RULE_KEYS)
    except StableRLError as e:
        if "nothing to replay" in str(e):
            raise StableRLError(f"{e} (OpenRLHF collects vLLM's log-probs only with {IS_CORRECTION_FLAG} token|seq)") \
                from None
        raise


# ----------------------------------------------------------------------------- in the actor worker


def old_pass_log_kept_mass(logits, sequences, attention_mask, action_mask, rule: SamplingRule, packing: bool,
                           ring_attn_group=None) -> torch.Tensor:
    """``log M`` ``[B, A]`` of the old-log-prob forward: ``logits`` as OpenRLHF's ``Actor.forward`` returns them
    (fp32, divided by its temperature; ``[B, S, V]``, or ``[1, nnz, V]`` with sample packing), at the positions that
    predict the action tokens (where ``action_mask``), 0 elsewhere."""
    if ring_attn_group is not None:
        raise StableRLError(f"{SAMPLING_REPLAY_FLAG}: not supported with ring attention (--ds.ring_attn_size > 1: the "
                            "logits are split over the ring)")
    b, s = sequences.shape
    width = action_mask.shape[1]
    device = logits.device
    if packing:  # [1, nnz, V]: the packed index of every valid (row, position)
        where = torch.full((b * s,), -1, dtype=torch.long, device=device)
        valid = attention_mask.flatten().to(device).bool()
        where[valid] = torch.arange(int(valid.sum()), device=device)
        where = where.view(b, s)
    else:
        where = torch.arange(b * s, device=device).view(b, s)
    predict = where[:, :-1][:, -width:]  # position s-1 predicts token s; the actions are the last `width`
    labels = sequences.to(device)[:, 1:][:, -width:]
    act = action_mask.to(device).bool()
    rows, ids = predict[act], labels[act]
    if bool((rows < 0).any()):
        raise StableRLError(f"{SAMPLING_REPLAY_FLAG}: an action token outside the attention mask")
    mask = getattr(action_mask, MASK_ATTR, None)
    flat = logits.reshape(-1, logits.shape[-1])
    if mask is not None:
        if len(mask) != b or any(tuple(getattr(m, "shape", ())) != (width,) for m in mask):
            raise StableRLError(f"{SAMPLING_REPLAY_FLAG}: the engine's sampling masks must be one SamplingMask of "
                                f"shape [{width}] (the action width) per row, for {b} rows")
        got = log_kept_mass_rows(flat, rows, ids, mask=concat_positions(list(mask), list(act.cpu()),
                                                                        SAMPLING_REPLAY_FLAG))
    else:
        got = log_kept_mass_rows(flat, rows, ids, rule=rule)
    out = torch.zeros(b, width, dtype=torch.float32, device=device)
    out[act] = got
    return out


# ----------------------------------------------------------------------------- in the experience maker (driver)


def replay_experiences(experiences, key: str) -> None:
    """Each experience's ``rollout_log_probs`` over the full vocabulary (its ``info[key]``: the old pass's ``log M``,
    removed), and the per-row mean kept mass into ``info`` (:data:`METRIC`)."""
    for i, e in enumerate(experiences):
        log_mass = e.info.pop(key)
        if e.rollout_log_probs is None:
            raise StableRLError(f"{SAMPLING_REPLAY_FLAG}: experience {i} has no rollout_log_probs (vLLM's log-probs; "
                                f"{IS_CORRECTION_FLAG} token|seq collects them)")
        mask = e.action_mask
        e.rollout_log_probs = replay_rollout_log_prob(e.rollout_log_probs, log_mass, mask)
        m = mask.to(torch.float32)
        e.info[METRIC] = (log_mass.float().exp() * m).sum(-1) / m.sum(-1).clamp(min=1)


__all__ = ["METRIC", "MASK_ATTR", "rollout_rule", "decide", "old_pass_log_kept_mass", "replay_experiences"]
