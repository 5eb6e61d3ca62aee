"""Call options: ``compute_policy_loss`` options (a registered aggregation, a rollout correction,
``top_entropy_quantile``) that a user sets through a framework's stablerl loss-params channel, next to the
loss's hyper-parameters; how each framework spells a stablerl key; and the checks run before the first step."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from .api import get_spec
from .checks import check_aggregation_request, check_top_entropy_quantile
from .contracts import ROLLOUT_CORRECTION, AlgorithmSpec
from .framework_spec import FrameworkSpec
from .params import MissingInputError, StableRLError, build_params, params_dict
from .registry import framework_of, get_registry
from .resolve import missing_inputs


#: the kind whose loss-params channel carries the call options
POLICY_LOSS_KIND = "policy_loss"


#: compute_policy_loss options a user sets through a framework's stablerl loss-params channel, next to the
#: loss's hyper-parameters (so every framework reaches them by config key): a registered aggregation such as
#: ``delta_l`` (``loss_agg_mode`` replaces the framework's own mode) and a stablerl rollout correction, each
#: with its own hyper-parameters. They act only on a stablerl policy loss (the framework's own loss never
#: calls compute_policy_loss).
CALL_OPTIONS = ("loss_agg_mode", "loss_agg_params", "rollout_correction", "rollout_correction_params",
                "top_entropy_quantile")
#: the input ``top_entropy_quantile < 1`` needs from the framework, and where it reaches a stablerl loss
TOP_ENTROPY_INPUT = "entropy"


def top_entropy_on(options: Mapping[str, Any]) -> bool:
    """Whether the call options train on a top-entropy fraction only (``top_entropy_quantile < 1``): the
    adapter must then feed the current policy's ``entropy`` even to a loss that does not declare it."""
    value = options.get("top_entropy_quantile")
    return value is not None and not isinstance(value, bool) and isinstance(value, (int, float)) and value < 1.0


#: the call option that selects an algorithm of each of these kinds
CALL_OPTION_OF_KIND = {"aggregation": "loss_agg_mode", "rollout_correction": "rollout_correction"}


def option_inputs(options: Mapping[str, Any]) -> tuple[str, ...]:
    """The inputs a loss call's options need beyond the loss's declaration: the rollout log-probs for a stablerl
    rollout correction, the current entropy for ``top_entropy_quantile`` < 1 (:func:`top_entropy_on`)."""
    return (("rollout_log_prob",) if options.get("rollout_correction") else ()) + (
        (TOP_ENTROPY_INPUT,) if top_entropy_on(options) else ())

def split_call_options(params: Mapping[str, Any]) -> tuple[dict, dict]:
    """``(hyper-parameters, call options)`` of a stablerl loss's params (:data:`CALL_OPTIONS`)."""
    hyper = {k: v for k, v in params.items() if k not in CALL_OPTIONS}
    return hyper, {k: v for k, v in params.items() if k in CALL_OPTIONS}


def stablerl_key(framework: FrameworkSpec, kind: str, name: str, value: Any = "<value>") -> str:
    if kind in CALL_OPTION_OF_KIND and kind not in framework.params_keys:
        # an aggregation's / correction's parameters: inside the loss's params key (unless the kind has its own)
        option = CALL_OPTION_OF_KIND[kind].replace("_mode", "") + "_params"
        return stablerl_key(framework, POLICY_LOSS_KIND, option, f'{{"{name}": {value}}}')
    template = framework.params_keys.get(kind)
    if callable(template):
        return template(name, value)
    return template.format(name=name, value=value) if template else f"{name}={value}"


