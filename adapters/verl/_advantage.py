"""stablerl at verl's advantage call site: declared estimator inputs, reward shapers, batch filters.

verl 0.9.1 calls a registered advantage estimator with ``token_level_rewards, response_mask,
index (uid), config`` only. Every other field the estimator, a reward shaper or a batch filter
needs is in the ``DataProto`` handed to the function that makes that call,
``verl.trainer.ppo.ray_trainer.compute_advantage(data, adv_estimator, gamma, lam, num_repeat,
norm_adv_by_std_in_grpo, config)``. This module wraps that function once, for every algorithm
(no per-algorithm code): when ``adv_estimator`` is a stablerl estimator, or ``config`` (verl's
``algorithm`` config) names a stablerl reward shaper / batch filter, the wrapper

1. shapes the per-response rewards with ``algorithm.stablerl_reward_shaper`` (the response sum of
   ``token_level_rewards``; the change is added on the last valid token, verl's convention for
   outcome rewards, so per-token terms such as an in-reward KL penalty are kept);
2. computes the advantages: a stablerl estimator gets its declared inputs (``AlgorithmSpec.requires``)
   and the optional extras in :data:`ESTIMATOR_EXTRAS` that are present, from ``data.batch`` /
   ``data.non_tensor_batch`` (see :data:`SOURCES`); a verl estimator runs verl's own code;
3. applies ``algorithm.stablerl_batch_filter``: verl's batch size is fixed there, so dropped rows
   and tokens get advantage 0 and ``response_mask`` 0; a filter that repeats or reorders rows (a
   resampler) is refused.

Any other call (a verl estimator and no shaper/filter) goes to verl's function untouched.

Callers: ``ray_trainer`` calls ``compute_advantage`` through its module global (legacy trainer);
``verl.trainer.ppo.v1.utils`` (v1 trainer, ``compute_advantage_for_multi_trajectories``) and
``verl.experimental.separation.ray_trainer`` bind it by ``from ... import``: :func:`instrument` wraps the
attribute right after ``ray_trainer`` executes (post-import hook) or at once if it is loaded, and
rebinds the callers' names; idempotent, the adapter's ``uninstrument()`` restores verl's function.

What reaches the call site differs by trainer (verl 0.9.1):

* legacy ``RayPPOTrainer``: the whole rollout batch (``responses``, ``old_log_probs``,
  ``rollout_log_probs``, ``token_level_scores``, the reward function's ``reward_extra_info`` as
  non-tensor fields...), except the old-pass entropies, which it pops (``entropys``) before. When the
  selected shaper, filter or estimator declares ``entropy``, the adapter's wrap of
  ``RayPPOTrainer._compute_old_log_prob`` keeps them under :data:`KEPT_ENTROPY` (the trainer pops only
  ``entropys``); this wrapper reads them and removes the field again, so the update gets verl's own batch.
  The same wrap records the trainer's ``total_training_steps`` (``Context.total_steps``, for schedules);
* v1 trainer (``trainer.use_v1=true``): ``_compute_advantage`` fetches only ``uid, response_mask,
  rm_scores, rollout_log_probs, old_log_probs, ref_log_prob, values`` from the transfer queue, and
  writes back only ``advantages``/``returns`` (``response_mask`` only with rollout correction).

This module imports no verl at import time.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

import numpy as np
import torch

import stablerl
from stablerl import ADVANTAGE_ESTIMATOR, BATCH_FILTER, REWARD_SHAPER, Context, MissingInputError, StableRLError
from stablerl.adapters.verl._ledger import LEDGER, patch_ray_trainer_method
from stablerl.contracts import OPTIONAL_INPUTS
from stablerl.frameworks import apply_filter_result, check_shaper_and_components
from stablerl.ops import last_valid_index
from stablerl.state import StateStore
from stablerl.params import UnknownNameError, build_params, unknown_name_message

logger = logging.getLogger("stablerl.adapters.verl")

TRAINER_MODULE = "verl.trainer.ppo.ray_trainer"
#: modules that bind ``compute_advantage`` with ``from verl.trainer.ppo.ray_trainer import compute_advantage``
CALLER_MODULES = ("verl.trainer.ppo.v1.utils", "verl.experimental.separation.ray_trainer")

#: ``algorithm.<key>`` config keys read by the wrapper
SHAPER_KEY, SHAPER_PARAMS_KEY = "stablerl_reward_shaper", "stablerl_reward_shaper_params"
FILTER_KEY, FILTER_PARAMS_KEY = "stablerl_batch_filter", "stablerl_batch_filter_params"
SEED_KEY = "stablerl_seed"
CONTROLLER_KEY = "stablerl_entropy_controller"
#: ``+algorithm.stablerl_batch_field_estimators=true``: register the estimators whose inputs only a customised
#: pipeline puts in the batch (``gigpo``) on the first call (see ``register_batch_field_estimators``)
BATCH_FIELDS_KEY = "stablerl_batch_field_estimators"


def _no_registrar() -> None:
    pass


#: the adapter package's ``register_batch_field_estimators``, set by the first adapter module that
#: instruments (the package imports this module; this module never imports its package)
BATCH_FIELD_REGISTRAR: Callable[[], Any] = _no_registrar

_V1_FIELDS = "uid, response_mask, rm_scores, rollout_log_probs, old_log_probs, ref_log_prob, values"

#: declared input -> (batch fields tried in order, where verl has it). Any other declared input is
#: looked up under its own name in ``data.batch`` / ``data.non_tensor_batch``.
SOURCES: dict[str, tuple[tuple[str, ...], str]] = {
    "index": (("uid",), 'the "uid" non-tensor field (both trainers)'),
    "scores": (
        ("token_level_scores", "rm_scores", "token_level_rewards"),
        "response sum of token_level_scores (both trainers; v1 copies rm_scores there)",
    ),
    "lengths": (("response_mask",), "response_mask.sum(-1) (both trainers)"),
    "old_log_prob": (("old_log_probs",), "old_log_probs (both trainers; not in bypass mode)"),
    "rollout_log_prob": (
        ("rollout_log_probs",),
        "rollout_log_probs (both trainers, with actor_rollout_ref.rollout.calculate_log_probs=True)",
    ),
    "token_ids": (("responses",), "responses (legacy trainer only: v1 fetches " + _V1_FIELDS + ")"),
    "sum_pi_squared": (
        ("sum_pi_squared",),
        "sum_pi_squared (legacy trainer, with actor_rollout_ref.actor.calculate_sum_pi_squared=True; v1 fetches only "
        + _V1_FIELDS + ")",
    ),
    "entropy": (
        ("stablerl_old_entropys", "entropys", "entropy"),
        "the legacy trainer's old-log-prob pass (its 'entropys', which the adapter keeps as 'stablerl_old_entropys' "
        "when a selected algorithm declares entropy), else a per-token 'entropys' / 'entropy' batch field: set "
        "trainer.use_v1=false and leave bypass mode off (algorithm.rollout_correction.bypass_mode=false; it runs no "
        "old-log-prob pass); v1's _compute_advantage fetches only " + _V1_FIELDS,
    ),
    "turn_ids": (
        ("turn_ids",),
        "a per-token 'turn_ids' batch field ([B, T] ints), written by your agent loop; no stock verl component "
        "writes it (only the per-sample __num_turns__), and v1 does not fetch it",
    ),
    "anchor_ids": (
        ("anchor_ids",),
        "a per-row 'anchor_ids' batch or non-tensor field ([B] ints, one row per agent step), written by your agent "
        "loop (verl-agent-style step rows); no stock verl component writes it",
    ),
    "step_returns": (
        ("step_returns",),
        "a per-row 'step_returns' batch or non-tensor field ([B] floats: the discounted return from the step), "
        "written by your agent loop; no stock verl component writes it",
    ),
}

#: the batch field under which the legacy trainer's old-log-prob-pass entropy is kept for compute_advantage
KEPT_ENTROPY = "stablerl_old_entropys"
#: the legacy trainer's total_training_steps, recorded at its old-log-prob pass (Context.total_steps)
TOTAL_STEPS: dict[str, Optional[int]] = {"value": None}

#: declared inputs of estimators that only a customised pipeline puts in verl's batch (see SOURCES); entropy is
#: not one: the adapter keeps the legacy trainer's old-log-prob pass entropy for an estimator that declares it
BATCH_FIELD_INPUTS = frozenset({"turn_ids", "anchor_ids", "step_returns"})

#: optional per-response extras an estimator reads when present (not declared: the estimator works
#: without them or raises its own message): taken from the batch / non-tensor batch by this name
ESTIMATOR_EXTRAS = ("pos_count", "neg_count", "bundle_index", "reward_components")

_OTHER_WHERE = (
    "a batch or non-tensor field of that name: the legacy trainer adds the reward function's reward_extra_info "
    "as non-tensor fields (return {'score': ..., '<name>': ...} from compute_score); v1's _compute_advantage "
    "fetches only " + _V1_FIELDS
)

#: per-process state: generators per seed, the call counter (ctx.step), filter/shaper state dicts
STATE = StateStore(holds="driver")
#: metrics of the last wrapped call (``stablerl/<name>``); verl's ``Tracking.log`` adds them to the step's
#: metrics (``_patch_tracking``) and empties the dict; a new ``Tracking`` (a new run) empties it too
LAST_METRICS: dict[str, float] = {}
_MARK = "_stablerl_verl_adv_wrapper"


def reset_state() -> None:
    """Forget generators, step counter, state and unlogged metrics (a fresh process)."""
    STATE.clear()
    LAST_METRICS.clear()


class VerlAdvantageInputError(MissingInputError):
    """A declared input of a stablerl estimator / shaper / filter is not in verl's batch."""


