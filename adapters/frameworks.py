"""The built-in framework declarations (verl, TRL, OpenRLHF): stablerl's ``register_frameworks`` plugin.

Framework-free: importing this module imports no framework and no adapter. Core reaches these
declarations only through the plugin manager (entry-point group ``stablerl.builtin``), the way a
third party would declare a fourth framework; each adapter reads its own declaration back with
``stablerl.frameworks.get_framework(NAME)``. So a fact about a framework (its built-in names, the
inputs it can feed and why not, its config keys and their defaults, the supported versions) is
written once, here, and `stablerl describe`, the generated docs and the adapters all read it.
"""

from __future__ import annotations

from stablerl.contracts import (ADVANTAGE_ESTIMATOR, BATCH_FILTER, CONTROLLER, POLICY_LOSS, REWARD_SHAPER,
                                ROLLOUT_CORRECTION, TRAINER_HOOK, AlgorithmSpec)
from stablerl.frameworks import CALL_OPTIONS, FrameworkKey, FrameworkSpec
from stablerl.hookspecs import hookimpl

# Per-response values a user's reward function provides to reward shapers and batch filters (verl: its
# reward_extra_info fields; TRL: log_extra / rollout_func fields / dataset columns; OpenRLHF: the
# extra_logs it copies into experience.info).
_REWARD_FUNCTION_INPUTS = frozenset({"correct", "flawed", "void_turn"})
# Inputs every adapter computes for shapers and filters at its advantage step.
_EXTENSION_INPUTS = frozenset({"index", "scores", "lengths"}) | _REWARD_FUNCTION_INPUTS

# ----------------------------------------------------------------------------- verl 0.9.1: adapters/verl/_spec.py

# the optimal_token_baseline estimators in TRL (adapters/trl/trainer.py, _stablerl_old_pass_stats)
_TRL_OTB_NOTE = (
    "old_log_prob and sum_pi_squared come from one forward of the policy through TRL's fused LM head at TRL's "
    "temperature (its log_sum_sq_probs output, which the adapter adds): TRL's old-log-prob pass where TRL runs one "
    "(num_iterations > 1, steps_per_generation > gradient_accumulation_steps, or vLLM importance-sampling "
    "correction), else one extra no-grad forward of the policy that generated the batch (text-only batches)"
)



def _json_value(value) -> str:
    """A value as a JSON literal in a TRL / OpenRLHF params line (placeholders and JSON objects as written)."""
    import json

    text = str(value)
    return text if not isinstance(value, str) or text.startswith(("<", "{")) else json.dumps(value)


def _trl_loss_key(name: str, value) -> str:
    return f'stablerl_loss_params={{"{name}": {_json_value(value)}}}'


def _openrlhf_loss_key(name: str, value) -> str:
    text = f"{name}={value}"
    return f"--actor.stablerl_params '{text}'" if any(c in text for c in ' "{') else f"--actor.stablerl_params {text}"

# ----------------------------------------------------------------------------- TRL 1.16

TRL_BUILTIN_LOSS_TYPES = frozenset({"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"})

