"""stablerl in OpenRLHF 0.11.2: every stablerl policy loss and advantage estimator behind OpenRLHF's flags.

OpenRLHF has no registry, no entry point and no import hook, and its loss and advantage code run
inside Ray actors. This adapter therefore patches, in every Ray worker that owns that code:

* ``openrlhf.trainer.ray.ppo_actor.ActorPPOTrainer.__init__``: after OpenRLHF built its
  ``PolicyLoss``, a stablerl ``--actor.policy_loss_type`` replaces ``self.actor_loss_fn`` by a
  :class:`StablePolicyLoss` built from the same flags (a subclass of OpenRLHF's ``PolicyLoss``,
  same constructor kwargs, same keyword call, same 5-tuple);
* ``openrlhf.trainer.ppo_utils.experience_maker.RemoteExperienceMaker.compute_advantages_and_returns``:
  a stablerl ``--algo.advantage.estimator`` computes the baseline-shaped advantages, then
  OpenRLHF's own KL-in-reward, reward clip and cumulative return run after it; OpenRLHF's names go
  to OpenRLHF's method untouched.
  With ``--algo.advantage.stablerl_reward_shaper`` / ``--algo.advantage.stablerl_batch_filter`` the
  same patch shapes the per-response rewards before the estimator (OpenRLHF's or stablerl's) and
  filters rows after it (``action_mask`` 0; see ``_shape_filter``).
* a stablerl loss that declares ``entropy``, ``token_ids`` or ``scores`` (not in OpenRLHF's loss
  call): ``ActorPPOTrainer.training_step`` and ``Actor.forward`` hand them to the loss (``_inputs``);
* with a batch filter: ``get_loss_batch_info`` / ``iter_grad_accum_global_norm`` as bound in
  ``ppo_actor`` and ``ppo_critic`` (an optimizer step whose rows were all dropped gets normaliser 1,
  so its loss and gradient are 0, not 0/0);
* ``--actor.stablerl_routing_replay R2|R3`` (MoE routing replay): ``Actor.forward``,
  ``RemoteExperienceMaker.make_experience`` and ``ActorPPOTrainer.training_step``; for R3 also
  ``BaseModelActor.execute_batch``, ``SamplesGenerator._process_response_into_experience``, the agent
  executors' ``execute`` and vLLM's ``AsyncEngineArgs.__init__`` (see ``_routing_replay``);
* checkpoints: ``DeepspeedStrategy.save_ckpt`` / ``load_ckpt`` carry the policy loss's state (EntroPIC,
  CAPO) in DeepSpeed's ``client_state``, and ``BasePPOTrainer``'s checkpoint methods the reward shapers'
  and batch filters' state, so a resumed run continues both (see ``_state``).

OpenRLHF's built-in names (``ppo``, ``gspo``; ``gae``, ``reinforce``, ``rloo``,
``reinforce_baseline``, ``group_norm``, ``dr_grpo``, ``flash_reinforce``) keep OpenRLHF's code.
A stablerl algorithm whose name collides is reachable as ``stablerl_<name>`` (``stablerl_gspo``,
``stablerl_rloo``, ``stablerl_dr_grpo``); every stablerl name is also accepted with the prefix.

How the patches reach the workers (nothing is patched in the driver):

* ``python -m stablerl.adapters.openrlhf.train_ppo_ray <OpenRLHF flags>``: the wrapper CLI adds
  ``worker_process_setup_hook="stablerl.adapters.openrlhf.instrument"`` to the ``runtime_env`` of
  OpenRLHF's ``ray.init``;
* no wrapper: ``RAY_RUNTIME_ENV_HOOK=stablerl.adapters.openrlhf.add_setup_hook`` in the driver's
  environment (selection by ``STABLERL_POLICY_LOSS`` / ``STABLERL_ADVANTAGE_ESTIMATOR`` /
  ``STABLERL_REWARD_SHAPER`` / ``STABLERL_BATCH_FILTER`` env vars, each with a ``..._PARAMS`` one),
  or a job-level ``runtime_env`` with that setup hook (``ray job submit``).

:func:`instrument` is light: it imports no OpenRLHF module; a ``sys.meta_path`` post-import hook applies
each patch when (and if) the worker imports the module that owns the patched class. Every patch is
recorded in one ledger (:mod:`._patches`): applied once per process (:func:`instrument` is idempotent)
and undone by :func:`uninstrument`.
"""

from __future__ import annotations

# The package only re-exports: its submodules import each other, never this module.
from ._names import advantage_settings, extension_choices, loss_settings, openrlhf_choices, resolve, resolve_extension
from ._patches import instrument, is_applied, uninstrument
from ._selection import Selection, add_setup_hook, extensions_from_env, parse_params, selection_from_args  # noqa: F401
from ._spec import (  # noqa: F401  (the package's public names)
    ENV_ADVANTAGE,
    ENV_ADVANTAGE_PARAMS,
    ENV_BATCH_FILTER,
    ENV_BATCH_FILTER_PARAMS,
    ENV_CHAINED_SETUP_HOOK,
    ENV_POLICY_LOSS,
    ENV_POLICY_LOSS_PARAMS,
    ENV_PREVIOUS_RUNTIME_ENV_HOOK,
    ENV_REWARD_SHAPER,
    ENV_REWARD_SHAPER_PARAMS,
    ENV_ROUTING_REPLAY,
    OPENRLHF,
    FEEDABLE_ADVANTAGE_INPUTS,
    FEEDABLE_EXTENSION_INPUTS,
    FEEDABLE_LOSS_INPUTS,
    FILTER_FLAG,
    OPENRLHF_ADV_ESTIMATORS,
    OPENRLHF_POLICY_LOSSES,
    PREFIX,
    REWARD_FUNCTION_INPUTS,
    SETUP_HOOK,
    SHAPER_FLAG,
    SUPPORTED_OPENRLHF,
    UnsupportedOpenRLHFVersionError,
    check_openrlhf,
    openrlhf_version,
)


def _deprecated(old: str, new: str) -> None:
    import warnings

    warnings.warn(f"stablerl.adapters.openrlhf.{old}() is deprecated; use {new}", DeprecationWarning, stacklevel=3)


def setup() -> None:
    """Deprecated name of :func:`instrument` (a ``worker_process_setup_hook`` naming it still works)."""
    _deprecated("setup", "instrument()")
    instrument()


def apply() -> None:
    """Deprecated: ``instrument(now=True)``."""
    _deprecated("apply", "instrument(now=True)")
    instrument(now=True)


def remove() -> None:
    """Deprecated: :func:`uninstrument`."""
    _deprecated("remove", "uninstrument()")
    uninstrument()


def __getattr__(name: str):
    # StablePolicyLoss subclasses OpenRLHF's PolicyLoss, whose import is heavy (openrlhf.models):
    # build it on first access only, so `instrument` stays light.
    if name == "StablePolicyLoss":
        from ._loss import StablePolicyLoss

        return StablePolicyLoss
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SUPPORTED_OPENRLHF", "OPENRLHF_POLICY_LOSSES", "OPENRLHF_ADV_ESTIMATORS", "PREFIX", "Selection",
    "UnsupportedOpenRLHFVersionError", "check_openrlhf", "openrlhf_choices", "resolve", "parse_params",
    "extension_choices", "resolve_extension", "loss_settings", "advantage_settings", "OPENRLHF",
    "selection_from_args", "instrument", "uninstrument", "is_applied",
    "add_setup_hook", "StablePolicyLoss",
]
