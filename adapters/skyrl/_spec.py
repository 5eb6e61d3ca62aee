"""SkyRL 0.3's declaration (its :class:`~stablerl.frameworks.FrameworkSpec`), registered by
``stablerl.adapters.frameworks``. What SkyRL feeds is derived from :class:`SkyRLAdapter`'s providers; the rest are
facts about SkyRL. Framework-free."""

from __future__ import annotations

from stablerl.contracts import (ADVANTAGE_ESTIMATOR, BATCH_FILTER, CONTROLLER, POLICY_LOSS, REWARD_SHAPER,
                                TRAINER_HOOK, AlgorithmSpec)
from stablerl.config_recipe import KindLines, Note, Params, recipe_lines
from stablerl.frameworks import FrameworkKey, FrameworkSpec

from ._adapter import SkyRLAdapter
from ._names import (ADV_KEY, ADV_PARAMS, ALGORITHM, FILTER, FILTER_PARAMS, LOSS_KEY, LOSS_PARAMS, NAME, SHAPER,
                     SHAPER_PARAMS, SKYRL_ADV_ESTIMATORS, SKYRL_POLICY_LOSSES, SUPPORTED_SKYRL)

_LOSS_CALL = ("SkyRL's loss call (PolicyWorkerBase._forward_backward_micro) passes log-probs, old and rollout "
              "log-probs, advantages, the algorithm config and the loss mask, nothing else")
_ONE_ROW = "SkyRL's batch keeps one row per response (or per step, step-wise) with no "
ENTRY = "python -m stablerl.adapters.skyrl.main"

SKYRL = FrameworkSpec(
    name=NAME,
    distribution="skyrl",
    supported=SUPPORTED_SKYRL,
    adapter="stablerl.adapters.skyrl",
    adapter_class="stablerl.adapters.skyrl._adapter:SkyRLAdapter",
    builtin_names={POLICY_LOSS: SKYRL_POLICY_LOSSES, ADVANTAGE_ESTIMATOR: SKYRL_ADV_ESTIMATORS},
    feedable=SkyRLAdapter.feedable(),
    why_not={
        "*": {
            "token_ids": "fed to policy losses only (the update micro-batch's sequences), not to the advantage step",
            "turn_ids": _ONE_ROW + "per-token turn ids",
            "anchor_ids": _ONE_ROW + "anchor-state ids",
            "step_returns": _ONE_ROW + "per-step returns",
            "router_log_prob": _LOSS_CALL,
            "old_router_log_prob": "SkyRL's old-log-prob pass returns no router log-probs",
            "hidden_states": _LOSS_CALL,
            "lm_head_weight": _LOSS_CALL,
            "reward_baselines": "SkyRL generates no greedy baseline response per prompt (ReMax)",
            "pos_count": "SkyRL samples n_samples_per_prompt per prompt in one round",
            "neg_count": "SkyRL samples n_samples_per_prompt per prompt in one round",
            "teacher_topk_log_prob": "no teacher forward returning top-k log-probs in SkyRL",
            "teacher_topk_ids": "no teacher forward returning top-k ids in SkyRL",
            "student_topk_log_prob": _LOSS_CALL,
            "params_view": "no trainer hook in SkyRL (see why_no_key)",
            "entropy_bonus": "no controller in SkyRL (see why_no_key)",
        },
    },
    conditions=SkyRLAdapter.conditions(),
    why_no_key={
        TRAINER_HOOK: "SkyRL's weights and optimizer live in its Ray policy workers (FSDP shards), driven by the trainer "
        "only through WorkerDispatch's forward_backward / optim_step: a hook that re-positions the weights between "
        "optimizer steps (SFPO's theta_0 + alpha (theta_K - theta_0)) has no worker method to run in",
        CONTROLLER: "SkyRL's policy worker weighs its entropy term with self.cfg.algorithm.entropy_loss_coef, the config "
        "it was built with; forward_backward's loss_fn_config reaches only the loss function's config, so no "
        "per-step entropy coefficient reaches the workers",
    },
    selection_keys={
        POLICY_LOSS: LOSS_KEY, ADVANTAGE_ESTIMATOR: ADV_KEY, REWARD_SHAPER: ALGORITHM + SHAPER,
        BATCH_FILTER: ALGORITHM + FILTER,
    },
    hyperparameter_keys={
        POLICY_LOSS: {
            "clip_ratio_low": FrameworkKey(ALGORITHM + "eps_clip_low", 0.2),
            "clip_ratio_high": FrameworkKey(ALGORITHM + "eps_clip_high", 0.2),
            "clip_ratio_c": FrameworkKey(ALGORITHM + "clip_ratio_c", 3.0),
            "tau_pos": FrameworkKey(ALGORITHM + "sapo.tau_pos", 1.0),
            "tau_neg": FrameworkKey(ALGORITHM + "sapo.tau_neg", 1.05),
        },
        ADVANTAGE_ESTIMATOR: {
            "norm_adv_by_std_in_grpo": FrameworkKey(ALGORITHM + "grpo_norm_by_std", True, refuse_if_unused=True),
        },
    },
    params_keys={
        POLICY_LOSS: ALGORITHM + LOSS_PARAMS + ".{name}={value}",
        ADVANTAGE_ESTIMATOR: ALGORITHM + ADV_PARAMS + ".{name}={value}",
        REWARD_SHAPER: ALGORITHM + SHAPER_PARAMS + ".{name}={value}",
        BATCH_FILTER: ALGORITHM + FILTER_PARAMS + ".{name}={value}",
    },
    usage=f'pip install "skyrl>=0.3,<0.4" stablerl; run {ENTRY} with SkyRL\'s own overrides (it registers every '
    "stablerl loss and estimator in SkyRL's registries and takes over SkyRL's advantage pre-scaling)",
    algorithm_notes={},
    switches={"routing_replay": ALGORITHM + "stablerl_routing_replay=R2  # or R3 (FSDP policy worker; R3: the "
              "generator returns rollout_expert_indices)"},
)


_SKYRL_OWN = frozenset(SKYRL.hyperparameter_keys[POLICY_LOSS])


def _skyrl_own_note(spec: AlgorithmSpec, fields: list) -> str:
    keys = ", ".join(SKYRL.hyperparameter_keys[POLICY_LOSS][f].key for f in fields if f in _SKYRL_OWN)
    return f"(SkyRL's own {keys} apply when set to a value other than SkyRL's default)"


def _per_field(params: str) -> Params:
    return Params(per_field=ALGORITHM + params + ".{field}=<value>")


SKYRL = SKYRL.with_config_lines(recipe_lines(SKYRL, {
    REWARD_SHAPER: KindLines(head=(ENTRY + " ...",), params=(_per_field(SHAPER_PARAMS),)),
    BATCH_FILTER: KindLines(head=(ENTRY + " ...",), params=(_per_field(FILTER_PARAMS),)),
    POLICY_LOSS: KindLines(head=(ENTRY + " ...",), params=(_per_field(LOSS_PARAMS),),
                           notes=(Note(_skyrl_own_note, fields_any=_SKYRL_OWN),)),
    "*": KindLines(select=ADV_KEY + "={name}", params=(Params(  # estimators
        per_field=lambda f: ALGORITHM + ("grpo_norm_by_std" if f == "norm_adv_by_std_in_grpo" else ADV_PARAMS + "." + f)
        + "=<value>"),)),
}))
