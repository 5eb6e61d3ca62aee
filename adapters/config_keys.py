"""How each framework reaches a stablerl algorithm: names and config keys (framework-free).

This module imports no framework; `stablerl describe`, `stablerl list` and the generated docs
use it, and the adapters use the same naming rule, so the documentation cannot drift from what
is registered.
"""

from __future__ import annotations

from stablerl.contracts import ADVANTAGE_ESTIMATOR, BATCH_FILTER, POLICY_LOSS, REWARD_SHAPER, UNAVAILABLE, AlgorithmSpec

# verl 0.9.1 built-ins: stablerl never shadows these names; its own versions are reachable as
# `stablerl_<name>`.
VERL_BUILTIN_POLICY_LOSSES = frozenset(
    {"vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo", "bypass_mode"}
)
VERL_BUILTIN_ADV_ESTIMATORS = frozenset(
    {
        "gae", "grpo", "grpo_vectorized", "gdpo", "grpo_passk", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
        "remax", "rloo", "rloo_vectorized", "opo", "gpg", "optimal_token_baseline", "tir_optimal_token_baseline",
    }
)
VERL_PREFIX = "stablerl_"

# TRL 1.16 built-in loss_type names keep TRL's behaviour in the stablerl trainer.
TRL_BUILTIN_LOSS_TYPES = frozenset({"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"})
TRL_PREFIX = "stablerl_"

# OpenRLHF 0.11.2 built-ins (argparse choices of openrlhf/cli/train_ppo_ray.py): these names keep
# OpenRLHF's code; a stablerl algorithm of the same name is `stablerl_<name>`.
OPENRLHF_BUILTIN_POLICY_LOSSES = ("ppo", "gspo")
OPENRLHF_BUILTIN_ADV_ESTIMATORS = (
    "gae", "reinforce", "rloo", "reinforce_baseline", "group_norm", "dr_grpo", "flash_reinforce",
)
OPENRLHF_PREFIX = "stablerl_"
OPENRLHF_COMMAND = "python -m stablerl.adapters.openrlhf.train_ppo_ray <your OpenRLHF flags>"

# verl actor-config keys a stablerl loss reads (not policy_loss fields): verl's built-ins read them there
VERL_ACTOR_KEYS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "tau_pos", "tau_neg")

# Per-response values a user's reward function provides to reward shapers and batch filters (verl: its
# reward_extra_info fields; TRL: log_extra / rollout_func fields / dataset columns; OpenRLHF: the
# extra_logs it copies into experience.info).
_REWARD_FUNCTION_INPUTS = frozenset({"correct", "flawed", "void_turn"})
# Inputs every adapter computes for shapers and filters at its advantage step.
_EXTENSION_INPUTS = frozenset({"index", "scores", "lengths"}) | _REWARD_FUNCTION_INPUTS