# ----------------------------------------------------------------------------- config


def _cfg(config: Any, key: str, default: Any = None) -> Any:
    from ._translate import cfg_get

    return cfg_get(config, key, default)


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _name_or_none(value: Any) -> Optional[str]:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    return str(value)


def _params(config: Any, key: str) -> dict[str, Any]:
    value = _cfg(config, key, None)
    if value is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(value, DictConfig):
            value = OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - verl always has omegaconf
        pass
    if not isinstance(value, dict):
        raise StableRLError(f"algorithm.{key} must be a mapping (e.g. +algorithm.{key}.scale=0.1), got {value!r}")
    return dict(value)


def _spec_for(kind: str, config_key: str, name: str):
    names = stablerl.get_registry().names(kind)
    if name not in names:
        raise UnknownNameError(unknown_name_message(f"algorithm.{config_key}", name, names))
    return stablerl.get_spec(kind, name)  # raises for 'unavailable' entries, with the reason


def selection(config: Any) -> dict[str, Any]:
    """The stablerl extensions named in verl's ``algorithm`` config, validated (names, hyper-parameters)."""
    controller = _name_or_none(_cfg(config, CONTROLLER_KEY, None))
    if controller is not None:
        raise StableRLError(
            f"algorithm.{CONTROLLER_KEY}={controller!r}: an entropy controller runs in the actor workers, which do "
            "not see the algorithm config: select it on the stablerl policy-loss config "
            "(actor_rollout_ref.actor.policy_loss._target_=stablerl.adapters.verl.StablePolicyLossConfig "
            f"+actor_rollout_ref.actor.policy_loss.stablerl_entropy_controller={controller}); verl runs only "
            "controllers that act through its entropy bonus (adaptive_entropy)"
        )
    out: dict[str, Any] = {"shaper": None, "filter": None}
    for slot, kind, key, pkey in (
        ("shaper", REWARD_SHAPER, SHAPER_KEY, SHAPER_PARAMS_KEY),
        ("filter", BATCH_FILTER, FILTER_KEY, FILTER_PARAMS_KEY),
    ):
        name = _name_or_none(_cfg(config, key, None))
        params = _params(config, pkey)
        if name is None:
            if params:
                raise StableRLError(f"algorithm.{pkey} is set but algorithm.{key} is not")
            continue
        spec = _spec_for(kind, key, name)
        build_params(spec, params)  # unknown / out-of-range hyper-parameter -> error naming it
        out[slot] = (name, params)
    return out


