"""Sampling-mask replay in verl 0.9.1 (:mod:`stablerl.sampling_mask`): rollout log-probs over the full vocabulary.

``+algorithm.sampling_mask_replay=auto|true|false`` (default ``auto``: on when ``actor_rollout_ref.rollout.top_k > 0``
or ``top_p < 1`` and the batch has ``rollout_log_probs``). The legacy trainer's old-log-prob pass
(``RayPPOTrainer._compute_old_log_prob``, wrapped here) asks the actor's engine for one more per-token output: the
stablerl engine subclass (``_engine``) computes ``log M``, the trainer's log-mass on the rollout's kept set, from the
temperature-scaled logits of that forward at the response positions only (chunked, no ``[B, T, V]`` store; the kept
set recomputed with the rollout's top-k/top-p, or the engine's per-row :class:`~stablerl.sampling_mask.SamplingMask`
in the non-tensor field ``sampling_mask``). The wrap then replaces the batch's ``rollout_log_probs`` by
``rollout_log_probs + log M`` before ``calculate_debug_metrics``, verl's rollout correction (TIS / rejection
sampling) and every stablerl loss or estimator reading ``rollout_log_prob`` see them; ``old_log_probs`` (the PPO
ratio's anchor) stay verl's. The step's mean kept mass is logged as ``sampling_mask/kept_mass``.

Not replayed (said at start-up, an error with ``true``): bypass mode (no old-log-prob pass) and the v1 trainer.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from stablerl.params import StableRLError
from stablerl.sampling_mask import (REPLAY_OPTION, ReplayDecision, SamplingRule, concat_positions, log_kept_mass_rows,
                                    log_replay_decision, replay_rollout_log_prob, resolve_replay)

# sampling-mask replay (adapters/verl/_sampling_mask.py): where it runs
SAMPLING_REPLAY = (
    "the legacy trainer (trainer.use_v1=false) in decoupled mode (algorithm.rollout_correction.bypass_mode=false), "
    "actor_rollout_ref.rollout.calculate_log_probs=True and +algorithm.sampling_mask_replay=auto (on when rollout.top_k "
    "> 0 or top_p < 1) or true: rollout_log_probs are replaced by their full-vocabulary form before any ratio")
#: the batch meta info under which the replayed rule rides to compute_advantage and the update
REPLAYED_KEY = "stablerl_sampling_replayed"
#: a per-row non-tensor field a customised rollout may set: the engine's kept sets, one ``SamplingMask`` of shape
#: ``[response_length]`` per row (vLLM >= 0.28 ``return_sampling_mask``)
MASK_FIELD = "sampling_mask"

KEY = f"algorithm.{REPLAY_OPTION}"
#: the non-tensor key that asks the engine for ``log M`` (set only for the old-log-prob pass): the rule as a dict
#: (``{"mask": True}``: the per-row masks of :data:`MASK_FIELD`)
FLAG = "stablerl_sampling_replay"
#: the engine's per-token output: ``log M`` in verl's no-padding layout (0 outside the response positions)
OUTPUT = "stablerl_log_kept_mass"
RULE_KEYS = "actor_rollout_ref.rollout.top_k / top_p"


def replayed(meta: Optional[dict], non_tensor: Any):
    """What the replay used for this batch (the ``sampling_mask`` provider): the :class:`SamplingRule`, or the rows'
    engine masks; None when the batch was not replayed."""
    if not meta:
        return None
    if meta.get("mask"):
        return non_tensor.get(MASK_FIELD) if non_tensor is not None else None
    from stablerl.sampling_mask import SamplingRule

    return SamplingRule(temperature=float(meta.get("temperature", 1.0)), top_k=int(meta["top_k"]),
                        top_p=float(meta["top_p"]), min_p=float(meta.get("min_p", 0.0)))



def rollout_rule(config) -> SamplingRule:
    """The rollout's sampling rule from verl's ``actor_rollout_ref.rollout`` (verl has no min_p)."""
    from stablerl.selection import config_get

    rollout = config_get(config_get(config, "actor_rollout_ref"), "rollout")
    return SamplingRule(temperature=float(config_get(rollout, "temperature", 1.0)),
                        top_k=int(config_get(rollout, "top_k", -1)), top_p=float(config_get(rollout, "top_p", 1.0)))


def decide(config, batch) -> ReplayDecision:
    """The replay decision for this trainer and batch (bypass mode and missing rollout log-probs included)."""
    from stablerl.selection import config_get

    algorithm = config_get(config, "algorithm")
    value = config_get(algorithm, REPLAY_OPTION) if algorithm is not None else None
    rule = rollout_rule(config)
    masks = MASK_FIELD in batch.non_tensor_batch
    has_rollout = "rollout_log_probs" in batch.batch.keys()
    return resolve_replay(value, rule, rollout_log_probs=has_rollout, key=KEY, framework="verl", engine_masks=masks,
                          rule_keys=RULE_KEYS)


def bypass_decision(config) -> Optional[ReplayDecision]:
    """In bypass mode (no old-log-prob pass) the replay cannot run: ``true`` is an error, ``auto`` says it is off."""
    from stablerl.selection import config_get

    algorithm = config_get(config, "algorithm")
    value = config_get(algorithm, REPLAY_OPTION) if algorithm is not None else None
    decision = resolve_replay(value, rollout_rule(config), rollout_log_probs=True, key=KEY, framework="verl",
                              rule_keys=RULE_KEYS)
    if not decision.on:
        return decision
    why = ("algorithm.rollout_correction.bypass_mode=true runs no old-log-prob pass, where the adapter measures the "
           "kept mass")
    if decision.reason.startswith(f"{KEY}=true"):
        raise StableRLError(f"{KEY}=true: {why}; set bypass_mode=false (decoupled mode) to replay the kept set")
    return ReplayDecision(False, decision.rule, f"auto: {why}; set bypass_mode=false to replay it", "verl")


def startup(config, v1: bool = False) -> ReplayDecision:
    """The decision line printed when a trainer is built (legacy ``RayPPOTrainer`` or v1 ``PPOTrainer``): bypass mode
    and the v1 trainer cannot replay (``true`` is an error there)."""
    from stablerl.selection import config_get

    algorithm = config_get(config, "algorithm")
    corr = config_get(algorithm, "rollout_correction") if algorithm is not None else None
    if corr is not None and config_get(corr, "bypass_mode"):
        decision = bypass_decision(config)
    else:
        value = config_get(algorithm, REPLAY_OPTION) if algorithm is not None else None
        rollout = config_get(config_get(config, "actor_rollout_ref"), "rollout")
        has_rollout = bool(config_get(rollout, "calculate_log_probs", False))
        decision = resolve_replay(value, rollout_rule(config), rollout_log_probs=has_rollout, key=KEY,
                                  framework="verl", rule_keys=RULE_KEYS)
        if v1 and decision.on:
            why = "the v1 trainer (trainer.use_v1=true) is not instrumented for it"
            if decision.reason.startswith(f"{KEY}=true"):
                raise StableRLError(f"{KEY}=true: {why}; set trainer.use_v1=false")
            decision = ReplayDecision(False, decision.rule, f"auto: {why}; set trainer.use_v1=false", "verl")
    log_replay_decision(decision)
    return decision


def _wrap_init(v1: bool):
    def wrap(original):
        @functools.wraps(original)
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            startup(self.config, v1=v1)

        return __init__

    return wrap


def instrument() -> None:
    """Wrap the legacy trainer's ``__init__`` (the start-up line) and the v1 trainer's (says it does not replay) when
    their modules are imported; :func:`wrap_old_log_prob` sits inside ``_advantage``'s wrap of the old-log-prob pass
    (one patch per method)."""
    from stablerl.adapters.verl._ledger import LEDGER, patch_ray_trainer_method

    def legacy(module):
        patch_ray_trainer_method("sampling_mask:__init__", module, "__init__", _wrap_init(False),
                                 "no sampling-mask replay start-up line")  # the replay: _advantage's old-pass wrap

    def v1(module):
        cls = getattr(module, "PPOTrainer", None)
        if cls is not None:
            LEDGER.set_attr("sampling_mask:v1.__init__", cls, "__init__", _wrap_init(True)(cls.__init__))

    LEDGER.on_import("sampling_mask:on_import", {"verl.trainer.ppo.ray_trainer": legacy,
                                                 "verl.trainer.ppo.v1.trainer_base": v1})


# ----------------------------------------------------------------------------- in the actor worker (engine)


def _response_lens(micro_batch) -> torch.Tensor:
    """Each row's response length, as verl's ``no_padding_2_padding`` reads it."""
    responses = micro_batch["responses"]
    if responses.is_nested:
        return responses.offsets().diff()
    return micro_batch["attention_mask"][:, micro_batch["prompts"].shape[1]:].sum(dim=1)


def engine_log_kept_mass(engine, output, output_args, micro_batch) -> Optional[torch.Tensor]:
    """``log M`` of one micro-batch as a nested (jagged) tensor laid out like verl's ``log_probs``, or None when the
    micro-batch does not ask for it (:data:`FLAG`)."""
    from verl.utils import tensordict_utils as tu

    flag = tu.get_non_tensor_data(data=micro_batch, key=FLAG, default=None)
    if flag is None:
        return None
    if tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False):
        raise StableRLError(f"{KEY}: the fused kernels never materialise the logits the kept mass is computed from; "
                            "set actor_rollout_ref.model.use_fused_kernels=False")
    if getattr(engine, "ulysses_sequence_parallel_size", 1) > 1:
        raise StableRLError(f"{KEY} is not supported with ulysses_sequence_parallel_size > 1 (the logits are "
                            "sequence-sharded)")
    logits = output.logits
    if hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()
    input_ids = micro_batch["input_ids"]
    cu = input_ids.offsets().to(logits.device)
    lens = _response_lens(micro_batch).to(cu.device)
    ends = cu[1:]
    # the packed positions that predict each row's response tokens (as no_padding_2_padding slices log_probs)
    rows = [torch.arange(end - r - 1, end - 1, device=logits.device) for end, r in zip(ends.tolist(), lens.tolist())]
    packed = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long, device=logits.device)
    labels = output_args["input_ids_rmpad_rolled"].reshape(-1)[packed]
    flat = logits.reshape(-1, logits.shape[-1])
    if "temperature_rmpad" in output_args:  # use_remove_padding: [1, nnz (+ pad), V]
        gather = packed
        temperature = output_args["temperature_rmpad"].reshape(-1)[packed]
    else:  # padded [B, S, V], each row's tokens left-aligned
        width = logits.shape[1]
        row_of = torch.repeat_interleave(torch.arange(len(rows), device=logits.device), lens.to(logits.device))
        gather = packed - cu[:-1][row_of] + row_of * width
        temperature = output_args["temperature"].reshape(-1).to(logits.device)[row_of]
    if flag.get("mask"):
        masks = tu.get(micro_batch, MASK_FIELD)
        keep = [torch.ones(int(r), dtype=torch.bool) for r in lens.tolist()]  # each row's first r positions
        mask = concat_positions(list(masks) if masks is not None else [], keep, f"{KEY} ({MASK_FIELD!r} field)")
        log_mass = log_kept_mass_rows(flat, gather, labels, mask=mask, temperature=temperature)
    else:
        rule = SamplingRule(top_k=int(flag["top_k"]), top_p=float(flag["top_p"]), min_p=float(flag.get("min_p", 0.0)))
        log_mass = log_kept_mass_rows(flat, gather, labels, rule=rule, temperature=temperature)
    values = torch.zeros(int(cu[-1]), dtype=torch.float32, device=logits.device)
    values[packed] = log_mass
    return torch.nested.nested_tensor_from_jagged(values, cu)


# ----------------------------------------------------------------------------- in the trainer (driver)


def flag_of(rule: Optional[SamplingRule]) -> dict:
    """The rule as the non-tensor dict the engine reads (``{"mask": True}``: the batch's engine masks)."""
    return {"mask": True} if rule is None else {"top_k": rule.top_k, "top_p": rule.top_p, "min_p": rule.min_p,
                                                "temperature": rule.temperature}


class _CapturingWorkerGroup:
    """The trainer's actor worker group for one ``compute_log_prob`` call: keeps the call's input and output (the
    engine's ``log M`` rides in the output, which verl's ``_compute_old_log_prob`` does not forward)."""

    def __init__(self, group):
        self._group = group
        self.calls = []

    def compute_log_prob(self, batch_td, *args, **kwargs):
        out = self._group.compute_log_prob(batch_td, *args, **kwargs)
        self.calls.append((batch_td, out))
        return out

    def __getattr__(self, name):
        return getattr(self._group, name)


def wrap_old_log_prob(original):
    """``RayPPOTrainer._compute_old_log_prob`` with the replay (see the module docstring); ``original`` untouched when
    the decision is off."""

    @functools.wraps(original)
    def _compute_old_log_prob(self, batch, *args, **kwargs):
        from stablerl.adapters.verl._ledger import verl_adapter

        decision = decide(self.config, batch)
        log_replay_decision(decision)
        if not decision.on:
            return original(self, batch, *args, **kwargs)
        rule = decision.rule
        batch.meta_info[FLAG] = flag_of(rule)
        group = self.actor_rollout_wg
        capture = _CapturingWorkerGroup(group)
        self.actor_rollout_wg = capture
        try:
            out = original(self, batch, *args, **kwargs)
        finally:
            self.actor_rollout_wg = group
            batch.meta_info.pop(FLAG, None)
        if len(capture.calls) != 1:
            raise StableRLError(f"{KEY}: expected one compute_log_prob call in the old-log-prob pass, saw "
                                f"{len(capture.calls)}")
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        batch_td, output = capture.calls[0]
        nested = tu.get(output, OUTPUT)
        if nested is None:
            raise StableRLError(f"{KEY}: the actor's old-log-prob pass returned no kept mass: the actor runs verl's "
                                "FSDP engine without the stablerl subclass (is the adapter imported in the workers, "
                                "strategy fsdp/fsdp2?)")
        log_mass = no_padding_2_padding(nested, batch_td).float()
        batch.meta_info[REPLAYED_KEY] = flag_of(rule)
        mask = batch.batch["response_mask"]
        batch.batch["rollout_log_probs"] = replay_rollout_log_prob(
            batch.batch["rollout_log_probs"], log_mass.to(mask.device), mask, verl_adapter().state.metrics)
        return out

    return _compute_old_log_prob


__all__ = ["KEY", "FLAG", "OUTPUT", "MASK_FIELD", "rollout_rule", "decide", "bypass_decision", "engine_log_kept_mass",
           "wrap_old_log_prob", "startup", "instrument"]
