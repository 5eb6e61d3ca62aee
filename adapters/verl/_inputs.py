"""Declared inputs for stablerl losses under verl: gathered once, at verl's loss call site.

verl 0.9.1 calls a registered policy loss with ``old_log_prob, log_prob, advantages,
response_mask, loss_agg_mode, config, rollout_is_weights`` only. The extra inputs a stablerl loss
declares (``AlgorithmSpec.requires``: entropies, token ids, rollout log-probs, uids, scores) are
in the arguments of the function that makes that call,
``verl.workers.utils.losses.ppo_loss(config, model_output, data, dp_group=None)``. This module
wraps that function: for the stablerl loss selected by ``config.policy_loss.loss_mode`` it gathers
exactly the declared inputs from verl's own ``model_output`` / ``data``, converts them to the
padded ``[B, T]`` layout ``ppo_loss`` gives ``old_log_prob``, and makes them visible to the
registered loss through core's scoped channel (:func:`stablerl.frameworks.loss_inputs`, a context
variable) around the call to the *original* ``ppo_loss`` (so verl's entropy bonus, KL loss and metrics
run unchanged). It is reset when the call returns or raises: nothing leaks from one call to the next,
and nested calls (distillation's ``ppo_loss`` inside its own loss) each see their own inputs.

Where each input comes from (verl 0.9.1):

* ``entropy``: ``model_output["entropy"]`` (current policy, same forward pass as the log-probs),
  present when ``actor_rollout_ref.actor.calculate_entropy=True`` (or ``entropy_coeff != 0``);
  converted with verl's ``no_padding_2_padding`` exactly as ``ppo_loss`` converts it.
* ``token_ids``: ``data["responses"]``.
* ``rollout_log_prob``: ``data["rollout_log_probs"]`` (``rollout.calculate_log_probs=True``, the default).
* ``index``: the ``uid`` non-tensor field (group ids).
* ``scores``: per-response sum over the response of ``token_level_scores`` (legacy trainer),
  else ``rm_scores`` (v1 trainer), else ``token_level_rewards``.
* ``old_entropy``: ``data["entropy"]`` (the v1 trainer writes the old-log-prob pass's entropy
  under that key) or ``data["entropys"]``; the legacy trainer drops them before the update.

Not provided by verl 0.9.1 (a loss declaring them is not registered): ``turn_ids``, ``versions``,
``policy_version``, ``router_log_prob``, ``old_router_log_prob``, ``pos_count``, ``neg_count`` and
the per-response extras of reward shapers; the training step is not passed either (``ctx.step`` is
None).

Callers bind the name at import time (``from verl.workers.utils.losses import ppo_loss`` in
``verl.workers.engine_workers`` and ``verl.trainer.distillation.losses``), so :func:`instrument`
replaces the attribute of the losses module *before* they import it: if the module is not loaded
yet, a post-import hook (a ``sys.meta_path`` finder that imports nothing itself) patches it right
after it executes; if it is loaded already, it is patched at once, together with the callers'
bound names. :func:`instrument` is idempotent (also across re-imports of the adapter); the adapter's
``uninstrument()`` restores verl's function (the wrap is recorded in its patch ledger).

Controller state (``Context.state``) lives in :data:`STATE` (a :class:`stablerl.state.StateStore`), one
slot per loss name and per process; it persists across steps in a worker and is saved with the actor's checkpoint by stablerl's
FSDP engine subclass (:mod:`stablerl.adapters.verl._state`; actor.strategy fsdp/fsdp2 only).

This module imports no verl at import time (verl's helpers are imported inside the wrapper, when
verl already loaded them).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import numpy as np
import torch

from stablerl import POLICY_LOSS, MissingInputError, get_spec
from stablerl.adapters.verl._ledger import LEDGER
from stablerl.contracts import OPTIONAL_INPUTS
from stablerl.frameworks import TOP_ENTROPY_INPUT, get_framework, loss_inputs, pending_loss_inputs, top_entropy_on
from stablerl.state import StateStore

logger = logging.getLogger("stablerl.adapters.verl")

LOSSES_MODULE = "verl.workers.utils.losses"
#: modules that do ``from verl.workers.utils.losses import ppo_loss`` (bound at import time)
CALLER_MODULES = ("verl.workers.engine_workers", "verl.trainer.distillation.losses")

#: declared input -> where the wrapper takes it from (the single place this is written down; the
#: set of keys must equal ``get_framework("verl").feedable[POLICY_LOSS]``, declared in stablerl.adapters.frameworks)
SOURCES: dict[str, str] = {
    "entropy": 'model_output["entropy"] (needs actor_rollout_ref.actor.calculate_entropy=True)',
    "token_ids": 'data["responses"]',
    "rollout_log_prob": 'data["rollout_log_probs"] (actor_rollout_ref.rollout.calculate_log_probs=True)',
    "index": 'the "uid" non-tensor field',
    "scores": 'response sum of data["token_level_scores"], else data["rm_scores"], else data["token_level_rewards"]',
    "old_entropy": 'data["entropy"] (written by the v1 trainer\'s old-log-prob pass) or data["entropys"]',
}

#: declared inputs verl 0.9.1 cannot provide to a policy loss, and why (the framework declaration's words)
NOT_PROVIDED: dict[str, str] = dict(get_framework("verl").why_not["*"])

_SCORE_FIELDS = ("token_level_scores", "rm_scores", "token_level_rewards")
_OLD_ENTROPY_FIELDS = ("entropy", "entropys")

#: per-process controller state, one slot per stablerl loss name (``Context.state``)
STATE = StateStore(holds="loss")

_DP_GROUP = "__dp_group__"  # beside the inputs: the group verl handed ppo_loss (for the loss's Context)
_MARK = "_stablerl_verl_wrapper"


def state_for(name: str) -> dict:
    """The persistent ``Context.state`` of loss ``name`` in this process."""
    return STATE.slot(POLICY_LOSS, name)


def current() -> Optional[dict[str, Any]]:
    """The inputs gathered by the innermost active ``ppo_loss`` wrapper call (None outside one)."""
    return pending_loss_inputs()


# ----------------------------------------------------------------------------- gathering


class VerlInputError(MissingInputError):
    """A declared input of the selected stablerl loss is not in verl's batch."""


