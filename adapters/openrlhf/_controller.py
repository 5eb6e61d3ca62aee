"""Entropy controllers (``stablerl.Controller``) in OpenRLHF 0.11.2: ``adaptive_entropy`` steers OpenRLHF's own
entropy bonus, ``--actor.entropy_coef`` (as the verl adapter steers verl's ``entropy_coeff``).

OpenRLHF's ``ActorPPOTrainer.training_step`` reads ``args.actor.entropy_coef`` on every call: with a value (0
included) the training forward returns entropy and ``entropy_loss`` is logged; a non-zero value subtracts
``coef * aggregate_loss(H)`` (token-mean over the optimizer step's global token count) from the loss: the
controller's loss term ``-c agg(H)`` exactly. In the actor worker the adapter

* sets ``entropy_coef`` to the controller's coefficient in force (``applied_coef``) before every micro-batch;
* meters the training forward's entropy over the action tokens (the ``Actor.forward`` patch, :func:`record_entropy`;
  core's ``EntropyMeter``) until DeepSpeed takes the optimizer step, and steps the controller with the step's
  token-mean entropy over every DP rank: one controller step per optimizer step, as the TRL adapter;
* logs the decision as ``stablerl/<name>/<key>`` and saves the controller in DeepSpeed's client_state (``._state``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from stablerl.api import get_spec
from stablerl.contracts import CONTROLLER as _CONTROLLER
from stablerl.entropy_meter import EntropyMeter
from stablerl.frameworks import effective_hyperparameters, log_effective_settings
from stablerl.params import StableRLError
from stablerl.state import StateStore
from stablerl.trainer_loop import ControllerDriver, scalar_metrics

from ._flags import NAME
from ._selection import check_entropy_coef_unset, selection_from_args


def arm(trainer: Any, adapter: Any) -> Optional[ControllerDriver]:
    """In ``ActorPPOTrainer.__init__``: the selected controller on the policy actor's ``PolicyWorker`` (with its
    entropy meter), its state adopted into this worker's checkpoints."""
    selection = selection_from_args(trainer.args)
    name = selection.entropy_controller
    if name is None:
        return None
    actor_args = trainer.args.actor
    check_entropy_coef_unset(name, actor_args)
    driver = ControllerDriver(name, selection.entropy_controller_params, provides=("entropy",), framework="OpenRLHF",
                              gives="the adapter gives each optimizer step's mean training entropy",
                              apply=lambda decision: None)  # the coefficient is read before every step
    if not hasattr(driver.controller, "applied_coef"):
        raise StableRLError(f"entropy controller {name!r} does not steer an entropy bonus (no applied_coef); "
                            "OpenRLHF's adapter sets only --actor.entropy_coef")
    store = StateStore(holds="controller")
    store.track(_CONTROLLER, name, driver)
    worker = adapter.worker(trainer, create=True)
    worker.controller, worker.controller_store, worker.meter = driver, store, EntropyMeter()  # the store lives with it
    adapter.controller_state.adopt(store)
    actor_args.entropy_coef = float(driver.controller.applied_coef)  # not None: OpenRLHF computes the entropy
    spec = get_spec(_CONTROLLER, name)  # the effective-settings table, once per process
    log_effective_settings(NAME, spec, effective_hyperparameters(NAME, spec, selection.entropy_controller_params))
    return driver


def record_entropy(worker: Any, args: tuple, kwargs: dict, result: Any) -> None:
    """After a training ``Actor.forward`` of an armed actor: add the action tokens' entropy (as OpenRLHF slices and
    masks it in ``training_step``) to the meter."""
    if worker is None or worker.controller is None or not kwargs.get("return_output") or not isinstance(result, tuple):
        return
    output = result[1]
    entropy = getattr(output, "entropy", None)
    action_mask = kwargs.get("action_mask", args[1] if len(args) > 1 else None)
    if entropy is None or not isinstance(action_mask, torch.Tensor):
        raise StableRLError("stablerl entropy controller: the training forward returned no entropy for the action "
                            "mask (OpenRLHF computes it when --actor.entropy_coef is not None, which the adapter sets)")
    worker.meter.add(entropy, action_mask)


def _optimizer_steps(trainer: Any) -> Optional[int]:
    """DeepSpeed's count of optimizer steps taken (``engine.global_steps``); None without a DeepSpeed engine (then
    every ``training_step`` is one optimizer step)."""
    steps = getattr(getattr(trainer.actor, "model", None), "global_steps", None)
    return int(steps) if isinstance(steps, int) else None


def before_step(trainer: Any, worker: Any) -> Optional[tuple]:
    """Before ``training_step``: the coefficient in force on OpenRLHF's args; returns what :func:`after_step` needs."""
    driver = worker.controller if worker is not None else None
    if driver is None:
        return None
    coef = float(driver.controller.applied_coef)
    trainer.args.actor.entropy_coef = coef
    return worker, coef, _optimizer_steps(trainer)


def after_step(trainer: Any, armed: Optional[tuple], status: Any) -> None:
    """After ``training_step``: at an optimizer step, step the controller with the step's entropy; the decision
    and the coefficient applied go into the status OpenRLHF logs (not reduced: every rank has the same)."""
    if armed is None:
        return
    worker, applied, steps_before = armed
    driver = worker.controller
    if steps_before is None or _optimizer_steps(trainer) != steps_before:
        group = None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            from openrlhf.utils.loss_utils import _get_dp_group

            group = _get_dp_group(trainer.strategy)
        driver.step(entropy=worker.meter.take(group))  # an all-masked step: None, no change
    if isinstance(status, dict) and isinstance(status.get("metrics"), dict):
        metrics = scalar_metrics({**driver.decision, "applied_coef": applied}, prefix=f"stablerl/{driver.name}/")
        status["metrics"].update(metrics)
        status.setdefault("weights", {}).update(dict.fromkeys(metrics))  # None: OpenRLHF does not reduce them


__all__ = ["arm", "record_entropy", "before_step", "after_step"]
