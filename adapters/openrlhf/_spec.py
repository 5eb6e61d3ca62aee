"""OpenRLHF 0.11.2 as stablerl declares it (its ``FrameworkSpec``, registered by ``stablerl.adapters.frameworks``):
built-in names, what it cannot feed and why, its flags, and the config lines of every algorithm. What it can feed
(``feedable``, ``conditions``) is derived from :class:`OpenRLHFAdapter`'s providers. Framework-free."""

from __future__ import annotations

from stablerl.config_recipe import KindLines, Note, Params, recipe_lines
from stablerl.contracts import (ADVANTAGE_ESTIMATOR, BATCH_FILTER, CONTROLLER, POLICY_LOSS, REWARD_SHAPER,
                                TRAINER_HOOK)
from stablerl.frameworks import FrameworkKey, FrameworkSpec

from ._adapter import OpenRLHFAdapter
from ._flags import (ADV_FLAG, ADV_PARAMS_FLAG, COMMAND, CONTROLLER_FLAG, DUAL_CLIP_FLAG, EPS_CLIP_FLAG,
                     EPS_CLIP_LOW_HIGH_FLAG, FILTER_FLAG, GAMMA_FLAG, IS_CORRECTION_FLAG, LOSS_FLAG, LOSS_PARAMS_FLAG,
                     NAME, NO_STD_NORM_FLAG, OPENRLHF_ADV_ESTIMATORS, OPENRLHF_POLICY_LOSSES, ROUTING_REPLAY_FLAG,
                     SHAPER_FLAG, SUPPORTED_OPENRLHF)


def _loss_key(name: str, value) -> str:
    text = f"{name}={value}"
    return f"{LOSS_PARAMS_FLAG} '{text}'" if any(c in text for c in ' "{') else f"{LOSS_PARAMS_FLAG} {text}"