def _stablerl_name(loss_mode: str) -> Optional[str]:
    """The stablerl loss registered in verl under ``loss_mode`` (None for verl's own losses)."""
    from verl.trainer.ppo import core_algos

    fn = core_algos.POLICY_LOSS_REGISTRY.get(loss_mode)
    mark = getattr(fn, "_stablerl_verl", None)
    if mark is None or mark[0] != POLICY_LOSS:
        return None
    return mark[1]


def _missing(name: str, loss_mode: str, what: str, fix: str) -> VerlInputError:
    return VerlInputError(
        f"stablerl loss {name!r} (loss_mode={loss_mode}) needs {what} ({OPTIONAL_INPUTS.get(what, '')}), "
        f"but verl's batch has none: {fix}"
    )


def _padded(data, keys: list[str]) -> dict[str, torch.Tensor]:
    """``data[keys]`` in the padded ``[B, T]`` layout, converted exactly as ``ppo_loss`` converts
    ``old_log_probs`` (``select(...).to_padded_tensor()``; jagged -> zero-padded, dense unchanged)."""
    wanted = sorted(set(keys) | {"response_mask"})
    sel = data.select(*wanted).to_padded_tensor()
    return {k: sel[k] for k in wanted}


def _group_index(data) -> Any:
    from verl.utils import tensordict_utils as tu

    uid = tu.get(data, "uid", None)
    if uid is None:
        return None
    if isinstance(uid, torch.Tensor):
        return uid
    return np.asarray(list(uid), dtype=object)


