"""What the user selected (the wrapper CLI's ``args.stablerl``, or the ``STABLERL_*`` environment of the
no-wrapper route), resolved and validated by core's rules (``stablerl.frameworks``: one name rule, one
precedence rule), and the Ray ``runtime_env`` hook that carries it to every worker."""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

import stablerl
from stablerl.contracts import ADVANTAGE_ESTIMATOR as _ADV, CONTROLLER as _CONTROLLER, POLICY_LOSS as _LOSS
from stablerl.frameworks import (as_params, check_call_options, check_framework_keys_used, check_shaper_and_components,
                                 effective_hyperparameters, selectable_names, split_call_options)
from stablerl.frameworks import resolve as _resolve_in
from stablerl.params import MissingInputError, StableRLError, build_params, parse_params  # noqa: F401 (re-export)

from ._spec import (_FILTER, _FORWARDED_ENV, _SHAPER, COMPONENT_WEIGHTS_FLAG, COMPONENTS_FLAG, CONTROLLER_FLAG,
                    ENV_ADVANTAGE, ENV_ADVANTAGE_PARAMS, ENV_BATCH_FILTER, ENV_BATCH_FILTER_PARAMS,
                    ENV_CHAINED_SETUP_HOOK, ENV_CONTROLLER, ENV_CONTROLLER_PARAMS,
                    ENV_POLICY_LOSS, ENV_POLICY_LOSS_PARAMS, ENV_PREVIOUS_RUNTIME_ENV_HOOK, ENV_REWARD_SHAPER,
                    ENV_REWARD_SHAPER_PARAMS, ENV_ROUTING_REPLAY, FILTER_FLAG, LEGACY_SETUP_HOOK, OPENRLHF, SETUP_HOOK,
                    SHAPER_FLAG)


def openrlhf_choices(kind: str) -> list[str]:
    """The names the wrapper's argparse lists: OpenRLHF's, then every stablerl algorithm OpenRLHF can feed."""
    return selectable_names(OPENRLHF, kind)


def resolve(kind: str, name: Optional[str]) -> Optional[str]:
    """The stablerl algorithm ``name`` selects, or None for an OpenRLHF built-in (or None): core's one name rule
    (:func:`stablerl.frameworks.resolve`; unknown names and inputs OpenRLHF cannot feed raise, saying why)."""
    return _resolve_in(OPENRLHF, kind, name)


def check_rollout_log_probs(spec, call_options: dict, is_correction_level: str) -> None:
    """A loss that reads the vLLM log-probs (``decoupled_ppo``) or a stablerl rollout correction needs
    OpenRLHF's IS correction on: OpenRLHF requests the vLLM log-probs only then."""
    correction = call_options.get("rollout_correction")
    if ("rollout_log_prob" in spec.requires or correction) and is_correction_level == "off":
        what = f"rollout_correction={correction!r}" if correction else f"policy loss {spec.name!r}"
        raise MissingInputError(
            f"{what} needs rollout log-probs: set --algo.advantage.is_correction_level token|seq (OpenRLHF requests "
            "vLLM log-probs only then; its own IS weights are then not applied)")


