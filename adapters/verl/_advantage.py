"""stablerl at verl's advantage call site: estimators with their declared inputs, reward shapers, batch filters.

verl 0.9.1 calls a registered advantage estimator with ``token_level_rewards, response_mask, index (uid), config``
only. Every other field an estimator, a reward shaper or a batch filter needs is in the ``DataProto`` handed to the
function that makes that call, ``verl.trainer.ppo.ray_trainer.compute_advantage(data, adv_estimator, gamma, lam,
num_repeat, norm_adv_by_std_in_grpo, config)``. This module wraps that function once, for every algorithm: when
``adv_estimator`` is a stablerl estimator, or ``config`` (verl's ``algorithm`` config) names a stablerl reward shaper
(``+algorithm.stablerl_reward_shaper``) or batch filter (``+algorithm.stablerl_batch_filter``), the batch becomes one
:class:`~stablerl.steps.BatchRecord` (verl's ``token_level_rewards`` layout, the ``DataProto`` as its host, read by
the adapter's providers) and core's :class:`~stablerl.steps.AdvantageStep` runs shape -> estimate (stablerl's, or
verl's own estimator) -> filter -> state bookkeeping; the result is written back into the batch. verl's batch size
is fixed there, so dropped rows and tokens get advantage 0 and ``response_mask`` 0; a resampling filter is refused.
Any other call (a verl estimator and no shaper/filter) goes to verl's function untouched.

Callers: ``ray_trainer`` calls ``compute_advantage`` through its module global (legacy trainer);
``verl.trainer.ppo.v1.utils`` (v1 trainer) and ``verl.experimental.separation.ray_trainer`` bind it by ``from ...
import``: :func:`instrument` wraps the attribute right after ``ray_trainer`` executes (post-import hook) or at once,
and rebinds the callers' names (recorded in the adapter's ledger).

What reaches the call site differs by trainer (verl 0.9.1):

* legacy ``RayPPOTrainer``: the whole rollout batch (``responses``, ``old_log_probs``, ``rollout_log_probs``,
  ``token_level_scores``, the reward function's ``reward_extra_info`` as non-tensor fields...), except the old-pass
  entropies, which it pops (``entropys``) before. When a selected algorithm reads ``entropy`` (an extra-pass provider),
  the wrap of ``RayPPOTrainer._compute_old_log_prob`` keeps them under ``KEPT_ENTROPY``; the call site removes the
  field again, so the update gets verl's own batch. The same wrap records the trainer's ``total_training_steps``;
* v1 trainer (``trainer.use_v1=true``): ``_compute_advantage`` fetches only ``uid, response_mask, rm_scores,
  rollout_log_probs, old_log_probs, ref_log_prob, values``, and writes back only ``advantages`` / ``returns``.

This module imports no verl at import time.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Optional

import stablerl
from stablerl import ADVANTAGE_ESTIMATOR, BATCH_FILTER, REWARD_SHAPER, Context, StableRLError
from stablerl.adapters.verl._ledger import LEDGER, patch_ray_trainer_method, verl_adapter
from stablerl.adapters.verl._providers import (BATCH_FIELD_INPUTS, KEPT_ENTROPY, WHERE, VerlAdvantageInputError,
                                               advantage_input_missing, batch_field)
from stablerl.algorithm_selection import AlgorithmSelection
from stablerl.frameworks import check_shaper_and_components
from stablerl.selection import config_get, name_or_none, truthy
from stablerl.steps import AdvantageStep, BatchRecord

logger = logging.getLogger("stablerl.adapters.verl")

TRAINER_MODULE = "verl.trainer.ppo.ray_trainer"
#: modules that bind ``compute_advantage`` with ``from verl.trainer.ppo.ray_trainer import compute_advantage``
CALLER_MODULES = ("verl.trainer.ppo.v1.utils", "verl.experimental.separation.ray_trainer")
#: the ledger key of the wrap (``uninstrument()`` restores it with every other patch)
PATCH_KEY = "compute_advantage"

#: ``algorithm.<key>`` config keys read by the wrapper
SHAPER_KEY, SHAPER_PARAMS_KEY = "stablerl_reward_shaper", "stablerl_reward_shaper_params"
FILTER_KEY, FILTER_PARAMS_KEY = "stablerl_batch_filter", "stablerl_batch_filter_params"
SEED_KEY = "stablerl_seed"
CONTROLLER_KEY = "stablerl_entropy_controller"
#: ``+algorithm.stablerl_batch_field_estimators=true``: register the estimators whose inputs only a customised
#: pipeline puts in the batch (``gigpo``) on the first call (``VerlAdapter.register_batch_field_estimators``)
BATCH_FIELDS_KEY = "stablerl_batch_field_estimators"
#: optional per-response extras an estimator reads when present (not declared: the estimator works without them or
#: raises its own message): taken from the batch / non-tensor batch by this name
ESTIMATOR_EXTRAS = ("pos_count", "neg_count", "bundle_index", "reward_components")
_NO_RESAMPLING = ("verl's batch keeps its size and order after compute_advantage (it is already balanced and split "
                  "over the workers), so only filters that keep or drop rows can run there")


def reset_state() -> None:
    """Forget generators, step counter, state and unlogged metrics (a fresh run; ``VerlState.reset``)."""
    verl_adapter().state.reset()


@dataclasses.dataclass
class VerlSelection(AlgorithmSelection):
    """The stablerl algorithms of verl's ``algorithm`` config (core's one selection object); the estimator's
    hyper-parameters are the ``algorithm.<name>`` keys (:func:`~stablerl.adapters.verl._translate.estimator_settings`)."""

    framework, label = "verl", "verl"
    algorithm_config: Any = None

    def advantage_settings(self) -> list:
        from ._translate import estimator_settings

        return estimator_settings(stablerl.get_spec(ADVANTAGE_ESTIMATOR, self.advantage_estimator), self.algorithm_config)


def selection(config: Any, estimator: Optional[str] = None) -> VerlSelection:
    """The stablerl algorithms named in verl's ``algorithm`` config (and ``estimator``, a stablerl estimator verl
    selected), validated (names, hyper-parameters); the estimator's hyper-parameters are read by the call site."""
    controller = name_or_none(config_get(config, CONTROLLER_KEY))
    if controller is not None:
        raise StableRLError(
            f"algorithm.{CONTROLLER_KEY}={controller!r}: an entropy controller runs in the actor workers, which do "
            "not see the algorithm config: select it on the stablerl policy-loss config "
            "(actor_rollout_ref.actor.policy_loss._target_=stablerl.adapters.verl.StablePolicyLossConfig "
            f"+actor_rollout_ref.actor.policy_loss.stablerl_entropy_controller={controller}); verl runs only "
            "controllers that act through its entropy bonus (adaptive_entropy)")
    return VerlSelection.from_config(config, {REWARD_SHAPER: (SHAPER_KEY, SHAPER_PARAMS_KEY),
                                              BATCH_FILTER: (FILTER_KEY, FILTER_PARAMS_KEY)},
                                     prefix="algorithm.", advantage_estimator=estimator, algorithm_config=config)