TRL = FrameworkSpec(
    name="trl",
    distribution="trl",
    supported=">=1.16,<1.17",
    adapter="stablerl.adapters.trl",
    builtin_names={POLICY_LOSS: TRL_BUILTIN_LOSS_TYPES},
    feedable={
        # rollout_log_prob only with use_vllm=True and vllm_importance_sampling_correction=True;
        # router log-probs only with routing_replay="R2"|"R3" (the adapter narrows per run)
        # old_entropy: TRL's old-log-prob pass also computes entropies for a loss that declares it; where TRL
        # skips that pass its old log-probs are the current policy's, and so is the old entropy
        POLICY_LOSS: frozenset(
            {"rollout_log_prob", "entropy", "token_ids", "index", "scores", "router_log_prob", "old_router_log_prob",
             "old_entropy"}
        ),
        # old_log_prob / sum_pi_squared: TRL's old-log-prob pass (or, where TRL runs none, one extra no-grad forward
        # of the generating policy) through TRL's fused LM head, asked for its log_sum_sq_probs output too
        # entropy (empg): one extra no-grad forward of the generating policy, as for filters
        ADVANTAGE_ESTIMATOR: frozenset({"index", "old_log_prob", "sum_pi_squared", "entropy"}),
        # filters may also take entropy: the TRL adapter runs one extra no-grad forward for it
        REWARD_SHAPER: _EXTENSION_INPUTS | {"pos_count", "neg_count"},
        BATCH_FILTER: _EXTENSION_INPUTS | {"pos_count", "neg_count", "entropy"},
        # the adapter runs num_iterations optimizer passes over each generation batch and calls the hook between them
        TRAINER_HOOK: frozenset({"params_view"}),
        # controllers: the generation temperature, and their penalty (an entropy bonus or their own term) in the loss
        CONTROLLER: frozenset({"entropy_bonus", "rollout_temperature", "loss_term"}),
        # stablerl_rollout_correction: the engine's sampling log-probs, with TRL's own IS correction off
        ROLLOUT_CORRECTION: frozenset({"rollout_log_prob"}),
    },
    why_not={
        "*": {
            "turn_ids": "TRL marks tool tokens with tool_mask but gives no per-token turn ids",
            "anchor_ids": "TRL's GRPOTrainer has one row per completion (its tool calls stay inside it), no agent "
            "steps with anchor-state ids",
            "step_returns": "TRL's GRPOTrainer has one row per completion, no agent steps with step returns",
            "versions": "TRL's GRPOTrainer keeps no per-token policy versions (a trainer subclass that tracks them can "
            "supply them through stablerl_extra_loss_inputs, as benchmarks/stability/_offpolicy_trainer.py does)",
            "policy_version": "TRL's loss call is not given the current policy version (a trainer subclass can supply "
            "it through stablerl_extra_loss_inputs)",
            "router_log_prob": "needs routing_replay='R2' or 'R3' on an MoE model (TRL's fused LM head drops router "
            "logits; stablerl records the router log-probs at the replayed experts)",
            "old_router_log_prob": "needs routing_replay='R2' or 'R3' on an MoE model (recorded in the old-log-prob pass)",
            "rollout_log_prob": "needs use_vllm=True and vllm_importance_sampling_correction=True",
            "entropy": "TRL computes entropies only inside _compute_loss, after advantages",
            "old_log_prob": "the adapter hands the old-log-prob pass's log-probs to advantage estimators only (the "
            "loss gets TRL's old_per_token_logps as its old policy)",
            "reward_baselines": "TRL's GRPOTrainer generates no greedy baseline response per prompt (ReMax)",
            "sum_pi_squared": "the adapter asks TRL's fused LM head for it (log_sum_sq_probs) in the old-log-prob pass "
            "for advantage estimators only",
            "hidden_states": "TRL's forward in _compute_loss returns log-probs and entropies, not the last hidden states",
            "lm_head_weight": "TRL's loss computation does not expose the LM-head weight to the loss",
            "sampling_rounds": "TRL's GRPOTrainer generates exactly num_generations completions per prompt in one "
            "call per generation batch (RepeatSampler fixes the batch layout), so it cannot draw more for a prompt",
        },
        ADVANTAGE_ESTIMATOR: {
            "pos_count": "TRL's GRPOTrainer samples num_generations per prompt in one round: nothing counts samples "
            "over rounds, and the adapter passes no per-prompt counts to estimators",
            "neg_count": "TRL's GRPOTrainer samples num_generations per prompt in one round",
        },
    },
    conditions={
        POLICY_LOSS: {
            "rollout_log_prob": "use_vllm=True and vllm_importance_sampling_correction=True",
            "router_log_prob": "routing_replay='R2' or 'R3' on an MoE model",
            "old_router_log_prob": "routing_replay='R2' or 'R3' on an MoE model",
        },
        ROLLOUT_CORRECTION: {
            "rollout_log_prob": "use_vllm=True (or a rollout_func returning logprobs) and "
            "vllm_importance_sampling_correction=False",
        },
    },
    selection_keys={
        POLICY_LOSS: "loss_type",
        ADVANTAGE_ESTIMATOR: "advantage_estimator",
        REWARD_SHAPER: "reward_shaper",
        BATCH_FILTER: "batch_filter",
        CONTROLLER: "entropy_controller",
        TRAINER_HOOK: "trainer_hook",
        # its own key (stablerl_loss_params' rollout_correction is an alias): it replaces TRL's vLLM IS correction
        ROLLOUT_CORRECTION: "stablerl_rollout_correction",
    },
    hyperparameter_keys={
        POLICY_LOSS: {
            # TRL's PPO-clip bounds, relative as in its dapo/grpo losses (epsilon_high None = unset)
            "clip_ratio_low": FrameworkKey("epsilon", 0.2),
            "clip_ratio_high": FrameworkKey("epsilon_high", None),
            # INTELLECT-2's two-sided clip (arXiv 2505.07291): -min(min(r, delta) A, clip(r) A) is the dual clip
            # min(max(-rA, -clip(r)A), -delta A) for A < 0 and PPO for A > 0, value and gradient
            "clip_ratio_c": FrameworkKey("delta", None),
        },
        ADVANTAGE_ESTIMATOR: {
            # scale_rewards: 'group' (TRL's default) -> True, 'none' -> False; 'batch' is refused
            "norm_adv_by_std_in_grpo": FrameworkKey(
                "scale_rewards", True, refuse_if_unused=True, spelled={True: "'group'", False: "'none'"}
            ),
            # multi_objective_aggregation: 'sum_then_normalize' (TRL's default: the estimator gets the weighted
            # sum) -> GDPO's default form; 'normalize_then_sum' (TRL's GDPO) -> gdpo form='trl'; refused for an
            # estimator without `form` (it works on the weighted sum)
            "form": FrameworkKey(
                "multi_objective_aggregation", "verl", refuse_if_unused=True,
                spelled={"verl": "'sum_then_normalize'", "trl": "'normalize_then_sum'"},
            ),
        },
    },
    params_keys={
        POLICY_LOSS: _trl_loss_key,
        ADVANTAGE_ESTIMATOR: 'stablerl_advantage_params={{"{name}": {value}}}',
        REWARD_SHAPER: 'stablerl_reward_shaper_params={{"{name}": {value}}}',
        BATCH_FILTER: 'stablerl_batch_filter_params={{"{name}": {value}}}',
        CONTROLLER: 'stablerl_entropy_controller_params={{"{name}": {value}}}',
        TRAINER_HOOK: 'stablerl_trainer_hook_params={{"{name}": {value}}}',
        ROLLOUT_CORRECTION: 'stablerl_rollout_correction_params={{"{name}": {value}}}',
    },
    usage="from stablerl.adapters.trl import GRPOTrainer, GRPOConfig  (instead of trl's)",
    switches={"rollout_correction": "vllm_importance_sampling_correction",
              "routing_replay": 'GRPOConfig(routing_replay="R2", ...)  # or "R3" (with vLLM)'},
    algorithm_notes={
        "empg": "entropy is the generating policy's, from one extra no-grad forward over the rollout (TRL computes "
        "entropies only in _compute_loss; shared with a batch filter that reads them too); a step is a contiguous "
        "run of completion_mask (TRL has no per-token turn ids): one step per completion",
        "erc": "old_entropy is the entropy of TRL's old-log-prob pass where TRL runs one (num_iterations > 1, "
        "steps_per_generation > gradient_accumulation_steps, or vLLM importance-sampling correction), else the "
        "current policy's detached (each micro-batch is then trained once, at the old policy: ratio 1, as TRL's "
        "old log-probs)",
        "optimal_token_baseline": _TRL_OTB_NOTE,
        "tir_optimal_token_baseline": _TRL_OTB_NOTE,
        "m2po": "old_log_prob is TRL's old_per_token_logps (recomputed when num_iterations > 1 or "
        "steps_per_generation > gradient_accumulation_steps), else the detached current policy (ratio 1); a "
        "trainer subclass can hand the behaviour policy's log-probs (stablerl_extra_loss_inputs)",
    },
)