def _stablerl_estimator(adv_estimator: Any) -> Optional[str]:
    from verl.trainer.ppo import core_algos

    key = getattr(adv_estimator, "value", adv_estimator)
    fn = core_algos.ADV_ESTIMATOR_REGISTRY.get(key) if isinstance(key, str) else None
    mark = getattr(fn, "_stablerl_verl", None)
    if mark is None or mark[0] != ADVANTAGE_ESTIMATOR:
        return None
    return mark[1]


def _refuse_unregistered(adv_estimator: Any) -> None:
    """A stablerl estimator name that is not in verl's registry: say why instead of verl's 'Unknown'."""
    from verl.trainer.ppo import core_algos

    from stablerl.frameworks import framework_names, get_framework

    verl = get_framework("verl")
    key = getattr(adv_estimator, "value", adv_estimator)
    if not isinstance(key, str) or key in core_algos.ADV_ESTIMATOR_REGISTRY or key in ("gae", "grpo"):
        return
    for spec in stablerl.list_algorithms(ADVANTAGE_ESTIMATOR):
        if key in framework_names(verl, spec) and spec.status != stablerl.UNAVAILABLE:
            missing = sorted(set(spec.requires) - verl.feedable[ADVANTAGE_ESTIMATOR])
            hint = (
                f"; it needs {missing}, batch fields no stock verl trainer writes (see "
                "stablerl.adapters.verl._advantage.SOURCES): put them in the batch and set "
                f"+algorithm.{BATCH_FIELDS_KEY}=true" if set(missing) <= BATCH_FIELD_INPUTS else ""
            )
            raise StableRLError(
                f"algorithm.adv_estimator={key}: the stablerl estimator {spec.name!r} is not registered in verl"
                + (hint or "; stablerl.adapters.verl.registration_report() says why")
            )