# Inputs each adapter can hand to an algorithm (beyond log-probs, advantages and the mask).
# verl 0.9.1's policy-loss call passes none beyond the basic tensors and rollout_is_weights; the
# verl adapter wraps that call site (verl.workers.utils.losses.ppo_loss) and gathers these from
# verl's model_output / batch (sources: stablerl.adapters.verl._inputs.SOURCES; entropy needs
# actor.calculate_entropy=True, old_entropy the v1 trainer). Its estimator call passes the group
# ids (uid) as index.
FEEDABLE_INPUTS = {
    "verl": {
        POLICY_LOSS: frozenset({"entropy", "old_entropy", "token_ids", "rollout_log_prob", "index", "scores"}),
        # estimators: gathered from the DataProto at verl's compute_advantage by the adapter's wrapper
        # (stablerl.adapters.verl._advantage.SOURCES); only fields both the legacy and the v1 trainer
        # have there. entropy / turn_ids: opt-in (register_batch_field_estimators), no stock trainer writes them.
        ADVANTAGE_ESTIMATOR: frozenset({"index", "scores", "lengths", "old_log_prob", "rollout_log_prob"}),
        # shapers / filters at the same call site (stablerl.adapters.verl._advantage); no stock trainer
        # keeps per-token entropy there
        REWARD_SHAPER: _EXTENSION_INPUTS,
        BATCH_FILTER: _EXTENSION_INPUTS,
    },
    "trl": {
        # rollout_log_prob only with use_vllm=True and vllm_importance_sampling_correction=True;
        # router log-probs only with routing_replay="R2"|"R3"
        POLICY_LOSS: frozenset(
            {"rollout_log_prob", "entropy", "token_ids", "index", "scores", "router_log_prob", "old_router_log_prob"}
        ),
        ADVANTAGE_ESTIMATOR: frozenset({"index"}),
        # filters may also take entropy: the TRL adapter runs one extra no-grad forward for it
        REWARD_SHAPER: _EXTENSION_INPUTS | {"pos_count", "neg_count"},
        BATCH_FILTER: _EXTENSION_INPUTS | {"pos_count", "neg_count", "entropy"},
    },
    "openrlhf": {
        # OpenRLHF's loss call passes rollout_log_probs only with --algo.advantage.is_correction_level
        # token|seq; the adapter's training_step / Actor.forward patches feed entropy (the training
        # forward's, return_entropy=True), token_ids (experience.sequences) and scores
        # (experience.rewards). No index: the replay buffer drops Experience.index and shuffles the rows,
        # so a loss call never sees whole prompt groups. Its advantage step groups responses by prompt (index).
        POLICY_LOSS: frozenset({"rollout_log_prob", "entropy", "token_ids", "scores"}),
        ADVANTAGE_ESTIMATOR: frozenset({"index"}),
        # at compute_advantages_and_returns (stablerl.adapters.openrlhf._shape_filter); no per-token
        # entropy there (the old-log-prob pass returns log-probs only)
        REWARD_SHAPER: _EXTENSION_INPUTS,
        BATCH_FILTER: _EXTENSION_INPUTS,
    },
}
_KINDS_WITH_KEYS = (POLICY_LOSS, ADVANTAGE_ESTIMATOR, REWARD_SHAPER, BATCH_FILTER)


def verl_names(spec: AlgorithmSpec) -> list[str]:
    """The names under which verl's registry resolves ``spec`` (bare name only where free)."""
    builtins = VERL_BUILTIN_POLICY_LOSSES if spec.kind == POLICY_LOSS else VERL_BUILTIN_ADV_ESTIMATORS
    names = [VERL_PREFIX + spec.name]
    if spec.name not in builtins and not spec.name.startswith(VERL_PREFIX):
        names.insert(0, spec.name)
    return names


def openrlhf_name(spec: AlgorithmSpec) -> str:
    """The ``--actor.policy_loss_type`` / ``--algo.advantage.estimator`` value for ``spec``."""
    builtins = OPENRLHF_BUILTIN_POLICY_LOSSES if spec.kind == POLICY_LOSS else OPENRLHF_BUILTIN_ADV_ESTIMATORS
    return OPENRLHF_PREFIX + spec.name if spec.name in builtins else spec.name


def trl_name(spec: AlgorithmSpec) -> str:
    """The ``loss_type`` / ``advantage_estimator`` value for the stablerl TRL trainer."""
    if spec.kind == POLICY_LOSS and spec.name in TRL_BUILTIN_LOSS_TYPES:
        return TRL_PREFIX + spec.name
    return spec.name


def frameworks_for(spec: AlgorithmSpec) -> list[str]:
    """Frameworks whose adapter can run ``spec`` (its declared inputs are all feedable)."""
    if spec.status == UNAVAILABLE or spec.kind not in _KINDS_WITH_KEYS:
        return []
    return [fw for fw, kinds in FEEDABLE_INPUTS.items() if set(spec.requires) <= kinds.get(spec.kind, frozenset())]


