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

How the patches reach the workers (nothing is patched in the driver except the CLI parser):

* ``python -m stablerl.adapters.openrlhf.train_ppo_ray <OpenRLHF flags>``: the wrapper CLI adds
  ``worker_process_setup_hook="stablerl.adapters.openrlhf.setup"`` to the ``runtime_env`` of
  OpenRLHF's ``ray.init``;
* no wrapper: ``RAY_RUNTIME_ENV_HOOK=stablerl.adapters.openrlhf.add_setup_hook`` in the driver's
  environment (selection by ``STABLERL_POLICY_LOSS`` / ``STABLERL_ADVANTAGE_ESTIMATOR`` /
  ``STABLERL_REWARD_SHAPER`` / ``STABLERL_BATCH_FILTER`` env vars, each with a ``..._PARAMS`` one),
  or a job-level ``runtime_env`` with that setup hook (``ray job submit``).

:func:`setup` is light: it imports no OpenRLHF module; a ``sys.meta_path`` post-import hook applies
each patch when (and if) the worker imports the module that owns the patched class. The patches
are reversible (:func:`remove`) and applied once per process (:func:`apply` is idempotent).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

#: The OpenRLHF versions this adapter supports: 0.11.2 changed PolicyLoss's IS-correction kwargs,
#: its 5-tuple return and the ``--algo.advantage.is_correction_*`` flags.
SUPPORTED_OPENRLHF = ">=0.11.2,<0.11.3"
_MIN, _MAX = (0, 11, 2), (0, 11, 3)

from stablerl.adapters import _post_import as post_import  # noqa: E402
from stablerl.adapters._patching import PatchLedger  # noqa: E402
from stablerl.adapters._versions import version_tuple  # noqa: E402
from stablerl.contracts import ADVANTAGE_ESTIMATOR as _ADV, POLICY_LOSS as _LOSS  # noqa: E402
from stablerl.contracts import BATCH_FILTER as _FILTER, REWARD_SHAPER as _SHAPER  # noqa: E402
from stablerl.frameworks import get_framework as _get_framework  # noqa: E402

#: OpenRLHF 0.11.2's own names (argparse choices of ``openrlhf/cli/train_ppo_ray.py``), the inputs the
#: adapter can feed and why not: declared once (stablerl.adapters.frameworks), read here and by
#: ``stablerl describe``. ``rollout_log_prob`` exists only while ``--algo.advantage.is_correction_level``
#: is not ``off``; entropy, token_ids and scores are fed by the training_step / Actor.forward patches (._inputs).
OPENRLHF = _get_framework("openrlhf")
OPENRLHF_POLICY_LOSSES = tuple(OPENRLHF.builtin_names[_LOSS])
OPENRLHF_ADV_ESTIMATORS = tuple(OPENRLHF.builtin_names[_ADV])
PREFIX = OPENRLHF.prefix
FEEDABLE_LOSS_INPUTS = OPENRLHF.feedable[_LOSS]
FEEDABLE_ADVANTAGE_INPUTS = OPENRLHF.feedable[_ADV]

#: Reward shapers and batch filters run at compute_advantages_and_returns on the whole rollout batch
#: (``_shape_filter``): prompt groups, the per-response rewards / the reward function's scores, the
#: response lengths, and per-response values of the user's reward function (its ``extra_logs``, which
#: OpenRLHF copies into ``experience.info``).
FEEDABLE_EXTENSION_INPUTS = OPENRLHF.feedable[_SHAPER] | OPENRLHF.feedable[_FILTER]
REWARD_FUNCTION_INPUTS = tuple(sorted(FEEDABLE_EXTENSION_INPUTS - {"index", "scores", "lengths"}))
SHAPER_FLAG = "--algo.advantage.stablerl_reward_shaper"
FILTER_FLAG = "--algo.advantage.stablerl_batch_filter"