@dataclass
class Selection:
    """What the user selected: stablerl names (None: OpenRLHF's own) and their hyper-parameters.

    The wrapper CLI attaches one to OpenRLHF's args as ``args.stablerl``; it travels to every model
    actor inside the pickled ``DeepspeedStrategy``."""

    policy_loss: Optional[str] = None
    policy_loss_params: dict = field(default_factory=dict)
    advantage_estimator: Optional[str] = None
    advantage_params: dict = field(default_factory=dict)
    #: OpenRLHF knobs given on the command line (one precedence rule: left at OpenRLHF's defaults, they leave the
    #: paper's defaults in place): clip flags as clip_ratio_low/high/c; --algo.advantage.no_std_norm / gamma;
    #: --reward.clip_range (its default is not applied to a stablerl estimator)
    openrlhf_clip: dict = field(default_factory=dict)
    openrlhf_advantage: dict = field(default_factory=dict)
    reward_clip_range: Optional[tuple] = None
    #: MoE routing replay (--actor.stablerl_routing_replay): "R2", "R3", or None (native routing)
    routing_replay: Optional[str] = None
    reward_shaper: Optional[str] = None
    reward_shaper_params: dict = field(default_factory=dict)
    batch_filter: Optional[str] = None
    batch_filter_params: dict = field(default_factory=dict)
    #: an entropy controller stepped once per optimizer step in the actor workers (._controller)
    entropy_controller: Optional[str] = None
    entropy_controller_params: dict = field(default_factory=dict)
    #: the reward function's extra_logs keys handed to the estimator as reward_components (GDPO), their weights
    reward_components: tuple = ()
    reward_weights: tuple = ()

    def loss_settings(self) -> list:
        """The loss's effective hyper-parameters with their sources: ``--actor.stablerl_params`` > the clip flags
        given on the command line > the paper's defaults (:data:`stablerl.frameworks.PRECEDENCE`)."""
        clip = dict(self.openrlhf_clip or {})
        return effective_hyperparameters(OPENRLHF, stablerl.get_spec(_LOSS, self.policy_loss),
                                         self.policy_loss_params, clip, user_set=set(clip))

    def advantage_settings(self) -> list:
        """The estimator's: ``--algo.advantage.stablerl_params`` > the advantage knobs given > the paper's
        defaults; a knob the estimator cannot honour is refused."""
        spec = stablerl.get_spec(_ADV, self.advantage_estimator)
        given = dict(self.openrlhf_advantage or {})
        check_framework_keys_used(OPENRLHF, spec, given, user_set=set(given))
        return effective_hyperparameters(OPENRLHF, spec, self.advantage_params, given, user_set=set(given))

    def requires(self, kind: str, what: str) -> bool:
        """Whether the selected algorithm of ``kind`` declares input ``what``."""
        name = {_LOSS: self.policy_loss, _ADV: self.advantage_estimator, _SHAPER: self.reward_shaper,
                _FILTER: self.batch_filter}[kind]
        return name is not None and what in stablerl.get_spec(kind, name).requires

    def needs_old_pass_entropy(self) -> bool:
        """A loss declaring ``old_entropy``, or an estimator / shaper / filter declaring ``entropy`` (they run after
        the old-log-prob pass): that pass then returns its entropy (``._inputs``)."""
        return self.requires(_LOSS, "old_entropy") or any(self.requires(k, "entropy") for k in (_ADV, _SHAPER, _FILTER))

    @property
    def has_extensions(self) -> bool:
        return self.reward_shaper is not None or self.batch_filter is not None

    def validate(self) -> "Selection":
        """Build the Params the workers will build (the effective ones) now, so a bad key or value fails in the
        driver, before Ray starts."""
        if self.policy_loss is not None:
            spec = stablerl.get_spec(_LOSS, self.policy_loss)
            hyper, options = split_call_options(as_params(self.loss_settings()))
            build_params(spec, hyper)
            check_call_options(OPENRLHF, spec, options, hyper)
        elif self.policy_loss_params:
            raise StableRLError("stablerl loss hyper-parameters given, but --actor.policy_loss_type is an OpenRLHF "
                                "built-in")
        if self.advantage_estimator is not None:
            spec = stablerl.get_spec(_ADV, self.advantage_estimator)
            build_params(spec, as_params(self.advantage_settings()))
            check_shaper_and_components(self.reward_shaper, spec, bool(self.reward_components), COMPONENTS_FLAG)
        elif self.advantage_params:
            raise StableRLError("stablerl advantage hyper-parameters given, but --algo.advantage.estimator is an "
                                "OpenRLHF built-in")
        elif self.reward_components:
            raise StableRLError(f"{COMPONENTS_FLAG} given, but --algo.advantage.estimator is an OpenRLHF built-in "
                                "(only stablerl estimators read reward components)")
        if self.reward_weights and len(self.reward_weights) != len(self.reward_components):
            raise StableRLError(f"{COMPONENT_WEIGHTS_FLAG} has {len(self.reward_weights)} values for "
                                f"{len(self.reward_components)} {COMPONENTS_FLAG} names")
        for kind, name, params, flag in ((_SHAPER, self.reward_shaper, self.reward_shaper_params, SHAPER_FLAG),
                                         (_FILTER, self.batch_filter, self.batch_filter_params, FILTER_FLAG),
                                         (_CONTROLLER, self.entropy_controller, self.entropy_controller_params,
                                          CONTROLLER_FLAG)):
            if name is not None:
                build_params(stablerl.get_spec(kind, name), params)
            elif params:
                raise StableRLError(f"{flag}_params given, but no {flag}")
        return self


loss_settings, advantage_settings = Selection.loss_settings, Selection.advantage_settings  # f(selection)


