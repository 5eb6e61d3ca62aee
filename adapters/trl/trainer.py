"""stablerl in TRL: a drop-in ``GRPOTrainer`` / ``GRPOConfig`` pair (TRL >= 1.16, < 1.17).

    from stablerl.adapters.trl import GRPOConfig, GRPOTrainer
    args = GRPOConfig(loss_type="m2po", advantage_estimator="qae",
                      stablerl_loss_params={"m2_threshold": 0.04}, stablerl_advantage_params={"quantile_k": 0.4})

What it translates, and nothing more (the algorithms live in ``stablerl.plugins``):

* ``loss_type``: TRL's built-in names (``grpo``, ``dapo``, ``cispo``, ``sapo``, ...) keep TRL's own
  code path; any other name is a stablerl policy loss; ``stablerl_<name>`` selects the stablerl
  loss explicitly (needed where a name exists in both, e.g. ``stablerl_cispo``).
* ``advantage_estimator``: ``None`` keeps TRL's advantages; a stablerl estimator name replaces them,
  computed on the rewards TRL gathered over every process (groups are TRL's contiguous blocks of
  ``num_generations``), then sliced to this process's rows exactly as TRL slices its own.
* ``routing_replay``: ``"R3"`` / ``"R2"`` MoE routing replay (``stablerl.routing_replay``; see
  docs/routing-replay.md): routes recorded around HF ``generate`` (R3; or taken from a ``rollout_func``'s
  vLLM ``routed_experts``) or in TRL's old-log-prob pass (R2) travel with the batch rows as the
  batch-first ``stablerl_routes`` tensor and are replayed in the old/ref passes and the training
  forward, kept until after backward. Also feeds ``rspo`` its router log-probs.
* ``reward_shaper`` / ``batch_filter`` / ``entropy_controller`` (+ ``stablerl_<kind>_params``): shapers run
  on the gathered rewards before a stablerl estimator; filters after the advantages, on the gathered batch
  (dropped rows/tokens: advantage 0 and loss mask 0 through ``tool_mask``; ``num_items_in_batch`` = kept
  tokens); controllers are stepped once per optimizer step with TRL's process-reduced entropy, their
  temperature applied to generation and their penalty added to the loss; controller, ``ctx.state`` and
  generator state are saved as ``stablerl_state.pt`` in each checkpoint (see docs/trl.md).

Everything TRL does around the loss is kept by running TRL's own ``_compute_loss`` for it: for a
stablerl loss, ``_compute_loss`` calls the parent's method with zero advantages under the TRL
built-in whose normaliser equals ``stablerl_loss_agg_mode`` (``dapo``, ``grpo``, ``luspo``,
``dr_grpo``), so that the parent contributes exactly the surroundings -- the forward pass with
entropies and the MoE aux loss, the KL to the reference model (with ``use_bias_correction_kl``),
the entropy bonus and its adaptive state, gradient-accumulation scaling and TRL's metrics -- and
its policy term is exactly zero. The stablerl policy loss is then computed from the log-probs and
entropies of that same forward pass (captured in ``_get_per_token_logps_and_entropies``), with
TRL's masks (completion x tool mask, off-policy sequence mask, ``top_entropy_quantile``) and the
vLLM importance-sampling ratio applied as per-token weights in TRL's order, and added.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

import stablerl
from stablerl import routing_replay as rr
from stablerl.contracts import (ADVANTAGE_ESTIMATOR, BATCH_FILTER, CONTROLLER, OPTIONAL_INPUTS, POLICY_LOSS,
                                REWARD_SHAPER, ROLLOUT_CORRECTION, TRAINER_HOOK, ParamsView)
from stablerl.frameworks import (UnsupportedVersionError, apply_filter_result, as_params, check_call_options,
                                 check_framework_keys_used, check_shaper_and_components, split_call_options, top_entropy_on,
                                 check_inputs, check_version, effective_hyperparameters, get_framework, log_effective_settings,
                                 resolve, version_in_range)
from stablerl.ops import AGG_MODES, last_valid_index, scores_on_last_token
from stablerl.params import StableRLError, UnknownNameError, build_params, unknown_name_message
from stablerl.state import StateStore

#: declared once, in ``stablerl.adapters.frameworks`` (``stablerl.frameworks.get_framework("trl").supported``)
SUPPORTED_TRL = get_framework("trl").supported

# TRL 1.16's built-in loss types keep TRL's own behaviour; the framework's facts (built-in names,
# feedable inputs and why not, config keys) are declared once in stablerl.adapters.frameworks.
TRL = get_framework("trl")
TRL_LOSS_TYPES = tuple(sorted(TRL.builtin_names[POLICY_LOSS]))
PREFIX = TRL.prefix

# The TRL built-in whose aggregation equals each stablerl loss_agg_mode. TRL's _compute_loss runs
# under it (with zero advantages) so that the KL term is normalised like the stablerl loss.
_HOST_LOSS_TYPE = {
    "token-mean": "dapo",  # sum / (tokens of the accumulation window over every process)
    "seq-mean-token-mean": "grpo",  # mean over sequences of the per-sequence token mean, / GA
    "seq-mean-token-sum": "luspo",  # mean over sequences of the per-sequence token sum, / GA
    "seq-mean-token-sum-norm": "dr_grpo",  # sum / (B * max_completion_length), / GA
}
# Metrics the host loss type logs about its own (here: zero-advantage) clipping; they are removed.
_HOST_CLIP_METRICS = (
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)

# The inputs TRL can feed in a given run (the declaration lists all of them; these narrow it per run).
_LOSS_INPUTS_ALWAYS = TRL.feedable[POLICY_LOSS] - {"rollout_log_prob", "router_log_prob", "old_router_log_prob"}
_LOSS_INPUTS_VLLM_IS = {"rollout_log_prob"}  # sampling_per_token_logps, with vllm_importance_sampling_correction
# router log-probs at the replayed experts, recorded in the old-log-prob pass and the training forward
_LOSS_INPUTS_ROUTING_REPLAY = {"router_log_prob", "old_router_log_prob"}


class UnsupportedTRLVersionError(UnsupportedVersionError):
    """The installed TRL is outside the range this adapter was written and tested against."""


# ----------------------------------------------------------------------------- version guard

# Private TRL methods this adapter overrides or calls, with the parameters it relies on.
_REQUIRED_SIGNATURES = {
    "_compute_loss": ("model", "inputs"),
    "_calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),
    "_generate_and_score_completions": ("inputs",),
    "_get_per_token_logps_and_entropies": ("model", "input_ids", "attention_mask", "logits_to_keep",
                                           "compute_entropy", "compute_aux_loss"),
    "get_high_entropy_mask": ("entropies", "mask", "threshold"),
    "get_off_policy_mask": ("advantages", "per_token_logps", "sampling_per_token_logps", "mask",
                            "off_policy_threshold"),
    # routing replay (routing_replay="R2"/"R3")
    "_generate": ("prompts",),
    "_generate_single_turn": ("prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"),
    "training_step": ("model", "inputs", "num_items_in_batch"),
    "compute_loss": ("model", "inputs", "return_outputs", "num_items_in_batch"),
    # controller / loss-state checkpointing
    "_load_optimizer_and_scheduler": ("checkpoint",),
}


def check_trl(trl_module=None) -> None:
    """Raise :class:`UnsupportedTRLVersionError` unless TRL is in the supported range and the
    private methods this adapter uses have the expected signatures.

    The range follows stablerl's one version policy (``stablerl.frameworks.check_version``):
    ``STABLERL_ALLOW_UNSUPPORTED=1`` (or the older ``STABLERL_TRL_SKIP_VERSION_CHECK=1``) turns the
    version-range error into a warning (to try a newer TRL); the signature checks always apply.
    """
    if trl_module is None:
        import trl as trl_module
    found = getattr(trl_module, "__version__", "unknown")
    check_version("trl", found, error=UnsupportedTRLVersionError,
                  allow=True if os.environ.get("STABLERL_TRL_SKIP_VERSION_CHECK", "") == "1" else None)
    cls = trl_module.GRPOTrainer
    for method, needed in _REQUIRED_SIGNATURES.items():
        fn = getattr(cls, method, None)
        if fn is None:
            raise UnsupportedTRLVersionError(
                f"trl {found}: GRPOTrainer.{method} no longer exists; stablerl.adapters.trl supports trl{SUPPORTED_TRL}"
            )
        params = inspect.signature(fn).parameters
        missing = [p for p in needed if p not in params]
        if missing:
            raise UnsupportedTRLVersionError(
                f"trl {found}: GRPOTrainer.{method} lacks parameter(s) {missing}; "
                f"stablerl.adapters.trl supports trl{SUPPORTED_TRL}"
            )


import trl as _trl  # noqa: E402  (after the guard's definition, before anything uses trl)
from transformers import TrainerCallback as _TrainerCallback  # noqa: E402


def instrument() -> None:
    """Check the installed TRL against the adapter (version policy and private signatures); run on import.
    The TRL adapter extends TRL by subclassing only (:class:`GRPOTrainer`, :class:`GRPOConfig`): nothing of
    TRL's is patched, so there is nothing else to do. Idempotent."""
    check_trl(_trl)


def uninstrument() -> None:
    """Nothing to undo: the TRL adapter changes no TRL object (see :func:`instrument`)."""


instrument()


# ----------------------------------------------------------------------------- names


def resolve_loss_type(loss_type: str) -> Optional[str]:
    """The stablerl policy-loss name ``loss_type`` selects, or ``None`` for a TRL built-in (core's one
    rule for every framework, :func:`stablerl.frameworks.resolve`; the inputs are checked per run by
    :func:`check_loss_inputs`). Unknown names raise :class:`stablerl.UnknownNameError` naming the
    nearest valid one."""
    return resolve(TRL, POLICY_LOSS, loss_type, inputs=False)


def _as_dict(value: Any, key: str) -> dict:
    if value is None or value == "":
        return {}
    if isinstance(value, str):  # from the CLI: a JSON object
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise StableRLError(f"{key} must be a JSON object such as '{{\"m2_threshold\": 0.04}}': {e}") from None
    if not isinstance(value, dict):
        raise StableRLError(f"{key} must be a dict (or a JSON object string), got {type(value).__name__}")
    return dict(value)


def loss_inputs_trl_can_feed(use_vllm_is: bool, routing_replay: bool = False) -> set[str]:
    return (set(_LOSS_INPUTS_ALWAYS) | (set(_LOSS_INPUTS_VLLM_IS) if use_vllm_is else set())
            | (set(_LOSS_INPUTS_ROUTING_REPLAY) if routing_replay else set()))


def check_extra_loss_inputs(names) -> tuple[str, ...]:
    """``stablerl_extra_loss_inputs``: names of declared inputs (or ``old_log_prob``) a trainer subclass
    supplies through :meth:`GRPOTrainer.stablerl_loss_inputs`; unknown names raise."""
    if names is None or names == "":
        return ()
    names = [names] if isinstance(names, str) else list(names)
    valid = set(OPTIONAL_INPUTS) | {"old_log_prob"}
    for n in names:
        if n not in valid:
            raise UnknownNameError(unknown_name_message("stablerl_extra_loss_inputs entry", str(n), valid))
    return tuple(names)


