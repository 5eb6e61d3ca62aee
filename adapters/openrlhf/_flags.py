"""OpenRLHF 0.11.2's own names and every flag and environment variable stablerl selects by, each written once: the
declaration (``_spec``), the wrapper CLI (``train_ppo_ray``), the messages and the no-wrapper route read them
here, with the version check. A leaf module (imports only core), so every other module of the adapter can."""

from __future__ import annotations

from typing import Optional

from stablerl.contracts import ADVANTAGE_ESTIMATOR, BATCH_FILTER, CONTROLLER, POLICY_LOSS, REWARD_SHAPER
from stablerl.frameworks import UnsupportedVersionError, check_version, installed_version

NAME = "openrlhf"
SUPPORTED_OPENRLHF = ">=0.11.2,<0.11.3"
PREFIX = "stablerl_"
# argparse choices of openrlhf/cli/train_ppo_ray.py, in its order
OPENRLHF_POLICY_LOSSES = ("ppo", "gspo")
OPENRLHF_ADV_ESTIMATORS = ("gae", "reinforce", "rloo", "reinforce_baseline", "group_norm", "dr_grpo", "flash_reinforce")

# OpenRLHF's flags the adapter extends or reads, and the flags it adds next to them
LOSS_FLAG, LOSS_PARAMS_FLAG = "--actor.policy_loss_type", "--actor.stablerl_params"
ADV_FLAG, ADV_PARAMS_FLAG = "--algo.advantage.estimator", "--algo.advantage.stablerl_params"
SHAPER_FLAG = "--algo.advantage.stablerl_reward_shaper"
FILTER_FLAG = "--algo.advantage.stablerl_batch_filter"
CONTROLLER_FLAG = "--actor.stablerl_entropy_controller"
COMPONENTS_FLAG = "--algo.advantage.stablerl_reward_components"
COMPONENT_WEIGHTS_FLAG = "--algo.advantage.stablerl_reward_weights"
ROUTING_REPLAY_FLAG = "--actor.stablerl_routing_replay"
TEACHER_FLAG = "--algo.advantage.stablerl_teacher_model"  # on-policy distillation: the reference loads the teacher
#: the advantage record's key for OpenRLHF's args (not an input: the teacher provider reads --algo.kl.estimator there)
ARGS_KEY = "_openrlhf_args"
IS_CORRECTION_FLAG = "--algo.advantage.is_correction_level"
SAMPLING_REPLAY_FLAG = "--algo.advantage.sampling_mask_replay"  # auto | true | false (stablerl.sampling_mask)
# OpenRLHF's knobs that also set a stablerl hyper-parameter when given on the command line
EPS_CLIP_FLAG, EPS_CLIP_LOW_HIGH_FLAG = "--actor.eps_clip", "--actor.eps_clip_low_high"
DUAL_CLIP_FLAG = "--actor.dual_clip"
NO_STD_NORM_FLAG, GAMMA_FLAG = "--algo.advantage.no_std_norm", "--algo.advantage.gamma"
REWARD_CLIP_FLAG = "--reward.clip_range"
COMMAND = "python -m stablerl.adapters.openrlhf.train_ppo_ray <your OpenRLHF flags>"

#: Environment variables of the no-wrapper route (forwarded to every worker by add_setup_hook).
ENV_POLICY_LOSS, ENV_POLICY_LOSS_PARAMS = "STABLERL_POLICY_LOSS", "STABLERL_POLICY_LOSS_PARAMS"
ENV_ADVANTAGE, ENV_ADVANTAGE_PARAMS = "STABLERL_ADVANTAGE_ESTIMATOR", "STABLERL_ADVANTAGE_PARAMS"
ENV_REWARD_SHAPER, ENV_REWARD_SHAPER_PARAMS = "STABLERL_REWARD_SHAPER", "STABLERL_REWARD_SHAPER_PARAMS"
ENV_BATCH_FILTER, ENV_BATCH_FILTER_PARAMS = "STABLERL_BATCH_FILTER", "STABLERL_BATCH_FILTER_PARAMS"
ENV_CONTROLLER, ENV_CONTROLLER_PARAMS = "STABLERL_ENTROPY_CONTROLLER", "STABLERL_ENTROPY_CONTROLLER_PARAMS"
#: kind -> (the variable naming its stablerl algorithm, the one holding its parameters): core's AlgorithmSelection.from_env
ENV_SELECTION = {POLICY_LOSS: (ENV_POLICY_LOSS, ENV_POLICY_LOSS_PARAMS), ADVANTAGE_ESTIMATOR: (ENV_ADVANTAGE, ENV_ADVANTAGE_PARAMS),
                 REWARD_SHAPER: (ENV_REWARD_SHAPER, ENV_REWARD_SHAPER_PARAMS),
                 BATCH_FILTER: (ENV_BATCH_FILTER, ENV_BATCH_FILTER_PARAMS), CONTROLLER: (ENV_CONTROLLER, ENV_CONTROLLER_PARAMS)}