def _from_env(args: Any = None) -> Selection:
    """The no-wrapper route's selection: the ``STABLERL_*`` variables, else the names OpenRLHF's own flags in
    ``args`` hold (parameters only with a name from the environment)."""
    env = os.environ
    actor, algo = getattr(args, "actor", None), getattr(args, "algo", None)
    loss, adv = env.get(ENV_POLICY_LOSS), env.get(ENV_ADVANTAGE)
    return Selection(
        policy_loss=resolve(_LOSS, loss or getattr(actor, "policy_loss_type", None)),
        policy_loss_params=parse_params(env.get(ENV_POLICY_LOSS_PARAMS), ENV_POLICY_LOSS_PARAMS) if loss else {},
        advantage_estimator=resolve(_ADV, adv or getattr(getattr(algo, "advantage", None), "estimator", None)),
        advantage_params=parse_params(env.get(ENV_ADVANTAGE_PARAMS), ENV_ADVANTAGE_PARAMS) if adv else {},
        routing_replay=env.get(ENV_ROUTING_REPLAY) or None,
        reward_shaper=resolve(_SHAPER, env.get(ENV_REWARD_SHAPER) or None),
        reward_shaper_params=parse_params(env.get(ENV_REWARD_SHAPER_PARAMS), ENV_REWARD_SHAPER_PARAMS),
        batch_filter=resolve(_FILTER, env.get(ENV_BATCH_FILTER) or None),
        batch_filter_params=parse_params(env.get(ENV_BATCH_FILTER_PARAMS), ENV_BATCH_FILTER_PARAMS),
        entropy_controller=resolve(_CONTROLLER, env.get(ENV_CONTROLLER) or None),
        entropy_controller_params=parse_params(env.get(ENV_CONTROLLER_PARAMS), ENV_CONTROLLER_PARAMS),
    )


def selection_from_args(args) -> Selection:
    """The selection for OpenRLHF ``args``: ``args.stablerl`` (wrapper), else the no-wrapper route's."""
    sel = getattr(args, "stablerl", None)
    if isinstance(sel, Selection):
        return sel
    return Selection(**sel) if isinstance(sel, dict) else _from_env(args)


# ----------------------------------------------------------------------------- Ray runtime_env


def _load_callable(path: str):
    module, _, attr = path.rpartition(".")
    if not module:
        raise ValueError(f"expected 'module.function', got {path!r}")
    return getattr(importlib.import_module(module), attr)


ZERO_COPY_ENV = "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"


def add_setup_hook(runtime_env: Optional[dict] = None, selection: Optional[Selection] = None) -> dict:
    """A ``RAY_RUNTIME_ENV_HOOK``: ``runtime_env`` plus the stablerl worker setup hook.

    Also forwards the STABLERL_* selection variables to every worker, keeps a user's own
    ``worker_process_setup_hook`` (chained through ``$STABLERL_CHAINED_SETUP_HOOK``), calls a previous
    ``RAY_RUNTIME_ENV_HOOK`` saved in ``$STABLERL_PREVIOUS_RAY_RUNTIME_ENV_HOOK`` and keeps the tensor attributes
    the ``selection`` (the wrapper's; else the environment's, validated here, before Ray starts) needs."""
    selection = selection or _from_env().validate()
    previous = os.environ.get(ENV_PREVIOUS_RUNTIME_ENV_HOOK)
    if previous and previous != "stablerl.adapters.openrlhf.add_setup_hook":
        runtime_env = _load_callable(previous)(runtime_env)
    env = dict(runtime_env or {})
    existing = env.get("worker_process_setup_hook")
    env_vars = dict(env.get("env_vars") or {})
    if existing and existing not in (SETUP_HOOK, LEGACY_SETUP_HOOK):
        if not isinstance(existing, str):
            raise ValueError("runtime_env already has a callable worker_process_setup_hook; give it as a "
                             "'module.function' string so stablerl can chain it")
        env_vars[ENV_CHAINED_SETUP_HOOK] = existing
    env["worker_process_setup_hook"] = SETUP_HOOK
    for key in _FORWARDED_ENV:
        if key in os.environ and key not in env_vars:
            env_vars[key] = os.environ[key]
    if selection.routing_replay or selection.needs_old_pass_entropy():
        # the routes / old-pass entropy ride on a log-prob tensor as an attribute, which Ray's zero-copy tensor
        # serializer drops (OpenRLHF's train() turns it on unless set): off, said on stderr
        what = "routes" if selection.routing_replay else "entropy"
        if env_vars.get(ZERO_COPY_ENV, "0") != "0":
            why = "routing replay" if selection.routing_replay else "the old-log-prob pass's entropy"
            print(f"stablerl/openrlhf: {why} sets {ZERO_COPY_ENV}=0 for the Ray workers (was "
                  f"{env_vars[ZERO_COPY_ENV]!r}): Ray's zero-copy tensor serializer drops the {what} carried on the log-prob tensors",
                  file=sys.stderr, flush=True)
        env_vars[ZERO_COPY_ENV] = "0"
    if env_vars:
        env["env_vars"] = env_vars
    return env