def check_call_options(framework: FrameworkSpec | str, spec: AlgorithmSpec, options: Mapping[str, Any],
                       hyper: Optional[Mapping[str, Any]] = None, feedable: Any = None) -> None:
    """Refuse, before the first step, call options ``spec`` in ``framework`` cannot run: an unknown
    aggregation or correction (nearest names), bad hyper-parameters of either, parameters without the
    option they belong to, a rollout correction where the framework feeds no rollout log-probs (why)."""
    fw = framework_of(framework)
    if not options:
        return
    if spec.kind != "policy_loss":
        raise StableRLError(f"{', '.join(sorted(options))}: options of a stablerl policy loss, not of {spec.kind}")
    mode = options.get("loss_agg_mode")
    agg_params = options.get("loss_agg_params")
    if agg_params is not None and not isinstance(agg_params, Mapping):
        raise StableRLError(f"loss_agg_params must be a mapping of the aggregation's hyper-parameters, got {agg_params!r}")
    if mode is not None:
        check_aggregation_request(spec, build_params(spec, dict(hyper or {})), mode, agg_params)
        if mode in get_registry().names("aggregation"):
            build_params(get_spec("aggregation", mode), dict(agg_params or {}))
    elif agg_params:
        raise StableRLError("loss_agg_params given without loss_agg_mode (a registered aggregation, e.g. delta_l)")
    correction = options.get("rollout_correction")
    correction_params = options.get("rollout_correction_params")
    if correction is not None:
        correction_spec = get_spec(ROLLOUT_CORRECTION, correction)
        build_params(correction_spec, dict(correction_params or {}))
        missing = missing_inputs(fw, correction_spec, feedable=feedable if feedable is not None
                                 else fw.feedable.get("policy_loss", ()))
        if missing:
            raise MissingInputError(
                f"rollout_correction={correction!r} needs input(s) {fw.name} cannot provide to a policy loss "
                f"({'; '.join(f'{m}: {fw.why(spec.kind, m)}' for m in missing)})"
            )
    elif correction_params:
        raise StableRLError("rollout_correction_params given without rollout_correction")
    if "top_entropy_quantile" in options:
        quantile = check_top_entropy_quantile(options["top_entropy_quantile"])
        if quantile < 1.0:
            if spec.output != "per_token":
                raise StableRLError(
                    f"top_entropy_quantile={quantile} weights the per-token loss before aggregation; policy loss "
                    f"{spec.name!r} returns a {spec.output} (its own aggregation), so there is no per-token loss to mask"
                )
            can = fw.feedable.get("policy_loss", ()) if feedable is None else feedable
            if TOP_ENTROPY_INPUT not in can:
                raise MissingInputError(
                    f"top_entropy_quantile={quantile} needs the current policy's entropy, which {fw.name} cannot "
                    f"provide to a policy loss ({fw.why(spec.kind, TOP_ENTROPY_INPUT)})"
                )


def dedicated_call_option(framework: FrameworkSpec | str, kind: str, name: Optional[str], params: Mapping[str, Any],
                          loss_params: Mapping[str, Any], loss_params_key: str) -> tuple[Optional[str], dict]:
    """``(name, params)`` of a call option of ``kind`` (a rollout correction) that ``framework`` selects by a
    dedicated key (``selection_keys[kind]``, e.g. TRL's ``stablerl_rollout_correction``; ``name`` / ``params``:
    its values), or by the alias in the stablerl loss's params (``loss_params``: ``{"rollout_correction": ...,
    "rollout_correction_params": {...}}``, the spelling of frameworks without that key). Both behave the same;
    setting it by both spellings at once is refused."""
    option = CALL_OPTION_OF_KIND[kind]
    option_params = option.replace("_mode", "") + "_params"
    alias = {k: loss_params[k] for k in (option, option_params) if loss_params.get(k) not in (None, {})}
    if not alias:
        return name or None, dict(params)
    if name or params:
        raise StableRLError(f"the {kind.replace('_', ' ')} is set twice: {framework_of(framework).selection_keys[kind]}"
                            f"(_params) and {loss_params_key}' {', '.join(sorted(alias))} (an alias of the same "
                            "setting); keep one")
    return alias.get(option) or None, params_dict(alias.get(option_params), f"{loss_params_key}' {option_params}")
