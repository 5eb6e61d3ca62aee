"""The OpenRLHF adapter's declarations: supported versions, OpenRLHF's own names, the flags and
environment variables of the two routes, and what OpenRLHF can feed (framework-free, imports no OpenRLHF)."""

from __future__ import annotations

from typing import Optional

from stablerl.contracts import ADVANTAGE_ESTIMATOR as _ADV, POLICY_LOSS as _LOSS
from stablerl.contracts import BATCH_FILTER as _FILTER, REWARD_SHAPER as _SHAPER
from stablerl.frameworks import UnsupportedVersionError, check_version, get_framework

#: OpenRLHF 0.11.2's own names (argparse choices of ``openrlhf/cli/train_ppo_ray.py``), the inputs the
#: adapter can feed and why not, and the supported versions: declared once (stablerl.adapters.frameworks),
#: read here and by ``stablerl describe``. ``rollout_log_prob`` exists only while
#: ``--algo.advantage.is_correction_level`` is not ``off``; entropy, token_ids and scores are fed by the
#: training_step / Actor.forward patches (._inputs).
OPENRLHF = get_framework("openrlhf")
SUPPORTED_OPENRLHF = OPENRLHF.supported
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
#: the reward function's extra_logs keys that are reward components (GDPO), and their weights
COMPONENTS_FLAG = "--algo.advantage.stablerl_reward_components"
COMPONENT_WEIGHTS_FLAG = "--algo.advantage.stablerl_reward_weights"

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
#: Ray's worker_process_setup_hook: instrument() in every worker (the older name still works)
SETUP_HOOK = "stablerl.adapters.openrlhf.instrument"
LEGACY_SETUP_HOOK = "stablerl.adapters.openrlhf.setup"

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


class UnsupportedOpenRLHFVersionError(UnsupportedVersionError):
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
    """Raise :class:`UnsupportedOpenRLHFVersionError` unless OpenRLHF is in :data:`SUPPORTED_OPENRLHF`
    (stablerl's one version policy, ``stablerl.frameworks.check_version``: ``STABLERL_ALLOW_UNSUPPORTED=1``
    makes an out-of-range version a warning). 0.11.2 changed PolicyLoss (is_correction_* kwargs, 5-value
    return) and its CLI flags."""
    return check_version("openrlhf", found if found is not None else openrlhf_version(),
                         error=UnsupportedOpenRLHFVersionError)


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