def _refuse_unregistered(adv_estimator: Any) -> None:
    """A stablerl estimator name that is not in verl's registry: say why instead of verl's 'Unknown'."""
    from verl.trainer.ppo import core_algos

    from stablerl.frameworks import framework_names

    verl = verl_adapter().spec
    key = getattr(adv_estimator, "value", adv_estimator)
    if not isinstance(key, str) or key in core_algos.ADV_ESTIMATOR_REGISTRY or key in ("gae", "grpo"):
        return
    for spec in stablerl.list_algorithms(ADVANTAGE_ESTIMATOR):
        if key in framework_names(verl, spec) and spec.status != stablerl.UNAVAILABLE:
            missing = sorted(set(spec.requires) - verl.feedable[ADVANTAGE_ESTIMATOR])
            hint = (f"; it needs {missing}, batch fields no stock verl trainer writes (see "
                    "stablerl.adapters.verl._providers.WHERE): put them in the batch and set "
                    f"+algorithm.{BATCH_FIELDS_KEY}=true" if set(missing) <= BATCH_FIELD_INPUTS else "")
            why = hint or "; stablerl.adapters.verl.registration_report() says why"
            raise StableRLError(f"algorithm.adv_estimator={key}: the stablerl estimator {spec.name!r} is not "
                                f"registered in verl{why}")


def _context(config: Any, kind: str, name: str) -> Context:
    state = verl_adapter().state
    seed = config_get(config, SEED_KEY)
    return state.driver.context(kind, name, seed=0 if seed is None else int(seed), total_steps=state.total_steps)


def _extras(data, config) -> dict[str, Any]:
    """The estimator's per-response extras (:data:`ESTIMATOR_EXTRAS`) the batch has, and verl's own GDPO keys:
    ``algorithm.gdpo_reward_keys`` names the reward function's extra fields that are the reward components,
    ``algorithm.gdpo_reward_weights`` their weights (unless a batch field ``reward_components`` gave them)."""
    extras = {k: v for k in ESTIMATOR_EXTRAS if (v := batch_field(data, k)) is not None}
    keys = config_get(config, "gdpo_reward_keys")
    if not keys or "reward_components" in extras:
        return extras
    keys = [str(k) for k in (keys if not isinstance(keys, str) else [keys])]
    missing = [k for k in keys if batch_field(data, k) is None]
    if missing:
        raise VerlAdvantageInputError(
            f"algorithm.gdpo_reward_keys names {missing}, which verl's batch does not have; they are the reward "
            f"function's extra fields (return {{'score': ..., '{missing[0]}': ...}} from compute_score)")
    extras["reward_components"] = {k: batch_field(data, k) for k in keys}
    weights = config_get(config, "gdpo_reward_weights")
    if weights is not None:
        extras["reward_weights"] = [float(w) for w in weights]
    return extras


