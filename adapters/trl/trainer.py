"""stablerl in TRL: a drop-in ``GRPOTrainer`` / ``GRPOConfig`` pair (TRL >= 1.16, < 1.17); see docs/trl.md.

    from stablerl.adapters.trl import GRPOConfig, GRPOTrainer
    args = GRPOConfig(loss_type="m2po", advantage_estimator="qae",
                      stablerl_loss_params={"m2_threshold": 0.04}, stablerl_advantage_params={"quantile_k": 0.4})

Glue only: TRL's config and batch are read here, the decisions are core's (``stablerl.frameworks``: names,
precedence, filters, advantages from scores; ``stablerl.trainer_loop``: controllers, trainer hooks;
``stablerl.state``: checkpoints; ``stablerl.routing_replay``: MoE routing replay). TRL's built-in ``loss_type``
names keep TRL's code. For a stablerl loss, ``_compute_loss`` runs TRL's own ``_compute_loss`` with zero
advantages under the TRL built-in whose normaliser equals ``stablerl_loss_agg_mode``, so TRL contributes exactly
the surroundings (forward with entropies, MoE aux loss, KL, entropy bonus, GA scaling, metrics) and a zero policy
term; the stablerl loss is computed from that same forward's log-probs and entropies (captured in
``_get_per_token_logps_and_entropies``), with TRL's masks and vLLM IS ratio as per-token weights, and added.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

import stablerl
from stablerl import routing_replay as rr
from stablerl.contracts import (ADVANTAGE_ESTIMATOR, BATCH_FILTER, CONTROLLER, OPTIONAL_INPUTS, POLICY_LOSS,
                                REWARD_SHAPER, ROLLOUT_CORRECTION, TRAINER_HOOK, ParamsView)
from stablerl.frameworks import (UnsupportedVersionError, advantages_from_scores, apply_filter_result, as_params,
                                 check_call_options, check_framework_keys_used, check_inputs, check_selection,
                                 check_shaper_and_components, check_signatures, check_supplied_inputs, check_version, declared_inputs,
                                 dedicated_call_option, effective_hyperparameters, get_framework, log_effective_settings,
                                 resolve, split_call_options, top_entropy_on)
from stablerl.ops import AGG_MODES
from stablerl.params import StableRLError, UnknownNameError, build_params, params_dict, unknown_name_message
from stablerl.state import LEGACY_FORMAT, StateStore, from_legacy_json, read_state
from stablerl.trainer_loop import ControllerDriver, HookPasses

TRL = get_framework("trl")  # TRL's facts (built-in names, feedable inputs, keys): stablerl.adapters.frameworks
SUPPORTED_TRL = TRL.supported
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
_HOST_CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                      "clip_ratio/high_max")

# The inputs TRL can feed in a given run (the declaration lists all of them; these narrow it per run).
_LOSS_INPUTS_VLLM_IS = {"rollout_log_prob"}  # sampling_per_token_logps, with vllm_importance_sampling_correction
# router log-probs at the replayed experts, recorded in the old-log-prob pass and the training forward
_LOSS_INPUTS_ROUTING_REPLAY = {"router_log_prob", "old_router_log_prob"}
_LOSS_INPUTS_ALWAYS = TRL.feedable[POLICY_LOSS] - _LOSS_INPUTS_VLLM_IS - _LOSS_INPUTS_ROUTING_REPLAY


class UnsupportedTRLVersionError(UnsupportedVersionError):
    """The installed TRL is outside the range this adapter was written and tested against."""


# ----------------------------------------------------------------------------- version guard

# Private TRL methods this adapter overrides or calls, with the parameters it relies on.
_REQUIRED_SIGNATURES = {
    "_compute_loss": ("model", "inputs"), "_generate_and_score_completions": ("inputs",), "_generate": ("prompts",),
    "_calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),
    "_get_per_token_logps_and_entropies": ("model", "input_ids", "attention_mask", "logits_to_keep", "compute_entropy",
                                           "compute_aux_loss"),
    "get_high_entropy_mask": ("entropies", "mask", "threshold"),
    "get_off_policy_mask": ("advantages", "per_token_logps", "sampling_per_token_logps", "mask", "off_policy_threshold"),
    "_generate_single_turn": ("prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"),
    "training_step": ("model", "inputs", "num_items_in_batch"),
    "compute_loss": ("model", "inputs", "return_outputs", "num_items_in_batch"),
    "_load_optimizer_and_scheduler": ("checkpoint",),  # stablerl state in TRL's checkpoints
}


def check_trl(trl_module=None) -> None:
    """Raise :class:`UnsupportedTRLVersionError` unless TRL is in the supported range (core's one version policy;
    ``STABLERL_ALLOW_UNSUPPORTED=1``, or the older ``STABLERL_TRL_SKIP_VERSION_CHECK=1``, makes it a warning) and
    the private methods this adapter uses have the expected signatures (always checked)."""
    if trl_module is None:
        import trl as trl_module
    found = getattr(trl_module, "__version__", "unknown")
    check_version("trl", found, error=UnsupportedTRLVersionError,
                  allow=True if os.environ.get("STABLERL_TRL_SKIP_VERSION_CHECK", "") == "1" else None)
    check_signatures("trl", trl_module.GRPOTrainer, _REQUIRED_SIGNATURES, found, error=UnsupportedTRLVersionError)


import trl as _trl  # noqa: E402  (after the guard's definition, before anything uses trl)
from accelerate.utils import is_peft_model as _is_peft_model  # noqa: E402
from trl.trainer.utils import add_fused_lm_head as _add_fused_lm_head  # noqa: E402
from transformers import TrainerCallback as _TrainerCallback  # noqa: E402


def instrument() -> None:
    """Check the installed TRL against the adapter (:func:`check_trl`); run on import. The adapter extends TRL by
    subclassing only: nothing of TRL's is patched, so there is nothing else to do. Idempotent."""
    check_trl(_trl)


def uninstrument() -> None:
    """Nothing to undo: the TRL adapter changes no TRL object (see :func:`instrument`)."""


instrument()


# ----------------------------------------------------------------------------- names and inputs


def resolve_loss_type(loss_type: str) -> Optional[str]:
    """The stablerl policy loss ``loss_type`` selects, or None for a TRL built-in (core's one name rule; the inputs
    are checked per run in :func:`validate_stablerl_args`). Unknown names raise naming the nearest valid one."""
    return resolve(TRL, POLICY_LOSS, loss_type, inputs=False)


def loss_inputs_trl_can_feed(use_vllm_is: bool, routing_replay: bool = False) -> set[str]:
    return (set(_LOSS_INPUTS_ALWAYS) | (_LOSS_INPUTS_VLLM_IS if use_vllm_is else set())
            | (_LOSS_INPUTS_ROUTING_REPLAY if routing_replay else set()))


def check_extra_loss_inputs(names) -> tuple[str, ...]:
    """``stablerl_extra_loss_inputs``: declared inputs (or ``old_log_prob``) a trainer subclass supplies through
    :meth:`GRPOTrainer.stablerl_loss_inputs`; unknown names raise."""
    names = [] if names in (None, "") else [names] if isinstance(names, str) else list(names)
    valid = set(OPTIONAL_INPUTS) | {"old_log_prob"}
    for n in names:
        if n not in valid:
            raise UnknownNameError(unknown_name_message("stablerl_extra_loss_inputs entry", str(n), valid))
    return tuple(names)


# ----------------------------------------------------------------------------- config

def _field(help: str, default: Any = None):
    return field(default=default, metadata={"help": help})


_PARAMS = "Hyper-parameters of the {}, a dict or a JSON object string"


