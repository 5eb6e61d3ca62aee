"""TRL's declaration (``FrameworkSpec``): registered by ``stablerl.adapters.frameworks.register_frameworks``.

Framework-free. What TRL can feed (``feedable``, ``conditions``) is derived from the adapter's providers
(:class:`~stablerl.adapters.trl._adapter.TRLAdapter`); the rest (names, keys, why not, notes) is written here.
"""

from __future__ import annotations

from stablerl.config_recipe import KindLines, Note, Params, recipe_lines
from stablerl.contracts import (ADVANTAGE_ESTIMATOR, BATCH_FILTER, CONTROLLER, POLICY_LOSS, REWARD_SHAPER,
                                ROLLOUT_CORRECTION, TRAINER_HOOK)
from stablerl.frameworks import FrameworkKey, FrameworkSpec

from ._adapter import TRLAdapter

# the optimal_token_baseline estimators in TRL (the adapter's old_log_prob / sum_pi_squared providers)
_TRL_OTB_NOTE = (
    "old_log_prob and sum_pi_squared come from one forward of the policy through TRL's fused LM head at TRL's "
    "temperature (its log_sum_sq_probs output, which the adapter adds): TRL's old-log-prob pass where TRL runs one "
    "(num_iterations > 1, steps_per_generation > gradient_accumulation_steps, or vLLM importance-sampling "
    "correction), else one extra no-grad forward of the policy that generated the batch (text-only batches)"
)


def _json_value(value) -> str:
    """A value as a JSON literal in a TRL params line (placeholders and JSON objects as written)."""
    import json

    text = str(value)
    return text if not isinstance(value, str) or text.startswith(("<", "{")) else json.dumps(value)


def _trl_loss_key(name: str, value) -> str:
    return f'stablerl_loss_params={{"{name}": {_json_value(value)}}}'


TRL_BUILTIN_LOSS_TYPES = frozenset({"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"})

