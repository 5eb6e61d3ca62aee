"""What the user selected (the wrapper CLI's ``args.stablerl``, or the ``STABLERL_*`` environment of the
no-wrapper route) and the Ray ``runtime_env`` hook that carries it to every worker."""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from ._names import resolve, resolve_extension
from ._spec import (
    _FILTER,
    _FORWARDED_ENV,
    _SHAPER,
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
    FILTER_FLAG,
    LEGACY_SETUP_HOOK,
    SETUP_HOOK,
    SHAPER_FLAG,
    COMPONENT_WEIGHTS_FLAG,
    COMPONENTS_FLAG,
)

def parse_params(value: Any, flag: str) -> dict[str, Any]:
    """Hyper-parameters from the CLI: ``KEY=VALUE`` items (VALUE read as JSON, else a string) or
    one JSON object; a dict passes through."""
    from stablerl.params import StableRLError

    if value is None or value == "" or value == []:
        return {}
    if isinstance(value, dict):
        return dict(value)
    items = [value] if isinstance(value, str) else list(value)
    if len(items) == 1 and items[0].lstrip().startswith("{"):
        try:
            out = json.loads(items[0])
        except json.JSONDecodeError as e:
            raise StableRLError(f"{flag}: not a JSON object ({e}): {items[0]!r}") from None
        if not isinstance(out, dict):
            raise StableRLError(f"{flag}: expected a JSON object, got {items[0]!r}")
        return out
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise StableRLError(f"{flag}: expected KEY=VALUE items (e.g. m2_threshold=0.04), got {item!r}")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


@dataclass
class Selection:
    """What the user selected: stablerl names (None: OpenRLHF's own) and their hyper-parameters.

    The wrapper CLI attaches one to OpenRLHF's args as ``args.stablerl``; it travels to every model
    actor inside the pickled ``DeepspeedStrategy``."""

    policy_loss: Optional[str] = None
    policy_loss_params: dict = field(default_factory=dict)
    advantage_estimator: Optional[str] = None
    advantage_params: dict = field(default_factory=dict)
    #: OpenRLHF clip flags given explicitly (--actor.eps_clip, --actor.eps_clip_low_high,
    #: --actor.dual_clip) as clip_ratio_low/high/c: they set those fields of a stablerl loss that
    #: has them. Flags left at OpenRLHF's defaults leave the paper's defaults in place.
    openrlhf_clip: dict = field(default_factory=dict)
    #: --algo.advantage.no_std_norm given: {"norm_adv_by_std_in_grpo": False} (honoured where the stablerl
    #: estimator has the switch, refused where it has not)
    openrlhf_advantage: dict = field(default_factory=dict)
    #: --reward.clip_range given on the command line: OpenRLHF's clamp of the baseline-shaped reward, then
    #: applied to the stablerl estimator's advantages too; its default is not (one behaviour in every framework)
    reward_clip_range: Optional[tuple] = None
    #: MoE routing replay (--actor.stablerl_routing_replay): "R2", "R3", or None (native routing)
    routing_replay: Optional[str] = None
    #: --algo.advantage.stablerl_reward_shaper / --algo.advantage.stablerl_batch_filter (None: none)
    reward_shaper: Optional[str] = None
    reward_shaper_params: dict = field(default_factory=dict)
    batch_filter: Optional[str] = None
    batch_filter_params: dict = field(default_factory=dict)
    #: --algo.advantage.stablerl_reward_components: the reward function's extra_logs keys (one value per
    #: response, copied by OpenRLHF into experience.info) handed to the estimator as reward_components (GDPO);
    #: --algo.advantage.stablerl_reward_weights: their weights (reward_weights)
    reward_components: tuple = ()
    reward_weights: tuple = ()

    def validate(self) -> "Selection":
        """Build the Params the workers will build (the effective ones: stablerl keys and the OpenRLHF flags
        given, under the one precedence rule) now, so a bad key or value fails in the driver, not in a worker."""
        import stablerl
        from stablerl.frameworks import as_params
        from stablerl.params import build_params

        from ._names import advantage_settings, loss_settings

        if self.policy_loss is not None:
            from stablerl.frameworks import check_call_options, split_call_options

            from ._spec import OPENRLHF

            spec = stablerl.get_spec(stablerl.POLICY_LOSS, self.policy_loss)
            hyper, options = split_call_options(as_params(loss_settings(self)))
            build_params(spec, hyper)
            check_call_options(OPENRLHF, spec, options, hyper)
        elif self.policy_loss_params:
            raise stablerl.StableRLError("stablerl loss hyper-parameters given, but --actor.policy_loss_type is an OpenRLHF built-in")
        if self.advantage_estimator is not None:
            # a framework knob the estimator cannot honour is refused here too, in the driver
            build_params(stablerl.get_spec(stablerl.ADVANTAGE_ESTIMATOR, self.advantage_estimator),
                         as_params(advantage_settings(self)))
        elif self.advantage_params:
            raise stablerl.StableRLError(
                "stablerl advantage hyper-parameters given, but --algo.advantage.estimator is an OpenRLHF built-in"
            )
        if self.reward_weights and len(self.reward_weights) != len(self.reward_components):
            raise stablerl.StableRLError(
                f"{COMPONENT_WEIGHTS_FLAG} has {len(self.reward_weights)} values for "
                f"{len(self.reward_components)} {COMPONENTS_FLAG} names")
        if self.reward_components and self.advantage_estimator is None:
            raise stablerl.StableRLError(
                f"{COMPONENTS_FLAG} given, but --algo.advantage.estimator is an OpenRLHF built-in (only stablerl "
                "estimators read reward components)")
        if self.advantage_estimator is not None:
            from stablerl.frameworks import check_shaper_and_components

            check_shaper_and_components(self.reward_shaper,
                                        stablerl.get_spec(stablerl.ADVANTAGE_ESTIMATOR, self.advantage_estimator),
                                        bool(self.reward_components), COMPONENTS_FLAG)
        for kind, name, params, flag in ((_SHAPER, self.reward_shaper, self.reward_shaper_params, SHAPER_FLAG),
                                         (_FILTER, self.batch_filter, self.batch_filter_params, FILTER_FLAG)):
            if name is not None:
                build_params(stablerl.get_spec(kind, name), params)
            elif params:
                raise stablerl.StableRLError(f"{flag}_params given, but no {flag}")
        return self

    @property
    def has_extensions(self) -> bool:
        return self.reward_shaper is not None or self.batch_filter is not None


