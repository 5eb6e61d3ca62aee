"""SkyRL 0.3's names and keys, in one place (framework-free: importing this imports no SkyRL module)."""

from __future__ import annotations

NAME = "skyrl"
SUPPORTED_SKYRL = ">=0.3,<0.4"
#: a stablerl algorithm whose name SkyRL's registry already holds is registered as PREFIX + name
PREFIX = "stablerl_"
#: PolicyLossRegistry.repopulate_registry's names (skyrl/backends/skyrl_train/utils/ppo_utils.py)
SKYRL_POLICY_LOSSES = ("regular", "dual_clip", "gspo", "cispo", "rollout_is", "clip_cov", "kl_cov", "sapo",
                       "cross_entropy", "importance_sampling", "dppo")
#: AdvantageEstimatorRegistry's names
SKYRL_ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce++", "maxrl")

ALGORITHM = "trainer.algorithm."
LOSS_KEY = ALGORITHM + "policy_loss_type"
ADV_KEY = ALGORITHM + "advantage_estimator"
LOSS_PARAMS = "stablerl_params"
ADV_PARAMS = "stablerl_advantage_params"
SHAPER, SHAPER_PARAMS = "stablerl_reward_shaper", "stablerl_reward_shaper_params"
FILTER, FILTER_PARAMS = "stablerl_batch_filter", "stablerl_batch_filter_params"

#: SkyRL's loss_reduction -> stablerl's loss_agg_mode with the same numbers (see _reduction)
REDUCTIONS = {"token_mean": "token-mean", "sequence_mean": "seq-mean-token-mean",
              "seq_mean_token_sum_norm": "seq-mean-token-sum-norm"}
REFUSED_REDUCTIONS = {
    "prompt_mean": "a token mean per prompt, then a mean over prompts: stablerl has no aggregation of that shape, "
    "so no stablerl loss gives the numbers it gives in verl, TRL or OpenRLHF",
    "token_mean_legacy": "a token mean per micro-batch averaged over micro-batches (SkyRL's legacy mode): the "
    "result depends on SkyRL's micro-batch size; use token_mean, which equals verl's/TRL's/OpenRLHF's token-mean",
}


class UnsupportedSkyRLVersionError(ImportError):
    """The installed SkyRL is outside :data:`SUPPORTED_SKYRL`."""


def skyrl_names(stablerl_name: str, builtin: tuple) -> list[str]:
    """The names a stablerl algorithm is registered under in SkyRL: the bare name unless SkyRL owns it, and
    always ``stablerl_<name>``."""
    prefixed = PREFIX + stablerl_name
    return [prefixed] if stablerl_name in builtin else [stablerl_name, prefixed]


def stablerl_name(skyrl_name: str, builtin: tuple) -> str | None:
    """The stablerl algorithm a SkyRL name selects (None: one of SkyRL's own)."""
    if skyrl_name in builtin:
        return None
    return skyrl_name[len(PREFIX):] if skyrl_name.startswith(PREFIX) else skyrl_name


class Registered:
    """A stablerl algorithm as the callable SkyRL's registry holds: its name, pickled by reference (Ray ships it)."""

    label = "algorithm"

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self):
        return (type(self), (self.name,))

    def __repr__(self) -> str:
        return f"<stablerl {self.label} {self.name!r} for SkyRL>"