@dataclass
class GRPOConfig(_trl.GRPOConfig):
    """TRL's ``GRPOConfig`` plus stablerl's selections (all settable from ``TrlParser`` CLI/YAML); ``loss_type``
    also accepts stablerl policy-loss names. See docs/trl.md."""

    advantage_estimator: Optional[str] = _field("stablerl advantage estimator (e.g. 'qae', 'rloo') on the rewards "
                                                "gathered over all processes; None keeps TRL's advantages.")
    stablerl_loss_params: Optional[Union[dict, str]] = _field(
        _PARAMS.format("stablerl policy loss") + ", e.g. '{\"m2_threshold\": 0.04}' (unset: the paper's defaults); "
        "also loss_agg_mode / rollout_correction / top_entropy_quantile.")
    stablerl_advantage_params: Optional[Union[dict, str]] = _field(_PARAMS.format("stablerl advantage estimator") + ".")
    stablerl_extra_loss_inputs: Optional[list[str]] = _field(
        "Declared loss inputs a GRPOTrainer subclass supplies by overriding stablerl_loss_inputs(inputs, log_prob) "
        "(e.g. 'rollout_log_prob', 'versions'; 'old_log_prob' replaces TRL's).")
    stablerl_loss_agg_mode: str = _field("Aggregation of a stablerl policy loss: 'token-mean' (= TRL dapo), "
                                         "'seq-mean-token-mean' (= grpo), 'seq-mean-token-sum' (= luspo) or "
                                         "'seq-mean-token-sum-norm' (= dr_grpo).", "token-mean")
    routing_replay: Optional[str] = _field("MoE routing replay: 'R3' (the rollout's experts: HF generate, or a "
                                           "rollout_func's vLLM 'routed_experts') or 'R2' (the old-log-prob pass's).")
    reward_shaper: Optional[str] = _field("stablerl reward shaper (e.g. 'redit') on the gathered rewards, before the "
                                          "advantage_estimator it needs; user inputs come from TRL's log_extra.")
    stablerl_reward_shaper_params: Optional[Union[dict, str]] = _field(_PARAMS.format("reward shaper") + ".")
    batch_filter: Optional[str] = _field("stablerl batch filter (e.g. 'dynamic_sampling') after the advantages: dropped "
                                         "rows/tokens get advantage 0 and loss mask 0.")
    stablerl_batch_filter_params: Optional[Union[dict, str]] = _field(_PARAMS.format("batch filter") + ".")
    entropy_controller: Optional[str] = _field("stablerl entropy controller ('aepo', 'epo'), stepped once per optimizer "
                                               "step with TRL's mean entropy; saved with each checkpoint.")
    stablerl_entropy_controller_params: Optional[Union[dict, str]] = _field(_PARAMS.format("entropy controller") + ".")
    trainer_hook: Optional[str] = _field("stablerl trainer hook ('sfpo') between the num_iterations optimizer passes "
                                         "over each generation batch.")
    stablerl_trainer_hook_params: Optional[Union[dict, str]] = _field(_PARAMS.format("trainer hook") + ".")
    stablerl_rollout_correction: Optional[str] = _field(
        "stablerl mismatch correction of a stablerl loss ('tis', 'icepop', ...) from the rollout engine's log-probs; "
        "needs vllm_importance_sampling_correction=False. Alias: stablerl_loss_params' rollout_correction(_params).")
    stablerl_rollout_correction_params: Optional[Union[dict, str]] = _field(_PARAMS.format("rollout correction") + ".")

    def __post_init__(self):
        super().__post_init__()
        # TRL validates loss_type only at the first loss call; stablerl names are validated now.
        for key in ("stablerl_loss_params", "stablerl_advantage_params", "stablerl_rollout_correction_params",
                    *_EXT_PARAMS_KEYS.values()):
            setattr(self, key, params_dict(getattr(self, key), key))
        validate_stablerl_args(self)
        self.routing_replay = routing_replay_mode(self)
        validate_stablerl_extensions(self)


def routing_replay_mode(args) -> Optional[str]:
    """``"R2"``, ``"R3"`` or ``None`` from ``args.routing_replay`` (case-insensitive; unknown names raise)."""
    return rr.parse_mode(getattr(args, "routing_replay", None), "routing_replay")


def _params(args, key: str) -> dict:
    return params_dict(getattr(args, key, None), key)


def _vllm_is(args) -> bool:
    return bool(getattr(args, "use_vllm", False) and getattr(args, "vllm_importance_sampling_correction", False))


def validate_stablerl_args(args, warn: bool = True) -> tuple[Optional[str], Optional[str]]:
    """Check the stablerl selections of a (stablerl or plain TRL) GRPOConfig; return (loss, estimator)."""
    routing_replay_mode(args)
    loss = resolve_loss_type(args.loss_type)
    if loss is None and _params(args, "stablerl_loss_params"):
        raise StableRLError(
            f"stablerl_loss_params is set but loss_type={args.loss_type!r} is TRL's built-in loss (its knobs are TRL's "
            f"own, e.g. epsilon/epsilon_high); use loss_type='{PREFIX}{args.loss_type}' if a stablerl loss of that name "
            "is meant")
    if loss is not None:
        spec = stablerl.get_spec(POLICY_LOSS, loss)
        # the effective hyper-parameters (stablerl keys, TRL's epsilons when set) and the call options
        # (loss_agg_mode, top_entropy_quantile; the rollout correction, by either spelling, is checked below)
        hyper, options = split_call_options(as_params(loss_settings(args, loss)))
        build_params(spec, hyper)
        check_call_options(TRL, spec, without_rollout_correction(options), hyper,
                           feedable=TRL.feedable[POLICY_LOSS] - (set() if _vllm_is(args) else _LOSS_INPUTS_VLLM_IS))
        if "top_entropy_quantile" in options and getattr(args, "top_entropy_quantile", 1.0) < 1.0:
            raise StableRLError(
                f"top_entropy_quantile is set twice: TRL's top_entropy_quantile={args.top_entropy_quantile} and "
                f"stablerl_loss_params' {options['top_entropy_quantile']}; set one (TRL's also restricts its entropy "
                "bonus to the kept tokens, stablerl's masks only the policy loss)")
        agg = getattr(args, "stablerl_loss_agg_mode", "token-mean")
        if agg not in AGG_MODES:
            raise UnknownNameError(unknown_name_message("stablerl_loss_agg_mode", agg, AGG_MODES))
        # the inputs TRL feeds in this run, and those a trainer subclass declared it supplies
        check_inputs(TRL, spec, extra_inputs=check_extra_loss_inputs(getattr(args, "stablerl_extra_loss_inputs", None)),
                     feedable=loss_inputs_trl_can_feed(_vllm_is(args), routing_replay_mode(args) is not None))
        if warn and args.delta is not None and "clip_ratio_c" not in spec.defaults():
            warnings.warn(f"delta (TRL's two-sided ratio clip, a dual clip: clip_ratio_c) has no counterpart in the "
                          f"stablerl loss {loss!r}, which does not use it", UserWarning, stacklevel=3)
    estimator = check_selection(TRL, ADVANTAGE_ESTIMATOR, getattr(args, "advantage_estimator", None),
                                _params(args, "stablerl_advantage_params"), key="advantage_estimator",
                                params_key="stablerl_advantage_params")
    if estimator:  # TRL's scale_rewards: honoured or refused, never ignored; then the effective values are built
        build_params(stablerl.get_spec(ADVANTAGE_ESTIMATOR, estimator), as_params(advantage_settings(args, estimator)))
    check_rollout_correction(args, loss)
    return loss, estimator


def without_rollout_correction(options: dict) -> dict:
    """The call options of ``stablerl_loss_params`` less the rollout correction (which has its own key)."""
    return {k: v for k, v in options.items() if k not in ("rollout_correction", "rollout_correction_params")}