def check_loss_inputs(name: str, use_vllm_is: bool, routing_replay: bool = False, extra=()) -> None:
    """Raise :class:`stablerl.MissingInputError` if the loss declares inputs TRL cannot feed in this run
    (``extra``: the ones a trainer subclass declared it supplies, ``stablerl_extra_loss_inputs``)."""
    check_inputs(TRL, stablerl.get_spec(POLICY_LOSS, name), extra_inputs=extra,
                 feedable=loss_inputs_trl_can_feed(use_vllm_is, routing_replay))


def check_advantage_inputs(name: str) -> None:
    resolve(TRL, ADVANTAGE_ESTIMATOR, name)


# ----------------------------------------------------------------------------- config


@dataclass
class GRPOConfig(_trl.GRPOConfig):
    """TRL's ``GRPOConfig`` plus stablerl's selections (all settable from ``TrlParser`` CLI/YAML).

    ``loss_type`` also accepts stablerl policy-loss names; see the module docstring.
    """

    advantage_estimator: Optional[str] = field(
        default=None,
        metadata={"help": "stablerl advantage estimator (e.g. 'qae', 'rloo', 'grpo'); None keeps TRL's advantages "
                  "(scale_rewards). Computed on the rewards gathered over all processes."},
    )
    stablerl_loss_params: Optional[Union[dict, str]] = field(
        default=None,
        metadata={"help": "Hyper-parameters of the stablerl policy loss, a dict or a JSON object string, e.g. "
                  "'{\"m2_threshold\": 0.04}'. Unset keys take the paper's defaults. TRL's epsilon/epsilon_high/"
                  "delta apply to TRL's built-in loss types only."},
    )
    stablerl_advantage_params: Optional[Union[dict, str]] = field(
        default=None,
        metadata={"help": "Hyper-parameters of the stablerl advantage estimator, a dict or a JSON object string, "
                  "e.g. '{\"quantile_k\": 0.4}'."},
    )
    stablerl_extra_loss_inputs: Optional[list[str]] = field(
        default=None,
        metadata={"help": "Declared loss inputs that a GRPOTrainer subclass supplies itself by overriding "
                  "stablerl_loss_inputs(inputs, log_prob) (e.g. 'rollout_log_prob', 'versions', 'policy_version' "
                  "from a custom off-policy or asynchronous rollout; 'old_log_prob' replaces TRL's). A loss that "
                  "needs an input TRL cannot feed is accepted only if it is listed here."},
    )
    stablerl_loss_agg_mode: str = field(
        default="token-mean",
        metadata={"help": "Aggregation of a stablerl policy loss: 'token-mean' (= TRL dapo's normaliser, the "
                  "default), 'seq-mean-token-mean' (= TRL grpo), 'seq-mean-token-sum' (= TRL luspo) or "
                  "'seq-mean-token-sum-norm' (= TRL dr_grpo, constant max_completion_length)."},
    )

    routing_replay: Optional[str] = field(
        default=None,
        metadata={"help": "MoE routing replay (stablerl.routing_replay): 'R3' replays the experts the rollout chose "
                  "(HF generate, recorded around generation; or a rollout_func returning vLLM 'routed_experts') in "
                  "the old/ref log-prob passes and in every training forward; 'R2' records the experts of the "
                  "old-log-prob pass and replays them in the training forwards. None: native routing."},
    )

    # reward shapers, batch filters and entropy controllers (see _ext_* in GRPOTrainer and docs/trl.md)
    reward_shaper: Optional[str] = field(
        default=None,
        metadata={"help": "stablerl reward shaper (e.g. 'redit', 'fapo', 'grpo_lambda') applied to the rewards "
                  "gathered over all processes before the advantage estimator; needs advantage_estimator. "
                  "Per-completion inputs (correct, flawed, ...) come from reward functions through TRL's "
                  "log_extra(name, values) kwarg, or from rollout_func extra fields / dataset columns."},
    )
    stablerl_reward_shaper_params: Optional[Union[dict, str]] = field(
        default=None, metadata={"help": "Hyper-parameters of the reward shaper, a dict or a JSON object string."},
    )
    batch_filter: Optional[str] = field(
        default=None,
        metadata={"help": "stablerl batch filter (e.g. 'dynamic_sampling', 'gtpo_entropy_filter', 'd3s') applied "
                  "after the advantages on the gathered batch: dropped rows get advantage 0 and loss mask 0 "
                  "(TRL's batch size is fixed); token masks multiply the loss mask; filters that resample or "
                  "reorder rows are refused."},
    )
    stablerl_batch_filter_params: Optional[Union[dict, str]] = field(
        default=None, metadata={"help": "Hyper-parameters of the batch filter, a dict or a JSON object string."},
    )
    entropy_controller: Optional[str] = field(
        default=None,
        metadata={"help": "stablerl entropy controller ('aepo', 'epo'): one instance per trainer, stepped once per "
                  "optimizer step with TRL's (process-reduced) mean entropy; its state is saved with each "
                  "checkpoint (stablerl_state.pt) and restored on resume."},
    )
    stablerl_entropy_controller_params: Optional[Union[dict, str]] = field(
        default=None, metadata={"help": "Hyper-parameters of the entropy controller, a dict or a JSON object string."},
    )
    trainer_hook: Optional[str] = field(
        default=None,
        metadata={"help": "stablerl trainer hook ('sfpo'): acts between the num_iterations optimizer passes over each "
                  "generation batch (num_iterations must equal the hook's passes per batch, e.g. sfpo: inner_steps + 1, "
                  "and steps_per_generation must equal gradient_accumulation_steps: one optimizer step per pass); its "
                  "state is saved with each checkpoint (stablerl_state.pt)."},
    )
    stablerl_trainer_hook_params: Optional[Union[dict, str]] = field(
        default=None, metadata={"help": "Hyper-parameters of the trainer hook, a dict or a JSON object string."},
    )
    stablerl_rollout_correction: Optional[str] = field(
        default=None,
        metadata={"help": "stablerl training-inference mismatch correction of a stablerl loss ('tis', 'icepop', "
                  "'seq_mis', 'geo_rs', 'opsm'), from the rollout engine's sampling log-probs (use_vllm=True or a "
                  "rollout_func returning logprobs). Replaces TRL's own: needs "
                  "vllm_importance_sampling_correction=False. stablerl_loss_params={'rollout_correction': ..., "
                  "'rollout_correction_params': {...}} is an alias of this key and its params (one of the two)."},
    )
    stablerl_rollout_correction_params: Optional[Union[dict, str]] = field(
        default=None, metadata={"help": "Hyper-parameters of the rollout correction, a dict or a JSON object string, "
                                "e.g. '{\"threshold\": 2.0}'."},
    )

    def __post_init__(self):
        super().__post_init__()
        # TRL validates loss_type only at the first loss call; stablerl names are validated now.
        self.stablerl_loss_params = _as_dict(self.stablerl_loss_params, "stablerl_loss_params")
        self.stablerl_advantage_params = _as_dict(self.stablerl_advantage_params, "stablerl_advantage_params")
        self.stablerl_rollout_correction_params = _as_dict(self.stablerl_rollout_correction_params,
                                                           "stablerl_rollout_correction_params")
        validate_stablerl_args(self)
        self.routing_replay = routing_replay_mode(self)
        for key in _EXT_PARAM_KEYS.values():
            setattr(self, key, _as_dict(getattr(self, key), key))
        validate_stablerl_extensions(self)


ROUTING_REPLAY_MODES = ("R2", "R3")


def routing_replay_mode(args) -> Optional[str]:
    """``"R2"``, ``"R3"`` or ``None`` from ``args.routing_replay`` (case-insensitive; unknown names raise)."""
    mode = getattr(args, "routing_replay", None)
    if mode is None or (isinstance(mode, str) and mode.strip().lower() in ("", "none", "off", "false")):
        return None
    if not isinstance(mode, str) or mode.strip().upper() not in ROUTING_REPLAY_MODES:
        raise UnknownNameError(unknown_name_message("routing_replay", str(mode), ROUTING_REPLAY_MODES))
    return mode.strip().upper()


def validate_stablerl_args(args, warn: bool = True) -> tuple[Optional[str], Optional[str]]:
    """Check the stablerl selections of a (stablerl or plain TRL) GRPOConfig; return (loss, estimator)."""
    routing_replay_mode(args)
    loss = resolve_loss_type(args.loss_type)
    loss_params = _as_dict(getattr(args, "stablerl_loss_params", None), "stablerl_loss_params")
    adv_params = _as_dict(getattr(args, "stablerl_advantage_params", None), "stablerl_advantage_params")
    agg = getattr(args, "stablerl_loss_agg_mode", "token-mean")
    if loss is None:
        if loss_params:
            raise StableRLError(
                f"stablerl_loss_params is set but loss_type={args.loss_type!r} is TRL's built-in loss "
                f"(its knobs are TRL's own, e.g. epsilon/epsilon_high); use loss_type='{PREFIX}{args.loss_type}' "
                "if a stablerl loss of that name is meant"
            )
    else:
        # the effective hyper-parameters (stablerl keys, TRL's epsilons when set): unknown key / bad value -> clear error
        spec = stablerl.get_spec(POLICY_LOSS, loss)
        # stablerl_loss_params may also carry compute_policy_loss options: loss_agg_mode (a registered
        # aggregation such as delta_l) and rollout_correction (with vLLM's log-probs), with their params
        hyper, options = split_call_options(as_params(loss_settings(args, loss)))
        build_params(spec, hyper)
        vllm_is = bool(args.use_vllm and args.vllm_importance_sampling_correction)
        # the rollout correction, by either spelling, is checked once below (check_rollout_correction)
        check_call_options(TRL, spec, without_rollout_correction(options), hyper,
                           feedable=TRL.feedable[POLICY_LOSS] - (set() if vllm_is else _LOSS_INPUTS_VLLM_IS))
        if "top_entropy_quantile" in options and getattr(args, "top_entropy_quantile", 1.0) < 1.0:
            raise StableRLError(
                f"top_entropy_quantile is set twice: TRL's top_entropy_quantile={args.top_entropy_quantile} and "
                f"stablerl_loss_params' {options['top_entropy_quantile']}; set one (TRL's also restricts its entropy "
                "bonus to the kept tokens, stablerl's masks only the policy loss)"
            )
        if agg not in AGG_MODES:
            raise UnknownNameError(unknown_name_message("stablerl_loss_agg_mode", agg, AGG_MODES))
        check_loss_inputs(loss, bool(args.use_vllm and args.vllm_importance_sampling_correction),
                          routing_replay=routing_replay_mode(args) is not None,
                          extra=check_extra_loss_inputs(getattr(args, "stablerl_extra_loss_inputs", None)))
        if warn and args.delta is not None and "clip_ratio_c" not in stablerl.get_spec(POLICY_LOSS, loss).defaults():
            warnings.warn(
                f"delta (TRL's two-sided ratio clip, a dual clip: clip_ratio_c) has no counterpart in the stablerl "
                f"loss {loss!r}, which does not use it",
                UserWarning,
                stacklevel=3,
            )
    estimator = getattr(args, "advantage_estimator", None)
    if estimator:
        check_advantage_inputs(estimator)
        # TRL's scale_rewards: honoured or refused, never ignored; then the effective values are built
        build_params(stablerl.get_spec(ADVANTAGE_ESTIMATOR, estimator), as_params(advantage_settings(args, estimator)))
    elif adv_params:
        raise StableRLError("stablerl_advantage_params is set but advantage_estimator is not")
    check_rollout_correction(args, loss)
    return loss, estimator or None