def selection_from_args(args) -> Selection:
    """The selection for OpenRLHF ``args``: ``args.stablerl`` (wrapper), else the STABLERL_* env vars
    (no-wrapper route), else the flag values themselves."""
    import stablerl

    sel = getattr(args, "stablerl", None)
    if isinstance(sel, Selection):
        return sel
    if isinstance(sel, dict):
        return Selection(**sel)
    env_loss, env_adv = os.environ.get(ENV_POLICY_LOSS), os.environ.get(ENV_ADVANTAGE)
    loss_name = env_loss or getattr(getattr(args, "actor", None), "policy_loss_type", None)
    adv_name = env_adv or getattr(getattr(getattr(args, "algo", None), "advantage", None), "estimator", None)
    return Selection(
        policy_loss=resolve(stablerl.POLICY_LOSS, loss_name),
        policy_loss_params=parse_params(os.environ.get(ENV_POLICY_LOSS_PARAMS), ENV_POLICY_LOSS_PARAMS) if env_loss else {},
        advantage_estimator=resolve(stablerl.ADVANTAGE_ESTIMATOR, adv_name),
        advantage_params=parse_params(os.environ.get(ENV_ADVANTAGE_PARAMS), ENV_ADVANTAGE_PARAMS) if env_adv else {},
        routing_replay=os.environ.get(ENV_ROUTING_REPLAY) or None,
        **extensions_from_env(),
    )


def extensions_from_env() -> dict[str, Any]:
    """The reward shaper / batch filter of the no-wrapper route (``STABLERL_REWARD_SHAPER`` etc.)."""
    out: dict[str, Any] = {}
    for slot, kind, env, env_params in (("reward_shaper", _SHAPER, ENV_REWARD_SHAPER, ENV_REWARD_SHAPER_PARAMS),
                                        ("batch_filter", _FILTER, ENV_BATCH_FILTER, ENV_BATCH_FILTER_PARAMS)):
        out[slot] = resolve_extension(kind, os.environ.get(env) or None)
        out[slot + "_params"] = parse_params(os.environ.get(env_params), env_params)
    return out