def gather(name: str, loss_mode: str, model_output: Any, data: Any, also: tuple = ()) -> dict[str, Any]:
    """Exactly the declared inputs of stablerl loss ``name`` from ``ppo_loss``'s arguments: every required one
    (an error names what to set when verl's batch lacks it), and each optional one the batch has. ``also``:
    inputs required beyond the loss's declaration (``rollout_log_prob`` for a stablerl rollout correction)."""
    spec = get_spec(POLICY_LOSS, name)
    out: dict[str, Any] = {}
    need = list(dict.fromkeys((*spec.requires, *also)))
    unknown = [r for r in need if r not in SOURCES]
    if unknown:
        raise VerlInputError(
            f"stablerl loss {name!r} (loss_mode={loss_mode}) needs "
            + ", ".join(f"{r!r} ({NOT_PROVIDED.get(r, OPTIONAL_INPUTS.get(r, ''))})" for r in unknown)
            + ", which verl 0.9.1 cannot provide to a policy loss"
        )
    wanted = set(need) | {r for r in spec.optional_inputs if r in SOURCES}

    def available(input_name: str, present: bool, how: str) -> bool:
        # a required input verl's batch lacks is an error saying what to set; an optional one is left out
        if not present and input_name in need:
            raise _missing(name, loss_mode, input_name, how)
        return present

    keys = set(data.keys())
    if "entropy" in wanted:
        entropy = model_output.get("entropy", None) if hasattr(model_output, "get") else None
        if available("entropy", entropy is not None,
                     "set actor_rollout_ref.actor.calculate_entropy=True (verl computes the entropy in the update "
                     "forward pass only then, or with entropy_coeff != 0)"):
            from verl.workers.utils.padding import no_padding_2_padding

            out["entropy"] = no_padding_2_padding(entropy, data)
    dense = []
    if "token_ids" in wanted and available("token_ids", "responses" in keys, 'the batch has no "responses" field'):
        dense.append(("token_ids", "responses"))
    if "rollout_log_prob" in wanted and available(
            "rollout_log_prob", "rollout_log_probs" in keys,
            'the batch has no "rollout_log_probs"; set actor_rollout_ref.rollout.calculate_log_probs=True'):
        dense.append(("rollout_log_prob", "rollout_log_probs"))
    if "old_entropy" in wanted:
        field = next((f for f in _OLD_ENTROPY_FIELDS if f in keys), None)
        if available("old_entropy", field is not None,
                     'the batch has no old-pass entropy ("entropy"/"entropys"); verl\'s v1 trainer (trainer.use_v1=true) '
                     "stores it from the old-log-prob pass, the legacy trainer drops it, and bypass mode skips that pass"):
            dense.append(("old_entropy", field))
    if "scores" in wanted:
        field = next((f for f in _SCORE_FIELDS if f in keys), None)
        if available("scores", field is not None, "the batch has none of " + ", ".join(_SCORE_FIELDS)):
            dense.append(("scores", field))
    if dense:
        padded = _padded(data, [field for _, field in dense])
        for input_name, field in dense:
            value = padded[field]
            if input_name == "scores":  # per-response outcome: sum of the token-level scores
                mask = padded["response_mask"].to(value.dtype)
                value = (value * mask).sum(-1) if value.dim() == 2 else value.reshape(-1)
            out[input_name] = value
    if "index" in wanted:
        index = _group_index(data)
        if available("index", index is not None, 'the batch has no "uid" field'):
            out["index"] = index
    return out


# ----------------------------------------------------------------------------- the wrapper