# ----------------------------------------------------------------------------- gathering


def _as_tensor(value: Any, n: int, device) -> Any:
    if isinstance(value, torch.Tensor):
        return value
    arr = np.asarray(value)
    if arr.dtype == object:
        try:
            arr = np.asarray(arr.tolist())
        except Exception:  # noqa: BLE001 - ragged: hand it over as is
            return value
    if arr.dtype.kind in "biuf":
        return torch.as_tensor(arr, device=device)
    return value


def _field(data, field: str) -> Any:
    if field in data.batch.keys():
        return data.batch[field]
    if field in data.non_tensor_batch:
        return data.non_tensor_batch[field]
    return None


def _scores(data) -> Optional[torch.Tensor]:
    mask = data.batch["response_mask"]
    for field in SOURCES["scores"][0]:
        if field in data.batch.keys():
            value = data.batch[field]
            return (value * mask.to(value.dtype)).sum(-1) if value.dim() == 2 else value.reshape(-1)
    return None


def gather_one(what: str, data) -> Any:
    """Input ``what`` from verl's batch (None when absent)."""
    mask = data.batch["response_mask"]
    if what == "index":
        return data.non_tensor_batch.get("uid")
    if what == "scores":
        return _scores(data)
    if what == "lengths":
        return mask.sum(-1)
    fields = SOURCES[what][0] if what in SOURCES else (what,)
    for field in fields:
        value = _field(data, field)
        if value is not None:
            return _as_tensor(value, mask.shape[0], mask.device)
    return None


def gather(kind: str, name: str, data, skip=()) -> dict[str, Any]:
    """The declared inputs of stablerl ``kind`` ``name`` from verl's ``data``; a missing one raises."""
    spec = stablerl.get_spec(kind, name)
    out: dict[str, Any] = {}
    for what in spec.requires:
        if what in skip:
            continue
        value = gather_one(what, data)
        if value is None:
            where = SOURCES[what][1] if what in SOURCES else _OTHER_WHERE
            raise VerlAdvantageInputError(
                f"stablerl {kind} {name!r} needs {what!r} ({OPTIONAL_INPUTS.get(what, '')}) at verl's "
                f"compute_advantage, but verl's batch has none; it is taken from {where}"
            )
        out[what] = value
    for what in spec.optional_inputs:  # a customised pipeline's batch field (turn_ids), when it wrote one
        if what in BATCH_FIELD_INPUTS and what not in skip:
            value = gather_one(what, data)
            if value is not None:
                out[what] = value
    return out