_CORRECTION_OPTIONS = ("rollout_correction", "rollout_correction_params")


def without_rollout_correction(options: dict) -> dict:
    """The call options of ``stablerl_loss_params`` less the rollout correction (which has its own path)."""
    return {k: v for k, v in options.items() if k not in _CORRECTION_OPTIONS}


def rollout_correction_setting(args) -> tuple[Optional[str], dict]:
    """``(name, params)`` of the stablerl rollout correction: ``stablerl_rollout_correction`` /
    ``stablerl_rollout_correction_params``, or their alias ``stablerl_loss_params={"rollout_correction": ...,
    "rollout_correction_params": {...}}`` (the spelling of verl's and OpenRLHF's adapters). Both behave the
    same; setting the correction (or its params) by both spellings at once is refused."""
    name = getattr(args, "stablerl_rollout_correction", None) or None
    params = _as_dict(getattr(args, "stablerl_rollout_correction_params", None), "stablerl_rollout_correction_params")
    loss_params = _as_dict(getattr(args, "stablerl_loss_params", None), "stablerl_loss_params")
    alias = {k: loss_params[k] for k in _CORRECTION_OPTIONS if loss_params.get(k) not in (None, {})}
    if alias:
        if name is not None or params:
            raise StableRLError(
                f"the rollout correction is set twice: stablerl_rollout_correction(_params) and stablerl_loss_params' "
                f"{', '.join(sorted(alias))} (an alias of the same setting); keep one")
        name = alias.get("rollout_correction") or None
        params = _as_dict(alias.get("rollout_correction_params"), "stablerl_loss_params' rollout_correction_params")
    return name, params


def check_rollout_correction(args, loss: Optional[str]) -> Optional[str]:
    """The stablerl rollout correction (:func:`rollout_correction_setting`, either spelling): a registered
    correction of a stablerl loss, its parameters valid, and TRL's own vLLM importance-sampling correction off
    (one correction, never two). Returns the name or None."""
    name, params = rollout_correction_setting(args)
    if name is None:
        if params:
            raise StableRLError("stablerl_rollout_correction_params is set but stablerl_rollout_correction is not")
        return None
    if loss is None:
        raise StableRLError(f"stablerl_rollout_correction={name!r} corrects a stablerl loss; loss_type="
                            f"{args.loss_type!r} is TRL's built-in (use loss_type='{PREFIX}{args.loss_type}' if a "
                            "stablerl loss of that name is meant, or TRL's vllm_importance_sampling_correction)")
    build_params(stablerl.get_spec(ROLLOUT_CORRECTION, name), params)
    if getattr(args, "use_vllm", False) and getattr(args, "vllm_importance_sampling_correction", False):
        raise StableRLError(f"stablerl_rollout_correction={name!r} and TRL's vllm_importance_sampling_correction=True "
                            "would correct the same mismatch twice; set vllm_importance_sampling_correction=False")
    return name


def loss_settings(args, loss: str):
    """The effective hyper-parameters of stablerl loss ``loss`` under TRL ``args``, with their sources
    (one precedence rule, :data:`stablerl.frameworks.PRECEDENCE`): ``stablerl_loss_params`` > TRL's
    ``epsilon`` / ``epsilon_high`` when set (other than 0.2 / None; relative bounds, as in TRL's
    dapo/grpo) and ``delta`` (INTELLECT-2's two-sided clip, which is the dual clip ``clip_ratio_c``) when set
    > the paper's defaults."""
    params = _as_dict(getattr(args, "stablerl_loss_params", None), "stablerl_loss_params")
    framework_values = {"clip_ratio_low": getattr(args, "epsilon", None), "clip_ratio_high": getattr(args, "epsilon_high", None),
                        "clip_ratio_c": getattr(args, "delta", None)}
    return effective_hyperparameters(TRL, stablerl.get_spec(POLICY_LOSS, loss), params, framework_values)


def advantage_settings(args, estimator: str):
    """The effective hyper-parameters of stablerl estimator ``estimator`` under TRL ``args``. TRL's
    ``scale_rewards`` is honoured where the estimator has a std-normalisation switch
    (``'none'`` -> ``norm_adv_by_std_in_grpo=False``) and refused where it would be ignored
    (``'none'`` for an estimator without the switch; ``'batch'`` for every stablerl estimator)."""
    spec = stablerl.get_spec(ADVANTAGE_ESTIMATOR, estimator)
    params = _as_dict(getattr(args, "stablerl_advantage_params", None), "stablerl_advantage_params")
    scale = getattr(args, "scale_rewards", "group")
    scale = {True: "group", False: "none"}.get(scale, scale)
    if scale == "batch":
        raise StableRLError(
            f"scale_rewards='batch' (TRL's batch-std scaling of its own advantages) has no effect on the stablerl "
            f"advantage estimator {estimator!r}, and ignoring it would change your advantages without a word: "
            "use scale_rewards='group' (default) or 'none', or TRL's built-in advantages (no advantage_estimator)"
        )
    aggregation = getattr(args, "multi_objective_aggregation", "sum_then_normalize")
    framework_values = {"norm_adv_by_std_in_grpo": scale != "none",
                        "form": "trl" if aggregation == "normalize_then_sum" else "verl"}
    check_framework_keys_used(TRL, spec, framework_values)
    return effective_hyperparameters(TRL, spec, params, framework_values)


# ----------------------------------------------------------------------------- shapers, filters, controllers

# config key of each extension -> its hyper-parameter key
_EXT_PARAM_KEYS = {
    "reward_shaper": "stablerl_reward_shaper_params",
    "batch_filter": "stablerl_batch_filter_params",
    "entropy_controller": "stablerl_entropy_controller_params",
    "trainer_hook": "stablerl_trainer_hook_params",
}
# per-response inputs the adapter computes itself: group ids, the (gathered) rewards, completion lengths
# (tokens of the loss mask); batch filters also get the rollout policy's entropies (one extra no-grad forward)
_EXT_INPUTS_AUTO = {"index", "scores", "lengths"}
# per-response inputs the user provides (reward function via TRL's log_extra, rollout_func extra field or dataset column)
_EXT_INPUTS_USER = ("correct", "flawed", "void_turn", "pos_count", "neg_count")
_EXT_HOW_TO_PROVIDE = (
    "have a reward function call TRL's log_extra({name!r}, values) with one value per completion it was given "
    "(TRL passes log_extra to every reward function), or return {name!r} from a rollout_func as an extra field "
    "(one value per completion), or give the dataset a {name!r} column"
)
_EXT_STATE_FILE = "stablerl_state.pt"
_EXT_LEGACY_STATE_FILE = "stablerl_controller.json"  # JSON of stablerl 0.1 development versions, still read
_EXT_RNG_STREAM = "reward_shaper+batch_filter"  # one generator for shapers and filters (see _ext_setup)
_LEGACY_SLOT_KINDS = {"filter:": BATCH_FILTER, "shaper:": REWARD_SHAPER, "adv:": ADVANTAGE_ESTIMATOR}
_EXT_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "token_type_ids",
                        "mm_token_type_ids", "image_position_ids", "spatial_shapes")


def _ext_name(args, key: str) -> Optional[str]:
    name = getattr(args, key, None)
    if name is None or (isinstance(name, str) and name.strip().lower() in ("", "none")):
        return None
    return name


def validate_stablerl_extensions(args) -> dict[str, Optional[str]]:
    """Check ``reward_shaper`` / ``batch_filter`` / ``entropy_controller`` and their parameters; return the names.

    Unknown names and hyper-parameters raise with the nearest valid one; inputs TRL cannot provide raise
    :class:`stablerl.MissingInputError` with the reason. Inputs the user's reward function must provide
    (``correct``, ``flawed``, ...) are checked at the first generation batch.
    """
    names = {}
    for key, params_key in _EXT_PARAM_KEYS.items():
        name = _ext_name(args, key)
        params = _as_dict(getattr(args, params_key, None), params_key)
        names[key] = name
        if name is None:
            if params:
                raise StableRLError(f"{params_key} is set but {key} is not")
            continue
        kind = {"reward_shaper": REWARD_SHAPER, "batch_filter": BATCH_FILTER, "entropy_controller": CONTROLLER,
                "trainer_hook": TRAINER_HOOK}[key]
        if kind == CONTROLLER:
            if name not in stablerl.get_registry().names(kind):
                raise UnknownNameError(unknown_name_message(key, name, stablerl.get_registry().names(kind)))
        else:
            resolve(TRL, kind, name)  # unknown, unavailable or unfeedable: an error saying which and why
        build_params(stablerl.get_spec(kind, name), params)
    if names["reward_shaper"] and not getattr(args, "advantage_estimator", None):
        raise StableRLError(
            f"reward_shaper={names['reward_shaper']!r} needs a stablerl advantage_estimator: TRL computes its "
            "built-in advantages inside _generate_and_score_completions from the unshaped rewards. For TRL's "
            "default advantages (scale_rewards='group') use advantage_estimator='grpo' with "
            "stablerl_advantage_params={'epsilon': 1e-4}"
        )
    if names["reward_shaper"]:  # the adapter always hands the estimator every reward function's reward
        check_shaper_and_components(names["reward_shaper"],
                                    stablerl.get_spec(ADVANTAGE_ESTIMATOR, args.advantage_estimator), True,
                                    "each reward function's reward, which TRL's adapter passes")
    return names


# ----------------------------------------------------------------------------- routing replay

_VLLM_ROUTES_MIN = rr.VLLM_ROUTES_MIN  # enable_return_routed_experts (vLLM PR #28284), declared once in core

_R3_VLLM_MESSAGE = (
    "routing_replay='R3' with use_vllm=True: TRL 1.16's vLLM path (VLLMGeneration) does not ask vLLM for the routed "
    "experts, so the rollout's routes never reach the trainer. Pass a rollout_func (it may drive a VLLMGeneration "
    "subclass) that runs vLLM with enable_return_routed_experts=True and returns, next to prompt_ids/completion_ids/"
    "logprobs, a 'routed_experts' list holding each completion's RequestOutput.outputs[i].routed_experts (stablerl "
    "converts them with stablerl.routing_replay.Routes.from_vllm). Otherwise use routing_replay='R2' (routes of the "
    "training engine's old-log-prob pass) or use_vllm=False (R3 recorded around HF generate)."
)