def rollout_correction_setting(args) -> tuple[Optional[str], dict]:
    """``(name, params)`` of the stablerl rollout correction: ``stablerl_rollout_correction(_params)`` or their alias
    in ``stablerl_loss_params`` (the verl / OpenRLHF spelling; core's :func:`dedicated_call_option`)."""
    return dedicated_call_option(TRL, ROLLOUT_CORRECTION, getattr(args, "stablerl_rollout_correction", None),
                                 _params(args, "stablerl_rollout_correction_params"),
                                 _params(args, "stablerl_loss_params"), "stablerl_loss_params")


def check_rollout_correction(args, loss: Optional[str]) -> Optional[str]:
    """The stablerl rollout correction (either spelling): a registered correction of a stablerl loss, its
    parameters valid, and TRL's own vLLM importance-sampling correction off (never two). Returns the name or None."""
    name, params = rollout_correction_setting(args)
    if name is not None and loss is None:
        raise StableRLError(f"stablerl_rollout_correction={name!r} corrects a stablerl loss; loss_type="
                            f"{args.loss_type!r} is TRL's built-in (use loss_type='{PREFIX}{args.loss_type}' if a "
                            "stablerl loss of that name is meant, or TRL's vllm_importance_sampling_correction)")
    name = check_selection(TRL, ROLLOUT_CORRECTION, name, params, key="stablerl_rollout_correction",
                           params_key="stablerl_rollout_correction_params", inputs=False)
    if name is not None and _vllm_is(args):
        raise StableRLError(f"stablerl_rollout_correction={name!r} and TRL's vllm_importance_sampling_correction=True "
                            "would correct the same mismatch twice; set vllm_importance_sampling_correction=False")
    return name


def loss_settings(args, loss: str):
    """The effective hyper-parameters of stablerl loss ``loss`` under TRL ``args``, with their sources (core's one
    precedence rule): ``stablerl_loss_params`` > TRL's ``epsilon`` / ``epsilon_high`` (relative bounds, as in TRL's
    dapo/grpo) and ``delta`` (the dual clip ``clip_ratio_c``) when set > the paper's defaults."""
    framework_values = {"clip_ratio_low": getattr(args, "epsilon", None),
                        "clip_ratio_high": getattr(args, "epsilon_high", None), "clip_ratio_c": getattr(args, "delta", None)}
    return effective_hyperparameters(TRL, stablerl.get_spec(POLICY_LOSS, loss), _params(args, "stablerl_loss_params"),
                                     framework_values)


def advantage_settings(args, estimator: str):
    """The effective hyper-parameters of stablerl estimator ``estimator`` under TRL ``args``. TRL's ``scale_rewards``
    is honoured where the estimator has a std-normalisation switch (``'none'`` -> ``norm_adv_by_std_in_grpo=False``)
    and refused where it would be ignored (``'none'`` without the switch; ``'batch'`` always)."""
    spec = stablerl.get_spec(ADVANTAGE_ESTIMATOR, estimator)
    scale = getattr(args, "scale_rewards", "group")
    scale = {True: "group", False: "none"}.get(scale, scale)
    if scale == "batch":
        raise StableRLError(
            f"scale_rewards='batch' (TRL's batch-std scaling of its own advantages) has no effect on the stablerl "
            f"advantage estimator {estimator!r}, and ignoring it would change your advantages without a word: "
            "use scale_rewards='group' (default) or 'none', or TRL's built-in advantages (no advantage_estimator)")
    aggregation = getattr(args, "multi_objective_aggregation", "sum_then_normalize")
    framework_values = {"norm_adv_by_std_in_grpo": scale != "none",
                        "form": "trl" if aggregation == "normalize_then_sum" else "verl"}
    check_framework_keys_used(TRL, spec, framework_values)
    return effective_hyperparameters(TRL, spec, _params(args, "stablerl_advantage_params"), framework_values)


# ----------------------------------------------------------------------------- shapers, filters, controllers, hooks

# config key of each extension -> its kind (its hyper-parameters: stablerl_<key>_params)
_EXT_KINDS = {"reward_shaper": REWARD_SHAPER, "batch_filter": BATCH_FILTER, "entropy_controller": CONTROLLER,
              "trainer_hook": TRAINER_HOOK}
_EXT_PARAMS_KEYS = {key: f"stablerl_{key}_params" for key in _EXT_KINDS}
# per-response inputs the user provides (reward function via TRL's log_extra, rollout_func extra field or dataset column)
_EXT_INPUTS_USER = ("correct", "flawed", "void_turn", "pos_count", "neg_count")
_EXT_HOW_TO_PROVIDE = (
    "have a reward function call TRL's log_extra({name!r}, values) with one value per completion it was given "
    "(TRL passes log_extra to every reward function), or return {name!r} from a rollout_func as an extra field "
    "(one value per completion), or give the dataset a {name!r} column"
)
_STATE_FILE = "stablerl_state.pt"
_LEGACY_STATE_FILE = "stablerl_controller.json"  # JSON of stablerl 0.1 development versions, still read
_EXT_RNG_STREAM = "reward_shaper+batch_filter"  # one generator for shapers and filters (see _ext_setup)
_EXT_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "token_type_ids",
                        "mm_token_type_ids", "image_position_ids", "spatial_shapes")


def validate_stablerl_extensions(args) -> dict[str, Optional[str]]:
    """Check ``reward_shaper`` / ``batch_filter`` / ``entropy_controller`` / ``trainer_hook`` and their parameters;
    return the names. Unknown names and hyper-parameters raise with the nearest valid one; inputs TRL cannot provide
    raise :class:`stablerl.MissingInputError` with the reason. Inputs the user's reward function must provide
    (``correct``, ``flawed``, ...) are checked at the first generation batch."""
    names = {key: check_selection(TRL, kind, getattr(args, key, None), _params(args, _EXT_PARAMS_KEYS[key]), key=key,
                                  params_key=_EXT_PARAMS_KEYS[key], inputs=kind != CONTROLLER)
             for key, kind in _EXT_KINDS.items()}
    shaper = names["reward_shaper"]
    estimator = check_selection(TRL, ADVANTAGE_ESTIMATOR, getattr(args, "advantage_estimator", None), {},
                                key="advantage_estimator", params_key="stablerl_advantage_params", inputs=False)
    if shaper and not estimator:
        raise StableRLError(
            f"reward_shaper={shaper!r} needs a stablerl advantage_estimator: TRL computes its built-in advantages "
            "inside _generate_and_score_completions from the unshaped rewards. For TRL's default advantages "
            "(scale_rewards='group') use advantage_estimator='grpo' with stablerl_advantage_params={'epsilon': 1e-4}")
    if shaper:  # the adapter always hands the estimator every reward function's reward
        check_shaper_and_components(shaper, stablerl.get_spec(ADVANTAGE_ESTIMATOR, estimator), True,
                                    "each reward function's reward, which TRL's adapter passes")
    return names


# ----------------------------------------------------------------------------- routing replay

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
    import inspect

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
    if getattr(cfg, "use_vllm", False) and bound.get("rollout_func") is None:
        raise StableRLError(_R3_VLLM_MESSAGE)


class _StablerlStateCallback(_TrainerCallback):
    """After each optimizer step: the trainer hook and the entropy controller act; at each save, the stablerl state
    (``stablerl_state.pt``) goes into the checkpoint folder (restored in ``_load_optimizer_and_scheduler``)."""

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


def _trained_mask(batch: dict) -> torch.Tensor:
    """TRL's loss mask: ``completion_mask`` x ``tool_mask`` (a batch filter's kept tokens go into ``tool_mask``)."""
    return batch["completion_mask"] if "tool_mask" not in batch else batch["completion_mask"] * batch["tool_mask"]