def _context(config: Any, kind: str, name: str) -> Context:
    seed = _cfg(config, SEED_KEY, None)
    return STATE.context(kind, name, seed=0 if seed is None else int(seed), total_steps=TOTAL_STEPS["value"])


# ----------------------------------------------------------------------------- the three stages


def _shape(data, config, name: str, params: dict) -> dict[str, float]:
    rewards = data.batch["token_level_rewards"]
    mask = data.batch["response_mask"]
    scores = (rewards * mask.to(rewards.dtype)).sum(-1)
    inputs = gather(REWARD_SHAPER, name, data, skip=("index",))
    inputs.pop("scores", None)
    index = data.non_tensor_batch.get("uid")
    if index is None:
        raise VerlAdvantageInputError(f"reward shaper {name!r} needs the 'uid' non-tensor field (group ids)")
    shaped, metrics = stablerl.shape_rewards(
        name, scores=scores, index=index, ctx=_context(config, REWARD_SHAPER, name), **inputs, **params
    )
    has = mask.sum(-1) > 0
    last = last_valid_index(mask)
    delta = torch.where(has, shaped.to(rewards.dtype) - scores, torch.zeros_like(scores))
    new = rewards.clone()
    new[torch.arange(new.shape[0], device=new.device), last] += delta
    data.batch["token_level_rewards"] = new
    return metrics


def _reward_components(data, config, extras: dict) -> dict[str, Any]:
    """verl's own GDPO keys: ``algorithm.gdpo_reward_keys`` names the reward function's extra fields (one value
    per response) that are the reward components, ``algorithm.gdpo_reward_weights`` their weights; handed to
    any stablerl estimator as ``reward_components`` / ``reward_weights`` (unless a batch field of that name
    already gave them)."""
    keys = _cfg(config, "gdpo_reward_keys", None)
    if not keys or "reward_components" in extras:
        return {}
    keys = [str(k) for k in (keys if not isinstance(keys, str) else [keys])]
    missing = [k for k in keys if _field(data, k) is None]
    if missing:
        raise VerlAdvantageInputError(
            f"algorithm.gdpo_reward_keys names {missing}, which verl's batch does not have; they are the reward "
            f"function's extra fields (return {{'score': ..., '{missing[0]}': ...}} from compute_score)"
        )
    mask = data.batch["response_mask"]
    out: dict[str, Any] = {"reward_components": {k: _as_tensor(_field(data, k), mask.shape[0], mask.device)
                                                 for k in keys}}
    weights = _cfg(config, "gdpo_reward_weights", None)
    if weights is not None:
        out["reward_weights"] = [float(w) for w in weights]
    return out


def _estimate(data, config, name: str) -> None:
    from ._translate import estimator_hyperparameters

    spec = stablerl.get_spec(ADVANTAGE_ESTIMATOR, name)
    index = data.non_tensor_batch.get("uid")
    if index is None:
        raise VerlAdvantageInputError(
            f"verl's batch has no 'uid' (group ids) for the stablerl estimator {name!r}"
        )
    inputs = gather(ADVANTAGE_ESTIMATOR, name, data, skip=("index",))
    extras = {}
    for key in ESTIMATOR_EXTRAS:
        if key not in inputs:
            value = gather_one(key, data)
            if value is not None:
                extras[key] = value
    extras.update(_reward_components(data, config, extras))
    advantages, returns = stablerl.compute_advantage(
        name,
        token_level_rewards=data.batch["token_level_rewards"],
        response_mask=data.batch["response_mask"],
        index=index,
        ctx=_context(config, ADVANTAGE_ESTIMATOR, name),
        **({"extras": extras} if extras else {}),
        **inputs,
        **estimator_hyperparameters(spec, config),
    )
    data.batch["advantages"] = advantages
    data.batch["returns"] = returns