OPENRLHF = FrameworkSpec(
    name=NAME,
    distribution="openrlhf",
    supported=SUPPORTED_OPENRLHF,
    adapter="stablerl.adapters.openrlhf",
    adapter_class="stablerl.adapters.openrlhf._adapter:OpenRLHFAdapter",
    builtin_names={
        POLICY_LOSS: OPENRLHF_POLICY_LOSSES,  # tuples: OpenRLHF's argparse order
        ADVANTAGE_ESTIMATOR: OPENRLHF_ADV_ESTIMATORS,
    },
    feedable=OpenRLHFAdapter.feedable(),  # derived from its @provides methods (_adapter)
    why_not={
        "*": {
            "teacher_log_prob": "the adapter feeds the reference model's (the teacher's) log-probs to advantage "
            "estimators only",
            "teacher_topk_log_prob": "not built yet: OpenRLHF's reference forward returns the log-probs of the sampled "
            "tokens only; a top-k teacher distribution needs another forward of the teacher",
            "teacher_topk_ids": "not built yet (see teacher_topk_log_prob)",
            "student_topk_log_prob": "OpenRLHF's Actor.forward returns the sampled tokens' log-probs, not the logits: "
            "the student's log-probs at the teacher's ids are not available to the loss",
            "rollout_log_prob": f"set {IS_CORRECTION_FLAG} token|seq (OpenRLHF requests vLLM "
            "log-probs only then)",
            "turn_ids": "OpenRLHF's experiences carry no per-token turn ids",
            "anchor_ids": "OpenRLHF's experiences are one per sample (its agent mode keeps a whole episode in one), "
            "with no anchor-state ids",
            "step_returns": "OpenRLHF's experiences carry no per-step discounted returns",
            "versions": "the adapter feeds policy versions to policy losses only (one per batch in the synchronous "
            "trainer, its own stamps under --train.async_enable)",
            "policy_version": "the adapter feeds policy versions to policy losses only",
            "router_log_prob": "OpenRLHF's loss call gets no router log-probs (stablerl's R2/R3 replay there replays "
            "experts, it records no router log-probs)",
            "old_router_log_prob": "OpenRLHF's old-log-prob pass returns no router log-probs",
            "hidden_states": "OpenRLHF's Actor.forward returns log-probs (and entropy), not the last hidden states",
            "lm_head_weight": "OpenRLHF's loss call gets no handle on the model (its LM-head weight)",
            "reward_baselines": "OpenRLHF generates no greedy baseline response per prompt (ReMax)",
            "sum_pi_squared": "the adapter computes it in OpenRLHF's old-log-prob pass for advantage estimators only "
            "(OpenRLHF's own pass returns log-probs and entropy, no sum of squared probabilities)",
            "pos_count": "OpenRLHF samples --rollout.n_samples_per_prompt per prompt in one round: nothing counts "
            "samples over rounds, and the adapter passes no per-prompt counts to estimators",
            "neg_count": "OpenRLHF samples --rollout.n_samples_per_prompt per prompt in one round",
        },
        CONTROLLER: {
            "rollout_temperature": "OpenRLHF samples every rollout at one --rollout.temperature, in the trainer "
            "process's samples generator, and draws no control samples to swap into the batch (AEPO)",
            "loss_term": "a controller's own term is defined per agent turn (EPO: one row per turn, turns >= "
            "max_steps/2); OpenRLHF keeps a whole episode in one sample with no turn index, so every row would be "
            "turn 0 and the term 0 (the adapter steers OpenRLHF's entropy bonus, --actor.entropy_coef)",
        },
    },
    conditions=OpenRLHFAdapter.conditions(),
    why_no_key={
        TRAINER_HOOK: "a trainer hook acts between optimizer passes inside the Ray actor (ActorPPOTrainer.ppo_train "
        "loops over --actor.max_epochs passes with no callback between them) and OpenRLHF always trains with "
        "DeepSpeed, whose optimizer keeps the fp32 master weights in its own flat partitions and copies them over the "
        "model's parameters after every step, so a reposition of the parameters (SFPO) would be overwritten; an "
        "adaptive sampler needs a rollout loop that draws more for a prompt (OpenRLHF draws a fixed "
        "--rollout.n_samples_per_prompt in one call); the TRL adapter runs sfpo",
    },
    selection_keys={
        POLICY_LOSS: LOSS_FLAG, ADVANTAGE_ESTIMATOR: ADV_FLAG, REWARD_SHAPER: SHAPER_FLAG, BATCH_FILTER: FILTER_FLAG,
        CONTROLLER: CONTROLLER_FLAG,
    },
    hyperparameter_keys={
        POLICY_LOSS: {
            # applied only when given on the command line (the wrapper reads argv)
            "clip_ratio_low": FrameworkKey(f"{EPS_CLIP_LOW_HIGH_FLAG}[0] / {EPS_CLIP_FLAG}", 0.2),
            "clip_ratio_high": FrameworkKey(f"{EPS_CLIP_LOW_HIGH_FLAG}[1] / {EPS_CLIP_FLAG}", 0.2),
            "clip_ratio_c": FrameworkKey(DUAL_CLIP_FLAG, None),
        },
        ADVANTAGE_ESTIMATOR: {
            "norm_adv_by_std_in_grpo": FrameworkKey(
                NO_STD_NORM_FLAG, True, refuse_if_unused=True, spelled={False: "(given)", True: "(not given)"}
            ),
            # the discount of the REINFORCE-family returns (applied only when given on the command line)
            "gamma": FrameworkKey(GAMMA_FLAG, 1.0, refuse_if_unused=True),
        },
    },
    params_keys={
        POLICY_LOSS: _loss_key,
        ADVANTAGE_ESTIMATOR: ADV_PARAMS_FLAG + " {name}={value}",
        REWARD_SHAPER: SHAPER_FLAG + "_params {name}={value}",
        BATCH_FILTER: FILTER_FLAG + "_params {name}={value}",
        CONTROLLER: CONTROLLER_FLAG + "_params {name}={value}",
    },
    usage=COMMAND,
    switches={"rollout_correction": IS_CORRECTION_FLAG, "routing_replay": ROUTING_REPLAY_FLAG + " R2  # or R3 (vLLM >= 0.14)"},
    algorithm_notes={
        "d3s": "OpenRLHF's advantage step does not know the run's total number of steps: the N/K schedule "
        "(n_init != n_final or k_init != k_final) is refused at the first step; set n_init == n_final and "
        "k_init == k_final",
        "a3po": "OpenRLHF records no weight versions; its synchronous trainer generates each batch with the "
        "weights the update starts from, so the adapter gives every generated token version 0 and the policy version "
        "1 (relative): alpha = 0, the proximal log-prob is the vLLM rollout log-prob (behaviour weight 1) and r = "
        "exp(lp - lp_rollout) is clipped for every micro-batch and epoch (OpenRLHF's recomputed old log-probs are "
        "unused unless prox_logp_method=recompute). Under --train.async_enable the adapter counts the weight syncs "
        "itself and stamps each sample with the version that generated it: a sample generated one sync before the "
        "round gets alpha 1/2 (not with --train.partial_rollout_enable, refused)",
        "m2po": "old_log_prob is the actor's recomputed old-log-prob pass; OpenRLHF offers no way to give the "
        "behaviour (vLLM) policy as the old policy",
    },
)


