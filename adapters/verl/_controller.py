"""Entropy controllers (``stablerl.Controller``) in verl 0.9.1: ``adaptive_entropy`` steers verl's own entropy bonus.

verl's actor config rejects unknown keys, so the controller is selected on the stablerl policy-loss config, which
the workers see (as a trainer hook is)::

    actor_rollout_ref.actor.policy_loss._target_=stablerl.adapters.verl.StablePolicyLossConfig
    +actor_rollout_ref.actor.policy_loss.stablerl_entropy_controller=adaptive_entropy
    +actor_rollout_ref.actor.policy_loss.stablerl_entropy_controller_params={entropy_target:0.2}
    actor_rollout_ref.actor.calculate_entropy=True

verl's ``ppo_loss`` subtracts ``entropy_coeff * agg(H)`` (its ``actor/entropy_loss``, aggregated with the loss's
``loss_agg_mode``): the controller's loss term ``-c agg(H)`` exactly. The adapter's ``update_actor`` wrapper
(:mod:`stablerl.adapters.verl._trainer_hook`) sets the ``entropy_coeff`` of the actor config bound into the worker's
loss function to the controller's coefficient in force before each update, and after it steps the controller
with the update's ``actor/entropy_loss`` (the same on every rank). One ``update_actor`` call is one controller step
(TRL steps per optimizer step: the same with one mini-batch and ``ppo_epochs=1``). The controller's state is saved
with the per-rank loss state (``stablerl_loss_state_rank<r>.pt``). Controllers that need more than the entropy
bonus (a rollout temperature: aepo; a loss term of their own: epo) are refused where the config is built.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from stablerl.adapters.verl._ledger import verl_adapter
from stablerl.rank_stats import agreed, as_float
from stablerl.selection import config_get, read_selection

logger = logging.getLogger("stablerl.adapters.verl")

KEY, PARAMS_KEY = "stablerl_entropy_controller", "stablerl_entropy_controller_params"
ENTROPY_METRIC = "actor/entropy_loss"
_CONTROLLERS: dict[str, Any] = {}  # name -> the controller's driver in this process (one actor per worker process)


def selection(policy_loss_cfg: Any) -> tuple[Optional[str], dict]:
    """``(controller name or None, its params)`` from an ``actor.policy_loss`` config."""
    return read_selection(policy_loss_cfg, KEY, PARAMS_KEY, prefix="policy_loss.")


def check_selection(policy_loss_cfg: Any) -> Optional[str]:
    """Refuse an unknown or unfeedable controller and bad hyper-parameters where the config is built."""
    return check_extension(policy_loss_cfg, "controller", KEY, PARAMS_KEY)


def check_extension(policy_loss_cfg: Any, kind: str, key: str, params_key: str) -> Optional[str]:
    """Refuse an unknown, unavailable or unfeedable extension of ``kind`` (an entropy controller, a trainer hook)
    selected by ``key`` on the stablerl policy-loss config, and bad hyper-parameters, where the config is built."""
    import stablerl
    from stablerl.frameworks import resolve
    from stablerl.params import build_params

    name, params = read_selection(policy_loss_cfg, key, params_key, prefix="policy_loss.")
    if name is not None:
        resolve("verl", kind, name)  # unknown name / an input verl cannot feed: the reason in verl's words
        build_params(stablerl.get_spec(kind, name), params)
    return name


def metrics_of(output: Any) -> Optional[dict]:
    """The metrics dict of ``update_actor``'s output (None on a rank without them)."""
    if output is None:
        return None
    try:
        from verl.utils import tensordict_utils as tu

        return tu.get(output, "metrics")
    except Exception:  # noqa: BLE001 - no metrics on this rank
        return None


def update_entropy(metrics: Optional[dict]) -> Optional[float]:
    """The update's ``actor/entropy_loss``, the same on every rank (None when verl reported none)."""
    return agreed(as_float(metrics.get(ENTROPY_METRIC)) if metrics is not None else None)


def controller_for(worker_config: Any):
    """This process's controller for the worker's config: core's :class:`~stablerl.trainer_loop.ControllerDriver`
    (built on first use; the controller tracked in the loss-state store)."""
    from stablerl.contracts import CONTROLLER
    from stablerl.params import StableRLError
    from stablerl.trainer_loop import ControllerDriver

    actor = config_get(worker_config, "actor")
    name, params = selection(config_get(actor, "policy_loss"))
    if name is None:
        return None
    driver = _CONTROLLERS.get(name)
    if driver is None:
        if float(config_get(actor, "entropy_coeff", 0.0) or 0.0) != 0.0:
            raise StableRLError(
                f"policy_loss.{KEY}={name!r} sets verl's entropy bonus coefficient itself: leave "
                "actor_rollout_ref.actor.entropy_coeff at 0 (the initial coefficient is the controller's entropy_coef)")
        if not config_get(actor, "calculate_entropy", False):
            raise StableRLError(
                f"policy_loss.{KEY}={name!r} is stepped with verl's {ENTROPY_METRIC}, which verl computes only with "
                "actor_rollout_ref.actor.calculate_entropy=True (or entropy_coeff != 0, which the controller sets)")
        # the coefficient is read before every update (before_update): nothing to apply after a step
        driver = ControllerDriver(name, params, provides=("entropy",), framework="verl", apply=lambda decision: None,
                                  gives=f"the adapter gives each update's {ENTROPY_METRIC}")
        _CONTROLLERS[name] = driver
        verl_adapter().state.loss.track(CONTROLLER, name, driver.controller)  # saved with the per-rank loss state
        logger.warning("stablerl/verl: entropy controller %r runs with %s", name, params or "its defaults")
    return driver


def before_update(worker: Any, driver: Any) -> float:
    """Set the coefficient in force for this update (``applied_coef``) on verl's loss config."""
    coef = float(driver.controller.applied_coef)
    from stablerl.contracts import CONTROLLER
    from stablerl.steps import BatchRecord

    adapter = verl_adapter()  # its entropy_bonus provider: the actor config bound into the worker's loss function
    config = adapter.provide(CONTROLLER, "entropy_bonus", BatchRecord(adapter, host=worker))
    # verl's BaseConfig refuses attribute assignment outside _mutable_fields; this one field is the controller's
    object.__setattr__(config, "entropy_coeff", coef)
    return coef


def after_update(driver: Any, name: str, output: Any, applied: float) -> None:
    """Step the controller with the update's entropy (the same on every rank) and report its decision."""
    from stablerl.params import StableRLError
    from stablerl.trainer_loop import scalar_metrics

    metrics = metrics_of(output)
    entropy = update_entropy(metrics)
    if entropy is None:
        raise StableRLError(f"stablerl entropy controller {name!r}: verl reported no {ENTROPY_METRIC} for this update "
                            "(set actor_rollout_ref.actor.calculate_entropy=True)")
    decision = driver.step(entropy=entropy)
    if metrics is not None:
        for key, value in scalar_metrics({**decision, "applied_coef": applied}, prefix=f"stablerl/{name}/").items():
            metrics[key] = [value]


def status() -> dict[str, Any]:
    return {name: driver.controller.state_dict() for name, driver in _CONTROLLERS.items()}