def _filter(data, config, name: str, params: dict) -> dict[str, float]:
    mask = data.batch["response_mask"]
    adv = data.batch["advantages"]
    inputs = gather(BATCH_FILTER, name, data, skip=("index",))
    scores = inputs.pop("scores", None)
    entropy = inputs.pop("entropy", None)
    result = stablerl.filter_batch(
        name, advantages=adv, response_mask=mask, index=data.non_tensor_batch.get("uid"),
        scores=scores if scores is not None else _scores(data), entropy=entropy,
        ctx=_context(config, BATCH_FILTER, name), **inputs, **params,
    )
    filtered = apply_filter_result(
        result, mask, adv, selected_by=f"algorithm.{FILTER_KEY}={name!r}",
        why_no_resampling="verl's batch keeps its size and order after compute_advantage (it is already balanced "
        "and split over the workers), so only filters that keep or drop rows can run there")
    data.batch["advantages"] = filtered.advantages
    if "returns" in data.batch.keys():
        data.batch["returns"] = data.batch["returns"] * filtered.response_mask.to(data.batch["returns"].dtype)
    data.batch["response_mask"] = filtered.response_mask
    return filtered.metrics


def _wrap(original):
    @functools.wraps(original)
    def compute_advantage(data, adv_estimator, gamma=1.0, lam=1.0, num_repeat=1, norm_adv_by_std_in_grpo=True,
                          config=None):
        name = _stablerl_estimator(adv_estimator)
        if name is None and _truthy(_cfg(config, BATCH_FIELDS_KEY, False)):
            BATCH_FIELD_REGISTRAR()
            name = _stablerl_estimator(adv_estimator)
        if name is None:
            _refuse_unregistered(adv_estimator)
        chosen = selection(config)
        if name is None and chosen["shaper"] is None and chosen["filter"] is None:
            if KEPT_ENTROPY in data.batch.keys():
                data.batch.pop(KEPT_ENTROPY)
            return original(data, adv_estimator=adv_estimator, gamma=gamma, lam=lam, num_repeat=num_repeat,
                            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, config=config)
        if "response_mask" not in data.batch.keys():  # as verl does for old trainers
            from verl.trainer.ppo.ray_trainer import compute_response_mask

            data.batch["response_mask"] = compute_response_mask(data)
        metrics: dict[str, float] = {}
        if chosen["shaper"] is not None and name is not None:
            check_shaper_and_components(
                chosen["shaper"][0], stablerl.get_spec(ADVANTAGE_ESTIMATOR, name),
                bool(_cfg(config, "gdpo_reward_keys", None)) or _field(data, "reward_components") is not None,
                "algorithm.gdpo_reward_keys or a 'reward_components' batch field")
        if chosen["shaper"] is not None:
            metrics.update(_shape(data, config, *chosen["shaper"]))
        if name is not None:
            _estimate(data, config, name)
        else:
            data = original(data, adv_estimator=adv_estimator, gamma=gamma, lam=lam, num_repeat=num_repeat,
                            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, config=config)
        if chosen["filter"] is not None:
            metrics.update(_filter(data, config, *chosen["filter"]))
        if KEPT_ENTROPY in data.batch.keys():  # read above; the update gets verl's own batch
            data.batch.pop(KEPT_ENTROPY)
        STATE.advance()
        LAST_METRICS.clear()
        LAST_METRICS.update({f"stablerl/{k}": float(v) for k, v in metrics.items()})
        return data

    setattr(compute_advantage, _MARK, True)
    compute_advantage.__wrapped__ = original
    return compute_advantage


# ----------------------------------------------------------------------------- the legacy old-log-prob pass


def needs_entropy(config: Any) -> bool:
    """True when the stablerl shaper, filter or estimator selected in verl's ``algorithm`` config declares
    ``entropy`` (the legacy trainer's old-log-prob pass then keeps it for ``compute_advantage``)."""
    chosen = selection(config)
    wanted = [(REWARD_SHAPER, chosen["shaper"]), (BATCH_FILTER, chosen["filter"])]
    estimator = _stablerl_estimator(_cfg(config, "adv_estimator", None))
    if estimator is not None:
        wanted.append((ADVANTAGE_ESTIMATOR, (estimator, {})))
    return any("entropy" in stablerl.get_spec(kind, picked[0]).requires for kind, picked in wanted if picked)


