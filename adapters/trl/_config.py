"""TRL's config: ``GRPOConfig`` with stablerl's selections, and their checks (names, hyper-parameters, the inputs
TRL feeds in a run). Core decides (``stablerl.frameworks``: one name rule, one precedence rule); this module reads
TRL's keys. Importing it checks the installed TRL (:class:`~stablerl.adapters.trl._adapter.TRLAdapter`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import stablerl
from stablerl import routing_replay as rr
from stablerl.algorithm_selection import AlgorithmSelection
from stablerl.contracts import (ADVANTAGE_ESTIMATOR, BATCH_FILTER, CONTROLLER, OPTIONAL_INPUTS, POLICY_LOSS,
                                REWARD_SHAPER, ROLLOUT_CORRECTION, TRAINER_HOOK)
from stablerl.frameworks import (as_params, check_call_options, check_framework_keys_used, check_inputs,
                                 check_selection, check_shaper_and_components, dedicated_call_option,
                                 effective_hyperparameters, get_framework, resolve, split_call_options)
from stablerl.ops import AGG_MODES
from stablerl.params import StableRLError, UnknownNameError, build_params, params_dict, unknown_name_message

from ._adapter import TRLAdapter

TRLAdapter().instrument()  # the installed TRL's version and private signatures, before anything uses TRL

import trl as _trl  # noqa: E402

# TRL's own trainer class, bound once at import: a script may later set trl.GRPOTrainer to stablerl's subclass,
# and every call of TRL's method (the extra forward, the R3 check of __init__'s arguments) must still reach TRL's
TRL_GRPOTrainer = _trl.GRPOTrainer

TRL = get_framework("trl")  # TRL's facts (built-in names, feedable inputs, keys): ._spec
SUPPORTED_TRL = TRL.supported
TRL_LOSS_TYPES = tuple(sorted(TRL.builtin_names[POLICY_LOSS]))
PREFIX = TRL.prefix


# ----------------------------------------------------------------------------- names and inputs


def resolve_loss_type(loss_type: str) -> Optional[str]:
    """The stablerl policy loss ``loss_type`` selects, or None for a TRL built-in (core's one name rule; the inputs
    are checked per run in :func:`validate_stablerl_args`). Unknown names raise naming the nearest valid one."""
    return resolve(TRL, POLICY_LOSS, loss_type, inputs=False)


def loss_inputs_trl_can_feed(use_vllm_is: bool, routing_replay: bool = False, own_generation: bool = False) -> set[str]:
    """The policy-loss inputs TRL feeds in a run: its providers' (the declaration lists all), less the conditional
    ones whose setting is off (vLLM IS correction, or ``own_generation`` (use_vllm=False): the behaviour log-probs;
    routing replay: router log-probs)."""
    holds = {"rollout_log_prob": use_vllm_is or own_generation, "router_log_prob": routing_replay,
             "old_router_log_prob": routing_replay, "versions": True, "policy_version": True,  # GRPOTrainer: sync
             "sampling_mask": True}  # on or off per run (sampling_mask_replay, decided when the trainer is built)
    conditional = TRL.conditions.get(POLICY_LOSS, {})
    return {name for name in TRL.feedable[POLICY_LOSS] if name not in conditional or holds[name]}


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
    sampling_mask_replay: Optional[str] = _field(
        "Sampling-mask replay: 'auto' (on when top_k > 0, top_p < 1 or min_p > 0 and a ratio is formed against the "
        "rollout's log-probs), 'true' or 'false'. Expresses the engine's kept-set log-probs over the full vocabulary "
        "before TRL's vLLM IS correction, off_policy_mask_threshold and stablerl's corrections read them.", "auto")
    stablerl_teacher_model: Optional[str] = _field(
        "On-policy distillation: path of the frozen teacher (the student's tokenizer; checked at start-up) whose "
        "log-probs of the sampled tokens feed teacher_log_prob (advantage_estimator='on_policy_distillation').")

    def __post_init__(self):
        super().__post_init__()
        # TRL validates loss_type only at the first loss call; stablerl names are validated now.
        for key in ("stablerl_loss_params", "stablerl_advantage_params", "stablerl_rollout_correction_params",
                    *EXTENSION_PARAMS_KEYS.values()):
            setattr(self, key, params_dict(getattr(self, key), key))
        validate_stablerl_args(self)
        from ._sampling_mask import check_option

        check_option(self)
        self.routing_replay = routing_replay_mode(self)
        validate_stablerl_extensions(self)


def routing_replay_mode(args) -> Optional[str]:
    """``"R2"``, ``"R3"`` or ``None`` from ``args.routing_replay`` (case-insensitive; unknown names raise)."""
    return rr.parse_mode(getattr(args, "routing_replay", None), "routing_replay")


def params_of(args, key: str) -> dict:
    return params_dict(getattr(args, key, None), key)


def vllm_is(args) -> bool:
    return bool(getattr(args, "use_vllm", False) and getattr(args, "vllm_importance_sampling_correction", False))


def validate_stablerl_args(args, warn: bool = True) -> tuple[Optional[str], Optional[str]]:
    """Check the stablerl selections of a (stablerl or plain TRL) GRPOConfig; return (loss, estimator)."""
    routing_replay_mode(args)
    loss = resolve_loss_type(args.loss_type)
    if loss is None and params_of(args, "stablerl_loss_params"):
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
                           feedable=loss_inputs_trl_can_feed(vllm_is(args), routing_replay=True))
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
                     feedable=loss_inputs_trl_can_feed(vllm_is(args), routing_replay_mode(args) is not None,
                                                       own_generation=not getattr(args, "use_vllm", False)))
        if warn and args.delta is not None and "clip_ratio_c" not in spec.defaults():
            warnings.warn(f"delta (TRL's two-sided ratio clip, a dual clip: clip_ratio_c) has no counterpart in the "
                          f"stablerl loss {loss!r}, which does not use it", UserWarning, stacklevel=3)
    estimator = check_selection(TRL, ADVANTAGE_ESTIMATOR, getattr(args, "advantage_estimator", None),
                                params_of(args, "stablerl_advantage_params"), key="advantage_estimator",
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
                                 params_of(args, "stablerl_rollout_correction_params"),
                                 params_of(args, "stablerl_loss_params"), "stablerl_loss_params")


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
    if name is not None and vllm_is(args):
        raise StableRLError(f"stablerl_rollout_correction={name!r} and TRL's vllm_importance_sampling_correction=True "
                            "would correct the same mismatch twice; set vllm_importance_sampling_correction=False")
    return name


def loss_settings(args, loss: str):
    """The effective hyper-parameters of stablerl loss ``loss`` under TRL ``args``, with their sources (core's one
    precedence rule): ``stablerl_loss_params`` > TRL's ``epsilon`` / ``epsilon_high`` (relative bounds, as in TRL's
    dapo/grpo) and ``delta`` (the dual clip ``clip_ratio_c``) when set > the paper's defaults."""
    framework_values = {"clip_ratio_low": getattr(args, "epsilon", None),
                        "clip_ratio_high": getattr(args, "epsilon_high", None), "clip_ratio_c": getattr(args, "delta", None)}
    return effective_hyperparameters(TRL, stablerl.get_spec(POLICY_LOSS, loss), params_of(args, "stablerl_loss_params"),
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
    return effective_hyperparameters(TRL, spec, params_of(args, "stablerl_advantage_params"), framework_values)


# ----------------------------------------------------------------------------- shapers, filters, controllers, hooks

# config key of each extension -> its kind (its hyper-parameters: stablerl_<key>_params)
EXTENSION_KINDS = {"reward_shaper": REWARD_SHAPER, "batch_filter": BATCH_FILTER, "entropy_controller": CONTROLLER,
                   "trainer_hook": TRAINER_HOOK}
EXTENSION_PARAMS_KEYS = {key: f"stablerl_{key}_params" for key in EXTENSION_KINDS}


def validate_stablerl_extensions(args) -> dict[str, Optional[str]]:
    """Check ``reward_shaper`` / ``batch_filter`` / ``entropy_controller`` / ``trainer_hook`` and their parameters;
    return the names. Unknown names and hyper-parameters raise with the nearest valid one; inputs TRL cannot provide
    raise :class:`stablerl.MissingInputError` with the reason. Inputs the user's reward function must provide
    (``correct``, ``flawed``, ...) are checked at the first generation batch."""
    names = {key: check_selection(TRL, kind, getattr(args, key, None), params_of(args, EXTENSION_PARAMS_KEYS[key]), key=key,
                                  params_key=EXTENSION_PARAMS_KEYS[key], inputs=kind != CONTROLLER)
             for key, kind in EXTENSION_KINDS.items()}
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



@dataclass
class TRLSelection(AlgorithmSelection):
    """A GRPOConfig's stablerl selections as core's one selection object, checked by TRL's rules above (TRL's keys
    and messages); its effective hyper-parameters are :func:`loss_settings` / :func:`advantage_settings`'s."""

    framework, label = "trl", "TRL"
    trainer_hook: Optional[str] = None
    config: Any = None

    def loss_settings(self) -> list:
        return loss_settings(self.config, self.policy_loss)

    def advantage_settings(self) -> list:
        return advantage_settings(self.config, self.advantage_estimator)


def selection_of(cfg) -> TRLSelection:
    """The validated selection of GRPOConfig ``cfg`` (a plain TRL config is validated here, with the delta warning)."""
    loss, estimator = validate_stablerl_args(cfg, warn=not isinstance(cfg, GRPOConfig))
    names = validate_stablerl_extensions(cfg)
    return TRLSelection(**names, **{f"{key}_params": params_of(cfg, EXTENSION_PARAMS_KEYS[key])
                                    for key in ("reward_shaper", "batch_filter", "entropy_controller")},
                        policy_loss=loss, policy_loss_params=params_of(cfg, "stablerl_loss_params"),
                        advantage_estimator=estimator, advantage_params=params_of(cfg, "stablerl_advantage_params"),
                        config=cfg)


__all__ = ["GRPOConfig", "TRLSelection", "selection_of", "SUPPORTED_TRL", "TRL_LOSS_TYPES", "TRL_GRPOTrainer", "advantage_settings",
           "check_extra_loss_inputs", "check_rollout_correction", "loss_inputs_trl_can_feed", "loss_settings",
           "resolve_loss_type", "rollout_correction_setting", "routing_replay_mode", "validate_stablerl_args",
           "validate_stablerl_extensions", "without_rollout_correction"]