def _wrap(original):
    @functools.wraps(original)
    def compute_advantage(data, adv_estimator, gamma=1.0, lam=1.0, num_repeat=1, norm_adv_by_std_in_grpo=True,
                          config=None):
        def verl_estimator(record=None):  # verl's own code, on the (shaped) batch
            if record is not None:
                data.batch["token_level_rewards"] = record.token_level_rewards
            out = original(data, adv_estimator=adv_estimator, gamma=gamma, lam=lam, num_repeat=num_repeat,
                           norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, config=config)
            return out if record is None else (out.batch["advantages"], out.batch.get("returns", None))

        adapter = verl_adapter()
        name = adapter.stablerl_name(ADVANTAGE_ESTIMATOR, adv_estimator)
        if name is None and truthy(config_get(config, BATCH_FIELDS_KEY, False)):
            adapter.register_batch_field_estimators()
            name = adapter.stablerl_name(ADVANTAGE_ESTIMATOR, adv_estimator)
        if name is None:
            _refuse_unregistered(adv_estimator)
        chosen = selection(config, name)
        if name is None and not chosen.has_extensions:
            _drop_kept_entropy(data)
            return verl_estimator()
        if "response_mask" not in data.batch.keys():  # as verl does for old trainers
            from verl.trainer.ppo.ray_trainer import compute_response_mask

            data.batch["response_mask"] = compute_response_mask(data)
        index = data.non_tensor_batch.get("uid")
        if index is None and (name or chosen.reward_shaper):
            raise VerlAdvantageInputError(
                f"verl's batch has no 'uid' (group ids) for stablerl's {name or chosen.reward_shaper!r}")
        if name is not None:
            spec = stablerl.get_spec(ADVANTAGE_ESTIMATOR, name)
            check_shaper_and_components(chosen.reward_shaper, spec, bool(config_get(config, "gdpo_reward_keys"))
                                        or batch_field(data, "reward_components") is not None,
                                        "algorithm.gdpo_reward_keys or a 'reward_components' batch field")
        record = BatchRecord(adapter, response_mask=data.batch["response_mask"], index=index, host=data,
                             token_level_rewards=data.batch["token_level_rewards"], missing=advantage_input_missing,
                             # a customised pipeline's per-row / per-token fields (turn_ids, anchor_ids, step_returns)
                             produced={k: v for k in BATCH_FIELD_INPUTS if (v := batch_field(data, k)) is not None})
        step = AdvantageStep(chosen.advantage_selection(chosen.effective_estimator_params(logger) if name else {}),
                             ctx=functools.partial(_context, config), state=adapter.state.driver,
                             filter_key=f"algorithm.{FILTER_KEY}", why_no_resampling=_NO_RESAMPLING)
        result = step.run(record, estimate=verl_estimator, extras=_extras(data, config) if name else None)
        data.batch["token_level_rewards"] = result.token_level_rewards
        data.batch["advantages"] = result.advantages
        if result.returns is not None:
            data.batch["returns"] = result.returns
        data.batch["response_mask"] = result.response_mask
        _drop_kept_entropy(data)  # read above; the update gets verl's own batch
        for key in [k for k in adapter.state.metrics if k.startswith("stablerl/")]:
            del adapter.state.metrics[key]  # the step's earlier metrics (sampling_mask/...) stay for Tracking.log
        adapter.state.metrics.update({f"stablerl/{k}": float(v) for k, v in result.metrics.items()})
        return data

    compute_advantage.__wrapped__ = original
    return compute_advantage


def _drop_kept_entropy(data) -> None:
    if KEPT_ENTROPY in data.batch.keys():
        data.batch.pop(KEPT_ENTROPY)


# ----------------------------------------------------------------------------- the legacy old-log-prob pass


def needs_entropy(config: Any) -> bool:
    """True when the stablerl shaper, filter or estimator selected in verl's ``algorithm`` config reads ``entropy``
    (its provider needs the legacy trainer's old-log-prob pass to keep it for ``compute_advantage``)."""
    from verl.trainer.ppo import core_algos  # noqa: F401  (the registry the estimator name is looked up in)

    estimator = verl_adapter().stablerl_name(ADVANTAGE_ESTIMATOR, config_get(config, "adv_estimator"))
    return selection(config, estimator).advantage_selection({}).reads("entropy")