class GRPOTrainer(_trl.GRPOTrainer):
    """TRL's ``GRPOTrainer`` with stablerl policy losses, advantage estimators, shapers, filters, controllers, trainer
    hooks and MoE routing replay. Accepts this module's :class:`GRPOConfig` (or TRL's: stablerl fields at defaults)."""

    _rr_mode: Optional[str] = None  # routing_replay
    _ext_penalty_capture: Optional[dict] = None  # entropies of the training forward, for a controller's penalty
    _ext_shaper = _ext_filter = None  # reward_shaper / batch_filter names
    _ext_driver: Optional[ControllerDriver] = None  # the entropy controller (_ext_controller: the controller itself)
    _ext_controller: Any = None
    _ext_passes: Optional[HookPasses] = None  # the trainer hook (_ext_hook) over the passes of a generation batch
    _ext_hook: Any = None
    # optimal_token_baseline's old-pass log sum pi^2 (set in __init__; off for a trainer built without it)
    _stablerl_wants_sum_sq = False
    _ext_entropy_cache: Optional[tuple] = None  # (rollout, its entropies): one extra forward per rollout
    _stablerl_wants_entropy = False  # empg: the rollout's entropies (set in __init__)
    _stablerl_sum_sq: Optional[dict] = None

    def __init__(self, *args, **kwargs):
        _rr_check_rollout(args, kwargs)  # before TRL builds (or imports) vLLM
        super().__init__(*args, **kwargs)
        cfg = self.args
        self._rr_mode = routing_replay_mode(cfg)
        self._rr_setup()
        # a stablerl GRPOConfig was validated when it was built; a plain TRL one is validated here
        self._stablerl_loss, self._stablerl_estimator = validate_stablerl_args(cfg, warn=not isinstance(cfg, GRPOConfig))
        self._stablerl_spec = stablerl.get_spec(POLICY_LOSS, self._stablerl_loss) if self._stablerl_loss else None
        # the effective hyper-parameters (one precedence rule), printed once at start-up with their sources
        self._stablerl_loss_params, self._stablerl_call_options, self._stablerl_adv_params = {}, {}, {}
        if self._stablerl_loss:
            settings = loss_settings(cfg, self._stablerl_loss)
            log_effective_settings(TRL, self._stablerl_spec, settings)
            self._stablerl_loss_params, options = split_call_options(as_params(settings))
            self._stablerl_call_options = without_rollout_correction(options)  # the correction: its own key
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
            spec = stablerl.get_spec(ROLLOUT_CORRECTION, self._stablerl_correction)
            log_effective_settings(TRL, spec, effective_hyperparameters(TRL, spec, self._stablerl_correction_params, {}))
        needs = set(self._stablerl_spec.requires) if self._stablerl_spec else set()
        # rspo: router log-probs at the replayed experts (old pass and training forward)
        self._rr_router_lp = bool(self._rr_mode and "router_log_prob" in needs)
        # algorithm state kept across steps, per trainer (several may share a process), saved in TRL's checkpoints
        self._stablerl_store = StateStore(holds="trainer")
        self._stablerl_capture: Optional[dict] = None  # log-probs / entropies of TRL's forward in _compute_loss
        self._stablerl_rewards: Optional[torch.Tensor] = None
        self._stablerl_needs_rows = bool(needs & {"index", "scores"})
        # erc: the old-log-prob pass also computes entropies (only then); its sink while a batch is generated
        self._stablerl_wants_old_entropy = "old_entropy" in needs
        self._stablerl_old_entropy: Optional[dict] = None
        # optimal_token_baseline: the old-log-prob pass's log-probs and sum_pi_squared, from TRL's fused LM head
        estimator_needs = stablerl.get_spec(ADVANTAGE_ESTIMATOR, self._stablerl_estimator).requires \
            if self._stablerl_estimator else ()
        self._stablerl_wants_sum_sq = "sum_pi_squared" in estimator_needs
        self._stablerl_wants_entropy = "entropy" in estimator_needs  # empg: the generating policy's entropies
        self._stablerl_sum_sq: Optional[dict] = None  # its sink while a batch is generated
        if self._stablerl_wants_sum_sq:
            self._stablerl_add_sum_sq_output()
        per_process = cfg.per_device_train_batch_size * cfg.steps_per_generation
        if "index" in needs and (cfg.steps_per_generation > 1 or per_process % cfg.num_generations):
            warnings.warn(
                f"policy loss {self._stablerl_loss!r} uses prompt groups, but TRL shuffles the generation batch "
                f"and splits it into steps_per_generation={cfg.steps_per_generation} micro-batches (and "
                f"{per_process} rows per process for groups of {cfg.num_generations}), so the loss sees partial "
                "groups. For whole groups use steps_per_generation=1 (gradient_accumulation_steps=1) and a "
                "per_device_train_batch_size divisible by num_generations.", UserWarning, stacklevel=2)
        self._ext_setup()

    # -- shared ----------------------------------------------------------------------------

    def _mode(self) -> str:
        return "train" if self.model.training else "eval"

    def _stablerl_context(self, inputs: dict, rows: int, mode: str, **kwargs) -> "stablerl.Context":
        """A loss-side Context: the tokens (``token_count``) and sequences (``seq_count``) of the accumulation window
        over every process, and an all-reduce across them."""
        n = self.accelerator.num_processes
        ga = self.current_gradient_accumulation_steps if mode == "train" else 1
        token_count = inputs["num_items_in_batch"].to(torch.float32)  # tokens of the generation batch, all processes
        if mode == "train":  # the generation batch spans steps_per_generation micro-batches
            token_count = token_count * ga / self.args.steps_per_generation
        common = dict(step=int(self.state.global_step), total_steps=int(self.state.max_steps or 0) or None,
                      token_count=token_count, seq_count=rows * n * ga, **kwargs)
        if n > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            return stablerl.torch_distributed_context(dp_size=n, **common)
        return stablerl.Context(dp_size=n, **common)

    def _stablerl_log(self, mode: str, metrics: dict, prefix: str = "stablerl/", gathered: bool = False) -> None:
        """Log ``metrics`` as ``prefix + key``, averaged over processes unless ``gathered`` (the same everywhere)."""
        if not metrics:
            return
        values = [float(v) for v in metrics.values()]
        if not gathered:
            local = torch.tensor(values, dtype=torch.float32, device=self.accelerator.device)
            values = self.accelerator.gather(local).view(-1, len(metrics)).mean(0).tolist()
        for key, value in zip(metrics, values):
            self._metrics[mode][prefix + key].append(value)

    # -- routing replay (routing_replay="R2" / "R3"; the mechanics are stablerl.routing_replay's) ---------

    def _rr_setup(self) -> None:
        self._rr_gen = None  # (per-sequence Routes of the last rollout, prompt lengths)
        self._rr_rollout: Optional[dict] = None  # state while a generation batch is scored
        self._rr_current: Optional[rr.Routes] = None  # routes of the micro-batch in compute_loss
        self._rr_handles: list = []  # replays kept on until after backward
        if self._rr_mode is None:
            return
        routers = rr.require_routers(self.accelerator.unwrap_model(self.model), needed_by=f"routing_replay={self._rr_mode!r}")
        self._rr_num_experts = max(r.num_experts for r in routers)
        self._rr_layer_ids = tuple(r.layer_id for r in routers)
        if self._rr_mode == "R3" and self.tools:
            raise StableRLError("routing_replay='R3' does not support tool calling (multi-turn generation splits the "
                                "rollout into several generate calls); use routing_replay='R2'")

    def _rr_release(self) -> None:
        for handle in self._rr_handles:
            handle.remove()
        self._rr_handles.clear()

    def _rr_routes(self, indices: torch.Tensor, valid: Optional[torch.Tensor] = None) -> rr.Routes:
        return rr.Routes.from_batch_tensor(indices, num_experts=self._rr_num_experts, layer_ids=self._rr_layer_ids,
                                           valid=valid)

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
        old_pass = self._trl_runs_old_pass()  # R2 records there
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
        """Run ``fn`` (TRL's chunked forward) with ``routes`` replayed, each chunk getting its rows; kept until after
        backward when ``keep`` (gradient checkpointing re-runs the routers there: released in training_step)."""
        target = self.accelerator.unwrap_model(model)
        handle = rr.replay(target, None)
        out = rr.replay_row_chunks(handle, target, routes, input_ids.shape, fn, keep=keep)
        if keep:
            self._rr_handles.append(handle)
        return out

    def _rr_recording(self, fn, model, logits_to_keep, record_routes: bool, lp_sink: Optional[dict]):
        """``fn`` under a capture: R2's routes (into the rollout state) and/or, for rspo, the router log-probs
        at the experts used, ``[B, C, L, k]`` at the positions that predict the completion tokens."""
        target = self.accelerator.unwrap_model(model)
        state = self._rr_rollout

        def run():
            with rr.capture(target, record_log_probs=lp_sink is not None) as cap:
                out = fn()
            if record_routes:  # one part per TRL chunk
                state["routes"] = self._rr_routes(torch.cat([r.batch_tensor()[0] for r in cap.routes_list()]))
            if lp_sink is not None:
                lp = torch.cat(cap.log_probs_list(device=self.accelerator.device, batch_first=True))
                lp_sink["router_log_prob"] = lp[:, lp.size(1) - logits_to_keep - 1: lp.size(1) - 1]
            return out

        return run

    def _rr_logps(self, fn, model, input_ids, logits_to_keep):
        state = self._rr_rollout
        if state is None:  # a training (or eval) forward
            return fn() if self._rr_current is None else self._rr_forward(model, self._rr_current, input_ids, fn,
                                                                           keep=torch.is_grad_enabled())
        # the old / ref log-prob passes of a fresh generation batch
        routes = self._rr_rollout_routes(input_ids.size(1) - logits_to_keep, logits_to_keep)
        if state["old"] and self.accelerator.unwrap_model(model) is self.accelerator.unwrap_model(self.model):
            state["old"] = False  # TRL's old-log-prob pass comes first (the ref pass, also of the PEFT policy, after it)
            record = routes is None and state["record"]  # R2
            if record or self._rr_router_lp:
                fn = self._rr_recording(fn, model, logits_to_keep, record,
                                        state["router_lp"] if self._rr_router_lp else None)
        return fn() if routes is None else self._rr_forward(model, routes, input_ids, fn, keep=False)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._rr_mode is None:
            return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        self._rr_release()
        t = inputs.get("stablerl_routes")
        routes = None if t is None else self._rr_routes(t, inputs.get("stablerl_routes_valid"))
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
        self._ext_hook_before_pass()
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._rr_release()  # after backward (nothing to release without routing replay)

    # -- reward shapers, batch filters, entropy controllers, trainer hooks (driven by the specs) ---------

    def _ext_setup(self) -> None:
        cfg = self.args
        names = validate_stablerl_extensions(cfg)
        self._ext_shaper, self._ext_filter = names["reward_shaper"], names["batch_filter"]
        self._ext_params = {key: _params(cfg, pk) for key, pk in _EXT_PARAMS_KEYS.items()}
        self._ext_inputs: Optional[dict] = None
        # one generator for shapers/filters, seeded alike on every process (they run on the gathered batch,
        # so every process draws the same numbers); saved with the checkpoint
        self._ext_rng = self._stablerl_store.generator(_EXT_RNG_STREAM, int(cfg.seed))
        self._ext_entropy_seen: tuple = (None, 0)
        self._ext_step_entropy_cache: tuple = (None, None)
        name = names["entropy_controller"]
        if name:
            if name == "adaptive_entropy" and (getattr(cfg, "use_adaptive_entropy", False) or getattr(cfg, "entropy_coef", 0.0)):
                raise StableRLError(
                    "entropy_controller='adaptive_entropy' adds its own entropy bonus: leave TRL's use_adaptive_entropy "
                    "False and entropy_coef 0 (set the initial coefficient in stablerl_entropy_controller_params)")
            self._ext_driver = ControllerDriver(name, self._ext_params["entropy_controller"], apply=self._ext_apply,
                                                provides=("entropy", "turn_entropy"), framework="TRL",
                                                gives="TRL gives the mean entropy of each optimizer step")
            self._ext_controller = self._ext_driver.controller
            self._stablerl_store.track(CONTROLLER, name, self._ext_driver)
            if self._ext_driver.per_turn:
                warnings.warn(
                    f"entropy_controller {name!r} works per turn; TRL's GRPOTrainer has no turn ids, so every sample is "
                    "turn 0 and the controller keeps one entropy history (for epo: its penalty applies only to turns >= "
                    "max_steps/2, so with turn 0 it stays 0 -- epo is meant for multi-turn agent loops)",
                    UserWarning, stacklevel=3)
        self._ext_hook_name = names["trainer_hook"]
        if self._ext_hook_name:
            self._ext_passes = HookPasses(self._ext_hook_name, self._ext_params["trainer_hook"])
            self._ext_hook = self._ext_passes.hook
            self._ext_hook_check(self._ext_hook.passes_per_batch())
            self._stablerl_store.track(TRAINER_HOOK, self._ext_hook_name, self._ext_hook)
        if any(x is not None for x in (self._ext_driver, self._stablerl_loss, self._stablerl_estimator, self._ext_shaper,
                                       self._ext_filter, self._ext_passes)):
            self.add_callback(_StablerlStateCallback(self))

    def _ext_gather_user_inputs(self, inputs) -> dict[str, Any]:
        """Per-completion user inputs (``correct``, ...) of every process, in TRL's row order: what reward functions
        passed to TRL's ``log_extra(name, values)``, else the rows' fields. Every process joins every gather."""
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

    def _ext_extras(self, spec, gathered_mask: Optional[torch.Tensor]) -> dict[str, Any]:
        """``spec``'s per-response extras: ``lengths`` (of the loss mask) and every user input given."""
        user = self._ext_inputs or {}
        required = declared_inputs(
            spec, lambda name: gathered_mask.sum(-1).to(torch.float64) if name == "lengths" else user.get(name),
            lambda name: _EXT_HOW_TO_PROVIDE.format(name=name), skip=("index", "scores", "entropy"))
        return {**user, **required}

    def _ext_gathered(self, local: torch.Tensor, device=None) -> torch.Tensor:
        """``[n, T]`` of this process -> ``[N, T_max]`` of every process (TRL's row order), float."""
        return self.accelerator.gather(self.accelerator.pad_across_processes(local.float(), dim=1, pad_index=0)).to(device)

    def _ext_ctx(self, kind: str, name: str) -> "stablerl.Context":
        return stablerl.Context(step=int(self.state.global_step), total_steps=int(self.state.max_steps or 0) or None,
                                generator=self._ext_rng, state=self._stablerl_store.slot(kind, name))

    def _ext_shape(self, out, rewards, group, mode):
        name = self._ext_shaper
        spec = stablerl.get_spec(REWARD_SHAPER, name)
        mask = self._ext_gathered(_trained_mask(out), rewards.device) if "lengths" in spec.requires else None
        shaped, metrics = stablerl.shape_rewards(name, scores=rewards, index=group, ctx=self._ext_ctx(REWARD_SHAPER, name),
                                                 **self._ext_extras(spec, mask), **self._ext_params["reward_shaper"])
        self._stablerl_log(mode, {**metrics, "shaped_reward/mean": shaped.float().mean().item()}, gathered=True)
        return shaped.to(rewards.dtype)

    def _ext_rollout_forward(self, out, mode, needed_by: str, compute_entropy: bool = False):
        """TRL's ``(logps, entropies, aux)`` ``[n, T]`` of the generating policy on this process's rollout (TRL's
        temperature, native MoE routing): one extra no-grad forward, for text-only batches."""
        multimodal = [k for k in _EXT_MULTIMODAL_KEYS if k in out]
        if multimodal:
            raise StableRLError(f"{needed_by} needs an extra forward pass over the rollout, which stablerl runs for "
                                f"text-only batches; this batch has {multimodal}")
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        bs = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        with torch.no_grad():
            return _trl.GRPOTrainer._get_per_token_logps_and_entropies(
                self, self.model, ids, attention, out["completion_ids"].size(1), batch_size=bs,
                compute_entropy=compute_entropy)

    def _ext_rollout_entropy(self, out, mode) -> torch.Tensor:
        """Per-token entropies ``[n, T]`` of the generating policy (TRL computes entropies only in ``_compute_loss``):
        one extra forward per rollout, shared by an estimator (empg) and a batch filter that both read them."""
        cached = self._ext_entropy_cache
        if cached is not None and cached[0] is out:
            return cached[1]
        readers = [f"advantage_estimator={self._stablerl_estimator!r}"] if self._stablerl_wants_entropy else []
        if self._ext_filter and "entropy" in stablerl.get_spec(BATCH_FILTER, self._ext_filter).requires:
            readers.append(f"batch_filter={self._ext_filter!r}")
        entropy = self._ext_rollout_forward(out, mode, " and ".join(readers) + " (the rollout's entropies)",
                                            compute_entropy=True)[1]
        self._ext_entropy_cache = (out, entropy)
        return entropy

    def _ext_filter_batch(self, out, rewards, group, rows, mode):
        """Apply the batch filter on the gathered batch (core's ``apply_filter_result``); TRL's batch is fixed, so
        dropped rows and tokens get advantage 0 and loss mask 0 (``tool_mask``, which multiplies ``completion_mask``
        in the loss only: attention is unchanged), and ``num_items_in_batch`` becomes the kept tokens."""
        name = self._ext_filter
        spec = stablerl.get_spec(BATCH_FILTER, name)
        local_adv = out["advantages"]
        width = out["completion_ids"].size(1)
        gmask = self._ext_gathered(_trained_mask(out), rewards.device)
        one_d = local_adv.dim() == 1  # TRL's own advantages: one per completion
        if one_d:
            gadv_rows = self.accelerator.gather(local_adv.float()).to(rewards.device)
            gadv = gadv_rows.unsqueeze(-1) * gmask
        else:
            gadv = self._ext_gathered(local_adv, rewards.device) * gmask
        entropy = self._ext_gathered(self._ext_rollout_entropy(out, mode), rewards.device) \
            if "entropy" in spec.requires else None
        result = stablerl.filter_batch(name, advantages=gadv, response_mask=gmask, index=group, scores=rewards.float(),
                                       entropy=entropy, ctx=self._ext_ctx(BATCH_FILTER, name),
                                       **self._ext_extras(spec, gmask), **self._ext_params["batch_filter"])
        filtered = apply_filter_result(
            result, gmask, gadv, selected_by=f"batch_filter={name!r}",
            why_no_resampling="TRL's generation batch has a fixed size and layout (each process's slice, split into "
            "micro-batches), so only filters that keep or drop rows can run in TRL (shuffle_r1: use shuffle=False "
            "for its pairwise sampling alone)")
        if one_d and result.advantages is None:
            new_rows = torch.where(filtered.dropped, torch.zeros_like(gadv_rows), gadv_rows)
            out["advantages"] = new_rows[rows].to(local_adv.dtype).contiguous()
        else:
            out["advantages"] = filtered.advantages[rows, :width].to(torch.float32).contiguous()
        keep = filtered.response_mask[rows, :width].to(out["completion_mask"].device, out["completion_mask"].dtype)
        out["tool_mask"] = keep if "tool_mask" not in out else out["tool_mask"] * keep
        old_items = out["num_items_in_batch"]
        out["num_items_in_batch"] = filtered.response_mask.sum().clamp(min=1).to(old_items.device, old_items.dtype)
        self._stablerl_log(mode, filtered.metrics, gathered=True)
        return out

    def _ext_apply(self, decision: dict[str, Any]) -> None:
        """A controller's ``temperature`` decision sets the sampling temperature of the next generations (not TRL's
        ``self.temperature``, which scales the logits of every log-prob pass: AEPO computes log-probs at the training
        temperature)."""
        if decision.get("temperature") is None:
            return
        temperature = float(decision["temperature"])
        if self.use_vllm:
            self.vllm_generation.temperature = temperature
        if getattr(self, "generation_config", None) is not None:
            self.generation_config.temperature = temperature
        if isinstance(getattr(self, "generation_kwargs", None), dict):
            self.generation_kwargs["temperature"] = temperature

    def _ext_controller_step(self) -> None:
        """Once per optimizer step, with TRL's mean entropy of the step (the same on every process)."""
        if self._ext_driver is None:
            return
        entropy = self._ext_step_entropy()
        metrics = self._ext_driver.step(entropy=entropy, turn_entropy=[float("nan") if entropy is None else entropy])
        self._stablerl_log("train", metrics, prefix=f"stablerl/{self._ext_driver.name}/", gathered=True)

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
        passes = self._ext_passes
        if passes is None or not self.model.training or passes.pass_index is not None:
            return
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every != 0:
            raise StableRLError(f"trainer_hook={self._ext_hook_name!r}: a generation batch starts at micro-step "
                                f"{self._step}, not a multiple of {generate_every} (resumed mid-batch?)")
        passes.before_pass(self._ext_params_view(), passes=self.num_iterations)

    def _ext_hook_after_pass(self) -> None:
        """After each optimizer step (one pass over the generation batch); after a batch's last pass, the hook's
        passes per batch become TRL's num_iterations."""
        passes = self._ext_passes
        if passes is None or passes.pass_index is None:
            return
        metrics = passes.after_pass(self._ext_params_view(), entropy=self._ext_step_entropy())
        self._stablerl_log("train", metrics, prefix=f"stablerl/{self._ext_hook_name}/", gathered=True)
        if passes.pass_index is None:
            # e.g. sfpo after its stop rule: one pass per batch from now on. TRL's sampler still repeats each
            # prompt batch for the num_iterations it was built with, so each repeat is generated afresh.
            self.num_iterations = self._ext_hook.passes_per_batch()

    def _ext_loss_with_penalty(self, model, inputs):
        """The loss plus the controller's term (EPO) on the training forward's entropies (token-mean, dapo's norm)."""
        self._ext_penalty_capture = {}
        try:
            loss = self._compute_loss(model, inputs)
            entropies = self._ext_penalty_capture.get("entropies")
        finally:
            self._ext_penalty_capture = None
        if entropies is None:
            return loss
        mode = self._mode()
        term, metrics = self._ext_driver.loss_term(entropies, _trained_mask(inputs),
                                                   self._stablerl_context(inputs, entropies.size(0), mode))
        self._stablerl_log(mode, metrics)
        return loss + term

    # -- checkpointed state: the controller, every ctx.state dict, the shapers/filters' generator -----

    def stablerl_state_dict(self) -> dict[str, Any]:
        """What :meth:`save_stablerl_state` writes (``StateStore.state_dict()``): the same on every process."""
        return self._stablerl_store.state_dict()

    def load_stablerl_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") == LEGACY_FORMAT:  # stablerl_controller.json of earlier development versions
            state = from_legacy_json(state, "trainer", (_EXT_RNG_STREAM, int(self.args.seed)))
        self._stablerl_store.load_state_dict(state, where="the checkpoint's " + _STATE_FILE)
        self._ext_rng = self._stablerl_store.generator(_EXT_RNG_STREAM, int(self.args.seed))

    def save_stablerl_state(self, folder: str) -> str:
        return self._stablerl_store.save(os.path.join(folder, _STATE_FILE))

    def load_stablerl_state(self, folder: str) -> bool:
        """Restore from ``folder``/stablerl_state.pt (or stablerl_controller.json); False when it has neither."""
        for name in (_STATE_FILE, _LEGACY_STATE_FILE):
            state = read_state(os.path.join(folder, name), map_location="cpu")
            if state is not None:
                self.load_stablerl_state_dict(state)
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
        # old_entropy (erc): TRL's old-log-prob pass, where TRL runs one, also computes entropies; they travel with
        # their rows as stablerl_old_entropy (without that pass the loss takes the current entropy, as TRL's logps)
        sink = {"armed": True} if self._stablerl_wants_old_entropy and self._trl_runs_old_pass() else None
        self._stablerl_old_entropy = sink
        # optimal_token_baseline: TRL's old-log-prob pass, where TRL runs one, also records log sum pi^2
        sum_sq = {"armed": True, "chunks": []} if self._stablerl_wants_sum_sq and self._trl_runs_old_pass() else None
        self._stablerl_sum_sq = sum_sq
        try:
            if self._rr_mode is None:
                out = super()._generate_and_score_completions(inputs)
            else:
                out = self._rr_generate_and_score(inputs)
        finally:
            self._stablerl_old_entropy = None
            self._stablerl_sum_sq = None
        if sink is not None:
            if sink.get("entropies") is None:
                raise StableRLError(f"policy loss {self._stablerl_loss!r} needs the old-log-prob pass's entropies, "
                                    "but TRL's old-log-prob pass did not run through _get_per_token_logps_and_entropies")
            out["stablerl_old_entropy"] = sink["entropies"]
        rewards_per_func, self._stablerl_rewards = self._stablerl_rewards, None
        if not (self._stablerl_estimator or self._stablerl_needs_rows or self._ext_filter):
            return out
        mode = self._mode()
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
            old_pass = self._stablerl_old_pass_stats(out, sum_sq, mode) if self._stablerl_wants_sum_sq else {}
            if self._stablerl_wants_entropy:
                old_pass["entropy"] = self._ext_rollout_entropy(out, mode)
            out["advantages"] = self._stablerl_advantages(out, rewards, unscorable, group, rows, mode,
                                                          components=rewards_per_func, old_pass=old_pass)
        if self._ext_filter:
            out = self._ext_filter_batch(out, rewards, group, rows, mode)
        self._ext_inputs = None
        self._ext_entropy_cache = None
        return out

    def _stablerl_old_pass_stats(self, out, sink: Optional[dict], mode) -> dict[str, torch.Tensor]:
        """``old_log_prob`` and ``sum_pi_squared`` ``[n, T]`` of this process's rollout, from one forward of the policy
        through TRL's fused LM head: TRL's old-log-prob pass where TRL runs one (``sink``: recorded there), else one
        extra no-grad forward (the current policy, which is the one that generated the batch)."""
        if sink is not None:
            if not sink["chunks"] or out.get("old_per_token_logps") is None:
                raise StableRLError(f"advantage estimator {self._stablerl_estimator!r} needs the old-log-prob pass's "
                                    "sum_pi_squared, but TRL's old-log-prob pass did not run through "
                                    "_get_per_token_logps_and_entropies")
            old = out["old_per_token_logps"]
        else:
            sink = {"chunks": []}
            with self._stablerl_recording_sum_sq(sink, out["completion_ids"].size(1)):
                old = self._ext_rollout_forward(
                    out, mode, f"advantage_estimator={self._stablerl_estimator!r} (old_log_prob and sum_pi_squared)")[0]
        sum_sq = torch.cat(sink["chunks"]).exp()
        if sum_sq.shape != old.shape:
            raise StableRLError(f"sum_pi_squared of shape {tuple(sum_sq.shape)} for old log-probs of shape "
                                f"{tuple(old.shape)}: TRL's fused LM head returned another layout")
        return {"old_log_prob": old.detach(), "sum_pi_squared": sum_sq}

    def _stablerl_fused_head_model(self):
        """The model TRL's ``add_fused_lm_head`` patched (the base model of a PEFT policy)."""
        return self.model.get_base_model() if _is_peft_model(self.model) else self.model

    def _stablerl_add_sum_sq_output(self) -> None:
        """TRL's fused LM head on the policy again (as ``GRPOTrainer.__init__`` adds it: TRL's temperature and
        ``cast_lm_head_to_fp32``), with TRL's ``log_sum_sq_probs`` output (log sum_v pi(v)^2 of each scored token)
        besides log-probs and entropies; the new head replaces the fused path, the model's own forward is kept."""
        _add_fused_lm_head(self._stablerl_fused_head_model(), temperature=self.temperature,
                           cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32,
                           outputs=("log_probs", "entropy", "log_sum_sq_probs"))

    @contextlib.contextmanager
    def _stablerl_recording_sum_sq(self, sink: dict, logits_to_keep: int):
        """While open, every fused-head forward of the policy appends its ``log_sum_sq_probs`` (sliced as TRL slices
        its log-probs) to ``sink["chunks"]``, in TRL's chunk order."""
        model = self._stablerl_fused_head_model()
        fused = model.__dict__.get("forward")
        if fused is None:
            raise StableRLError("the policy has no fused LM head (TRL's add_fused_lm_head): sum_pi_squared needs it")

        def recording(*args, **kwargs):
            output = fused(*args, **kwargs)
            if kwargs.get("fused_lm_head"):
                sink["chunks"].append(output.log_sum_sq_probs[:, -logits_to_keep:].detach())
            return output

        model.forward = recording
        try:
            yield
        finally:
            model.forward = fused

    def _stablerl_advantages(self, out, rewards, unscorable, group, rows, mode, components=None, old_pass=None):
        """stablerl advantages ``[n_local, T_local]``: core's ``advantages_from_scores`` on the gathered rewards and
        every process's masks (real lengths), sliced as TRL slices its own. ``components``: each reward function's
        reward ``[N, n_funcs]``, handed over with TRL's ``reward_weights`` (GDPO). ``old_pass``: ``old_log_prob`` /
        ``sum_pi_squared`` / ``entropy`` ``[n_local, T_local]``, gathered like the masks."""
        local_mask = out["completion_mask"]
        mask = self._ext_gathered(local_mask, rewards.device)
        inputs = {k: self._ext_gathered(v, rewards.device) * mask for k, v in (old_pass or {}).items()}
        extras = None if components is None else {"reward_components": components.to(mask.device),
                                                  "reward_weights": self.reward_weights.to(mask.device)}
        name = self._stablerl_estimator
        ctx = stablerl.Context(step=int(self.state.global_step), state=self._stablerl_store.slot(ADVANTAGE_ESTIMATOR, name))
        adv, metrics = advantages_from_scores(name, rewards, mask, group, unscorable=unscorable, ctx=ctx, extras=extras,
                                              **inputs, **self._stablerl_adv_params)
        self._stablerl_log(mode, metrics, gathered=True)
        return adv[rows, : local_mask.size(1)].contiguous()

    # -- loss ------------------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        old_entropy, sum_sq = self._stablerl_old_entropy, self._stablerl_sum_sq
        # TRL's old-log-prob pass is the first pass of the policy while a batch is generated (the ref pass of a
        # PEFT policy comes after it); it asks for no entropies: for erc it computes them too
        old_pass = not kwargs.get("compute_entropy") and \
            self.accelerator.unwrap_model(model) is self.accelerator.unwrap_model(self.model)
        record_old_entropy = bool(old_entropy and old_entropy["armed"] and old_pass)
        if record_old_entropy:
            old_entropy["armed"] = False
            kwargs["compute_entropy"] = True
        fn = functools.partial(super()._get_per_token_logps_and_entropies, model, input_ids, attention_mask,
                               logits_to_keep, *args, **kwargs)
        if sum_sq and sum_sq["armed"] and old_pass:  # optimal_token_baseline: log sum pi^2 of the same forward
            sum_sq["armed"] = False
            fn = functools.partial(self._stablerl_with_sum_sq, fn, sum_sq, logits_to_keep)
        if self._rr_mode is None:
            out = fn()
        else:
            if self._rr_router_lp and self._stablerl_capture is not None and kwargs.get("compute_entropy"):
                fn = self._rr_recording(fn, model, logits_to_keep, False, self._stablerl_capture)
            out = self._rr_logps(fn, model, input_ids, logits_to_keep)
        if record_old_entropy:
            old_entropy["entropies"] = out[1].detach()
        if kwargs.get("compute_entropy"):  # the training forward inside _compute_loss
            for sink in (self._stablerl_capture, self._ext_penalty_capture):
                if sink is not None:
                    sink["logps"], sink["entropies"] = out[0], out[1]
        return out

    def _stablerl_with_sum_sq(self, fn, sink: dict, logits_to_keep: int):
        sink["chunks"] = []  # the last run's (a replayed forward runs once; kept exact if one ever re-ran)
        with self._stablerl_recording_sum_sq(sink, logits_to_keep):
            return fn()

    def _compute_loss(self, model, inputs):
        if self._ext_driver is not None and self._ext_driver.penalty is not None and self._ext_penalty_capture is None:
            return self._ext_loss_with_penalty(model, inputs)
        if self._stablerl_loss is None:
            return super()._compute_loss(model, inputs)
        mode = self._mode()
        metrics = self._metrics[mode]
        before = {k: len(metrics[k]) for k in _HOST_CLIP_METRICS if k in metrics}
        policy_loss_logged = len(metrics["policy_loss"]) if "policy_loss" in metrics else 0
        # TRL's own _compute_loss with zero advantages: its policy term is exactly 0, everything around it is TRL's.
        # Not core's loss_inputs channel: TRL's loss types are a string switch, so the adapter calls the stablerl loss
        # itself; only TRL's log-probs / entropies cross TRL's method boundary (_get_per_token_logps_and_entropies).
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
        """Extension point: ``{name: value}`` for the names in ``stablerl_extra_loss_inputs`` (``[B, C]`` tensors like
        ``log_prob``, or scalars); ``inputs``: TRL's micro-batch dict. See docs/trl.md. Default: nothing."""
        return {}

    def _stablerl_supplied_inputs(self, inputs, logps) -> dict[str, Any]:
        declared = check_extra_loss_inputs(getattr(self.args, "stablerl_extra_loss_inputs", None))
        if not declared:
            return {}
        return check_supplied_inputs(self._stablerl_spec, declared, dict(self.stablerl_loss_inputs(inputs, logps) or {}),
                                     declared_in="stablerl_extra_loss_inputs", supplied_by="stablerl_loss_inputs")

    def _stablerl_policy_loss(self, inputs, logps, entropies, mode, router_log_prob=None):
        spec = self._stablerl_spec
        mask = _trained_mask(inputs)
        valid = mask.bool()  # what core reads: a bool mask costs it no cast and no compare
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        sampling = inputs.get("sampling_per_token_logps")
        supplied = self._stablerl_supplied_inputs(inputs, logps)

        # TRL's per-token multipliers, in TRL's order: off-policy sequence mask, entropy mask, vLLM IS ratio
        weights = []
        if self.off_policy_mask_threshold is not None or self.top_entropy_quantile < 1.0:
            mask = mask.to(logps.dtype)  # TRL's own masks take a float mask (a cast only when one is on)
        if self.off_policy_mask_threshold is not None:
            weights.append(self.get_off_policy_mask(
                advantages=advantages, per_token_logps=logps, sampling_per_token_logps=old if sampling is None else sampling,
                mask=mask, off_policy_threshold=self.off_policy_mask_threshold))
        if self.top_entropy_quantile < 1.0:
            weights.append(self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile).to(logps.dtype))
        use_vllm_is = bool(self.use_vllm and self.vllm_importance_sampling_correction)
        rollout_log_prob = None
        if self._stablerl_correction or (use_vllm_is and "rollout_log_prob" in spec.requires):
            # the algorithm corrects for the sampler itself (like TRL's vespo): the sampler's log-probs, where NaN (a
            # token vLLM did not score) means no mismatch; TRL's ratio is not applied on top (one correction, never two)
            if sampling is None:
                raise StableRLError(f"stablerl_rollout_correction={self._stablerl_correction!r}: this batch has no "
                                    "sampling log-probs (the rollout_func returned no logprobs?)")
            unscored = old if use_vllm_is else supplied.get("old_log_prob", old)
            rollout_log_prob = torch.where(torch.isnan(sampling), unscored, sampling)
        elif use_vllm_is:
            weights.append(inputs["importance_sampling_ratio"])
        is_weights = functools.reduce(lambda a, w: a * w.to(logps.dtype), weights, torch.ones_like(logps)).detach() \
            if weights else None

        old = supplied.pop("old_log_prob", old)
        rollout_log_prob = supplied.pop("rollout_log_prob", rollout_log_prob)
        extra: dict[str, Any] = dict(supplied)
        if self._stablerl_correction:
            extra["rollout_correction"] = self._stablerl_correction
            if self._stablerl_correction_params:
                extra["rollout_correction_params"] = self._stablerl_correction_params
        if "old_entropy" in spec.requires:
            # TRL's old-log-prob pass's entropies; without that pass old == current, as for TRL's old log-probs
            old_entropy = inputs.get("stablerl_old_entropy")
            extra["old_entropy"] = entropies.detach() if old_entropy is None else old_entropy
        for name, key in (("token_ids", "completion_ids"), ("index", "stablerl_index"), ("scores", "stablerl_scores")):
            if name in spec.requires:
                extra[name] = inputs[key]
        if "router_log_prob" in spec.requires:
            if router_log_prob is None:
                raise StableRLError(f"policy loss {self._stablerl_loss!r} needs router log-probs: set routing_replay")
            old_router = inputs.get("stablerl_old_router_log_prob")
            extra["router_log_prob"] = router_log_prob
            # no old-log-prob pass (TRL trains each micro-batch once, at theta_old): old == current, like TRL's logps
            extra["old_router_log_prob"] = router_log_prob if old_router is None else old_router.to(router_log_prob.device)
        ctx = self._stablerl_context(inputs, logps.size(0), mode, loss_scale_factor=float(self.max_completion_length),
                                     state=self._stablerl_store.slot(POLICY_LOSS, self._stablerl_loss))
        loss, metrics = stablerl.compute_policy_loss(
            self._stablerl_loss, log_prob=logps, old_log_prob=old, advantages=advantages.expand_as(logps),
            response_mask=valid, rollout_log_prob=rollout_log_prob,
            # only to a loss that reads it (or masks by it: stablerl_loss_params' top_entropy_quantile < 1), so the
            # others skip core's clean-up pass over it
            entropy=entropies if "entropy" in spec.reads or top_entropy_on(self._stablerl_call_options) else None,
            ctx=ctx, is_weights=is_weights, **extra,
            # stablerl_loss_agg_mode, unless stablerl_loss_params names a registered aggregation (delta_l)
            **{"loss_agg_mode": self._stablerl_agg_mode, **self._stablerl_call_options}, **self._stablerl_loss_params)
        self._stablerl_log(mode, metrics)
        # for TRL's `policy_loss` metric, in the host loss type's convention (dapo: as is; others: before /GA)
        ga = self.current_gradient_accumulation_steps if mode == "train" else 1
        return loss, loss.detach() * (1 if self._stablerl_agg_mode == "token-mean" else ga)


__all__ = ["GRPOConfig", "GRPOTrainer", "SUPPORTED_TRL", "TRL_LOSS_TYPES",
           "UnsupportedTRLVersionError", "check_trl", "instrument", "resolve_loss_type", "routing_replay_mode",
           "validate_stablerl_args", "validate_stablerl_extensions", "uninstrument"]
