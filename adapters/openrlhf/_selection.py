"""What the user selected (the wrapper CLI's ``args.stablerl``, or the ``STABLERL_*`` environment of the
no-wrapper route), resolved and validated by core's rules (``stablerl.frameworks``: one name rule, one
precedence rule), and the Ray ``runtime_env`` hook that carries it to every worker."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

import stablerl
from stablerl.algorithm_selection import AlgorithmSelection
from stablerl.contracts import ADVANTAGE_ESTIMATOR as _ADV, POLICY_LOSS as _LOSS
from stablerl.frameworks import check_framework_keys_used, effective_hyperparameters, get_framework, selectable_names
from stablerl.frameworks import resolve as _resolve_in
from stablerl.ray_setup import with_setup_hook, without_zero_copy
from stablerl.params import MissingInputError, StableRLError, build_params, parse_params  # noqa: F401 (re-export)

from ._flags import (ADD_SETUP_HOOK, COMPONENT_WEIGHTS_FLAG, COMPONENTS_FLAG, CONTROLLER_FLAG, ENV_CHAINED_SETUP_HOOK,
                     ENV_PREVIOUS_RUNTIME_ENV_HOOK, ENV_ROUTING_REPLAY, ENV_SAMPLING_REPLAY, ENV_SELECTION,
                     FORWARDED_ENV, IS_CORRECTION_FLAG, LEGACY_SETUP_HOOK, NAME, SETUP_HOOK)


def openrlhf_choices(kind: str) -> list[str]:
    """The names the wrapper's argparse lists: OpenRLHF's, then every stablerl algorithm OpenRLHF can feed."""
    return selectable_names(get_framework(NAME), kind)


def resolve(kind: str, name: Optional[str]) -> Optional[str]:
    """The stablerl algorithm ``name`` selects, or None for an OpenRLHF built-in (or None): core's one name rule
    (:func:`stablerl.frameworks.resolve`; unknown names and inputs OpenRLHF cannot feed raise, saying why)."""
    return _resolve_in(NAME, kind, name)


def check_rollout_log_probs(spec, call_options: dict, is_correction_level: str) -> None:
    """A loss that reads the vLLM log-probs (``decoupled_ppo``) or a stablerl rollout correction needs
    OpenRLHF's IS correction on: OpenRLHF requests the vLLM log-probs only then."""
    correction = call_options.get("rollout_correction")
    if ("rollout_log_prob" in spec.requires or correction) and is_correction_level == "off":
        what = f"rollout_correction={correction!r}" if correction else f"policy loss {spec.name!r}"
        raise MissingInputError(
            f"{what} needs rollout log-probs: set {IS_CORRECTION_FLAG} token|seq (OpenRLHF requests "
            "vLLM log-probs only then; its own IS weights are then not applied)")


def check_entropy_coef_unset(controller: Optional[str], actor_args) -> None:
    """An entropy controller sets OpenRLHF's ``--actor.entropy_coef`` itself: a value the user gave is refused."""
    coef = getattr(actor_args, "entropy_coef", None)
    if controller is not None and coef not in (None, 0, 0.0):
        raise StableRLError(f"{CONTROLLER_FLAG} {controller} sets OpenRLHF's entropy bonus itself: leave "
                            f"--actor.entropy_coef unset (got {coef}); the initial coefficient is the controller's "
                            "entropy_coef")