def _wrap_old_log_prob(original):
    @functools.wraps(original)
    def _compute_old_log_prob(self, batch, *args, **kwargs):
        out = original(self, batch, *args, **kwargs)
        TOTAL_STEPS["value"] = getattr(self, "total_training_steps", None)
        old_log_prob = out[0] if isinstance(out, tuple) else out
        config = getattr(self, "config", None)
        algorithm = _cfg(config, "algorithm", None) if config is not None else None
        if "entropys" in old_log_prob.batch.keys() and needs_entropy(algorithm):
            # the trainer pops 'entropys' from this result before batch.union(): keep the same tensor by another name
            old_log_prob.batch[KEPT_ENTROPY] = old_log_prob.batch["entropys"]
        return out

    return _compute_old_log_prob


def _patch_old_log_prob(module) -> None:
    patch_ray_trainer_method(f"{PATCH_KEY}:_compute_old_log_prob", module, "_compute_old_log_prob", _wrap_old_log_prob,
                             "the old-log-prob pass's entropy does not reach compute_advantage")


# ----------------------------------------------------------------------------- patching


def _no_compute_advantage(module) -> None:
    logger.warning("stablerl: %s has no compute_advantage; estimator inputs are not gathered", module.__name__)


#: the ledger key of the wrap (``uninstrument()`` restores it with every other patch)
PATCH_KEY = "compute_advantage"


def _patch_tracking(module) -> None:
    """verl's trainers log one ``metrics`` dict per step through ``Tracking.log`` in the process that calls
    ``compute_advantage`` (the TaskRunner); the shaper's / filter's / estimator's metrics of that step join
    it there, under ``stablerl/...``, for every logger backend (console, file, wandb, ...)."""
    cls = getattr(module, "Tracking", None)
    if cls is None or not callable(getattr(cls, "log", None)):
        logger.warning("stablerl: verl.utils.tracking has no Tracking.log; stablerl's advantage-side metrics "
                       "are not logged (they stay in stablerl.adapters.verl._advantage.LAST_METRICS)")
        return
    log, init = cls.log, cls.__init__

    @functools.wraps(init)
    def tracking_init(self, *args, **kwargs):
        LAST_METRICS.clear()  # a new logger is a new run: an earlier run's unlogged metrics are not its own
        return init(self, *args, **kwargs)

    @functools.wraps(log)
    def tracking_log(self, data, step, *args, **kwargs):
        if LAST_METRICS and isinstance(data, dict):
            data = {**data, **LAST_METRICS}
            LAST_METRICS.clear()
        return log(self, data, step, *args, **kwargs)

    LEDGER.set_attr(f"{PATCH_KEY}:Tracking.__init__", cls, "__init__", tracking_init)
    LEDGER.set_attr(f"{PATCH_KEY}:Tracking.log", cls, "log", tracking_log)


def instrument() -> str:
    """Wrap verl's ``compute_advantage`` (and the callers' bound names) now (``"patched"``) or right after
    ``ray_trainer`` is imported (``"deferred"``), and verl's ``Tracking.log`` so that the step's stablerl
    metrics are logged. Idempotent."""
    LEDGER.on_import(f"{PATCH_KEY}:tracking", {"verl.utils.tracking": _patch_tracking})
    LEDGER.on_import(f"{PATCH_KEY}:old_log_prob", {TRAINER_MODULE: _patch_old_log_prob})
    return LEDGER.wrap_function(PATCH_KEY, TRAINER_MODULE, "compute_advantage", _wrap, CALLER_MODULES,
                                missing=_no_compute_advantage)


def is_patched() -> bool:
    return LEDGER.function_status(PATCH_KEY, TRAINER_MODULE, "compute_advantage") in ("patched", "deferred")


def describe() -> dict[str, Any]:
    """Sources of estimator inputs and the config keys, for docs and reports."""
    return {
        "sources": {k: v[1] for k, v in SOURCES.items()},
        "batch_field_inputs": sorted(BATCH_FIELD_INPUTS),
        "estimator_extras": list(ESTIMATOR_EXTRAS),
        "keys": [SHAPER_KEY, SHAPER_PARAMS_KEY, FILTER_KEY, FILTER_PARAMS_KEY, SEED_KEY, BATCH_FIELDS_KEY],
    }


__all__ = [
    "SOURCES", "BATCH_FIELD_INPUTS", "ESTIMATOR_EXTRAS", "STATE", "LAST_METRICS", "instrument", "is_patched",
    "selection", "gather", "describe", "reset_state", "VerlAdvantageInputError",
]