#: Environment variables of the no-wrapper route (forwarded to every worker by add_setup_hook).
ENV_POLICY_LOSS = "STABLERL_POLICY_LOSS"
ENV_POLICY_LOSS_PARAMS = "STABLERL_POLICY_LOSS_PARAMS"
ENV_ADVANTAGE = "STABLERL_ADVANTAGE_ESTIMATOR"
ENV_ADVANTAGE_PARAMS = "STABLERL_ADVANTAGE_PARAMS"
ENV_ROUTING_REPLAY = "STABLERL_ROUTING_REPLAY"
ENV_REWARD_SHAPER = "STABLERL_REWARD_SHAPER"
ENV_REWARD_SHAPER_PARAMS = "STABLERL_REWARD_SHAPER_PARAMS"
ENV_BATCH_FILTER = "STABLERL_BATCH_FILTER"
ENV_BATCH_FILTER_PARAMS = "STABLERL_BATCH_FILTER_PARAMS"
ENV_CHAINED_SETUP_HOOK = "STABLERL_CHAINED_SETUP_HOOK"
ENV_PREVIOUS_RUNTIME_ENV_HOOK = "STABLERL_PREVIOUS_RAY_RUNTIME_ENV_HOOK"
_FORWARDED_ENV = (ENV_POLICY_LOSS, ENV_POLICY_LOSS_PARAMS, ENV_ADVANTAGE, ENV_ADVANTAGE_PARAMS, ENV_ROUTING_REPLAY,
                  ENV_REWARD_SHAPER, ENV_REWARD_SHAPER_PARAMS, ENV_BATCH_FILTER, ENV_BATCH_FILTER_PARAMS,
                  ENV_CHAINED_SETUP_HOOK)
SETUP_HOOK = "stablerl.adapters.openrlhf.setup"

_ACTOR_MODULE = "openrlhf.trainer.ray.ppo_actor"
_CRITIC_MODULE = "openrlhf.trainer.ray.ppo_critic"
_MAKER_MODULE = "openrlhf.trainer.ppo_utils.experience_maker"
# routing replay R3 (rollout routes): the vLLM rollout worker, the samples generator, the model actors' base
_LAUNCHER_MODULE = "openrlhf.trainer.ray.launcher"
_SAMPLES_MODULE = "openrlhf.trainer.ppo_utils.samples_generator"
_AGENT_MODULE = "openrlhf.utils.agent"
_VLLM_ARGS_MODULE = "vllm.engine.arg_utils"
# stablerl state in checkpoints: DeepSpeed's client_state (actors) and the trainer process's client_states
_STRATEGY_MODULE = "openrlhf.utils.deepspeed.deepspeed"
_TRAINER_MODULE = "openrlhf.trainer.ppo_trainer"


class UnsupportedOpenRLHFVersionError(ImportError):
    """The installed OpenRLHF is outside :data:`SUPPORTED_OPENRLHF`."""


# ----------------------------------------------------------------------------- version guard


