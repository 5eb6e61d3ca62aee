"""The OpenRLHF adapter's declarations: supported versions, OpenRLHF's own names, the flags and
environment variables of the two routes, and the modules it patches (framework-free, imports no OpenRLHF).
What OpenRLHF can feed to each kind of algorithm is declared once, in ``stablerl.adapters.frameworks``."""

from __future__ import annotations

from typing import Optional

from stablerl.contracts import ADVANTAGE_ESTIMATOR as _ADV, POLICY_LOSS as _LOSS
from stablerl.contracts import BATCH_FILTER as _FILTER, REWARD_SHAPER as _SHAPER
from stablerl.frameworks import UnsupportedVersionError, check_version, get_framework, installed_version

OPENRLHF = get_framework("openrlhf")
SUPPORTED_OPENRLHF = OPENRLHF.supported
OPENRLHF_POLICY_LOSSES = tuple(OPENRLHF.builtin_names[_LOSS])
OPENRLHF_ADV_ESTIMATORS = tuple(OPENRLHF.builtin_names[_ADV])
PREFIX = OPENRLHF.prefix
#: per-response values of the user's reward function (its extra_logs, which OpenRLHF copies into
#: experience.info) that reward shapers and batch filters may read
REWARD_FUNCTION_INPUTS = tuple(sorted((OPENRLHF.feedable[_SHAPER] | OPENRLHF.feedable[_FILTER])
                                      - {"index", "scores", "lengths"}))
SHAPER_FLAG = "--algo.advantage.stablerl_reward_shaper"
FILTER_FLAG = "--algo.advantage.stablerl_batch_filter"
CONTROLLER_FLAG = "--actor.stablerl_entropy_controller"
COMPONENTS_FLAG = "--algo.advantage.stablerl_reward_components"
COMPONENT_WEIGHTS_FLAG = "--algo.advantage.stablerl_reward_weights"

#: Environment variables of the no-wrapper route (forwarded to every worker by add_setup_hook).
ENV_POLICY_LOSS, ENV_POLICY_LOSS_PARAMS = "STABLERL_POLICY_LOSS", "STABLERL_POLICY_LOSS_PARAMS"
ENV_ADVANTAGE, ENV_ADVANTAGE_PARAMS = "STABLERL_ADVANTAGE_ESTIMATOR", "STABLERL_ADVANTAGE_PARAMS"
ENV_REWARD_SHAPER, ENV_REWARD_SHAPER_PARAMS = "STABLERL_REWARD_SHAPER", "STABLERL_REWARD_SHAPER_PARAMS"
ENV_BATCH_FILTER, ENV_BATCH_FILTER_PARAMS = "STABLERL_BATCH_FILTER", "STABLERL_BATCH_FILTER_PARAMS"
ENV_CONTROLLER, ENV_CONTROLLER_PARAMS = "STABLERL_ENTROPY_CONTROLLER", "STABLERL_ENTROPY_CONTROLLER_PARAMS"
ENV_ROUTING_REPLAY = "STABLERL_ROUTING_REPLAY"
ENV_CHAINED_SETUP_HOOK = "STABLERL_CHAINED_SETUP_HOOK"
ENV_PREVIOUS_RUNTIME_ENV_HOOK = "STABLERL_PREVIOUS_RAY_RUNTIME_ENV_HOOK"
_FORWARDED_ENV = (ENV_POLICY_LOSS, ENV_POLICY_LOSS_PARAMS, ENV_ADVANTAGE, ENV_ADVANTAGE_PARAMS, ENV_ROUTING_REPLAY,
                  ENV_REWARD_SHAPER, ENV_REWARD_SHAPER_PARAMS, ENV_BATCH_FILTER, ENV_BATCH_FILTER_PARAMS,
                  ENV_CONTROLLER, ENV_CONTROLLER_PARAMS, ENV_CHAINED_SETUP_HOOK)
#: Ray's worker_process_setup_hook: instrument() in every worker (the older name still works)
SETUP_HOOK = "stablerl.adapters.openrlhf.instrument"
LEGACY_SETUP_HOOK = "stablerl.adapters.openrlhf.setup"


class UnsupportedOpenRLHFVersionError(UnsupportedVersionError):
    """The installed OpenRLHF is outside :data:`SUPPORTED_OPENRLHF`."""


def openrlhf_version() -> Optional[str]:
    """The installed OpenRLHF version (distribution metadata; imports nothing), or None."""
    return installed_version("openrlhf")


def check_openrlhf(found: Optional[str] = None) -> str:
    """Raise :class:`UnsupportedOpenRLHFVersionError` unless OpenRLHF is in :data:`SUPPORTED_OPENRLHF`
    (stablerl's one version policy; ``STABLERL_ALLOW_UNSUPPORTED=1`` makes it a warning). 0.11.2 changed
    PolicyLoss (is_correction_* kwargs, 5-value return) and its CLI flags."""
    return check_version("openrlhf", found if found is not None else openrlhf_version(),
                         error=UnsupportedOpenRLHFVersionError)


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