def _rr_check_rollout(args, kwargs) -> None:
    """R3 needs a rollout whose routes reach the trainer: HF generate, or a rollout_func returning them."""
    try:
        bound = inspect.signature(_trl.GRPOTrainer.__init__).bind_partial(None, *args, **kwargs).arguments
    except TypeError:
        return  # TRL reports its own signature error
    cfg = bound.get("args")
    if cfg is None or routing_replay_mode(cfg) != "R3":
        return
    if getattr(cfg, "use_transformers_continuous_batching", False):
        raise StableRLError("routing_replay='R3' does not support use_transformers_continuous_batching (generate_batch "
                            "gives no per-step batch layout); use the regular HF generate path or routing_replay='R2'")
    if getattr(cfg, "use_vllm", False):
        if bound.get("rollout_func") is None:
            raise StableRLError(_R3_VLLM_MESSAGE)
        try:
            from importlib.metadata import version

            found = version("vllm")
        except Exception:  # vLLM not installed here (server mode) or no metadata
            return
        if not version_in_range(found, ">=" + ".".join(map(str, _VLLM_ROUTES_MIN))):
            warnings.warn(
                f"routing_replay='R3': vLLM {found} may predate enable_return_routed_experts (vLLM PR #28284; "
                f"documented for vLLM >= {'.'.join(map(str, _VLLM_ROUTES_MIN))}, >= 0.22 for hybrid-attention models)",
                UserWarning,
                stacklevel=3,
            )


def _json_decode(value: Any) -> Any:
    """A value of the legacy ``stablerl_controller.json`` (tensors were tagged with their dtype and shape)."""
    if isinstance(value, dict):
        if "__tensor__" in value:
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"])).reshape(value["shape"])
        return {k: _json_decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_decode(v) for v in value]
    return value


def _from_legacy_json(state: dict, seed: int) -> dict:
    """The ``{"format": 1}`` JSON of earlier development versions as a ``StateStore.state_dict()``."""
    slots: dict[str, dict] = {}
    for key, value in _json_decode(state.get("ctx_state") or {}).items():
        kind, name = next(((k, key[len(p):]) for p, k in _LEGACY_SLOT_KINDS.items() if key.startswith(p)),
                          (POLICY_LOSS, key))  # a loss's slot was its bare name
        slots.setdefault(kind, {})[name] = value
    generators = {}
    if state.get("rng") is not None:
        generators[_EXT_RNG_STREAM] = {seed: torch.tensor(state["rng"], dtype=torch.uint8)}
    objects = {}
    ctrl = state.get("controller")
    if ctrl is not None:
        objects[CONTROLLER] = {ctrl.get("name"): {"state": _json_decode(ctrl["state"]),
                                                  "decision": _json_decode(ctrl.get("decision") or {})}}
    return {**StateStore(holds="trainer").state_dict(), "slots": slots, "generators": generators, "objects": objects}