def openrlhf_version() -> Optional[str]:
    """The installed OpenRLHF version (distribution metadata; imports nothing), or None."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    try:
        return version("openrlhf")
    except PackageNotFoundError:
        return None


def check_openrlhf(found: Optional[str] = None) -> str:
    """Raise :class:`UnsupportedOpenRLHFVersionError` unless OpenRLHF is in :data:`SUPPORTED_OPENRLHF`."""
    found = found if found is not None else openrlhf_version()
    if found is None:
        raise UnsupportedOpenRLHFVersionError(
            f"stablerl.adapters.openrlhf needs OpenRLHF (openrlhf{SUPPORTED_OPENRLHF}), which is not installed: "
            f"pip install 'openrlhf{SUPPORTED_OPENRLHF}'"
        )
    if not (_MIN <= version_tuple(found) < _MAX):
        raise UnsupportedOpenRLHFVersionError(
            f"stablerl.adapters.openrlhf supports openrlhf{SUPPORTED_OPENRLHF} (0.11.2 only), found openrlhf {found}. "
            "OpenRLHF 0.11.2 changed PolicyLoss (is_correction_* kwargs, 5-value return) and its CLI flags; "
            f"install a supported version: pip install 'openrlhf{SUPPORTED_OPENRLHF}'"
        )
    return found


def _check_policy_loss_api(policy_loss_cls) -> None:
    import inspect

    params = inspect.signature(policy_loss_cls.__init__).parameters
    needed = ("clip_eps_low", "clip_eps_high", "dual_clip", "token_level_loss", "policy_loss_type", "is_correction_level",
              "is_correction_mode", "is_correction_gating", "is_correction_threshold")
    missing = [p for p in needed if p not in params]
    fwd = inspect.signature(policy_loss_cls.forward).parameters
    missing += [f"forward({p})" for p in ("rollout_log_probs", "dp_size", "batch_num_tokens", "global_batch_size")
                if p not in fwd]
    if missing:
        raise UnsupportedOpenRLHFVersionError(
            f"OpenRLHF's PolicyLoss lacks {missing}; stablerl.adapters.openrlhf supports openrlhf{SUPPORTED_OPENRLHF}"
        )


# ----------------------------------------------------------------------------- names and selection


def _registry_names(kind: str) -> list[str]:
    import stablerl

    return [s.name for s in stablerl.list_algorithms(kind) if s.status != stablerl.UNAVAILABLE]


def openrlhf_choices(kind: str) -> list[str]:
    """The names the wrapper's argparse lists: OpenRLHF's, then every stablerl algorithm OpenRLHF
    can feed (bare where free, ``stablerl_<name>`` where OpenRLHF has the same name)."""
    from stablerl.frameworks import selectable_names

    return selectable_names(OPENRLHF, kind)


def resolve(kind: str, name: Optional[str]) -> Optional[str]:
    """The stablerl algorithm ``name`` selects, or None for an OpenRLHF built-in (or None): core's one
    rule for every framework (:func:`stablerl.frameworks.resolve`). Unknown names raise
    :class:`stablerl.UnknownNameError` listing the valid ones; inputs OpenRLHF cannot feed raise
    :class:`stablerl.MissingInputError` saying why."""
    from stablerl.frameworks import resolve as resolve_in

    return resolve_in(OPENRLHF, kind, name)


def extension_choices(kind: str) -> list[str]:
    """The reward shapers / batch filters OpenRLHF can feed (names of the wrapper's argparse choices)."""
    return openrlhf_choices(kind)


def resolve_extension(kind: str, name: Optional[str]) -> Optional[str]:
    """The stablerl reward shaper / batch filter ``name`` (None: none), under the same rule as :func:`resolve`."""
    return resolve(kind, name)


def loss_settings(selection: "Selection") -> list:
    """The effective hyper-parameters of the selected stablerl loss, with their sources (one precedence
    rule, :data:`stablerl.frameworks.PRECEDENCE`): ``--actor.stablerl_params`` > the OpenRLHF clip flags
    given on the command line (``selection.openrlhf_clip``) > the paper's defaults."""
    import stablerl
    from stablerl.frameworks import effective_hyperparameters

    clip = dict(selection.openrlhf_clip or {})
    return effective_hyperparameters(OPENRLHF, stablerl.get_spec(_LOSS, selection.policy_loss),
                                     selection.policy_loss_params, clip, user_set=set(clip))


def advantage_settings(selection: "Selection") -> list:
    """The effective hyper-parameters of the selected stablerl estimator: ``--algo.advantage.stablerl_params``
    > ``--algo.advantage.no_std_norm`` when given (``selection.openrlhf_advantage``; refused for an
    estimator without a std-normalisation switch) > the paper's defaults."""
    import stablerl
    from stablerl.frameworks import check_framework_keys_used, effective_hyperparameters

    spec = stablerl.get_spec(_ADV, selection.advantage_estimator)
    given = dict(selection.openrlhf_advantage or {})
    check_framework_keys_used(OPENRLHF, spec, given, user_set=set(given))
    return effective_hyperparameters(OPENRLHF, spec, selection.advantage_params, given, user_set=set(given))


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

    def validate(self) -> "Selection":
        """Build the Params now so a bad key or value fails in the driver, not in a worker."""
        import stablerl
        from stablerl.params import build_params

        if self.policy_loss is not None:
            build_params(stablerl.get_spec(stablerl.POLICY_LOSS, self.policy_loss), self.policy_loss_params)
        elif self.policy_loss_params:
            raise stablerl.StableRLError("stablerl loss hyper-parameters given, but --actor.policy_loss_type is an OpenRLHF built-in")
        if self.advantage_estimator is not None:
            build_params(stablerl.get_spec(stablerl.ADVANTAGE_ESTIMATOR, self.advantage_estimator), self.advantage_params)
            advantage_settings(self)  # a framework knob the estimator cannot honour is refused here, in the driver
        elif self.advantage_params:
            raise stablerl.StableRLError(
                "stablerl advantage hyper-parameters given, but --algo.advantage.estimator is an OpenRLHF built-in"
            )
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


# ----------------------------------------------------------------------------- patches

_LOCK = threading.RLock()
_PATCHES = PatchLedger("__stablerl_openrlhf_patch__")


def _set_patch(key: str, owner: Any, attr: str, new: Any) -> None:
    _PATCHES.set_attr(key, owner, attr, new)  # once per process; remove() undoes it


def _patch_actor_module(module) -> None:
    """Wrap ``ActorPPOTrainer.__init__``: a stablerl policy_loss_type replaces the loss it built."""
    check_openrlhf()
    _check_policy_loss_api(module.PolicyLoss)
    cls = module.ActorPPOTrainer
    original = cls.__dict__["__init__"]

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        sel = selection_from_args(self.args)
        if sel.policy_loss is not None:
            from ._loss import build_policy_loss
            from ._state import adopt_loss

            self.actor_loss_fn = build_policy_loss(self.args, sel, strategy=self.strategy)
            adopt_loss(self.actor_loss_fn)  # its state goes into this actor's checkpoints, and comes back on resume
        if sel.routing_replay is not None:
            from ._routing_replay import arm

            arm(self, sel.routing_replay)

    __init__.__wrapped__ = original
    __init__.__doc__ = original.__doc__
    _set_patch("ActorPPOTrainer.__init__", cls, "__init__", __init__)
    from ._routing_replay import patch_actor_module

    patch_actor_module(module, _set_patch)  # training_step, Actor.forward (R2)
    _patch_loss_normalisers(module, "ppo_actor")


def _nonzero_normalisers(info: dict) -> dict:
    """A step whose rows a batch filter all dropped has 0 tokens and 0 sequences: OpenRLHF's
    ``sum(loss * mask) / 0`` would make the loss and every gradient NaN; with 1 they are exactly 0."""
    import torch

    out = dict(info)
    for key in ("batch_num_tokens", "global_batch_size"):
        value = out.get(key)
        if value is not None:
            value = torch.as_tensor(value)
            out[key] = torch.where(value == 0, torch.ones_like(value), value)
    return out


def _patch_loss_normalisers(module, owner: str) -> None:
    """With a batch filter selected, OpenRLHF's loss normalisers (``get_loss_batch_info``,
    ``iter_grad_accum_global_norm``, as bound in ``module``) never divide by an all-masked step's 0."""
    get_info = module.__dict__.get("get_loss_batch_info")
    iter_norm = module.__dict__.get("iter_grad_accum_global_norm")

    def filtering(strategy) -> bool:
        return selection_from_args(strategy.args).batch_filter is not None

    if get_info is not None:
        def get_loss_batch_info(strategy, *args, **kwargs):
            info = get_info(strategy, *args, **kwargs)
            return _nonzero_normalisers(info) if filtering(strategy) else info

        get_loss_batch_info.__wrapped__ = get_info
        _set_patch(f"{owner}.get_loss_batch_info", module, "get_loss_batch_info", get_loss_batch_info)
    if iter_norm is not None:
        def iter_grad_accum_global_norm(data_iter, strategy, *args, **kwargs):
            items = iter_norm(data_iter, strategy, *args, **kwargs)
            if not filtering(strategy):
                return items
            return ((item, _nonzero_normalisers(info)) for item, info in items)

        iter_grad_accum_global_norm.__wrapped__ = iter_norm
        _set_patch(f"{owner}.iter_grad_accum_global_norm", module, "iter_grad_accum_global_norm",
                   iter_grad_accum_global_norm)


def _patch_critic_module(module) -> None:
    check_openrlhf()
    _patch_loss_normalisers(module, "ppo_critic")  # gae + a batch filter: the critic loss sees the same masks


def _patch_maker_module(module) -> None:
    """Wrap ``RemoteExperienceMaker.compute_advantages_and_returns`` (OpenRLHF names delegate)."""
    check_openrlhf()
    cls = module.RemoteExperienceMaker
    original = cls.__dict__["compute_advantages_and_returns"]

    def compute_advantages_and_returns(self, experiences):
        sel = selection_from_args(self.strategy.args)
        if sel.advantage_estimator is None:
            estimate = functools.partial(original, self)
        else:
            from ._advantage import stable_advantages_and_returns

            estimate = functools.partial(stable_advantages_and_returns, self, selection=sel)
        if not sel.has_extensions:
            return estimate(experiences)
        from ._shape_filter import advantages_with_extensions

        return advantages_with_extensions(self, experiences, sel, estimate)

    compute_advantages_and_returns.__wrapped__ = original
    compute_advantages_and_returns.__doc__ = original.__doc__
    _set_patch("RemoteExperienceMaker.compute_advantages_and_returns", cls, "compute_advantages_and_returns",
               compute_advantages_and_returns)
    from ._routing_replay import patch_maker_module

    patch_maker_module(module, _set_patch, selection_from_args)  # make_experience (R2)


def _patch_launcher_module(module) -> None:
    from ._routing_replay import patch_launcher_module

    check_openrlhf()
    patch_launcher_module(module, _set_patch)  # BaseModelActor.execute_batch (R3)


def _patch_samples_module(module) -> None:
    from ._routing_replay import patch_samples_module

    check_openrlhf()
    patch_samples_module(module, _set_patch, selection_from_args)  # _process_response_into_experience (R3)


def _patch_agent_module(module) -> None:
    from ._routing_replay import patch_agent_module

    check_openrlhf()
    patch_agent_module(module, _set_patch)  # agent executors' execute (R3)


def _patch_vllm_args_module(module) -> None:
    from ._routing_replay import patch_vllm_arg_utils

    patch_vllm_arg_utils(module, _set_patch)  # AsyncEngineArgs.__init__ (R3)


def _patch_strategy_module(module) -> None:
    from ._state import patch_strategy_module

    check_openrlhf()
    patch_strategy_module(module, _set_patch)  # DeepspeedStrategy.save_ckpt / load_ckpt (the loss's state)


def _patch_trainer_module(module) -> None:
    from ._state import patch_trainer_module

    check_openrlhf()
    patch_trainer_module(module, _set_patch)  # BasePPOTrainer checkpoints (the shapers' / filters' state)


_PATCHERS = {_ACTOR_MODULE: _patch_actor_module, _CRITIC_MODULE: _patch_critic_module,
             _MAKER_MODULE: _patch_maker_module,
             _LAUNCHER_MODULE: _patch_launcher_module, _SAMPLES_MODULE: _patch_samples_module,
             _AGENT_MODULE: _patch_agent_module, _VLLM_ARGS_MODULE: _patch_vllm_args_module,
             _STRATEGY_MODULE: _patch_strategy_module, _TRAINER_MODULE: _patch_trainer_module}


_HOOK_TAG = "stablerl.openrlhf"





def setup() -> None:
    """Ray ``worker_process_setup_hook``: arm the patches in this process (imports no OpenRLHF).

    Modules already imported are patched now; the others when (and if) they are imported. Safe to
    call many times. Also runs ``$STABLERL_CHAINED_SETUP_HOOK`` (a user's own setup hook)."""
    found = openrlhf_version()
    if found is not None:
        check_openrlhf(found)
    with _LOCK:
        post_import.install(_HOOK_TAG, _PATCHERS, once=False)
        for name, patcher in _PATCHERS.items():
            if name in sys.modules:
                patcher(sys.modules[name])
    chained = os.environ.get(ENV_CHAINED_SETUP_HOOK)
    if chained and chained != SETUP_HOOK and not getattr(setup, "_chained_done", False):
        setup._chained_done = True  # type: ignore[attr-defined]
        _load_callable(chained)()


def apply() -> None:
    """Import OpenRLHF's modules (and ``vllm.engine.arg_utils``) and patch them now (heavy: ``import
    openrlhf.models``); idempotent."""
    check_openrlhf()
    setup()
    for name in _PATCHERS:
        importlib.import_module(name)  # the post-import hook (or setup above) patches it


def remove() -> None:
    """Undo every patch and disarm the import hook (the exact original attributes come back)."""
    with _LOCK:
        _PATCHES.restore()
        post_import.remove(_HOOK_TAG)


def is_applied() -> dict[str, bool]:
    """Which patches are in place in this process."""
    return {key: True for key in _PATCHES.keys()} | {
        k: False for k in ("ActorPPOTrainer.__init__", "RemoteExperienceMaker.compute_advantages_and_returns",
                           "ActorPPOTrainer.training_step", "Actor.forward",
                           "RemoteExperienceMaker.make_experience", "BaseModelActor.execute_batch",
                           "SamplesGenerator._process_response_into_experience", "SingleTurnAgentExecutor.execute",
                           "MultiTurnAgentExecutor.execute", "AsyncEngineArgs.__init__",
                           "ppo_actor.get_loss_batch_info", "ppo_actor.iter_grad_accum_global_norm",
                           "ppo_critic.get_loss_batch_info", "ppo_critic.iter_grad_accum_global_norm",
                           "DeepspeedStrategy.save_ckpt", "DeepspeedStrategy.load_ckpt",
                           "BasePPOTrainer.save_logs_and_checkpoints", "BasePPOTrainer.save_best_checkpoint",
                           "BasePPOTrainer.init_checkpoint_states")
        if k not in _PATCHES
    }


# ----------------------------------------------------------------------------- Ray runtime_env


def _load_callable(path: str):
    module, _, attr = path.rpartition(".")
    if not module:
        raise ValueError(f"expected 'module.function', got {path!r}")
    return getattr(importlib.import_module(module), attr)


def add_setup_hook(runtime_env: Optional[dict] = None) -> dict:
    """A ``RAY_RUNTIME_ENV_HOOK``: ``runtime_env`` plus the stablerl worker setup hook.

    Also forwards the STABLERL_* selection variables to every worker, keeps a user's own
    ``worker_process_setup_hook`` (chained through ``$STABLERL_CHAINED_SETUP_HOOK``) and calls a
    previous ``RAY_RUNTIME_ENV_HOOK`` saved in ``$STABLERL_PREVIOUS_RAY_RUNTIME_ENV_HOOK``."""
    Selection(**extensions_from_env()).validate()  # a bad shaper / filter fails here, before Ray starts
    previous = os.environ.get(ENV_PREVIOUS_RUNTIME_ENV_HOOK)
    if previous and previous != "stablerl.adapters.openrlhf.add_setup_hook":
        runtime_env = _load_callable(previous)(runtime_env)
    env = dict(runtime_env or {})
    existing = env.get("worker_process_setup_hook")
    env_vars = dict(env.get("env_vars") or {})
    if existing and existing != SETUP_HOOK:
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
    if env_vars:
        env["env_vars"] = env_vars
    return env


def __getattr__(name: str):
    # StablePolicyLoss subclasses OpenRLHF's PolicyLoss, whose import is heavy (openrlhf.models):
    # build it on first access only, so `setup` stays light.
    if name == "StablePolicyLoss":
        from ._loss import StablePolicyLoss

        return StablePolicyLoss
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SUPPORTED_OPENRLHF", "OPENRLHF_POLICY_LOSSES", "OPENRLHF_ADV_ESTIMATORS", "PREFIX", "Selection",
    "UnsupportedOpenRLHFVersionError", "check_openrlhf", "openrlhf_choices", "resolve", "parse_params",
    "extension_choices", "resolve_extension", "loss_settings", "advantage_settings", "OPENRLHF",
    "selection_from_args", "setup", "apply", "remove", "is_applied", "add_setup_hook", "StablePolicyLoss",
]