TRL = FrameworkSpec(
    name="trl",
    distribution="trl",
    supported=">=1.16,<1.17",
    adapter="stablerl.adapters.trl",
    adapter_class="stablerl.adapters.trl._adapter:TRLAdapter",
    builtin_names={POLICY_LOSS: TRL_BUILTIN_LOSS_TYPES},
    feedable=TRLAdapter.feedable(),  # derived from the adapter's providers (stablerl.providers)
    why_not={
        "*": {
            "turn_ids": "TRL marks tool tokens with tool_mask but gives no per-token turn ids",
            "anchor_ids": "TRL's GRPOTrainer has one row per completion (its tool calls stay inside it), no agent "
            "steps with anchor-state ids",
            "step_returns": "TRL's GRPOTrainer has one row per completion, no agent steps with step returns",
            "router_log_prob": "needs routing_replay='R2' or 'R3' on an MoE model (TRL's fused LM head drops router "
            "logits; stablerl records the router log-probs at the replayed experts)",
            "old_router_log_prob": "needs routing_replay='R2' or 'R3' on an MoE model (recorded in the old-log-prob pass)",
            "rollout_log_prob": "with use_vllm=True it needs vllm_importance_sampling_correction=True (TRL keeps the "
            "sampler's log-probs only then; without vLLM they are TRL's old-log-prob pass at generation)",
            "entropy": "TRL computes entropies only inside _compute_loss, after advantages",
            "old_log_prob": "the adapter hands the old-log-prob pass's log-probs to advantage estimators only (the "
            "loss gets TRL's old_per_token_logps as its old policy)",
            "reward_baselines": "TRL's GRPOTrainer generates no greedy baseline response per prompt (ReMax)",
            "sum_pi_squared": "the adapter asks TRL's fused LM head for it (log_sum_sq_probs) in the old-log-prob pass "
            "for advantage estimators only",
            "hidden_states": "TRL's forward in _compute_loss returns log-probs and entropies, not the last hidden states",
            "lm_head_weight": "TRL's loss computation does not expose the LM-head weight to the loss",
            "teacher_log_prob": "the adapter feeds the teacher's log-probs (stablerl_teacher_model) to advantage "
            "estimators only",
            "teacher_topk_log_prob": "not built yet: TRL's fused LM head returns log-probs of the sampled tokens only; "
            "a top-k teacher distribution needs the teacher's logits (TRL's own DistillationTrainer computes the "
            "full-vocabulary divergence in its own loss)",
            "teacher_topk_ids": "not built yet (see teacher_topk_log_prob)",
            "student_topk_log_prob": "not built yet: TRL's fused LM head never materialises the training forward's "
            "logits, so the student's log-probs at the teacher's ids are not available to the loss",
            "sampling_rounds": "TRL's GRPOTrainer generates exactly num_generations completions per prompt in one "
            "call per generation batch (RepeatSampler fixes the batch layout), so it cannot draw more for a prompt",
        },
        ADVANTAGE_ESTIMATOR: {
            "pos_count": "TRL's GRPOTrainer samples num_generations per prompt in one round: nothing counts samples "
            "over rounds, and the adapter passes no per-prompt counts to estimators",
            "neg_count": "TRL's GRPOTrainer samples num_generations per prompt in one round",
        },
    },
    conditions=TRLAdapter.conditions(),  # the conditional providers' settings
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
        "a3po": "versions are generation rounds (AReaL's weight versions: one per weight sync to the rollout engine, "
        "constant over the optimizer steps that train one rollout batch): each row is stamped with the round that "
        "generated it (-1 on prompt, padding and tool tokens), policy_version is the round of the batch being trained. "
        "TRL's GRPOTrainer is synchronous: it trains only its latest generation batch (over steps_per_generation / "
        "gradient_accumulation_steps optimizer steps, num_iterations times), so versions == policy_version and alpha = "
        "0: A-3PO is decoupled PPO with the behaviour log-probs as proximal policy. Without vLLM the behaviour "
        "log-probs are TRL's old-log-prob pass at generation (the generating weights'); with vLLM they are the "
        "sampler's (vllm_importance_sampling_correction=True). trl.experimental.async_grpo.AsyncGRPOTrainer (where "
        "alpha would be nonzero) is not supported: it has no loss_type and needs a vLLM server",
        "m2po": "old_log_prob is TRL's old_per_token_logps (recomputed when num_iterations > 1 or "
        "steps_per_generation > gradient_accumulation_steps), else the detached current policy (ratio 1); a "
        "trainer subclass can hand the behaviour policy's log-probs (stablerl_extra_loss_inputs)",
    },
)


_IMPORT = "from stablerl.adapters.trl import GRPOTrainer, GRPOConfig"
_JSON = dict(item='"{field}": <value>', sep=", ")


def _trl_kind(params_key: str, *notes: Note) -> KindLines:
    return KindLines(head=(_IMPORT,), select='GRPOConfig({key}="{name}", ...)', notes=notes, params=(Params((
        f"GRPOConfig(..., {params_key}={{{{{{items}}}}}})",), **_JSON),))


def _trl_name_kind(params_key: str) -> KindLines:  # loss and estimators: also the TrlParser CLI/YAML spelling
    return KindLines(head=(_IMPORT,), select='GRPOConfig({key}="{name}", ...)', params=(Params((
        f"GRPOConfig(..., {params_key}={{{{{{items}}}}}})",
        f"CLI/YAML: --{{key}} {{name}} --{params_key} '{{{{{{items}}}}}}'"), **_JSON),))


TRL = TRL.with_config_lines(recipe_lines(TRL, {
    REWARD_SHAPER: _trl_kind("stablerl_reward_shaper_params", Note('(needs a stablerl advantage_estimator, e.g. "grpo")')),
    BATCH_FILTER: _trl_kind("stablerl_batch_filter_params"),
    CONTROLLER: _trl_kind("stablerl_entropy_controller_params"),
    TRAINER_HOOK: _trl_kind("stablerl_trainer_hook_params", Note(
        "(num_iterations = inner_steps + 1, e.g. 4; steps_per_generation = gradient_accumulation_steps)", name="sfpo")),
    POLICY_LOSS: _trl_name_kind("stablerl_loss_params"),
    "*": _trl_name_kind("stablerl_advantage_params"),  # estimators (the declaration's fallback)
}))

__all__ = ["TRL", "TRL_BUILTIN_LOSS_TYPES"]