_OLD_PASS_ENTROPY = ("  (old-log-prob pass entropy: the adapter has that pass return it and carries it with the rows; "
                     "no flag needed)")
_IS_NOTE = Note(f"  {IS_CORRECTION_FLAG} token   # OpenRLHF passes vLLM log-probs only then", requires=("rollout_log_prob",))


def _kind(flag: str, params_flag: str, *notes: Note) -> KindLines:
    return KindLines(head=(COMMAND,), select=f"  {flag} {{name}}", params=(Params((f"  {params_flag} {{items}}",)),),
                     notes=notes)


_ENTROPY_FLAGLESS = Note("  (entropy: the adapter has OpenRLHF's old-log-prob pass return it; no flag needed)",
                         requires=("entropy",))
OPENRLHF = OPENRLHF.with_config_lines(recipe_lines(OPENRLHF, {
    CONTROLLER: _kind(CONTROLLER_FLAG, CONTROLLER_FLAG + "_params", Note(
        "  (--actor.entropy_coef stays unset: the controller sets OpenRLHF's entropy bonus every step)")),
    REWARD_SHAPER: _kind(SHAPER_FLAG, SHAPER_FLAG + "_params", _ENTROPY_FLAGLESS),
    BATCH_FILTER: _kind(FILTER_FLAG, FILTER_FLAG + "_params",
                        Note("  (dropped rows get action_mask 0; filters that repeat rows are refused)"), _ENTROPY_FLAGLESS),
    POLICY_LOSS: _kind(
        LOSS_FLAG, LOSS_PARAMS_FLAG,
        Note("  (--actor.eps_clip / --actor.eps_clip_low_high / --actor.dual_clip, when given, set clip_ratio_low/high/c)",
             fields_any=frozenset({"clip_ratio_low", "clip_ratio_high", "clip_ratio_c"})),
        _IS_NOTE,
        Note("  (entropy: the adapter has OpenRLHF's training forward return it; no flag needed)", requires=("entropy",)),
        Note(_OLD_PASS_ENTROPY, requires=("old_entropy",)),
        Note("  (index: the adapter carries prompt groups through the replay buffer and shuffles whole groups)",
             requires=("index",))),
    "*": _kind(  # estimators (the declaration's fallback)
        ADV_FLAG, ADV_PARAMS_FLAG, _IS_NOTE,
        Note("  (old_log_prob: OpenRLHF's action_log_probs; sum_pi_squared: the adapter has the old-log-prob pass "
             "compute it at --rollout.temperature; no flag needed)", requires=("sum_pi_squared",)),
        Note(_OLD_PASS_ENTROPY, requires=("old_entropy", "entropy"))),
}))