# ----------------------------------------------------------------------------- OpenRLHF 0.11.2

# A-3PO's versions in OpenRLHF: one per batch, so alpha = 0 and the proximal log-prob is the rollout's
_OPENRLHF_ONE_VERSION = (
    "the synchronous trainer (no --train.async_enable): each batch is generated by the weights its update starts "
    "from, so every token is of the proximal version (A-3PO's alpha = 0: decoupled PPO with the vLLM log-probs as "
    "proximal policy); refused with --train.async_enable (a batch may come from older weights, and OpenRLHF records "
    "no per-token versions)"
)

# argparse choices of openrlhf/cli/train_ppo_ray.py
OPENRLHF_BUILTIN_POLICY_LOSSES = ("ppo", "gspo")
OPENRLHF_BUILTIN_ADV_ESTIMATORS = ("gae", "reinforce", "rloo", "reinforce_baseline", "group_norm", "dr_grpo", "flash_reinforce")
OPENRLHF_COMMAND = "python -m stablerl.adapters.openrlhf.train_ppo_ray <your OpenRLHF flags>"

OPENRLHF = FrameworkSpec(
    name="openrlhf",
    distribution="openrlhf",
    supported=">=0.11.2,<0.11.3",
    adapter="stablerl.adapters.openrlhf",
    builtin_names={
        POLICY_LOSS: OPENRLHF_BUILTIN_POLICY_LOSSES,  # tuples: OpenRLHF's argparse order
        ADVANTAGE_ESTIMATOR: OPENRLHF_BUILTIN_ADV_ESTIMATORS,
    },
    # the loss call passes rollout_log_probs only with --algo.advantage.is_correction_level token|seq; the
    # adapter's training_step / Actor.forward patches feed entropy, token_ids and scores. Its advantage
    # step groups responses by prompt (index); shapers and filters run there on the whole rollout batch.
    # index (prompt groups) at the loss: the adapter carries the groups through the replay buffer in
    # Experience.info and its DataLoader keeps them whole per micro-batch (adapters/openrlhf/_groups.py).
    # The old-log-prob pass's entropy (old_entropy at the loss; entropy at the advantage step): the adapter has
    # that pass return it when a selected algorithm declares it and carries it in Experience.info (_inputs.py).
    feedable={
        # versions / policy_version: one weight version per batch (the synchronous trainer), A-3PO's
        POLICY_LOSS: frozenset({"rollout_log_prob", "entropy", "token_ids", "scores", "index", "old_entropy",
                                "versions", "policy_version"}),
        # old_log_prob: experience.action_log_probs; sum_pi_squared: the adapter has the old-log-prob pass compute it
        # from the same temperature-scaled logits (only when the selected estimator declares it)
        ADVANTAGE_ESTIMATOR: frozenset({"index", "entropy", "old_log_prob", "sum_pi_squared"}),
        REWARD_SHAPER: _EXTENSION_INPUTS | {"entropy"},
        BATCH_FILTER: _EXTENSION_INPUTS | {"entropy"},
        # the adapter sets OpenRLHF's own --actor.entropy_coef before every training_step (adaptive_entropy)
        CONTROLLER: frozenset({"entropy_bonus"}),
    },
    why_not={
        "*": {
            "rollout_log_prob": "set --algo.advantage.is_correction_level token|seq (OpenRLHF requests vLLM "
            "log-probs only then)",
            "turn_ids": "OpenRLHF's experiences carry no per-token turn ids",
            "anchor_ids": "OpenRLHF's experiences are one per sample (its agent mode keeps a whole episode in one), "
            "with no anchor-state ids",
            "step_returns": "OpenRLHF's experiences carry no per-step discounted returns",
            "versions": "OpenRLHF's experiences carry no per-token policy versions (its async mode keeps none per token)",
            "policy_version": "OpenRLHF's loss call does not know the current policy version",
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
    conditions={
        "*": {"rollout_log_prob": "--algo.advantage.is_correction_level token|seq"},
        POLICY_LOSS: {
            "versions": _OPENRLHF_ONE_VERSION,
            "policy_version": "the synchronous trainer (no --train.async_enable), as for versions (the version after "
            "the batch's)",
            "index": "--train.micro_batch_size and --rollout.micro_batch_size multiples of "
            "--rollout.n_samples_per_prompt, no --train.dynamic_batch_enable (whole prompt groups per micro-batch)",
        },
    },
    why_no_key={
        TRAINER_HOOK: "a trainer hook acts between optimizer passes inside the Ray actor (ActorPPOTrainer.ppo_train "
        "loops over --actor.max_epochs passes with no callback between them) and OpenRLHF always trains with "
        "DeepSpeed, whose optimizer keeps the fp32 master weights in its own flat partitions and copies them over the "
        "model's parameters after every step, so a reposition of the parameters (SFPO) would be overwritten; an "
        "adaptive sampler needs a rollout loop that draws more for a prompt (OpenRLHF draws a fixed "
        "--rollout.n_samples_per_prompt in one call); the TRL adapter runs sfpo",
    },
    selection_keys={
        POLICY_LOSS: "--actor.policy_loss_type",
        ADVANTAGE_ESTIMATOR: "--algo.advantage.estimator",
        REWARD_SHAPER: "--algo.advantage.stablerl_reward_shaper",
        BATCH_FILTER: "--algo.advantage.stablerl_batch_filter",
        CONTROLLER: "--actor.stablerl_entropy_controller",
    },
    hyperparameter_keys={
        POLICY_LOSS: {
            # applied only when given on the command line (the wrapper reads argv)
            "clip_ratio_low": FrameworkKey("--actor.eps_clip_low_high[0] / --actor.eps_clip", 0.2),
            "clip_ratio_high": FrameworkKey("--actor.eps_clip_low_high[1] / --actor.eps_clip", 0.2),
            "clip_ratio_c": FrameworkKey("--actor.dual_clip", None),
        },
        ADVANTAGE_ESTIMATOR: {
            "norm_adv_by_std_in_grpo": FrameworkKey(
                "--algo.advantage.no_std_norm", True, refuse_if_unused=True, spelled={False: "(given)", True: "(not given)"}
            ),
            # the discount of the REINFORCE-family returns (applied only when given on the command line)
            "gamma": FrameworkKey("--algo.advantage.gamma", 1.0, refuse_if_unused=True),
        },
    },
    params_keys={
        POLICY_LOSS: _openrlhf_loss_key,
        ADVANTAGE_ESTIMATOR: "--algo.advantage.stablerl_params {name}={value}",
        REWARD_SHAPER: "--algo.advantage.stablerl_reward_shaper_params {name}={value}",
        BATCH_FILTER: "--algo.advantage.stablerl_batch_filter_params {name}={value}",
        CONTROLLER: "--actor.stablerl_entropy_controller_params {name}={value}",
    },
    usage=OPENRLHF_COMMAND,
    switches={"rollout_correction": "--algo.advantage.is_correction_level",
              "routing_replay": "--actor.stablerl_routing_replay R2  # or R3 (vLLM >= 0.14)"},
    algorithm_notes={
        "d3s": "OpenRLHF's advantage step does not know the run's total number of steps: the N/K schedule "
        "(n_init != n_final or k_init != k_final) is refused at the first step; set n_init == n_final and "
        "k_init == k_final",
        "a3po": "OpenRLHF records no per-token versions; its synchronous trainer generates each batch with the "
        "weights the update starts from, so the adapter gives every generated token version 0 and the policy version "
        "1 (relative): alpha = 0, the proximal log-prob is the vLLM rollout log-prob (behaviour weight 1) and r = "
        "exp(lp - lp_rollout) is clipped for every micro-batch and epoch (OpenRLHF's recomputed old log-probs are "
        "unused unless prox_logp_method=recompute)",
        "m2po": "old_log_prob is the actor's recomputed old-log-prob pass; OpenRLHF offers no way to give the "
        "behaviour (vLLM) policy as the old policy",
    },
)


# ----------------------------------------------------------------------------- config lines (docs, describe)


def _trl_lines(spec: AlgorithmSpec) -> list[str]:
    fields = list(spec.defaults())
    if spec.kind in (REWARD_SHAPER, BATCH_FILTER, CONTROLLER, TRAINER_HOOK):
        key = {REWARD_SHAPER: "reward_shaper", BATCH_FILTER: "batch_filter", CONTROLLER: "entropy_controller",
               TRAINER_HOOK: "trainer_hook"}[spec.kind]
        lines = ["from stablerl.adapters.trl import GRPOTrainer, GRPOConfig", f'GRPOConfig({key}="{spec.name}", ...)']
        if fields:
            example = ", ".join(f'"{f}": <value>' for f in fields)
            lines.append(f"GRPOConfig(..., stablerl_{key}_params={{{example}}})")
        if spec.kind == REWARD_SHAPER:
            lines.append('(needs a stablerl advantage_estimator, e.g. "grpo")')
        if spec.name == "sfpo":
            lines.append("(num_iterations = inner_steps + 1, e.g. 4; steps_per_generation = gradient_accumulation_steps)")
        return lines
    key = TRL.selection_keys[spec.kind]
    params_key = "stablerl_loss_params" if spec.kind == POLICY_LOSS else "stablerl_advantage_params"
    name = _first_name(TRL, spec)
    lines = ["from stablerl.adapters.trl import GRPOTrainer, GRPOConfig", f'GRPOConfig({key}="{name}", ...)']
    if fields:
        example = ", ".join(f'"{f}": <value>' for f in fields)
        lines.append(f"GRPOConfig(..., {params_key}={{{example}}})")
        lines.append(f"CLI/YAML: --{key} {name} --{params_key} '{{{example}}}'")
    return lines


def _openrlhf_lines(spec: AlgorithmSpec) -> list[str]:
    fields = list(spec.defaults())
    if spec.kind == CONTROLLER:
        lines = [OPENRLHF_COMMAND, f"  {OPENRLHF.selection_keys[CONTROLLER]} {spec.name}"]
        if fields:
            lines.append(f"  {OPENRLHF.selection_keys[CONTROLLER]}_params " + " ".join(f"{f}=<value>" for f in fields))
        return lines + ["  (--actor.entropy_coef stays unset: the controller sets OpenRLHF's entropy bonus every step)"]
    if spec.kind in (REWARD_SHAPER, BATCH_FILTER):
        key = "reward_shaper" if spec.kind == REWARD_SHAPER else "batch_filter"
        lines = [OPENRLHF_COMMAND, f"  --algo.advantage.stablerl_{key} {spec.name}"]
        if fields:
            lines.append(f"  --algo.advantage.stablerl_{key}_params " + " ".join(f"{f}=<value>" for f in fields))
        if spec.kind == BATCH_FILTER:
            lines.append("  (dropped rows get action_mask 0; filters that repeat rows are refused)")
        if "entropy" in spec.requires:
            lines.append("  (entropy: the adapter has OpenRLHF's old-log-prob pass return it; no flag needed)")
        return lines
    loss = spec.kind == POLICY_LOSS
    flag, params_flag = (
        ("--actor.policy_loss_type", "--actor.stablerl_params") if loss
        else ("--algo.advantage.estimator", "--algo.advantage.stablerl_params")
    )
    lines = [OPENRLHF_COMMAND, f"  {flag} {_first_name(OPENRLHF, spec)}"]
    if fields:
        lines.append(f"  {params_flag} " + " ".join(f"{f}=<value>" for f in fields))
    if loss and set(fields) & {"clip_ratio_low", "clip_ratio_high", "clip_ratio_c"}:
        lines.append("  (--actor.eps_clip / --actor.eps_clip_low_high / --actor.dual_clip, when given, "
                     "set clip_ratio_low/high/c)")
    if "rollout_log_prob" in spec.requires:
        lines.append("  --algo.advantage.is_correction_level token   # OpenRLHF passes vLLM log-probs only then")
    if loss and "entropy" in spec.requires:
        lines.append("  (entropy: the adapter has OpenRLHF's training forward return it; no flag needed)")
    if not loss and "sum_pi_squared" in spec.requires:
        lines.append("  (old_log_prob: OpenRLHF's action_log_probs; sum_pi_squared: the adapter has the old-log-prob pass "
                     "compute it at --rollout.temperature; no flag needed)")
    if "old_entropy" in spec.requires or (not loss and "entropy" in spec.requires):
        lines.append("  (old-log-prob pass entropy: the adapter has that pass return it and carries it with the rows; "
                     "no flag needed)")
    if loss and "index" in spec.requires:
        lines.append("  (index: the adapter carries prompt groups through the replay buffer and shuffles whole groups)")
    return lines


def _first_name(framework: FrameworkSpec, spec: AlgorithmSpec) -> str:
    from stablerl.frameworks import framework_names

    return framework_names(framework, spec)[0]


TRL = TRL.with_config_lines(_trl_lines)
OPENRLHF = OPENRLHF.with_config_lines(_openrlhf_lines)


@hookimpl
def register_frameworks(register):
    from stablerl.adapters.verl._spec import VERL  # imported here: its package may instrument (see its __init__)

    for framework in (VERL, TRL, OPENRLHF):
        register(framework)