def _wrap_old_log_prob(original):
    @functools.wraps(original)
    def _compute_old_log_prob(self, batch, *args, **kwargs):
        out = original(self, batch, *args, **kwargs)
        verl_adapter().state.total_steps = getattr(self, "total_training_steps", None)
        old_log_prob = out[0] if isinstance(out, tuple) else out
        config = getattr(self, "config", None)
        algorithm = config_get(config, "algorithm") if config is not None else None
        if "entropys" in old_log_prob.batch.keys() and needs_entropy(algorithm):
            # the trainer pops 'entropys' from this result before batch.union(): keep the same tensor by another name
            old_log_prob.batch[KEPT_ENTROPY] = old_log_prob.batch["entropys"]
        return out

    return _compute_old_log_prob


def _patch_old_log_prob(module) -> None:
    from stablerl.adapters.verl._sampling_mask import wrap_old_log_prob as replay  # sampling-mask replay, inside

    patch_ray_trainer_method(f"{PATCH_KEY}:_compute_old_log_prob", module, "_compute_old_log_prob",
                             lambda original: _wrap_old_log_prob(replay(original)),
                             "the old-log-prob pass's entropy does not reach compute_advantage")


# ----------------------------------------------------------------------------- patching


def _patch_tracking(module) -> None:
    """verl's trainers log one ``metrics`` dict per step through ``Tracking.log`` in the process that calls
    ``compute_advantage`` (the TaskRunner); the shaper's / filter's / estimator's metrics of that step join it there,
    under ``stablerl/...``, for every logger backend (console, file, wandb, ...)."""
    cls = getattr(module, "Tracking", None)
    if cls is None or not callable(getattr(cls, "log", None)):
        logger.warning("stablerl: verl.utils.tracking has no Tracking.log; stablerl's advantage-side metrics "
                       "are not logged (they stay in verl_adapter().state.metrics)")
        return
    log, init = cls.log, cls.__init__
    metrics = verl_adapter().state.metrics

    @functools.wraps(init)
    def tracking_init(self, *args, **kwargs):
        metrics.clear()  # a new logger is a new run: an earlier run's unlogged metrics are not its own
        return init(self, *args, **kwargs)

    @functools.wraps(log)
    def tracking_log(self, data, step, *args, **kwargs):
        if metrics and isinstance(data, dict):
            data = {**data, **metrics}
            metrics.clear()
        return log(self, data, step, *args, **kwargs)

    LEDGER.set_attr(f"{PATCH_KEY}:Tracking.__init__", cls, "__init__", tracking_init)
    LEDGER.set_attr(f"{PATCH_KEY}:Tracking.log", cls, "log", tracking_log)


def _no_compute_advantage(module) -> None:
    logger.warning("stablerl: %s has no compute_advantage; estimator inputs are not gathered", module.__name__)


def instrument() -> str:
    """Wrap verl's ``compute_advantage`` (and the callers' bound names) now (``"patched"``) or right after
    ``ray_trainer`` is imported (``"deferred"``), the legacy trainer's old-log-prob pass, and verl's ``Tracking.log``
    so that the step's stablerl metrics are logged. Idempotent."""
    LEDGER.on_import(f"{PATCH_KEY}:tracking", {"verl.utils.tracking": _patch_tracking})
    LEDGER.on_import(f"{PATCH_KEY}:old_log_prob", {TRAINER_MODULE: _patch_old_log_prob})
    return LEDGER.wrap_function(PATCH_KEY, TRAINER_MODULE, "compute_advantage", _wrap, CALLER_MODULES,
                                missing=_no_compute_advantage)


def is_patched() -> bool:
    return LEDGER.function_status(PATCH_KEY, TRAINER_MODULE, "compute_advantage") in ("patched", "deferred")


def describe() -> dict[str, Any]:
    """Sources of estimator inputs and the config keys, for docs and reports."""
    return {"sources": dict(WHERE), "batch_field_inputs": sorted(BATCH_FIELD_INPUTS),
            "estimator_extras": list(ESTIMATOR_EXTRAS),
            "keys": [SHAPER_KEY, SHAPER_PARAMS_KEY, FILTER_KEY, FILTER_PARAMS_KEY, SEED_KEY, BATCH_FIELDS_KEY]}


__all__ = ["ESTIMATOR_EXTRAS", "KEPT_ENTROPY", "instrument", "is_patched", "selection", "needs_entropy", "describe",
           "reset_state", "VerlAdvantageInputError"]