class _ControllerState:
    """The entropy controller's state and last decision, as the trainer's state store saves them; restoring
    re-applies the decision (e.g. AEPO's generation temperature)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def state_dict(self) -> dict:
        return {"state": self.trainer._ext_controller.state_dict(), "decision": dict(self.trainer._ext_decision)}

    def load_state_dict(self, state: dict) -> None:
        self.trainer._ext_controller.load_state_dict(state["state"])
        self.trainer._ext_decision = dict(state.get("decision") or {})
        self.trainer._ext_apply(self.trainer._ext_decision)


class _StablerlStateCallback(_TrainerCallback):
    """Steps the entropy controller once per optimizer step and writes the stablerl state
    (``stablerl_state.pt``) into every checkpoint folder (restored in ``_load_optimizer_and_scheduler``)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._ext_hook_after_pass()
        self.trainer._ext_controller_step()

    def on_save(self, args, state, control, **kwargs):
        if not args.should_save:
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = os.path.join(self.trainer._get_output_dir(trial=None), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if os.path.isdir(folder):
            self.trainer.save_stablerl_state(folder)


# ----------------------------------------------------------------------------- trainer


class GRPOTrainer(_trl.GRPOTrainer):
    """TRL's ``GRPOTrainer`` with stablerl policy losses and advantage estimators.

    Accepts this module's :class:`GRPOConfig` (or TRL's, then with defaults for the stablerl fields).
    """

    _rr_mode: Optional[str] = None  # routing_replay, set in __init__
    _ext_penalty_capture: Optional[dict] = None  # entropies of the training forward, for a controller's penalty
    _ext_shaper: Optional[str] = None  # reward_shaper / batch_filter names and the penalty flag, set in __init__
    _ext_filter: Optional[str] = None
    _ext_penalty: bool = False
    _ext_hook: Any = None  # trainer hook, set in _ext_setup

    def __init__(self, *args, **kwargs):
        _rr_check_rollout(args, kwargs)  # before TRL builds (or imports) vLLM
        super().__init__(*args, **kwargs)
        cfg = self.args
        self._rr_mode = routing_replay_mode(cfg)
        self._rr_setup()
        # a stablerl GRPOConfig was validated when it was built; a plain TRL one is validated here
        self._stablerl_loss, self._stablerl_estimator = validate_stablerl_args(cfg, warn=not isinstance(cfg, GRPOConfig))
        # the effective hyper-parameters (one precedence rule), printed once at start-up with their sources
        self._stablerl_loss_params, self._stablerl_adv_params = {}, {}
        self._stablerl_call_options: dict = {}  # loss_agg_mode (+ params) from stablerl_loss_params
        if self._stablerl_loss:
            settings = loss_settings(cfg, self._stablerl_loss)
            log_effective_settings(TRL, stablerl.get_spec(POLICY_LOSS, self._stablerl_loss), settings)
            self._stablerl_loss_params, options = split_call_options(as_params(settings))
            self._stablerl_call_options = without_rollout_correction(options)  # the correction: below, either spelling
        if self._stablerl_estimator:
            settings = advantage_settings(cfg, self._stablerl_estimator)
            log_effective_settings(TRL, stablerl.get_spec(ADVANTAGE_ESTIMATOR, self._stablerl_estimator), settings)
            self._stablerl_adv_params = as_params(settings)
        self._stablerl_agg_mode = getattr(cfg, "stablerl_loss_agg_mode", "token-mean")
        self._stablerl_correction = check_rollout_correction(cfg, self._stablerl_loss)
        self._stablerl_correction_params = rollout_correction_setting(cfg)[1]
        if self._stablerl_correction:
            if not (self.use_vllm or self.rollout_func is not None):
                raise StableRLError(f"stablerl_rollout_correction={self._stablerl_correction!r} needs the rollout "
                                    "engine's sampling log-probs: use_vllm=True or a rollout_func returning logprobs")
            correction_spec = stablerl.get_spec(ROLLOUT_CORRECTION, self._stablerl_correction)
            log_effective_settings(TRL, correction_spec, effective_hyperparameters(
                TRL, correction_spec, self._stablerl_correction_params, {}))
        self._stablerl_spec = stablerl.get_spec(POLICY_LOSS, self._stablerl_loss) if self._stablerl_loss else None
        # rspo: router log-probs at the replayed experts (old pass and training forward)
        self._rr_router_lp = bool(self._rr_mode and self._stablerl_spec and "router_log_prob" in self._stablerl_spec.requires)
        # persistent per-algorithm state (Context.state, the shapers/filters' generator, the controller): per
        # trainer, not per process (several trainers may share one process), saved in TRL's checkpoint folders
        self._stablerl_store = StateStore(holds="trainer")
        self._stablerl_capture: Optional[dict] = None
        self._stablerl_rewards: Optional[torch.Tensor] = None
        needs = set(self._stablerl_spec.requires) if self._stablerl_spec else set()
        self._stablerl_needs_rows = bool(needs & {"index", "scores"})
        # erc: the old-log-prob pass also computes entropies (only then); its sink while a batch is generated
        self._stablerl_wants_old_entropy = "old_entropy" in needs
        self._stablerl_old_entropy: Optional[dict] = None
        per_process = cfg.per_device_train_batch_size * cfg.steps_per_generation
        if "index" in needs and (cfg.steps_per_generation > 1 or per_process % cfg.num_generations):
            warnings.warn(
                f"policy loss {self._stablerl_loss!r} uses prompt groups, but TRL shuffles the generation batch "
                f"and splits it into steps_per_generation={cfg.steps_per_generation} micro-batches (and "
                f"{per_process} rows per process for groups of {cfg.num_generations}), so the loss sees partial "
                "groups. For whole groups use steps_per_generation=1 (gradient_accumulation_steps=1) and a "
                "per_device_train_batch_size divisible by num_generations.",
                UserWarning,
                stacklevel=2,
            )
        self._ext_setup()

    # -- shared ----------------------------------------------------------------------------

    def _stablerl_context(self, **kwargs) -> "stablerl.Context":
        n = self.accelerator.num_processes
        common = dict(step=int(self.state.global_step), total_steps=int(self.state.max_steps or 0) or None, **kwargs)
        if n > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            return stablerl.torch_distributed_context(dp_size=n, **common)
        return stablerl.Context(dp_size=n, **common)

    def _stablerl_log(self, mode: str, metrics: dict[str, float], prefix: str = "stablerl/") -> None:
        if not metrics:
            return
        values = torch.tensor(list(metrics.values()), dtype=torch.float32, device=self.accelerator.device)
        gathered = self.accelerator.gather(values).view(-1, len(metrics)).mean(0).tolist()
        for key, value in zip(metrics, gathered):
            self._metrics[mode][prefix + key].append(value)

    # -- routing replay (routing_replay="R2" / "R3"; the mechanics are stablerl.routing_replay's) ---------

    def _rr_setup(self) -> None:
        self._rr_gen = None  # (per-sequence Routes of the last rollout, prompt lengths)
        self._rr_rollout: Optional[dict] = None  # state while a generation batch is scored
        self._rr_current: Optional[rr.Routes] = None  # routes of the micro-batch in compute_loss
        self._rr_handles: list = []  # replay handles kept until after backward
        if self._rr_mode is None:
            return
        model = self.accelerator.unwrap_model(self.model)
        routers = rr.find_routers(model)
        if not routers:
            families = [f.name for f in rr.router_families()]
            raise StableRLError(
                f"routing_replay={self._rr_mode!r} needs a Mixture-of-Experts model, but {type(model).__name__} has no "
                f"MoE router of a known family ({', '.join(families)}); remove routing_replay for a dense model, or "
                "register a RouterFamily through the register_router_families hook")
        self._rr_num_experts = max(r.num_experts for r in routers)
        self._rr_layer_ids = tuple(r.layer_id for r in routers)
        if self._rr_mode == "R3" and self.tools:
            raise StableRLError("routing_replay='R3' does not support tool calling (multi-turn generation splits the "
                                "rollout into several generate calls); use routing_replay='R2'")

    def _rr_release(self) -> None:
        for handle in self._rr_handles:
            handle.remove()
        self._rr_handles.clear()

    def _rr_routes_of(self, inputs) -> Optional[rr.Routes]:
        t = inputs.get("stablerl_routes")
        if t is None:
            return None
        return rr.Routes.from_batch_tensor(t, num_experts=self._rr_num_experts, layer_ids=self._rr_layer_ids,
                                           valid=inputs.get("stablerl_routes_valid"))

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self._rr_mode != "R3" or self.use_vllm or self.use_transformers_continuous_batching:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images=has_tool_images)
        with rr.capture(self.accelerator.unwrap_model(self.model)) as cap:
            completion_ids, logprobs = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images=has_tool_images)
        # generate: [left-padded prompt (P) | C_gen - 1 forwarded tokens]; +1 invalid column for the last token
        routes = cap.routes().extend(1)
        width = max(len(p) for p in prompt_ids)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        seqs = [row.slice_tokens(width - len(p), width + len(c))
                for row, p, c in zip(routes.sequences(), prompt_ids, completion_ids)]
        self._rr_gen = (seqs, [len(p) for p in prompt_ids])
        return completion_ids, logprobs

    def _generate(self, prompts):
        out = super()._generate(prompts)
        if self._rr_mode == "R3" and self.rollout_func is not None:
            prompt_ids, completion_ids, extra_fields = out[0], out[1], out[5]
            experts = extra_fields.pop("routed_experts", None)
            if experts is None or len(experts) != len(completion_ids):
                raise StableRLError("routing_replay='R3' with a rollout_func: its output needs a 'routed_experts' list "
                                    "with one vLLM routed_experts array per completion. " + _R3_VLLM_MESSAGE)
            model = self.accelerator.unwrap_model(self.model)
            seqs = [rr.Routes.from_vllm(e, model=model, num_tokens=len(p) + len(c))
                    for e, p, c in zip(experts, prompt_ids, completion_ids)]
            self._rr_gen = (seqs, [len(p) for p in prompt_ids])
        return out

    def _rr_rollout_routes(self, prompt_width: int, completion_width: int) -> Optional[rr.Routes]:
        """Routes of the generation batch in TRL's [left-padded prompt | right-padded completion] layout."""
        state = self._rr_rollout
        if state["routes"] is None and self._rr_mode == "R3":
            if self._rr_gen is None:
                raise StableRLError("routing_replay='R3': the rollout recorded no routes")
            seqs, prompt_lengths = self._rr_gen
            state["routes"] = rr.Routes.pad_prompt_response(seqs, prompt_lengths, prompt_width, completion_width)
        return state["routes"]

    def _rr_generate_and_score(self, inputs):
        every = self.args.steps_per_generation * self.num_iterations
        # TRL's own condition for computing old log-probs (R2 records there)
        old_pass = self.args.gradient_accumulation_steps % every != 0 or bool(
            self.use_vllm and self.vllm_importance_sampling_correction)
        self._rr_gen = None
        self._rr_rollout = {"routes": None, "record": self._rr_mode == "R2" and old_pass, "old": old_pass}
        lp_sink = self._rr_rollout["router_lp"] = {}
        try:
            out = super()._generate_and_score_completions(inputs)
            routes = self._rr_rollout_routes(out["prompt_ids"].size(1), out["completion_ids"].size(1))
        finally:
            self._rr_rollout = None
            self._rr_gen = None
        if lp_sink.get("router_log_prob") is not None:  # [B, C, L, k] fp32, old policy at the replayed experts
            out["stablerl_old_router_log_prob"] = lp_sink["router_log_prob"]
        if routes is not None:  # batch-first (TRL shuffles and splits them with their rows), on the CPU
            indices, valid = routes.batch_tensor()
            out["stablerl_routes"] = indices.cpu()
            if valid is not None:
                out["stablerl_routes_valid"] = valid.cpu()
        return out

    def _rr_forward(self, model, routes: rr.Routes, input_ids, fn, keep: bool):
        """Run ``fn`` (TRL's chunked forward) with ``routes`` replayed, each chunk getting its rows."""
        if routes.batch_shape != tuple(input_ids.shape[:2]):
            raise rr.RoutesMismatchError(f"routing replay: routes for a batch of {routes.batch_shape}, the forward "
                                         f"input is {tuple(input_ids.shape[:2])}")
        target = self.accelerator.unwrap_model(model)
        handle = rr.replay(target, None)
        cursor = [0]

        def next_rows(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            n = ids.shape[0]
            handle.set_routes(routes.rows(slice(cursor[0], cursor[0] + n)))
            cursor[0] += n

        hook = target.register_forward_pre_hook(next_rows, with_kwargs=True)
        kept = False
        try:
            out = fn()
            kept = keep
        finally:
            hook.remove()
            if kept:  # gradient checkpointing re-runs the routers in backward: removed in training_step
                self._rr_handles.append(handle)
            else:
                handle.remove()
        return out

    def _rr_recording(self, fn, model, logits_to_keep, record_routes: bool, lp_sink: Optional[dict]):
        """``fn`` under a capture: R2's routes (into the rollout state) and/or, for rspo, the router log-probs
        at the experts used, ``[B, C, L, k]`` at the positions that predict the completion tokens."""
        target = self.accelerator.unwrap_model(model)
        state = self._rr_rollout

        def run():
            with rr.capture(target, record_log_probs=lp_sink is not None) as cap:
                out = fn()
            if record_routes:
                parts = [r.batch_tensor()[0] for r in cap.routes_list()]  # one per TRL chunk
                state["routes"] = rr.Routes.from_batch_tensor(
                    torch.cat(parts), num_experts=self._rr_num_experts, layer_ids=self._rr_layer_ids)
            if lp_sink is not None:
                lp = torch.cat(cap.log_probs_list(device=self.accelerator.device, batch_first=True))
                width = lp.size(1)
                lp_sink["router_log_prob"] = lp[:, width - logits_to_keep - 1: width - 1]
            return out

        return run

    def _rr_logps(self, fn, model, input_ids, logits_to_keep):
        state = self._rr_rollout
        if state is not None:  # old / ref log-prob passes of a fresh generation batch
            routes = self._rr_rollout_routes(input_ids.size(1) - logits_to_keep, logits_to_keep)
            old = state["old"] and self.accelerator.unwrap_model(model) is self.accelerator.unwrap_model(self.model)
            if old:  # TRL's old-log-prob pass comes first (the ref pass, also of the PEFT policy, after it)
                state["old"] = False
                record = routes is None and state["record"]  # R2
                if record or self._rr_router_lp:
                    fn = self._rr_recording(fn, model, logits_to_keep, record,
                                            state["router_lp"] if self._rr_router_lp else None)
            if routes is not None:
                return self._rr_forward(model, routes, input_ids, fn, keep=False)
            return fn()
        if self._rr_current is None:
            return fn()
        return self._rr_forward(model, self._rr_current, input_ids, fn, keep=torch.is_grad_enabled())

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._rr_mode is None:
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        self._rr_release()
        routes = self._rr_routes_of(inputs)
        cap = None
        if routes is None and self._rr_mode == "R2":
            # TRL skipped the old-log-prob pass (each micro-batch is trained once, at theta_old): record the
            # routes of this first training forward; they travel with the micro-batch
            cap = rr.capture(self.accelerator.unwrap_model(model))
        self._rr_current = routes
        try:
            loss = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        finally:
            self._rr_current = None
            if cap is not None:
                cap.stop()
            if not self.model.training:
                self._rr_release()
        if cap is not None and cap.passes:
            inputs["stablerl_routes"] = cap.routes().batch_tensor()[0].cpu()
        return loss

    def training_step(self, model, inputs, num_items_in_batch):
        if self._ext_hook is not None:
            self._ext_hook_before_pass()
        if self._rr_mode is None:
            return super().training_step(model, inputs, num_items_in_batch)
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._rr_release()  # after backward

    # -- reward shapers, batch filters, entropy controllers (generic: driven by the specs) ---------

    def _ext_setup(self) -> None:
        cfg = self.args
        names = validate_stablerl_extensions(cfg)
        self._ext_shaper, self._ext_filter = names["reward_shaper"], names["batch_filter"]
        self._ext_controller_name = names["entropy_controller"]
        self._ext_params = {key: _as_dict(getattr(cfg, pk, None), pk) for key, pk in _EXT_PARAM_KEYS.items()}
        self._ext_inputs: Optional[dict] = None
        # one generator for shapers/filters, seeded alike on every process (they run on the gathered batch,
        # so every process draws the same numbers); saved with the checkpoint
        self._ext_rng = self._stablerl_store.generator(_EXT_RNG_STREAM, int(cfg.seed))
        self._ext_controller = None
        self._ext_decision: dict[str, Any] = {}
        self._ext_entropy_seen: tuple = (None, 0)
        self._ext_penalty = False
        if self._ext_controller_name:
            ctrl = stablerl.make_controller(self._ext_controller_name, **self._ext_params["entropy_controller"])
            accepted = inspect.signature(ctrl.step).parameters
            needed = [n for n, p in accepted.items() if p.default is inspect.Parameter.empty
                      and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in ("entropy", "turn_entropy")]
            if needed:
                raise stablerl.MissingInputError(
                    f"entropy_controller {self._ext_controller_name!r} needs statistic(s) {needed} that TRL does not "
                    "provide (TRL gives the mean entropy of each optimizer step)")
            if self._ext_controller_name == "adaptive_entropy" and (
                    getattr(cfg, "use_adaptive_entropy", False) or getattr(cfg, "entropy_coef", 0.0)):
                raise StableRLError(
                    "entropy_controller='adaptive_entropy' adds its own entropy bonus: leave TRL's use_adaptive_entropy "
                    "False and entropy_coef 0 (set the initial coefficient in stablerl_entropy_controller_params)")
            self._ext_controller = ctrl
            self._stablerl_store.track(CONTROLLER, self._ext_controller_name, _ControllerState(self))
            penalty = getattr(ctrl, "penalty", None)
            self._ext_penalty = callable(penalty)
            if self._ext_penalty and "turn_index" in inspect.signature(penalty).parameters:
                warnings.warn(
                    f"entropy_controller {self._ext_controller_name!r} works per turn; TRL's GRPOTrainer has no turn "
                    "ids, so every sample is turn 0 and the controller keeps one entropy history (for epo: its "
                    "penalty applies only to turns >= max_steps/2, so with turn 0 it stays 0 -- epo is meant for "
                    "multi-turn agent loops)",
                    UserWarning,
                    stacklevel=3,
                )
        self._ext_hook = None
        self._ext_hook_name = names["trainer_hook"]
        self._ext_hook_pass: Optional[int] = None  # pass index within the current generation batch, None between
        self._ext_step_entropy_cache: tuple = (None, None)
        if self._ext_hook_name:
            self._ext_hook = stablerl.make_trainer_hook(self._ext_hook_name, **self._ext_params["trainer_hook"])
            self._ext_hook_check(self._ext_hook.passes_per_batch())
            self._stablerl_store.track(TRAINER_HOOK, self._ext_hook_name, self._ext_hook)
        if self._ext_controller is not None or self._stablerl_loss or self._stablerl_estimator or self._ext_shaper \
                or self._ext_filter or self._ext_hook is not None:
            self.add_callback(_StablerlStateCallback(self))

    def _ext_gather_user_inputs(self, inputs) -> dict[str, Any]:
        """Per-completion user inputs (``correct``, ``flawed``, ...) of every process, in TRL's row order.

        Taken from what reward functions passed to ``log_extra(name, values)`` (TRL's per-completion channel),
        else from the rows (rollout_func extra fields, dataset columns). Every process joins every gather.
        """
        from accelerate.utils import gather_object

        n = len(inputs)
        found = {}
        for name in _EXT_INPUTS_USER:
            local = self._pending_extra_logs.get(name) if hasattr(self, "_pending_extra_logs") else None
            if local is not None and len(local) != n:
                raise StableRLError(
                    f"log_extra({name!r}, ...) got {len(local)} values for {n} completions on this process: call it "
                    "from exactly one reward function, with one value per completion")
            if local is None and n and all(name in row for row in inputs):
                local = [row[name] for row in inputs]
            parts = gather_object([None if local is None else list(local)])
            if all(p is None for p in parts):
                continue
            if any(p is None for p in parts):
                raise StableRLError(f"input {name!r} was given on some processes only")
            found[name] = [v for p in parts for v in p]
        return found

    def _ext_extras(self, spec, key: str, gathered_mask: Optional[torch.Tensor]) -> dict[str, Any]:
        """The per-response extras ``spec`` uses: user inputs given (required ones must be) and ``lengths``."""
        extras: dict[str, Any] = {}
        user = self._ext_inputs or {}
        for name in spec.requires:
            if name in ("index", "scores", "entropy"):
                continue
            if name == "lengths":
                extras["lengths"] = gathered_mask.sum(-1).to(torch.float64)
            elif user.get(name) is not None:
                extras[name] = user[name]
            else:
                raise stablerl.MissingInputError(
                    f"{key} {spec.name!r} needs input {name!r} ({OPTIONAL_INPUTS.get(name, '')}): "
                    + _EXT_HOW_TO_PROVIDE.format(name=name))
        for name, value in user.items():  # optional inputs the user gave (e.g. fapo's correct)
            extras.setdefault(name, value)
        return extras

    def _ext_gathered_mask(self, out) -> torch.Tensor:
        local = out["completion_mask"] if "tool_mask" not in out else out["completion_mask"] * out["tool_mask"]
        return self.accelerator.gather(self.accelerator.pad_across_processes(local, dim=1, pad_index=0)).float()

    def _ext_ctx(self, kind: str, name: str) -> "stablerl.Context":
        return stablerl.Context(step=int(self.state.global_step), total_steps=int(self.state.max_steps or 0) or None,
                                generator=self._ext_rng, state=self._stablerl_store.slot(kind, name))

    def _ext_log(self, mode: str, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():  # computed on the gathered batch: the same on every process
            self._metrics[mode]["stablerl/" + k].append(float(v))

    def _ext_shape(self, out, rewards, group, mode):
        name = self._ext_shaper
        spec = stablerl.get_spec(REWARD_SHAPER, name)
        mask = self._ext_gathered_mask(out).to(rewards.device) if "lengths" in spec.requires else None
        extras = self._ext_extras(spec, "reward_shaper", mask)
        shaped, metrics = stablerl.shape_rewards(name, scores=rewards, index=group,
                                                 ctx=self._ext_ctx(REWARD_SHAPER, name), **extras,
                                                 **self._ext_params["reward_shaper"])
        self._ext_log(mode, metrics)
        self._metrics[mode]["stablerl/shaped_reward/mean"].append(shaped.float().mean().item())
        return shaped.to(rewards.dtype)

    def _ext_rollout_entropy(self, out, mode) -> torch.Tensor:
        """Per-token entropies ``[n, T]`` of the policy on this process's rollout (one extra no-grad forward).

        TRL computes entropies only inside ``_compute_loss``, after the advantages; filters that need them get
        the entropies of the policy that generated the batch, at TRL's temperature, with native MoE routing.
        """
        multimodal = [k for k in _EXT_MULTIMODAL_KEYS if k in out]
        if multimodal:
            raise StableRLError(f"batch_filter={self._ext_filter!r} needs the rollout's entropies, computed in an extra "
                                f"forward pass that stablerl runs for text-only batches; this batch has {multimodal}")
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        bs = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        with torch.no_grad():
            _, entropies, _ = _trl.GRPOTrainer._get_per_token_logps_and_entropies(
                self, self.model, ids, attention, out["completion_ids"].size(1), batch_size=bs, compute_entropy=True)
        return entropies

    def _ext_filter_batch(self, out, rewards, group, rows, mode):
        """Apply the batch filter on the gathered batch; TRL's batch is fixed, so dropped rows and tokens get
        advantage 0 and loss mask 0 (``tool_mask``, which multiplies ``completion_mask`` in the loss only, so
        attention is unchanged), and ``num_items_in_batch`` becomes the kept tokens."""
        name = self._ext_filter
        spec = stablerl.get_spec(BATCH_FILTER, name)
        local_adv = out["advantages"]
        T_local = out["completion_ids"].size(1)
        gmask = self._ext_gathered_mask(out).to(rewards.device)
        one_d = local_adv.dim() == 1
        if one_d:
            gadv_rows = self.accelerator.gather(local_adv.float()).to(rewards.device)
            gadv = gadv_rows.unsqueeze(-1) * gmask
        else:
            gadv = self.accelerator.gather(self.accelerator.pad_across_processes(local_adv.float(), dim=1, pad_index=0))
            gadv = gadv.to(rewards.device) * gmask
        entropy = None
        if "entropy" in spec.requires:
            local_h = self._ext_rollout_entropy(out, mode).float()
            entropy = self.accelerator.gather(self.accelerator.pad_across_processes(local_h, dim=1, pad_index=0))
            entropy = entropy.to(rewards.device)
        extras = self._ext_extras(spec, "batch_filter", gmask)
        result = stablerl.filter_batch(name, advantages=gadv, response_mask=gmask, index=group, scores=rewards.float(),
                                       entropy=entropy, ctx=self._ext_ctx(BATCH_FILTER, name), **extras,
                                       **self._ext_params["batch_filter"])
        filtered = apply_filter_result(
            result, gmask, gadv, selected_by=f"batch_filter={name!r}",
            why_no_resampling="TRL's generation batch has a fixed size and layout (each process's slice, split into "
            "micro-batches), so only filters that keep or drop rows can run in TRL (shuffle_r1: use shuffle=False "
            "for its pairwise sampling alone)")
        if one_d and result.advantages is None:
            new_rows = torch.where(filtered.dropped, torch.zeros_like(gadv_rows), gadv_rows)
            out["advantages"] = new_rows[rows].to(local_adv.dtype).contiguous()
        else:
            out["advantages"] = filtered.advantages[rows, :T_local].to(torch.float32).contiguous()
        new_mask = filtered.response_mask
        local_keep = new_mask[rows, :T_local].to(out["completion_mask"].device, out["completion_mask"].dtype)
        out["tool_mask"] = local_keep if "tool_mask" not in out else out["tool_mask"] * local_keep
        old_items = out["num_items_in_batch"]
        out["num_items_in_batch"] = new_mask.sum().clamp(min=1).to(old_items.device, old_items.dtype)
        self._ext_log(mode, filtered.metrics)
        return out

    def _ext_set_temperature(self, temperature: float) -> None:
        """The sampling temperature of the next generations (not TRL's ``self.temperature``, which scales the
        logits of every log-prob pass: AEPO computes log-probs at the training temperature)."""
        if self.use_vllm:
            self.vllm_generation.temperature = temperature
        if getattr(self, "generation_config", None) is not None:
            self.generation_config.temperature = temperature
        if isinstance(getattr(self, "generation_kwargs", None), dict):
            self.generation_kwargs["temperature"] = temperature

    def _ext_apply(self, decision: dict[str, Any]) -> None:
        if decision.get("temperature") is not None:
            self._ext_set_temperature(float(decision["temperature"]))

    def _ext_controller_step(self) -> None:
        """Once per optimizer step: feed the controller TRL's mean entropy of the step (each micro-batch's value is
        already reduced over processes by TRL, so every process computes the same update)."""
        if self._ext_controller is None:
            return
        entropy = self._ext_step_entropy()
        stats = {"entropy": entropy, "turn_entropy": [float("nan") if entropy is None else entropy]}
        accepted = inspect.signature(self._ext_controller.step).parameters
        decision = self._ext_controller.step(**{k: v for k, v in stats.items() if k in accepted})
        self._ext_decision = {k: v for k, v in (decision or {}).items()
                              if v is None or isinstance(v, (bool, int, float, str))}
        self._ext_apply(self._ext_decision)
        for k, v in self._ext_decision.items():
            if isinstance(v, (bool, int, float)):
                self._metrics["train"][f"stablerl/{self._ext_controller_name}/{k}"].append(float(v))

    def _ext_step_entropy(self) -> Optional[float]:
        """TRL's mean entropy of the micro-batches of the optimizer step that just ended (each value already
        reduced over processes by TRL); read once per step, shared by the controller and the trainer hook."""
        step = int(self.state.global_step)
        if self._ext_step_entropy_cache[0] == step:
            return self._ext_step_entropy_cache[1]
        values = self._metrics["train"].get("entropy")
        values = [] if values is None else values
        seen, count = self._ext_entropy_seen
        new = values[count:] if seen is values else values  # TRL's log() replaces the lists after logging
        self._ext_entropy_seen = (values, len(values))
        new = [v for v in new if not (isinstance(v, float) and v != v)]
        entropy = sum(new) / len(new) if new else None
        self._ext_step_entropy_cache = (step, entropy)
        return entropy

    # -- trainer hook (between optimizer passes over one generation batch) ---------------------

    def _ext_hook_check(self, passes: int) -> None:
        cfg = self.args
        name = self._ext_hook_name
        if cfg.num_iterations != passes:
            raise StableRLError(
                f"trainer_hook={name!r} runs {passes} optimizer passes over each generation batch: set "
                f"num_iterations={passes} (TRL reuses a generation batch num_iterations times), got {cfg.num_iterations}")
        if cfg.steps_per_generation != cfg.gradient_accumulation_steps:
            raise StableRLError(
                f"trainer_hook={name!r} needs one optimizer step per pass over the generation batch: "
                f"steps_per_generation ({cfg.steps_per_generation}) must equal gradient_accumulation_steps "
                f"({cfg.gradient_accumulation_steps})")
        if getattr(self, "is_deepspeed_enabled", False):
            # ZeRO keeps the fp32 master weights in the optimizer's own flat partitions and copies them over the
            # model's parameters after every step (ZeRO-3 also partitions the parameters themselves)
            raise StableRLError(f"trainer_hook={name!r} changes the parameters in place between passes; under "
                                "DeepSpeed the next optimizer step would overwrite them from its fp32 master "
                                "partitions: use DDP or FSDP (the optimizer then steps the parameters themselves)")

    def _ext_params_view(self) -> ParamsView:
        model = self.model
        return ParamsView(parameters=lambda: [p for p in model.parameters() if p.requires_grad],
                          optimizer=self.optimizer)

    def _ext_hook_before_pass(self) -> None:
        """At the first micro-batch of an optimizer step: a new generation batch starts when no pass is under way."""
        if self._ext_hook is None or not self.model.training or self._ext_hook_pass is not None:
            return
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every != 0:
            raise StableRLError(f"trainer_hook={self._ext_hook_name!r}: a generation batch starts at micro-step "
                                f"{self._step}, not a multiple of {generate_every} (resumed mid-batch?)")
        self._ext_hook.before_batch(self._ext_params_view())
        self._ext_hook_pass = 0

    def _ext_hook_after_pass(self) -> None:
        """After each optimizer step (one pass over the generation batch): the hook acts; after the batch's last
        pass, the next batch's number of passes becomes TRL's num_iterations."""
        if self._ext_hook is None or self._ext_hook_pass is None:
            return
        k = self._ext_hook_pass
        out = self._ext_hook.after_pass(self._ext_params_view(), k, entropy=self._ext_step_entropy())
        for key, v in (out or {}).items():
            if isinstance(v, (bool, int, float)):
                self._metrics["train"][f"stablerl/{self._ext_hook_name}/{key}"].append(float(v))
        if k + 1 >= self.num_iterations:
            self._ext_hook_pass = None
            # e.g. sfpo after its stop rule: one pass per batch from now on. TRL's sampler still repeats each
            # prompt batch for the num_iterations it was built with, so each repeat is generated afresh.
            self.num_iterations = self._ext_hook.passes_per_batch()
        else:
            self._ext_hook_pass = k + 1

    def _ext_loss_with_penalty(self, model, inputs):
        """The controller's loss term (EPO), from the entropies of the training forward, added to the loss.

        Token-mean over the tokens of the accumulation window on every process (TRL dapo's normaliser);
        every sample is turn 0 (TRL has no turn ids)."""
        self._ext_penalty_capture = {}
        try:
            loss = self._compute_loss(model, inputs)
            entropies = self._ext_penalty_capture.get("entropies")
        finally:
            self._ext_penalty_capture = None
        if entropies is None:
            return loss
        mode = "train" if self.model.training else "eval"
        mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
        GA = self.current_gradient_accumulation_steps if mode == "train" else 1
        token_count = inputs["num_items_in_batch"].to(torch.float32)
        if mode == "train":
            token_count = token_count * GA / self.args.steps_per_generation
        ctx = self._stablerl_context(token_count=token_count, seq_count=entropies.size(0) * self.accelerator.num_processes * GA)
        penalty = self._ext_controller.penalty
        kwargs: dict[str, Any] = {"loss_agg_mode": "token-mean", "ctx": ctx}
        if "turn_index" in inspect.signature(penalty).parameters:
            kwargs["turn_index"] = torch.zeros(entropies.size(0), dtype=torch.long, device=entropies.device)
        term, metrics = penalty(entropies, response_mask=mask.to(entropies.dtype), **kwargs)
        self._stablerl_log(mode, {k: float(v) for k, v in metrics.items()})
        return loss + term

    # -- checkpointed state: the controller, every ctx.state dict, the shapers/filters' generator -----

    def stablerl_state_dict(self) -> dict[str, Any]:
        """What :meth:`save_stablerl_state` writes (``StateStore.state_dict()``): the same on every process."""
        return self._stablerl_store.state_dict()

    def load_stablerl_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") == 1:  # stablerl_controller.json of earlier development versions
            state = _from_legacy_json(state, int(self.args.seed))
        self._stablerl_store.load_state_dict(state, where="the checkpoint's " + _EXT_STATE_FILE)
        self._ext_rng = self._stablerl_store.generator(_EXT_RNG_STREAM, int(self.args.seed))

    def save_stablerl_state(self, folder: str) -> str:
        path = os.path.join(folder, _EXT_STATE_FILE)
        torch.save(self.stablerl_state_dict(), path + ".tmp")  # tensors as tensors (CAPO's moments are [V, H])
        os.replace(path + ".tmp", path)  # a crash mid-save leaves no torn file
        return path

    def load_stablerl_state(self, folder: str) -> bool:
        """Restore from ``folder``/stablerl_state.pt (or an older stablerl_controller.json); False when the
        folder has neither."""
        path = os.path.join(folder, _EXT_STATE_FILE)
        if os.path.exists(path):
            self.load_stablerl_state_dict(torch.load(path, map_location="cpu", weights_only=False))
            return True
        legacy = os.path.join(folder, _EXT_LEGACY_STATE_FILE)
        if os.path.exists(legacy):
            with open(legacy) as f:
                self.load_stablerl_state_dict(json.load(f))
            return True
        return False

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and getattr(self, "_ext_rng", None) is not None:
            self.load_stablerl_state(checkpoint)  # every process reads the same file

    # -- advantages ------------------------------------------------------------------------

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._stablerl_rewards = rewards_per_func  # (N_global, n_funcs), gathered over processes
        if self._ext_shaper or self._ext_filter:  # per-completion inputs of shapers/filters, before TRL flushes them
            self._ext_inputs = self._ext_gather_user_inputs(inputs)
        return rewards_per_func

    def _trl_runs_old_pass(self) -> bool:
        """TRL's own condition for its old-log-prob pass in ``_generate_and_score_completions``."""
        every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % every != 0 or bool(
            self.use_vllm and self.vllm_importance_sampling_correction)

    def _generate_and_score_completions(self, inputs):
        # old_entropy (erc): TRL's old-log-prob pass, when TRL runs one, also computes entropies (see
        # _get_per_token_logps_and_entropies); they travel batch-first with their rows as stablerl_old_entropy.
        # Without that pass TRL's old log-probs are the current policy's (ratio 1): the loss then takes the
        # current entropy as the old one (_stablerl_policy_loss), the same rule.
        sink = {"armed": True} if self._stablerl_wants_old_entropy and self._trl_runs_old_pass() else None
        self._stablerl_old_entropy = sink
        try:
            if self._rr_mode is None:
                out = super()._generate_and_score_completions(inputs)
            else:
                out = self._rr_generate_and_score(inputs)
        finally:
            self._stablerl_old_entropy = None
        if sink is not None:
            if sink.get("entropies") is None:
                raise StableRLError(f"policy loss {self._stablerl_loss!r} needs the old-log-prob pass's entropies, "
                                    "but TRL's old-log-prob pass did not run through _get_per_token_logps_and_entropies")
            out["stablerl_old_entropy"] = sink["entropies"]
        if not (self._stablerl_estimator or self._stablerl_needs_rows or self._ext_filter):
            self._stablerl_rewards = None
            return out
        rewards_per_func, self._stablerl_rewards = self._stablerl_rewards, None
        mode = "train" if self.model.training else "eval"
        G = self.num_generations if mode == "train" else self.num_generations_eval
        device = rewards_per_func.device
        # TRL's reward: weighted sum of the reward functions; rows every function declined are unscorable
        rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
        unscorable = torch.isnan(rewards_per_func).all(dim=1)
        rewards = torch.where(unscorable, torch.zeros_like(rewards), rewards)
        n = out["completion_ids"].size(0)
        rows = slice(self.accelerator.process_index * n, (self.accelerator.process_index + 1) * n)  # TRL's slice
        group = torch.arange(rewards.numel(), device=device) // G  # RepeatSampler: contiguous groups of G
        if self._ext_shaper:  # before everything that uses the rewards (needs advantage_estimator)
            rewards = self._ext_shape(out, rewards, group, mode)
        if self._stablerl_needs_rows:  # extra batch-first keys travel with their rows through TRL's shuffles
            out["stablerl_index"] = group[rows].clone()
            out["stablerl_scores"] = rewards[rows].clone()
        if self._stablerl_estimator:
            out["advantages"] = self._stablerl_advantages(out, rewards, unscorable, group, rows, mode,
                                                          components=rewards_per_func)
        if self._ext_filter:
            out = self._ext_filter_batch(out, rewards, group, rows, mode)
        self._ext_inputs = None
        return out

    def _stablerl_advantages(self, out, rewards, unscorable, group, rows, mode, components=None):
        """stablerl advantages ``[n_local, T_local]`` from the gathered rewards (TRL's layout). ``components``:
        each reward function's reward ``[N, n_funcs]`` (NaN where it returned None), handed to the estimator
        with TRL's ``reward_weights`` as the extras ``reward_components`` / ``reward_weights`` (GDPO)."""
        local_mask = out["completion_mask"]
        # Response masks of every process, padded to one length, so length-aware estimators (OPO) see
        # the real lengths. The reward sits on the last response token (verl's convention: S_i is the
        # sum of token rewards). A row with an empty mask (mask_truncated_completions) keeps its reward
        # on position 0 so it still counts in its group's statistics, as in TRL; it is not trained on.
        mask = self.accelerator.gather(self.accelerator.pad_across_processes(local_mask, dim=1, pad_index=0)).float()
        mask = mask.to(rewards.device)
        empty = mask.sum(-1) == 0
        mask[empty, 0] = 1.0
        last = last_valid_index(mask)
        token_rewards = scores_on_last_token(rewards.to(mask.dtype), mask)
        # unscorable rows (every reward function returned None): a group of their own each, so they
        # stay out of the others' statistics; their advantage is 0 (TRL's rule)
        index = group.clone()
        n_unscorable = int(unscorable.sum())
        if n_unscorable:
            index[unscorable] = int(group.max()) + 1 + torch.arange(n_unscorable, device=index.device)
        name = self._stablerl_estimator
        ctx = stablerl.Context(step=int(self.state.global_step), state=self._stablerl_store.slot(ADVANTAGE_ESTIMATOR, name))
        extras = {}
        if components is not None:
            extras = {"reward_components": components.to(mask.device),
                      "reward_weights": self.reward_weights.to(mask.device)}
        adv, _ = stablerl.compute_advantage(
            name, token_level_rewards=token_rewards, response_mask=mask, index=index, ctx=ctx,
            **({"extras": extras} if extras else {}), **self._stablerl_adv_params
        )
        adv = torch.where(unscorable.unsqueeze(-1), torch.zeros_like(adv), adv)
        per_seq = adv.gather(1, last.unsqueeze(-1)).squeeze(-1)
        self._metrics[mode]["stablerl/advantages/mean"].append(per_seq.mean().item())
        self._metrics[mode]["stablerl/advantages/std"].append(per_seq.std().item() if per_seq.numel() > 1 else 0.0)
        self._metrics[mode]["stablerl/advantages/frac_zero"].append((per_seq == 0).float().mean().item())
        return adv[rows, : local_mask.size(1)].to(torch.float32).contiguous()

    # -- loss ------------------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        old_entropy = self._stablerl_old_entropy
        # TRL's old-log-prob pass is the first pass of the policy while a batch is generated (the ref pass of a
        # PEFT policy comes after it); it asks for no entropies: for erc it computes them too
        record_old_entropy = bool(old_entropy and old_entropy["armed"] and not kwargs.get("compute_entropy")
                                  and self.accelerator.unwrap_model(model) is self.accelerator.unwrap_model(self.model))
        if record_old_entropy:
            old_entropy["armed"] = False
            kwargs["compute_entropy"] = True
        out = self._stablerl_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        if record_old_entropy:
            old_entropy["entropies"] = out[1].detach()
        return out

    def _stablerl_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if self._rr_mode is None:
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args,
                                                             **kwargs)
        else:
            fn = functools.partial(super()._get_per_token_logps_and_entropies, model, input_ids, attention_mask,
                                   logits_to_keep, *args, **kwargs)
            if self._rr_router_lp and self._stablerl_capture is not None and kwargs.get("compute_entropy"):
                fn = self._rr_recording(fn, model, logits_to_keep, False, self._stablerl_capture)
            out = self._rr_logps(fn, model, input_ids, logits_to_keep)
        if self._stablerl_capture is not None and kwargs.get("compute_entropy"):
            self._stablerl_capture["logps"], self._stablerl_capture["entropies"] = out[0], out[1]
        if self._ext_penalty_capture is not None and kwargs.get("compute_entropy"):
            self._ext_penalty_capture["entropies"] = out[1]
        return out

    def _compute_loss(self, model, inputs):
        if self._ext_penalty and self._ext_penalty_capture is None:
            return self._ext_loss_with_penalty(model, inputs)
        if self._stablerl_loss is None:
            return super()._compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        metrics = self._metrics[mode]
        before = {k: len(metrics[k]) for k in _HOST_CLIP_METRICS if k in metrics}
        policy_loss_logged = len(metrics["policy_loss"]) if "policy_loss" in metrics else 0
        # TRL's own _compute_loss with zero advantages: its policy term is exactly 0, everything
        # around it (forward, KL, entropy bonus, aux loss, GA scaling, metrics) is TRL's.
        # Why a capture dict here and not core's loss_inputs channel (verl, OpenRLHF): TRL has no loss
        # registry -- its loss types are a string switch inside _compute_loss -- so stablerl's loss is never
        # called from inside TRL; this adapter calls it itself, with the declared inputs read straight from
        # TRL's `inputs` dict. What must cross TRL's method boundary is the other way round: the log-probs and
        # entropies TRL computes inside _compute_loss, captured in _get_per_token_logps_and_entropies.
        surroundings_inputs = dict(inputs)
        surroundings_inputs["advantages"] = torch.zeros_like(inputs["advantages"])
        saved_loss_type = self.loss_type
        self.loss_type = _HOST_LOSS_TYPE[self._stablerl_agg_mode]
        self._stablerl_capture = {}
        try:
            surroundings = super()._compute_loss(model, surroundings_inputs)
            captured = self._stablerl_capture
        finally:
            self.loss_type = saved_loss_type
            self._stablerl_capture = None
        for key in _HOST_CLIP_METRICS:  # clip statistics of the zero-advantage host loss mean nothing
            if key in metrics:
                del metrics[key][before.get(key, 0):]
                if not metrics[key]:
                    del metrics[key]
        loss, loss_value = self._stablerl_policy_loss(inputs, captured["logps"], captured["entropies"], mode,
                                                      router_log_prob=captured.get("router_log_prob"))
        if "policy_loss" in metrics and len(metrics["policy_loss"]) > policy_loss_logged:
            # TRL logs its (KL-inclusive) policy loss only when the entropy bonus is on; add ours to it
            metrics["policy_loss"][-1] += self.accelerator.gather(loss_value).nanmean().item()
        return surroundings + loss

    def stablerl_loss_inputs(self, inputs: dict, log_prob: torch.Tensor) -> dict[str, Any]:
        """Extension point: loss inputs this trainer supplies itself, ``{name: value}`` for the names listed in
        ``stablerl_extra_loss_inputs`` (per-token tensors ``[B, C]`` like ``log_prob``, or a scalar such as
        ``policy_version``). ``inputs`` is TRL's micro-batch dict (extra per-row tensors added in
        ``_generate_and_score_completions`` travel with it); ``old_log_prob`` / ``rollout_log_prob``
        replace TRL's. The default supplies nothing."""
        return {}

    def _stablerl_supplied_inputs(self, inputs, logps) -> dict[str, Any]:
        declared = set(check_extra_loss_inputs(getattr(self.args, "stablerl_extra_loss_inputs", None)))
        if not declared:
            return {}
        supplied = dict(self.stablerl_loss_inputs(inputs, logps) or {})
        undeclared = sorted(set(supplied) - declared)
        if undeclared:
            raise StableRLError(f"stablerl_loss_inputs returned {undeclared}, which stablerl_extra_loss_inputs does "
                                f"not list ({sorted(declared)})")
        needed = (set(self._stablerl_spec.requires) & declared) - set(supplied)
        if needed:
            raise stablerl.MissingInputError(
                f"policy loss {self._stablerl_loss!r} needs {sorted(needed)}, declared in stablerl_extra_loss_inputs, "
                "but stablerl_loss_inputs did not return them")
        return supplied

    def _stablerl_policy_loss(self, inputs, logps, entropies, mode, router_log_prob=None):
        spec = self._stablerl_spec
        completion_mask = inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        valid = mask.bool()  # what core reads: a bool mask costs it no cast and no compare
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old

        # TRL's per-token multipliers, in TRL's order: off-policy sequence mask, entropy mask, vLLM IS ratio
        weights = []
        use_vllm_is = bool(self.use_vllm and self.vllm_importance_sampling_correction)
        if self.off_policy_mask_threshold is not None or self.top_entropy_quantile < 1.0:
            mask = mask.to(logps.dtype)  # TRL's own masks take a float mask (a cast only when one is on)
        if self.off_policy_mask_threshold is not None:
            sampling = inputs.get("sampling_per_token_logps", old)
            weights.append(
                self.get_off_policy_mask(
                    advantages=advantages,
                    per_token_logps=logps,
                    sampling_per_token_logps=sampling,
                    mask=mask,
                    off_policy_threshold=self.off_policy_mask_threshold,
                )
            )
        if self.top_entropy_quantile < 1.0:
            weights.append(self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile).to(logps.dtype))
        rollout_log_prob = None
        if use_vllm_is:
            if "rollout_log_prob" in spec.requires or self._stablerl_correction:
                # the algorithm corrects for the sampler itself (like TRL's vespo): give it the sampler's
                # log-probs (NaN = unscored by vLLM -> no mismatch) and do not apply TRL's ratio on top (a
                # stablerl rollout correction with TRL's on is refused at config time; never both here either)
                sampling = inputs["sampling_per_token_logps"]
                rollout_log_prob = torch.where(torch.isnan(sampling), old, sampling)
            else:
                weights.append(inputs["importance_sampling_ratio"])
        is_weights = None
        if weights:
            is_weights = torch.ones_like(logps)
            for w in weights:
                is_weights = is_weights * w.to(logps.dtype)
            is_weights = is_weights.detach()

        P = self.accelerator.num_processes
        GA = self.current_gradient_accumulation_steps if mode == "train" else 1
        token_count = inputs["num_items_in_batch"].to(torch.float32)  # tokens of the generation batch, all processes
        if mode == "train":  # the generation batch spans steps_per_generation micro-batches
            token_count = token_count * GA / self.args.steps_per_generation
        ctx = self._stablerl_context(
            token_count=token_count,
            seq_count=logps.size(0) * P * GA,
            loss_scale_factor=float(self.max_completion_length),
            state=self._stablerl_store.slot(POLICY_LOSS, self._stablerl_loss),
        )
        extra: dict[str, Any] = {}
        supplied = self._stablerl_supplied_inputs(inputs, logps)
        old = supplied.pop("old_log_prob", old)
        rollout_log_prob = supplied.pop("rollout_log_prob", rollout_log_prob)
        extra.update(supplied)
        if self._stablerl_correction:
            sampling = inputs.get("sampling_per_token_logps")
            if sampling is None:
                raise StableRLError(f"stablerl_rollout_correction={self._stablerl_correction!r}: this batch has no "
                                    "sampling log-probs (the rollout_func returned no logprobs?)")
            if rollout_log_prob is None:  # NaN = unscored by vLLM -> no mismatch on that token
                rollout_log_prob = torch.where(torch.isnan(sampling), old, sampling)
            extra["rollout_correction"] = self._stablerl_correction
            if self._stablerl_correction_params:
                extra["rollout_correction_params"] = self._stablerl_correction_params
        if "old_entropy" in spec.requires:
            # TRL's old-log-prob pass's entropies; without that pass old == current, as for TRL's old log-probs
            old_entropy = inputs.get("stablerl_old_entropy")
            extra["old_entropy"] = entropies.detach() if old_entropy is None else old_entropy
        if "token_ids" in spec.requires:
            extra["token_ids"] = inputs["completion_ids"]
        if "index" in spec.requires:
            extra["index"] = inputs["stablerl_index"]
        if "scores" in spec.requires:
            extra["scores"] = inputs["stablerl_scores"]
        if "router_log_prob" in spec.requires:
            if router_log_prob is None:
                raise StableRLError(f"policy loss {self._stablerl_loss!r} needs router log-probs: set routing_replay")
            old_router = inputs.get("stablerl_old_router_log_prob")
            extra["router_log_prob"] = router_log_prob
            # no old-log-prob pass (TRL trains each micro-batch once, at theta_old): old == current, like TRL's logps
            extra["old_router_log_prob"] = router_log_prob if old_router is None else old_router.to(router_log_prob.device)
        loss, metrics = stablerl.compute_policy_loss(
            self._stablerl_loss,
            log_prob=logps,
            old_log_prob=old,
            advantages=advantages.expand_as(logps),
            response_mask=valid,
            rollout_log_prob=rollout_log_prob,
            # only to a loss that reads it (undeclared inputs are never read: stablerl.testing checks it),
            # so the others skip core's clean-up pass over it
            # (and to any loss with stablerl_loss_params' top_entropy_quantile < 1, which masks by it)
            entropy=entropies if "entropy" in spec.reads or top_entropy_on(self._stablerl_call_options) else None,
            ctx=ctx,
            is_weights=is_weights,
            **extra,
            # stablerl_loss_agg_mode, unless stablerl_loss_params names a registered aggregation (delta_l)
            **{"loss_agg_mode": self._stablerl_agg_mode, **self._stablerl_call_options},
            **self._stablerl_loss_params,
        )
        self._stablerl_log(mode, metrics)
        # for TRL's `policy_loss` metric, in the host loss type's convention (dapo: as is; others: before /GA)
        return loss, loss.detach() * (1 if self._stablerl_agg_mode == "token-mean" else GA)


__all__ = [
    "GRPOConfig",
    "GRPOTrainer",
    "ROUTING_REPLAY_MODES",
    "SUPPORTED_TRL",
    "TRL_LOSS_TYPES",
    "UnsupportedTRLVersionError",
    "check_trl",
    "instrument",
    "resolve_loss_type",
    "routing_replay_mode",
    "validate_stablerl_args",
    "validate_stablerl_extensions",
    "uninstrument",
]
