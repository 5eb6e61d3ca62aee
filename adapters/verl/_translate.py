"""verl <-> stablerl translation: context, hyper-parameters, and the two wrapper factories.

Nothing here computes an algorithm: tensors and config come in from verl, one call to
:func:`stablerl.compute_policy_loss` / :func:`stablerl.compute_advantage` is made, and the
result goes back in verl's format. This module imports only torch and stablerl (no verl), so
it can be unit-tested and imported in every process without side effects (``_inputs`` imports no
verl either).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Optional

import torch

from stablerl import ADVANTAGE_ESTIMATOR, POLICY_LOSS, Context, StableRLError, torch_distributed_context
from stablerl import compute_advantage as _compute_advantage
from stablerl import compute_policy_loss as _compute_policy_loss
from stablerl import get_spec

logger = logging.getLogger("stablerl.adapters.verl")

#: verl actor-config keys that map 1:1 onto stablerl hyper-parameters of the same name (the PPO
#: clip bounds and dual clip; SAPO's temperatures). They are read from the actor config
#: (``actor_rollout_ref.actor.<key>``), never from ``policy_loss``, exactly as verl's built-ins do.
from stablerl.adapters.config_keys import FEEDABLE_INPUTS
from stablerl.adapters.config_keys import VERL_ACTOR_KEYS as ACTOR_KEYS

# absolute import: one gatherer (one ContextVar, one state dict) per process, even when the
# adapter package is executed a second time under another module name
from stablerl.adapters.verl import _inputs as _declared

#: extra inputs (``AlgorithmSpec.requires``) verl hands to each kind of function (single source:
#: ``stablerl.adapters.config_keys``, which the docs are generated from)
VERL_PROVIDES = FEEDABLE_INPUTS["verl"]

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def cfg_get(obj: Any, key: str, default: Any = None) -> Any:
    """``obj.key`` for a verl BaseConfig/dataclass, OmegaConf DictConfig or plain mapping."""
    if obj is None:
        return default
    getter = getattr(obj, "get", None)
    if callable(getter):
        try:
            return getter(key, default)
        except Exception:  # noqa: BLE001 - e.g. a struct DictConfig without the key
            pass
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


# ----------------------------------------------------------------------------- policy losses


def verl_context(config: Any, response_mask: torch.Tensor, loss_agg_mode: str, dp_group: Any = None) -> tuple[Context, str]:
    """The stablerl :class:`Context` (and aggregation mode) equal to verl's ``agg_loss`` semantics.

    verl fills ``config.global_batch_info`` before each call (``dp_size``, ``batch_num_tokens``:
    the DP all-reduced mask sum of the mini-batch, ``global_batch_size``: sequences in the
    mini-batch, ``loss_scale_factor``: ``actor.loss_scale_factor``); they become the Context's
    ``dp_size``, ``token_count``, ``seq_count`` and ``loss_scale_factor``. Missing values fall back
    as in verl: stablerl's ``aggregate`` already uses the local mask sum / the local number of
    non-empty rows (and raises when ``dp_size > 1``); two verl conventions are translated here:

    * ``seq-mean-token-sum-norm`` without ``loss_scale_factor``: the padded length
      ``response_mask.shape[-1]`` (verl's default; not constant, so a warning is logged once);
    * ``token-sum`` (a verl-only mode): ``token-mean`` with a normaliser of 1, i.e. ``sum * dp_size``.
    """
    info = cfg_get(config, "global_batch_info", None) or {}
    dp_size = info.get("dp_size") or 1
    dp_size = int(dp_size.item()) if isinstance(dp_size, torch.Tensor) else int(dp_size)
    token_count = info.get("batch_num_tokens")
    seq_count = info.get("global_batch_size")
    scale = info.get("loss_scale_factor")
    if scale is None:
        scale = cfg_get(config, "loss_scale_factor", None)
    mode = loss_agg_mode
    if mode == "token-sum":
        mode, token_count = "token-mean", 1
    elif mode == "seq-mean-token-sum-norm" and scale is None:
        scale = response_mask.shape[-1]
        _warn_once(
            "scale",
            "stablerl/verl: loss_agg_mode=seq-mean-token-sum-norm without actor.loss_scale_factor uses the "
            "padded response length (verl's default), which changes from batch to batch; set "
            "actor_rollout_ref.actor.loss_scale_factor=<max_response_length> for Dr. GRPO",
        )
    fields = dict(token_count=token_count, seq_count=seq_count, dp_size=dp_size, loss_scale_factor=scale)
    if dp_group is not None and dp_size > 1:
        # verl passes ppo_loss its DP group and runs the same number of micro-batches on every rank
        # (same_micro_num_in_dp), so a loss's batch statistics can be reduced over the ranks' micro-batches
        ctx = torch_distributed_context(dp_group, **fields)
    else:
        ctx = Context(**fields)
    return ctx, mode


def loss_hyperparameters(spec, config: Any) -> dict[str, Any]:
    """stablerl hyper-parameters for ``spec`` from a verl actor config.

    * the :data:`ACTOR_KEYS` from the actor config, if the algorithm has them
      (``clip_ratio_low``/``clip_ratio_high`` = ``None`` falls back to ``actor.clip_ratio`` as
      verl's built-ins do);
    * every field of ``actor.policy_loss`` whose name is one of the algorithm's hyper-parameters
      and whose value is not ``None`` (``None`` keeps the algorithm's default).
    """
    names = set(spec.params.field_names())
    out: dict[str, Any] = {}
    if config is None:
        return out
    actor = {key: cfg_get(config, key, None) for key in ACTOR_KEYS}
    for key in ("clip_ratio_low", "clip_ratio_high"):
        if actor[key] is None:
            actor[key] = cfg_get(config, "clip_ratio", None)
    for key, value in actor.items():
        if key in names and value is not None:
            out[key] = value
    policy_loss = cfg_get(config, "policy_loss", None)
    if policy_loss is not None:
        for key in names - set(ACTOR_KEYS):
            value = cfg_get(policy_loss, key, None)
            if value is not None:
                out[key] = value
    return out


def make_policy_loss_fn(name: str):
    """A verl policy-loss function that computes the stablerl loss ``name``.

    verl 0.9.1 calls it by keyword from ``verl.workers.utils.losses.ppo_loss``. The inputs the
    loss declares beyond verl's arguments come from the ``ppo_loss`` wrapper
    (:mod:`stablerl.adapters.verl._inputs`); ``ctx.state`` is this process's state of ``name``.
    """

    def stablerl_policy_loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Optional[torch.Tensor] = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        spec = get_spec(POLICY_LOSS, name)
        ctx, mode = verl_context(config, response_mask, loss_agg_mode, _declared.dp_group_for(name))
        ctx.state = _declared.state_for(name)  # per-process, persists across steps (saved with the actor's checkpoint)
        # declared inputs (entropy, token ids, uids...), gathered by the ppo_loss wrapper
        extra = _declared.inputs_for(name, spec.requires, spec.optional_inputs)
        loss, metrics = _compute_policy_loss(
            name,
            log_prob=log_prob,
            old_log_prob=old_log_prob,
            advantages=advantages,
            response_mask=response_mask,
            loss_agg_mode=mode,
            ctx=ctx,
            is_weights=rollout_is_weights,
            **extra,
            **loss_hyperparameters(spec, config),
        )
        return loss, {f"actor/{k}": v for k, v in metrics.items()}

    stablerl_policy_loss.__name__ = stablerl_policy_loss.__qualname__ = f"stablerl_policy_loss_{name}"
    stablerl_policy_loss.__doc__ = f"stablerl policy loss {name!r} (verl adapter)."
    stablerl_policy_loss._stablerl_verl = (POLICY_LOSS, name)  # type: ignore[attr-defined]
    return stablerl_policy_loss


# ----------------------------------------------------------------------------- estimators

def estimator_hyperparameters(spec, config: Any) -> dict[str, Any]:
    """For each hyper-parameter of ``spec``: ``algorithm.<name>`` if set and not ``None``
    (``+algorithm.quantile_k=0.6``; verl's own ``algorithm.norm_adv_by_std_in_grpo`` reaches every
    estimator with a hyper-parameter of that name)."""
    out: dict[str, Any] = {}
    if config is None:
        return out
    for key in spec.params.field_names():
        value = cfg_get(config, key, None)
        if value is not None:
            out[key] = value
    return out


def make_adv_estimator_fn(name: str):
    """A verl advantage-estimator function that computes the stablerl estimator ``name``.

    verl 0.9.1 calls it by keyword from ``verl.trainer.ppo.ray_trainer.compute_advantage``
    (in the TaskRunner) with ``index`` = the ``uid`` numpy object array and ``config`` = the
    ``algorithm`` DictConfig.
    """

    def stablerl_adv_estimator(
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        index: Any = None,
        config: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        spec = get_spec(ADVANTAGE_ESTIMATOR, name)
        if index is None:
            raise StableRLError(
                f"verl passed no index (uid) to the stablerl estimator {name!r}; the batch needs a 'uid' field"
            )
        return _compute_advantage(
            name,
            token_level_rewards=token_level_rewards,
            response_mask=response_mask,
            index=index,
            **estimator_hyperparameters(spec, config),
        )

    stablerl_adv_estimator.__name__ = stablerl_adv_estimator.__qualname__ = f"stablerl_adv_estimator_{name}"
    stablerl_adv_estimator.__doc__ = f"stablerl advantage estimator {name!r} (verl adapter)."
    stablerl_adv_estimator._stablerl_verl = (ADVANTAGE_ESTIMATOR, name)  # type: ignore[attr-defined]
    return stablerl_adv_estimator