def _wrap(original):
    @functools.wraps(original)
    def ppo_loss(config, model_output, data, dp_group=None):
        policy_loss = getattr(config, "policy_loss", None)
        loss_mode = policy_loss.get("loss_mode", "vanilla") if policy_loss is not None else "vanilla"
        name = _stablerl_name(loss_mode)
        if name is None:  # a verl loss (or not a policy-loss config): nothing to gather
            return original(config, model_output, data, dp_group)
        pinned = (policy_loss.get("stablerl_params", None) if policy_loss is not None else None) or {}
        also = ("rollout_log_prob",) if pinned.get("rollout_correction") else ()  # stablerl's correction needs them
        if top_entropy_on(pinned):  # top_entropy_quantile < 1: the current entropy, for any stablerl loss
            also += (TOP_ENTROPY_INPUT,)
        with loss_inputs(name, {_DP_GROUP: dp_group, **gather(name, loss_mode, model_output, data, also)}):
            return original(config, model_output, data, dp_group)

    setattr(ppo_loss, _MARK, True)
    ppo_loss.__wrapped__ = original
    return ppo_loss


def _no_ppo_loss(module) -> None:
    logger.warning("stablerl: %s has no ppo_loss; declared loss inputs are not gathered", module.__name__)


#: the ledger key of the wrap (``uninstrument()`` restores it with every other patch)
PATCH_KEY = "ppo_loss"


def instrument() -> str:
    """Wrap verl's ``ppo_loss`` (now, or right after its module is imported), and the callers' bound names.
    Idempotent. Returns ``"patched"`` (the module was loaded and is now wrapped), ``"deferred"`` (a
    post-import hook will wrap it when it is first imported) or ``"failed"`` (verl has no ``ppo_loss``)."""
    return LEDGER.wrap_function(PATCH_KEY, LOSSES_MODULE, "ppo_loss", _wrap, CALLER_MODULES, missing=_no_ppo_loss)


def is_patched() -> bool:
    """True when verl's ``ppo_loss`` is wrapped, or will be on import."""
    return LEDGER.function_status(PATCH_KEY, LOSSES_MODULE, "ppo_loss") in ("patched", "deferred")


def dp_group_for(name: str):
    """The data-parallel group verl handed to the active ``ppo_loss`` call of loss ``name`` (None outside
    one, or when verl passed none)."""
    got = pending_loss_inputs(name)
    return got.get(_DP_GROUP) if got is not None else None


# verl's distillation policy-gradient path (verl.trainer.distillation.losses.distillation_loss with
# distillation_loss.use_policy_gradient=True) calls the policy loss directly, not through ppo_loss
OUTSIDE_PPO_LOSS = ("this call did not come through verl.workers.utils.losses.ppo_loss (verl's distillation "
                    "policy-gradient path, distillation_loss.use_policy_gradient=True, calls the loss directly; "
                    "or the patch is off: stablerl.adapters.verl.instrument())")


def through_ppo_loss(name: str) -> bool:
    """True inside a call of loss ``name`` that came through the wrapped ``ppo_loss``."""
    return pending_loss_inputs(name) is not None


def inputs_for(name: str, requires, optional=()) -> dict[str, Any]:
    """The declared inputs for a call of stablerl loss ``name`` (from the active wrapper call): the required
    ones and those optional ones the wrapper found in verl's batch.

    Raises a clear error when the loss requires inputs and no wrapper call is active for it (the
    loss was called from somewhere other than ``verl.workers.utils.losses.ppo_loss``)."""
    got = pending_loss_inputs(name)
    if got is None:
        if not requires:
            return {}
        raise VerlInputError(
            f"stablerl loss {name!r} needs {', '.join(requires)}, which stablerl gathers at verl's "
            f"verl.workers.utils.losses.ppo_loss; {OUTSIDE_PPO_LOSS}. Choose a loss that needs no extra input there"
        )
    return {k: got[k] for k in (*requires, *optional) if k in got}


def describe() -> dict[str, dict[str, str]]:
    """``{"provided": {input: source}, "not_provided": {input: reason}}`` for docs and reports."""
    return {"provided": dict(SOURCES), "not_provided": dict(NOT_PROVIDED)}


__all__ = [
    "SOURCES", "NOT_PROVIDED", "STATE", "state_for", "current", "gather", "instrument", "is_patched",
    "inputs_for", "describe", "VerlInputError",
]
