"""verl <-> stablerl translation: context, hyper-parameters, and the two wrapper factories.

Nothing here computes an algorithm: tensors and config come in from verl, one call to
:func:`stablerl.compute_policy_loss` / :func:`stablerl.compute_advantage` is made, and the
result goes back in verl's format. This module imports only torch and stablerl (no verl), so
it can be unit-tested and imported in every process without side effects (``_inputs`` imports no
verl either).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from stablerl import ADVANTAGE_ESTIMATOR, POLICY_LOSS, Context, StableRLError, torch_distributed_context
from stablerl import compute_advantage as _compute_advantage
from stablerl import compute_policy_loss as _compute_policy_loss
from stablerl import get_spec
from stablerl.call_options import option_inputs
from stablerl.frameworks import (
    CALL_OPTIONS,
    as_params,
    check_framework_keys_used,
    effective_hyperparameters,
    get_framework,
    log_effective_settings,
    split_call_options,
)
from stablerl.selection import config_get as cfg_get

logger = logging.getLogger("stablerl.adapters.verl")

#: this framework's declaration (stablerl.adapters.verl._spec): inputs, config keys and their defaults
VERL = get_framework("verl")
#: verl actor-config keys that map 1:1 onto stablerl hyper-parameters of the same name (the PPO
#: clip bounds and dual clip; SAPO's temperatures), read from ``actor_rollout_ref.actor.<key>`` as
#: verl's built-ins read them; they apply under the one precedence rule (stablerl.frameworks.PRECEDENCE)
_ACTOR_PREFIX = "actor_rollout_ref.actor."
ACTOR_KEYS = tuple(n for n, k in VERL.hyperparameter_keys[POLICY_LOSS].items()
                   if k.key.startswith(_ACTOR_PREFIX) and not k.key.startswith(_ACTOR_PREFIX + "policy_loss."))

# absolute import: one gatherer (one ContextVar, one state dict) per process, even when the
# adapter package is executed a second time under another module name
from stablerl.adapters.verl import _inputs as _declared

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


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


def loss_settings(spec, config: Any):
    """The effective hyper-parameters of policy loss ``spec`` under a verl actor config, with their
    sources (:func:`stablerl.frameworks.effective_hyperparameters`, one precedence rule):

    * stablerl keys: the fields of ``actor.policy_loss`` (``StablePolicyLossConfig``) named like the
      algorithm's hyper-parameters, when not ``None``;
    * verl's keys (the actor's ``clip_ratio_low/high/c``, ``tau_pos/neg``; verl's own ``policy_loss``
      fields such as ``kl_cov_ratio``) apply when set to a value other than verl's default
      (``clip_ratio_low/high = None`` falls back to ``actor.clip_ratio`` as verl's built-ins do);
    * otherwise the paper's default, with a note where verl's default differs from it.
    """
    names = spec.params.field_names()
    framework_keys = VERL.hyperparameter_keys[POLICY_LOSS]
    stablerl_params: dict[str, Any] = {}
    framework_values: dict[str, Any] = {}
    if config is not None:
        policy_loss = cfg_get(config, "policy_loss", None)
        pinned = cfg_get(policy_loss, "stablerl_params", None) or {}  # stablerl keys, also for verl's own names
        for name in CALL_OPTIONS:  # loss_agg_mode=delta_l, rollout_correction=tis, ...: compute_policy_loss options
            if name in pinned and pinned[name] is not None:
                value = pinned[name]
                stablerl_params[name] = dict(value) if hasattr(value, "items") else value
        for name in names:
            if name in pinned and pinned[name] is not None:
                stablerl_params[name] = pinned[name]
            key = framework_keys.get(name)
            if key is not None and key.key.startswith(_ACTOR_PREFIX + "policy_loss."):
                framework_values[name] = cfg_get(policy_loss, name, None)  # verl's own policy_loss field
                continue
            if key is not None:
                value = cfg_get(config, name, None)
                if value is None and name in ("clip_ratio_low", "clip_ratio_high"):
                    value = cfg_get(config, "clip_ratio", None)
                framework_values[name] = value
            value = cfg_get(policy_loss, name, None)  # a StablePolicyLossConfig field: a stablerl key
            if value is not None:
                stablerl_params[name] = value
    return effective_hyperparameters(VERL, spec, stablerl_params, framework_values)


def loss_hyperparameters(spec, config: Any) -> dict[str, Any]:
    """The keyword hyper-parameters for ``spec`` under a verl actor config (values other than the
    paper defaults; see :func:`loss_settings`)."""
    return as_params(loss_settings(spec, config))


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
        if spec.batch_statistics and ctx.dp_size > 1 and not _declared.through_ppo_loss(name):
            # without ppo_loss's DP group its batch statistics would silently be per rank
            raise _declared.VerlInputError(
                f"stablerl loss {name!r} takes statistics over the whole batch, which stablerl reduces over the "
                f"data-parallel ranks with the group verl hands to ppo_loss; {_declared.OUTSIDE_PPO_LOSS}. Use a "
                "loss without batch statistics there (stablerl describe <name> says which have them), or one rank"
            )
        ctx.state = _declared.state_for(name)  # per-process, persists across steps (saved with the actor's checkpoint)
        # declared inputs (entropy, token ids, uids...), gathered by the ppo_loss wrapper
        extra = _declared.inputs_for(name, spec.requires, spec.optional_inputs)
        settings = loss_settings(spec, config)
        log_effective_settings(VERL, spec, settings, logger)  # once per worker process
        params, options = split_call_options(as_params(settings))
        options.setdefault("loss_agg_mode", mode)  # a registered aggregation (delta_l) replaces verl's mode
        # the inputs the call options need (a rollout correction, top_entropy_quantile), gathered by the ppo_loss wrapper
        extra.update(_declared.inputs_for(name, [n for n in option_inputs(options) if n not in extra]))
        loss, metrics = _compute_policy_loss(
            name,
            log_prob=log_prob,
            old_log_prob=old_log_prob,
            advantages=advantages,
            response_mask=response_mask,
            ctx=ctx,
            is_weights=rollout_is_weights,
            **extra,
            **options,
            **params,
        )
        return loss, {f"actor/{k}": v for k, v in metrics.items()}

    stablerl_policy_loss.__name__ = stablerl_policy_loss.__qualname__ = f"stablerl_policy_loss_{name}"
    stablerl_policy_loss.__doc__ = f"stablerl policy loss {name!r} (verl adapter)."
    stablerl_policy_loss._stablerl_verl = (POLICY_LOSS, name)  # type: ignore[attr-defined]
    return stablerl_policy_loss


# ----------------------------------------------------------------------------- estimators

def estimator_settings(spec, config: Any):
    """The effective hyper-parameters of estimator ``spec`` under verl's ``algorithm`` config: every
    ``algorithm.<name>`` (``+algorithm.quantile_k=0.6``) is a stablerl key, except verl's own
    ``algorithm.norm_adv_by_std_in_grpo``, which is verl's key (default True) and applies under the one
    precedence rule; set to False for an estimator without that hyper-parameter, it is refused."""
    framework_keys = VERL.hyperparameter_keys[ADVANTAGE_ESTIMATOR]
    stablerl_params: dict[str, Any] = {}
    framework_values = {name: cfg_get(config, name, None) for name in framework_keys} if config is not None else {}
    if config is not None:
        for key in spec.params.field_names():
            value = cfg_get(config, key, None)
            if value is not None and key not in framework_keys:
                stablerl_params[key] = value
    check_framework_keys_used(VERL, spec, framework_values)
    return effective_hyperparameters(VERL, spec, stablerl_params, framework_values)


def estimator_hyperparameters(spec, config: Any) -> dict[str, Any]:
    """The keyword hyper-parameters for ``spec`` under verl's ``algorithm`` config (see
    :func:`estimator_settings`)."""
    settings = estimator_settings(spec, config)
    log_effective_settings(VERL, spec, settings, logger)
    return as_params(settings)


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