ENV_ROUTING_REPLAY = "STABLERL_ROUTING_REPLAY"  # the mode where no args exist (vLLM rollout workers)
ENV_SAMPLING_REPLAY = "STABLERL_SAMPLING_MASK_REPLAY"  # the no-wrapper route's --algo.advantage.sampling_mask_replay
ENV_CHAINED_SETUP_HOOK = "STABLERL_CHAINED_SETUP_HOOK"
ENV_PREVIOUS_RUNTIME_ENV_HOOK = "STABLERL_PREVIOUS_RAY_RUNTIME_ENV_HOOK"
FORWARDED_ENV = (ENV_POLICY_LOSS, ENV_POLICY_LOSS_PARAMS, ENV_ADVANTAGE, ENV_ADVANTAGE_PARAMS, ENV_ROUTING_REPLAY,
                 ENV_REWARD_SHAPER, ENV_REWARD_SHAPER_PARAMS, ENV_BATCH_FILTER, ENV_BATCH_FILTER_PARAMS,
                 ENV_CONTROLLER, ENV_CONTROLLER_PARAMS, ENV_CHAINED_SETUP_HOOK, ENV_SAMPLING_REPLAY)
#: Ray's worker_process_setup_hook: instrument() in every worker (the older name still works)
SETUP_HOOK = "stablerl.adapters.openrlhf.instrument"
LEGACY_SETUP_HOOK = "stablerl.adapters.openrlhf.setup"
ADD_SETUP_HOOK = "stablerl.adapters.openrlhf.add_setup_hook"  # the RAY_RUNTIME_ENV_HOOK


class UnsupportedOpenRLHFVersionError(UnsupportedVersionError):
    """The installed OpenRLHF is outside :data:`SUPPORTED_OPENRLHF`."""


def openrlhf_version() -> Optional[str]:
    """The installed OpenRLHF version (distribution metadata; imports nothing), or None."""
    return installed_version("openrlhf")


def check_openrlhf(found: Optional[str] = None) -> str:
    """Raise :class:`UnsupportedOpenRLHFVersionError` unless OpenRLHF is in :data:`SUPPORTED_OPENRLHF`
    (stablerl's one version policy; ``STABLERL_ALLOW_UNSUPPORTED=1`` makes it a warning). 0.11.2 changed
    PolicyLoss (is_correction_* kwargs, 5-value return) and its CLI flags."""
    found = found if found is not None else openrlhf_version()
    return check_version(NAME, found, error=UnsupportedOpenRLHFVersionError)


def check_policy_loss_api(policy_loss_cls) -> None:
    """Refuse an OpenRLHF whose ``PolicyLoss`` lacks what :class:`StablePolicyLoss` passes or reads."""
    import inspect

    init, fwd = (inspect.signature(f).parameters for f in (policy_loss_cls.__init__, policy_loss_cls.forward))
    missing = [p for p in ("clip_eps_low", "clip_eps_high", "dual_clip", "token_level_loss", "policy_loss_type",
                           "is_correction_level", "is_correction_mode", "is_correction_gating",
                           "is_correction_threshold") if p not in init]
    missing += [f"forward({p})" for p in ("rollout_log_probs", "dp_size", "batch_num_tokens", "global_batch_size")
                if p not in fwd]
    if missing:
        raise UnsupportedOpenRLHFVersionError(
            f"OpenRLHF's PolicyLoss lacks {missing}; stablerl.adapters.openrlhf supports openrlhf{SUPPORTED_OPENRLHF}")