def config_keys(spec: AlgorithmSpec) -> dict[str, list[str]]:
    """Per framework, the config lines that select ``spec`` and set its hyper-parameters."""
    if spec.kind in (REWARD_SHAPER, BATCH_FILTER):
        return _extension_keys(spec)
    fields = list(spec.defaults())
    out: dict[str, list[str]] = {}
    frameworks = frameworks_for(spec)
    if "verl" in frameworks:
        name = verl_names(spec)[0]
        if spec.kind == POLICY_LOSS:
            lines = [f"actor_rollout_ref.actor.policy_loss.loss_mode={name}"]
            shared = [f for f in fields if f in VERL_ACTOR_KEYS]
            own = [f for f in fields if f not in shared]
            lines += [f"actor_rollout_ref.actor.{f}=<value>" for f in shared]
            if own:
                lines.append("actor_rollout_ref.actor.policy_loss._target_=stablerl.adapters.verl.StablePolicyLossConfig")
                lines += [f"+actor_rollout_ref.actor.policy_loss.{f}=<value>" for f in own]
        else:
            lines = [f"algorithm.adv_estimator={name}"]
            lines += [
                (f"algorithm.{f}=<value>" if f == "norm_adv_by_std_in_grpo" else f"+algorithm.{f}=<value>")
                for f in fields
            ]
        out["verl"] = lines
    if "trl" in frameworks:
        key = "loss_type" if spec.kind == POLICY_LOSS else "advantage_estimator"
        params_key = "stablerl_loss_params" if spec.kind == POLICY_LOSS else "stablerl_advantage_params"
        lines = ["from stablerl.adapters.trl import GRPOTrainer, GRPOConfig", f'GRPOConfig({key}="{trl_name(spec)}", ...)']
        if fields:
            example = ", ".join(f'"{f}": <value>' for f in fields)
            lines.append(f"GRPOConfig(..., {params_key}={{{example}}})")
            lines.append(f"CLI/YAML: --{key} {trl_name(spec)} --{params_key} '{{{example}}}'")
        out["trl"] = lines
    if "openrlhf" in frameworks:
        loss = spec.kind == POLICY_LOSS
        flag, params_flag = (
            ("--actor.policy_loss_type", "--actor.stablerl_params") if loss
            else ("--algo.advantage.estimator", "--algo.advantage.stablerl_params")
        )
        lines = [OPENRLHF_COMMAND, f"  {flag} {openrlhf_name(spec)}"]
        if fields:
            lines.append(f"  {params_flag} " + " ".join(f"{f}=<value>" for f in fields))
        if loss and set(fields) & {"clip_ratio_low", "clip_ratio_high", "clip_ratio_c"}:
            lines.append("  (--actor.eps_clip / --actor.eps_clip_low_high / --actor.dual_clip, when given, "
                         "set clip_ratio_low/high/c)")
        if "rollout_log_prob" in spec.requires:
            lines.append("  --algo.advantage.is_correction_level token   # OpenRLHF passes vLLM log-probs only then")
        if loss and "entropy" in spec.requires:
            lines.append("  (entropy: the adapter has OpenRLHF's training forward return it; no flag needed)")
        out["openrlhf"] = lines
    return out


def _extension_keys(spec: AlgorithmSpec) -> dict[str, list[str]]:
    """Per framework, the lines that select a reward shaper / batch filter and set its hyper-parameters."""
    fields = list(spec.defaults())
    key = "reward_shaper" if spec.kind == REWARD_SHAPER else "batch_filter"
    out: dict[str, list[str]] = {}
    frameworks = frameworks_for(spec)
    if "verl" in frameworks:
        out["verl"] = [f"+algorithm.stablerl_{key}={spec.name}"]
        out["verl"] += [f"+algorithm.stablerl_{key}_params.{f}=<value>" for f in fields]
    if "trl" in frameworks:
        lines = ["from stablerl.adapters.trl import GRPOTrainer, GRPOConfig", f'GRPOConfig({key}="{spec.name}", ...)']
        if fields:
            example = ", ".join(f'"{f}": <value>' for f in fields)
            lines.append(f"GRPOConfig(..., stablerl_{key}_params={{{example}}})")
        if spec.kind == REWARD_SHAPER:
            lines.append('(needs a stablerl advantage_estimator, e.g. "grpo")')
        out["trl"] = lines
    if "openrlhf" in frameworks:
        lines = [OPENRLHF_COMMAND, f"  --algo.advantage.stablerl_{key} {spec.name}"]
        if fields:
            lines.append(f"  --algo.advantage.stablerl_{key}_params " + " ".join(f"{f}=<value>" for f in fields))
        if spec.kind == BATCH_FILTER:
            lines.append("  (dropped rows get action_mask 0; filters that repeat rows are refused)")
        out["openrlhf"] = lines
    return out