# ----------------------------------------------------------------------------- Ray runtime_env


def _load_callable(path: str):
    module, _, attr = path.rpartition(".")
    if not module:
        raise ValueError(f"expected 'module.function', got {path!r}")
    return getattr(importlib.import_module(module), attr)


ZERO_COPY_ENV = "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"


def keep_tensor_attributes(env_vars: dict, old_pass_entropy: bool = False) -> None:
    """Routing replay / the old-pass entropy: the workers' routes or entropy ride on a log-prob tensor as an
    attribute, which Ray's zero-copy tensor serializer drops. OpenRLHF 0.11.2's ``train()`` turns it on by
    default (``env_vars`` ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS`` = ``$RAY_ENABLE_ZERO_COPY_TORCH_TENSORS`` or
    "1"): switched off here, said on stderr."""
    import sys

    why, what = (("the old-log-prob pass's entropy", "entropy") if old_pass_entropy else ("routing replay", "routes"))
    if env_vars.get(ZERO_COPY_ENV, "0") != "0":
        print(f"stablerl/openrlhf: {why} sets {ZERO_COPY_ENV}=0 for the Ray workers (was "
              f"{env_vars[ZERO_COPY_ENV]!r}): Ray's zero-copy tensor serializer drops the {what} carried on the "
              "log-prob tensors", file=sys.stderr, flush=True)
    env_vars[ZERO_COPY_ENV] = "0"


def _reads_old_pass_entropy(extensions: Selection) -> bool:
    """The no-wrapper route's selection (STABLERL_* variables) reads the old-log-prob pass's entropy."""
    import stablerl

    from ._inputs import needs_old_pass_entropy

    sel = Selection(policy_loss=resolve(stablerl.POLICY_LOSS, os.environ.get(ENV_POLICY_LOSS) or None),
                    advantage_estimator=resolve(stablerl.ADVANTAGE_ESTIMATOR, os.environ.get(ENV_ADVANTAGE) or None),
                    reward_shaper=extensions.reward_shaper, batch_filter=extensions.batch_filter)
    return needs_old_pass_entropy(sel)


def add_setup_hook(runtime_env: Optional[dict] = None) -> dict:
    """A ``RAY_RUNTIME_ENV_HOOK``: ``runtime_env`` plus the stablerl worker setup hook.

    Also forwards the STABLERL_* selection variables to every worker, keeps a user's own
    ``worker_process_setup_hook`` (chained through ``$STABLERL_CHAINED_SETUP_HOOK``) and calls a
    previous ``RAY_RUNTIME_ENV_HOOK`` saved in ``$STABLERL_PREVIOUS_RAY_RUNTIME_ENV_HOOK``."""
    extensions = Selection(**extensions_from_env()).validate()  # a bad shaper / filter fails here, before Ray starts
    previous = os.environ.get(ENV_PREVIOUS_RUNTIME_ENV_HOOK)
    if previous and previous != "stablerl.adapters.openrlhf.add_setup_hook":
        runtime_env = _load_callable(previous)(runtime_env)
    env = dict(runtime_env or {})
    existing = env.get("worker_process_setup_hook")
    env_vars = dict(env.get("env_vars") or {})
    if existing and existing not in (SETUP_HOOK, LEGACY_SETUP_HOOK):
        if not isinstance(existing, str):
            raise ValueError(
                "runtime_env already has a callable worker_process_setup_hook; give it as a 'module.function' "
                "string so stablerl can chain it"
            )
        env_vars[ENV_CHAINED_SETUP_HOOK] = existing
    env["worker_process_setup_hook"] = SETUP_HOOK
    for key in _FORWARDED_ENV:
        if key in os.environ and key not in env_vars:
            env_vars[key] = os.environ[key]
    if os.environ.get(ENV_ROUTING_REPLAY):
        keep_tensor_attributes(env_vars)
    elif _reads_old_pass_entropy(extensions):
        keep_tensor_attributes(env_vars, old_pass_entropy=True)
    if env_vars:
        env["env_vars"] = env_vars
    return env