@dataclass
class Selection(AlgorithmSelection):
    """What the user selected (core's :class:`~stablerl.algorithm_selection.AlgorithmSelection`: stablerl names,
    None: OpenRLHF's own, and their hyper-parameters; its ``validate()``) with OpenRLHF's own knobs.

    The wrapper CLI attaches one to OpenRLHF's args as ``args.stablerl``; it travels to every model
    actor inside the pickled ``DeepspeedStrategy``."""

    framework, label = NAME, "OpenRLHF"
    components_key, weights_key = COMPONENTS_FLAG, COMPONENT_WEIGHTS_FLAG
    #: OpenRLHF knobs given on the command line (one precedence rule: left at OpenRLHF's defaults, they leave the
    #: paper's defaults in place): clip flags as clip_ratio_low/high/c; --algo.advantage.no_std_norm / gamma;
    #: --reward.clip_range (its default is not applied to a stablerl estimator)
    openrlhf_clip: dict = field(default_factory=dict)
    openrlhf_advantage: dict = field(default_factory=dict)
    reward_clip_range: Optional[tuple] = None
    #: MoE routing replay (--actor.stablerl_routing_replay): "R2", "R3", or None (native routing)
    routing_replay: Optional[str] = None
    #: sampling-mask replay (--algo.advantage.sampling_mask_replay, ``._sampling_mask``): the resolved decision
    sampling_replay: Any = None

    def old_pass_stats(self) -> frozenset:
        """Core's, and ``log_kept_mass`` when sampling-mask replay is on (the old-log-prob pass measures it)."""
        on = self.sampling_replay is not None and self.sampling_replay.on
        return super().old_pass_stats() | frozenset({"log_kept_mass"} if on else ())

    def loss_settings(self) -> list:
        """The loss's effective hyper-parameters with their sources: ``--actor.stablerl_params`` > the clip flags
        given on the command line > the paper's defaults (:data:`stablerl.frameworks.PRECEDENCE`)."""
        clip = dict(self.openrlhf_clip or {})
        return effective_hyperparameters(NAME, stablerl.get_spec(_LOSS, self.policy_loss),
                                         self.policy_loss_params, clip, user_set=set(clip))

    def advantage_settings(self) -> list:
        """The estimator's: ``--algo.advantage.stablerl_params`` > the advantage knobs given > the paper's
        defaults; a knob the estimator cannot honour is refused."""
        spec = stablerl.get_spec(_ADV, self.advantage_estimator)
        given = dict(self.openrlhf_advantage or {})
        check_framework_keys_used(NAME, spec, given, user_set=set(given))
        return effective_hyperparameters(NAME, spec, self.advantage_params, given, user_set=set(given))


loss_settings, advantage_settings = Selection.loss_settings, Selection.advantage_settings  # f(selection)


def _from_env(args: Any = None) -> Selection:
    """The no-wrapper route's selection: the ``STABLERL_*`` variables, else the names OpenRLHF's own flags in
    ``args`` hold (parameters only with a name from the environment)."""
    actor, algo = getattr(args, "actor", None), getattr(args, "algo", None)
    given = {_LOSS: getattr(actor, "policy_loss_type", None),
             _ADV: getattr(getattr(algo, "advantage", None), "estimator", None)}
    return Selection.from_env(os.environ, ENV_SELECTION, given, routing_replay=os.environ.get(ENV_ROUTING_REPLAY) or None,
                              sampling_replay=_env_replay(args))


def _env_replay(args: Any):
    from ._sampling_mask import decide

    return decide(args, os.environ.get(ENV_SAMPLING_REPLAY), key=ENV_SAMPLING_REPLAY) if args is not None else None


def selection_from_args(args) -> Selection:
    """The selection for OpenRLHF ``args``: ``args.stablerl`` (wrapper), else the no-wrapper route's."""
    sel = getattr(args, "stablerl", None)
    if isinstance(sel, Selection):
        return sel
    return Selection(**sel) if isinstance(sel, dict) else _from_env(args)


# ----------------------------------------------------------------------------- Ray runtime_env



def add_setup_hook(runtime_env: Optional[dict] = None, selection: Optional[Selection] = None) -> dict:
    """A ``RAY_RUNTIME_ENV_HOOK``: ``runtime_env`` plus the stablerl worker setup hook (core's
    :func:`~stablerl.ray_setup.with_setup_hook`: the STABLERL_* variables forwarded, a user's own setup hook chained
    through ``$STABLERL_CHAINED_SETUP_HOOK``, a previous ``RAY_RUNTIME_ENV_HOOK`` in
    ``$STABLERL_PREVIOUS_RAY_RUNTIME_ENV_HOOK`` called first), keeping the tensor attributes the ``selection`` (the
    wrapper's; else the environment's, validated here, before Ray starts) needs."""
    selection = selection or _from_env().validate()
    env = with_setup_hook(runtime_env, SETUP_HOOK, ours=(SETUP_HOOK, LEGACY_SETUP_HOOK, ADD_SETUP_HOOK),
                          chained_env=ENV_CHAINED_SETUP_HOOK, previous_env=ENV_PREVIOUS_RUNTIME_ENV_HOOK,
                          forward=FORWARDED_ENV)
    stats = selection.old_pass_stats()
    if selection.routing_replay or stats:
        # the routes / old-pass statistics ride on a log-prob tensor as an attribute (OpenRLHF's train() turns Ray's
        # zero-copy serializer on unless set): off, said on stderr
        what = "routes" if selection.routing_replay else " and ".join(sorted(stats))
        without_zero_copy(env, why="routing replay" if selection.routing_replay else f"the old-log-prob pass's {what}",
                          what=what, carrier="log-prob tensors", label="stablerl/openrlhf")
    return env
