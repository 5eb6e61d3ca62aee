"""The framework contract: what every framework adapter answers, declared once per framework.

An adapter declares a :class:`FrameworkSpec` through the ``register_frameworks`` hook (the built-in
verl, TRL and OpenRLHF declarations come through the same hook as a third party's). Everything
two adapters would otherwise each write lives here: name resolution, which inputs a framework can
feed and why not, hyper-parameter precedence, and loading the adapter module itself. Core never
imports an adapter by name: :func:`load_adapter` imports the module a declaration names.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Mapping, Optional

from .contracts import OPTIONAL_INPUTS, UNAVAILABLE, AlgorithmSpec
from .params import MissingInputError, StableRLError, UnknownNameError, params_dict, unknown_name_message


@dataclass(frozen=True)
class FrameworkKey:
    """A framework config key that sets a stablerl hyper-parameter (e.g. verl's
    ``actor_rollout_ref.actor.clip_ratio_high``) and the framework's own default for it."""

    key: str
    default: Any = None
    # a value the user set for an algorithm without that hyper-parameter is refused, not ignored
    # (framework knobs that change advantages: TRL's scale_rewards, OpenRLHF's no_std_norm)
    refuse_if_unused: bool = False
    # how the framework spells a stablerl value, e.g. TRL's scale_rewards: {False: "'none'"}
    spelled: Optional[Mapping[Any, str]] = None

    def show(self, value: Any) -> str:
        spelled = (self.spelled or {}).get(value) if not isinstance(value, (list, dict)) else None
        return f"{self.key}={spelled if spelled is not None else value}"


@dataclass(frozen=True)
class FrameworkSpec:
    """One framework as its adapter declares it (no framework import needed to build it)."""

    name: str  # "verl", "trl", "openrlhf"
    distribution: str  # the pip distribution whose version is checked
    supported: str  # PEP 440 specifier of the versions the adapter supports, e.g. ">=0.9.1,<0.10"
    adapter: str  # import path of the adapter module; imported only by load_adapter()
    # "module:Class" of the adapter's FrameworkAdapter subclass (stablerl.adapter.get_adapter)
    adapter_class: str = ""
    # kind -> names the framework ships itself; a stablerl algorithm of the same name is prefix+name
    builtin_names: Mapping[str, frozenset] = field(default_factory=dict)
    # kind -> optional inputs (contracts.OPTIONAL_INPUTS) the adapter can feed to that kind
    feedable: Mapping[str, frozenset] = field(default_factory=dict)
    # kind (or "*" for every kind) -> input -> why the framework cannot feed it (shown on refusal)
    why_not: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # kind (or "*") -> input -> what the user must set for the framework to feed it (a feedable input that
    # exists only under a setting: an algorithm requiring it is "partial", not plain "selectable")
    conditions: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # kind -> why the framework has no config key for that kind (shown instead of a bare "no config key")
    why_no_key: Mapping[str, str] = field(default_factory=dict)
    # kind -> the config key / flag that selects an algorithm of that kind
    selection_keys: Mapping[str, str] = field(default_factory=dict)
    # kind -> stablerl hyper-parameter name -> the framework key that also sets it, with the
    # framework's default (see effective_hyperparameters for the precedence)
    hyperparameter_keys: Mapping[str, Mapping[str, FrameworkKey]] = field(default_factory=dict)
    # kind -> how a user sets a stablerl hyper-parameter in this framework: a template with {name}
    # and {value}, e.g. "+actor_rollout_ref.actor.policy_loss.{name}={value}", or a function (name, value) -> str
    params_keys: Mapping[str, Any] = field(default_factory=dict)
    prefix: str = "stablerl_"
    # spec -> the config lines that select spec and set its hyper-parameters (docs, `stablerl describe`)
    config_lines: Optional[Callable[[AlgorithmSpec], list]] = None
    # how to install the adapter / run the framework with it (one line, for docs)
    usage: str = ""
    # named framework switches core's messages refer to, e.g. {"rollout_correction": "<the key that
    # turns the framework's own rollout-correction weights off>"}
    switches: Mapping[str, str] = field(default_factory=dict)
    # algorithm name -> what differs in this framework by the framework's own design (shown with its
    # config lines: `stablerl describe`, the generated docs, the parity matrix)
    algorithm_notes: Mapping[str, str] = field(default_factory=dict)

    def condition(self, kind: str, input_name: str) -> Optional[str]:
        """What the user must set for this framework to feed ``input_name`` to ``kind`` (None: always fed)."""
        return self.conditions.get(kind, {}).get(input_name) or self.conditions.get("*", {}).get(input_name)

    def with_config_lines(self, fn: Callable[[AlgorithmSpec], list]) -> "FrameworkSpec":
        from dataclasses import replace

        return replace(self, config_lines=fn)

    def why(self, kind: str, input_name: str) -> str:
        """Why this framework cannot feed ``input_name`` to an algorithm of ``kind``."""
        return (self.why_not.get(kind, {}).get(input_name) or self.why_not.get("*", {}).get(input_name)
                or OPTIONAL_INPUTS.get(input_name, "not provided"))


def list_frameworks() -> list[FrameworkSpec]:
    """Every framework declared through ``register_frameworks`` (built-in and third-party)."""
    from .registry import get_registry

    return list(get_registry().frameworks.values())  # in declaration order


def get_framework(name: str) -> FrameworkSpec:
    """The declaration of framework ``name``; unknown names raise naming the declared ones."""
    from .registry import get_registry

    frameworks = get_registry().frameworks
    try:
        return frameworks[name]
    except KeyError:
        raise UnknownNameError(unknown_name_message("framework", name, frameworks)) from None


def _declared(framework: FrameworkSpec | str) -> FrameworkSpec:
    return get_framework(framework) if isinstance(framework, str) else framework


def load_adapter(name: str) -> ModuleType:
    """Import and return the adapter module of framework ``name`` (this imports the framework)."""
    return importlib.import_module(get_framework(name).adapter)


# ----------------------------------------------------------------------------- names


def framework_names(framework: FrameworkSpec, spec: AlgorithmSpec) -> list[str]:
    """The names under which ``framework`` selects ``spec``, preferred first: the bare name where the
    framework has no built-in of that name, and always ``prefix + name``."""
    prefixed = framework.prefix + spec.name
    if spec.name in framework.builtin_names.get(spec.kind, ()) or spec.name.startswith(framework.prefix):
        return [prefixed]
    return [spec.name, prefixed]


def missing_inputs(framework: FrameworkSpec, spec: AlgorithmSpec, extra: Any = (), feedable: Any = None) -> list[str]:
    """The inputs ``spec`` requires that ``framework`` cannot feed. ``feedable``: what this run can
    feed, when narrower than the declaration (TRL's vLLM log-probs only with its IS correction on);
    ``extra``: inputs this run feeds beyond it (a TRL trainer subclass's own)."""
    can = set(framework.feedable.get(spec.kind, ()) if feedable is None else feedable) | set(extra)
    return [r for r in spec.requires if r not in can]


def why_missing(framework: FrameworkSpec, spec: AlgorithmSpec, missing: list[str]) -> str:
    """One sentence per missing input: why the framework cannot feed it (or what it is)."""
    return "; ".join(f"{m}: {framework.why(spec.kind, m)}" for m in missing)


#: the three answers of :func:`reach`
SELECTABLE, PARTIAL, REFUSED = "selectable", "partial", "refused"


POLICY_LOSS_KIND = "policy_loss"


def reach_conditions(framework: FrameworkSpec, spec: AlgorithmSpec) -> list[str]:
    """``"<input>: <what the user must set>"`` for each input ``spec`` requires that ``framework`` feeds
    only under a setting (``FrameworkSpec.conditions``); for an aggregation or rollout correction (set
    through the loss's params), also that the policy loss must be a stablerl one."""
    on_loss = spec.kind in CALL_OPTION_OF_KIND
    # set through the loss's params: the loss's conditions; by a dedicated key: that kind's own
    kind = POLICY_LOSS_KIND if on_loss and spec.kind not in framework.selection_keys else spec.kind
    out = []
    for name in spec.requires:
        condition = framework.condition(kind, name)
        if condition:
            out.append(f"{name}: {condition}")
    feedable = framework.feedable.get(spec.kind, ())
    for name, unless in spec.requires_unless.items():
        # the default settings need it: fed by the framework only when the user's pipeline supplies it
        how = framework.condition(spec.kind, name) if name in feedable else None
        out.append(f"{name} (its default settings need it): {how or framework.why(spec.kind, name)}; or {unless}")
    if on_loss:
        out.append(f"a stablerl policy loss ({framework.name}'s own losses do not call stablerl)")
    return out


def reach(framework: FrameworkSpec, spec: AlgorithmSpec) -> tuple[str, str]:
    """Can a user of ``framework`` select ``spec``: ``("selectable", name)``; ``("partial", name)`` when it
    runs only with a setting the user must supply (:func:`reach_conditions` says which); or
    ``("refused", reason)``, the reason in the framework's words."""
    if spec.status == UNAVAILABLE:
        return REFUSED, f"unavailable: {spec.notes}"
    if spec.kind == "router_family" and "routing_replay" in framework.switches:
        # no key names a family: routing replay detects it per router module of the model
        return SELECTABLE, framework.switches["routing_replay"]
    if spec.kind in framework.selection_keys and spec.kind in CALL_OPTION_OF_KIND:
        # a dedicated key (TRL's stablerl_rollout_correction): still on a stablerl policy loss, so partial
        missing = missing_inputs(framework, spec)
        if missing:
            return REFUSED, f"needs {', '.join(missing)} ({why_missing(framework, spec, missing)})"
        return PARTIAL, f'{framework.selection_keys[spec.kind]}="{spec.name}"'
    if spec.kind in CALL_OPTION_OF_KIND and POLICY_LOSS_KIND in framework.params_keys:
        # selected through the stablerl policy loss's params channel; a correction needs the loss's rollout log-probs
        missing = missing_inputs(framework, spec, feedable=framework.feedable.get(POLICY_LOSS_KIND, ()))
        if missing:
            return REFUSED, f"needs {', '.join(missing)} ({why_missing(framework, spec, missing)})"
        return PARTIAL, stablerl_key(framework, POLICY_LOSS_KIND, CALL_OPTION_OF_KIND[spec.kind], spec.name)
    if spec.kind not in framework.selection_keys:
        kind = spec.kind.replace("_", " ")
        why = framework.why_no_key.get(spec.kind)
        return REFUSED, (f"{framework.name} has no config key for {'an' if kind[0] in 'aeiou' else 'a'} {kind}"
                         + (f": {why}" if why else ""))
    missing = missing_inputs(framework, spec)
    if missing:
        return REFUSED, f"needs {', '.join(missing)} ({why_missing(framework, spec, missing)})"
    return (PARTIAL if reach_conditions(framework, spec) else SELECTABLE), framework_names(framework, spec)[0]


def reach_table(specs: Any = None) -> list[dict]:
    """Per algorithm and framework: ``{"status", "name"}`` (selectable), plus ``"needs"`` (partial: what
    the user must set), or ``{"status", "why"}`` (refused). One source for ``stablerl list``, its ``--json``,
    README's algorithm table and the docs pages."""
    from .api import list_algorithms

    rows = []
    for spec in (list_algorithms() if specs is None else specs):
        per: dict = {}
        for fw in list_frameworks():
            status, detail = reach(fw, spec)
            if status == REFUSED:
                per[fw.name] = {"status": status, "why": detail}
            else:
                per[fw.name] = {"status": status, "name": detail}
                if status == PARTIAL:
                    per[fw.name]["needs"] = reach_conditions(fw, spec)
        rows.append({"name": spec.name, "kind": spec.kind, "status": spec.status, "reach": per})
    return rows


def reach_counts(rows: Optional[list] = None) -> dict[str, dict[str, int]]:
    """framework -> {"selectable": n, "partial": n, "refused": n} over ``rows`` (:func:`reach_table`)."""
    rows = reach_table() if rows is None else rows
    out: dict[str, dict[str, int]] = {fw.name: {SELECTABLE: 0, PARTIAL: 0, REFUSED: 0} for fw in list_frameworks()}
    for row in rows:
        for name, entry in row["reach"].items():
            out[name][entry["status"]] += 1
    return out


def selectable_names(framework: FrameworkSpec, kind: str, extra_inputs: Any = ()) -> list[str]:
    """The framework's own names of ``kind``, then every stablerl algorithm it can feed, as selected."""
    from .api import list_algorithms

    own = framework.builtin_names.get(kind, ())
    out = list(own) if isinstance(own, (tuple, list)) else sorted(own)  # a declared order is kept
    for spec in list_algorithms(kind):
        if spec.status != UNAVAILABLE and not missing_inputs(framework, spec, extra_inputs):
            out.append(framework_names(framework, spec)[0])
    return out


def check_inputs(framework: FrameworkSpec | str, spec: AlgorithmSpec, selected_as: Optional[str] = None,
                 extra_inputs: Any = (), feedable: Any = None) -> None:
    """Raise :class:`MissingInputError`, saying why in the framework's words, if ``framework`` cannot feed
    an input ``spec`` requires (``feedable`` / ``extra_inputs``: see :func:`missing_inputs`)."""
    fw = _declared(framework)
    missing = missing_inputs(fw, spec, extra_inputs, feedable)
    if missing:
        key = fw.selection_keys.get(spec.kind, spec.kind.replace("_", " "))
        raise MissingInputError(
            f"{spec.kind.replace('_', ' ')} {spec.name!r} ({key}={selected_as or spec.name}) needs input(s) "
            f"{fw.name} cannot provide ({why_missing(fw, spec, missing)})"
        )


def resolve(framework: FrameworkSpec | str, kind: str, name: Optional[str], extra_inputs: Any = (),
            feedable: Any = None, inputs: bool = True) -> Optional[str]:
    """The stablerl algorithm that ``name`` selects in ``framework``, or ``None`` for the framework's
    own algorithm of that name (or no name).

    One rule for every framework: a framework's built-in name keeps the framework's code;
    ``prefix + name`` always selects stablerl's; a bare stablerl name selects it where the framework
    has no built-in of that name. Unknown names raise :class:`UnknownNameError` with the nearest
    valid one; an unavailable algorithm raises with its reason; an algorithm whose inputs the
    framework cannot feed raises :class:`MissingInputError` saying why (``inputs=False``: left to a
    later :func:`check_inputs`, where what the framework feeds depends on the run's settings).
    """
    from .api import get_spec
    from .registry import get_registry

    fw = _declared(framework)
    if name is None or name == "":
        return None
    if name in fw.builtin_names.get(kind, ()):
        return None
    bare = name[len(fw.prefix):] if name.startswith(fw.prefix) else name
    key = fw.selection_keys.get(kind, kind.replace("_", " "))
    if bare not in get_registry().names(kind):
        own = sorted(fw.builtin_names.get(kind, ()))
        raise UnknownNameError(
            unknown_name_message(f"{fw.name} {key} value", name, selectable_names(fw, kind, extra_inputs))
            + (f" ({fw.name}'s own: {', '.join(own)}; " if own else " (")
            + f"any stablerl {kind.replace('_', ' ')} also as '{fw.prefix}<name>')"
        )
    spec = get_spec(kind, bare)  # raises for 'unavailable' entries, with the reason
    if inputs:
        check_inputs(fw, spec, name, extra_inputs, feedable)
    return bare


def _option_lines(fw: FrameworkSpec, spec: AlgorithmSpec) -> list[str]:
    """An aggregation / rollout correction: set in the stablerl policy loss's params (:data:`CALL_OPTIONS`)."""
    option = CALL_OPTION_OF_KIND[spec.kind]
    fields = list(spec.defaults())
    dedicated = fw.selection_keys.get(spec.kind)
    if dedicated:  # its own key, and its parameters in one dict (the params_keys template of its kind)
        lines = [f'{dedicated}="{spec.name}"']
        if fields:
            lines.append(stablerl_key(fw, spec.kind, fields[0], "<value>").split("=", 1)[0] + "={"
                         + ", ".join(f'"{f}": <value>' for f in fields) + "}")
        return lines
    lines = [stablerl_key(fw, POLICY_LOSS_KIND, option, spec.name)]
    if fields:
        lines.append(stablerl_key(fw, POLICY_LOSS_KIND, option.replace("_mode", "") + "_params",
                                  "{" + ", ".join(f'"{f}": <value>' for f in fields) + "}"))
    return lines


def selectable_in(spec: AlgorithmSpec) -> list[str]:
    """The frameworks (declaration order) whose users can select ``spec`` by a config key."""
    return [fw.name for fw in list_frameworks() if reach(fw, spec)[0] != REFUSED]


def config_lines(spec: AlgorithmSpec) -> dict[str, list[str]]:
    """Per framework that can select ``spec``: the config lines that select it and set its
    hyper-parameters (``stablerl describe`` and the generated docs)."""
    out: dict[str, list[str]] = {}
    for fw in list_frameworks():
        if fw.config_lines is not None and reach(fw, spec)[0] != REFUSED:
            if spec.kind == "router_family":
                out[fw.name] = [fw.switches["routing_replay"], "(routing replay detects the router family per module)"]
            elif spec.kind in CALL_OPTION_OF_KIND:
                out[fw.name] = _option_lines(fw, spec)
            else:
                out[fw.name] = list(fw.config_lines(spec))
            out[fw.name] += [f"(needs {c})" for c in reach_conditions(fw, spec)]
            if spec.name in fw.algorithm_notes:
                out[fw.name].append(f"(in {fw.name}: {fw.algorithm_notes[spec.name]})")
    return out


# ----------------------------------------------------------------------------- hyper-parameters

#: where an effective hyper-parameter value came from, highest precedence first
FROM_STABLERL_KEY = "stablerl key"
FROM_FRAMEWORK_KEY = "framework key"
FROM_PAPER_DEFAULT = "paper default"

PRECEDENCE = (
    "One precedence rule in every framework: (1) a stablerl key (verl: policy_loss./algorithm. fields, "
    "TRL: stablerl_*_params, OpenRLHF: --*.stablerl_params) > (2) a framework key the user set (verl's "
    "actor clip keys at a value other than verl's default, TRL's epsilon/epsilon_high, OpenRLHF's clip "
    "flags given on the command line) > (3) the paper's default. A framework key left at the framework's "
    "own default never replaces a paper default; where the two differ, start-up says so and names the key."
)


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


def split_call_options(params: Mapping[str, Any]) -> tuple[dict, dict]:
    """``(hyper-parameters, call options)`` of a stablerl loss's params (:data:`CALL_OPTIONS`)."""
    hyper = {k: v for k, v in params.items() if k not in CALL_OPTIONS}
    return hyper, {k: v for k, v in params.items() if k in CALL_OPTIONS}


def check_call_options(framework: FrameworkSpec | str, spec: AlgorithmSpec, options: Mapping[str, Any],
                       hyper: Optional[Mapping[str, Any]] = None, feedable: Any = None) -> None:
    """Refuse, before the first step, call options ``spec`` in ``framework`` cannot run: an unknown
    aggregation or correction (nearest names), bad hyper-parameters of either, parameters without the
    option they belong to, a rollout correction where the framework feeds no rollout log-probs (why)."""
    from .checks import check_aggregation_request
    from .contracts import ROLLOUT_CORRECTION
    from .params import build_params

    fw = _declared(framework)
    if not options:
        return
    if spec.kind != "policy_loss":
        raise StableRLError(f"{', '.join(sorted(options))}: options of a stablerl policy loss, not of {spec.kind}")
    mode = options.get("loss_agg_mode")
    agg_params = options.get("loss_agg_params")
    if agg_params is not None and not isinstance(agg_params, Mapping):
        raise StableRLError(f"loss_agg_params must be a mapping of the aggregation's hyper-parameters, got {agg_params!r}")
    if mode is not None:
        from .api import get_spec
        from .registry import get_registry

        check_aggregation_request(spec, build_params(spec, dict(hyper or {})), mode, agg_params)
        if mode in get_registry().names("aggregation"):
            build_params(get_spec("aggregation", mode), dict(agg_params or {}))
    elif agg_params:
        raise StableRLError("loss_agg_params given without loss_agg_mode (a registered aggregation, e.g. delta_l)")
    correction = options.get("rollout_correction")
    correction_params = options.get("rollout_correction_params")
    if correction is not None:
        from .api import get_spec

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
        from .checks import check_top_entropy_quantile

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


TOP_ENTROPY_TEXT = (
    "top_entropy_quantile  (call option of every per-token stablerl policy loss, stable)\n"
    "Train only on the highest-entropy fraction of tokens (TRL's top_entropy_quantile)\n"
    "paper:     arXiv 2506.01939  https://arxiv.org/abs/2506.01939\n"
    "formula:   l_t <- l_t * [H_t >= quantile(H over the valid tokens of every DP rank, 1 - q)]; the aggregation's "
    "denominator is unchanged\n"
    "defaults:  top_entropy_quantile=1.0 (off); any value in (0, 1]\n"
    "requires:  entropy (the current policy's, from the loss's own forward pass)\n"
    "reference: TRL 1.16 GRPOTrainer.get_high_entropy_mask (same mask, ties at the threshold kept)\n"
    "notes:     not for a loss returning a scalar (its own aggregation: gmpo, sapo, ...): refused by name"
)


def top_entropy_reach(framework: FrameworkSpec | str) -> tuple[str, list[str]]:
    """``(reach, config lines)`` of the ``top_entropy_quantile`` call option in ``framework``: set in the
    stablerl loss's params like ``loss_agg_mode``; partial where the framework computes the current
    entropy only on request (verl: ``actor.calculate_entropy=True``), refused where it cannot feed it."""
    fw = _declared(framework)
    if TOP_ENTROPY_INPUT not in fw.feedable.get(POLICY_LOSS_KIND, ()):
        return REFUSED, [fw.why(POLICY_LOSS_KIND, TOP_ENTROPY_INPUT)]
    lines = [stablerl_key(fw, POLICY_LOSS_KIND, "top_entropy_quantile", 0.2)]
    condition = fw.condition(POLICY_LOSS_KIND, TOP_ENTROPY_INPUT)
    if condition:
        lines.append(f"(needs {TOP_ENTROPY_INPUT}: {condition})")
    return (PARTIAL if condition else SELECTABLE), lines


@dataclass(frozen=True)
class Setting:
    """One effective hyper-parameter: its value, where it came from, and the key that sets it."""

    name: str
    value: Any
    source: str  # FROM_STABLERL_KEY, FROM_FRAMEWORK_KEY or FROM_PAPER_DEFAULT
    key: str  # the key that set it, or the stablerl key that would set it
    note: str = ""  # e.g. a framework default that differs from the paper default and was not used


def stablerl_key(framework: FrameworkSpec, kind: str, name: str, value: Any = "<value>") -> str:
    if kind in CALL_OPTION_OF_KIND and kind not in framework.params_keys:
        # an aggregation's / correction's parameters: inside the loss's params key (unless the kind has its own)
        option = CALL_OPTION_OF_KIND[kind].replace("_mode", "") + "_params"
        return stablerl_key(framework, POLICY_LOSS_KIND, option, f'{{"{name}": {value}}}')
    template = framework.params_keys.get(kind)
    if callable(template):
        return template(name, value)
    return template.format(name=name, value=value) if template else f"{name}={value}"


def effective_hyperparameters(
    framework: FrameworkSpec | str,
    spec: AlgorithmSpec,
    stablerl_params: Optional[Mapping[str, Any]] = None,
    framework_values: Optional[Mapping[str, Any]] = None,
    user_set: Optional[Any] = None,
) -> list[Setting]:
    """Every hyper-parameter of ``spec`` as it will run in ``framework``, under :data:`PRECEDENCE`.

    ``stablerl_params``: the stablerl keys the user set. ``framework_values``: stablerl name -> the
    value of the framework key declared for it (``FrameworkSpec.hyperparameter_keys``), as read from
    the framework's config. ``user_set``: the names whose framework key the user set explicitly, when
    the framework can tell (OpenRLHF's command line); otherwise a framework value counts as set when
    it differs from the framework's declared default.
    """
    fw = _declared(framework)
    stablerl_params = dict(stablerl_params or {})
    framework_values = dict(framework_values or {})
    keys = fw.hyperparameter_keys.get(spec.kind, {})
    defaults = spec.defaults()
    options = {}
    if spec.kind == "policy_loss":  # aggregation / rollout correction through the same channel (CALL_OPTIONS)
        stablerl_params, options = split_call_options(stablerl_params)
    for name in stablerl_params:  # a typo is an error naming the valid keys, never a silently dropped value
        if name not in defaults:
            valid = list(defaults) + (list(CALL_OPTIONS) if spec.kind == "policy_loss" else [])
            raise UnknownNameError(unknown_name_message(f"hyper-parameter for {spec.name!r}", name, valid))
    out: list[Setting] = []
    for name, default in defaults.items():
        own_key = stablerl_key(fw, spec.kind, name)
        if name in stablerl_params:
            out.append(Setting(name, stablerl_params[name], FROM_STABLERL_KEY,
                               stablerl_key(fw, spec.kind, name, stablerl_params[name])))
            continue
        fk = keys.get(name)
        value = framework_values.get(name)
        if fk is not None and value is not None:
            explicitly = (name in user_set) if user_set is not None else not _same(value, fk.default)
            if explicitly:
                out.append(Setting(name, value, FROM_FRAMEWORK_KEY, fk.show(value)))
                continue
            if not _same(value, default):
                out.append(Setting(
                    name, default, FROM_PAPER_DEFAULT, own_key,
                    note=f"{fk.show(value)} is {fw.name}'s default, not applied; to run with it set "
                         f"{stablerl_key(fw, spec.kind, name, value)}",
                ))
                continue
        out.append(Setting(name, default, FROM_PAPER_DEFAULT, own_key))
    for name, value in options.items():
        out.append(Setting(name, value, FROM_STABLERL_KEY, stablerl_key(fw, spec.kind, name, value)))
    return out


def check_selection(framework: FrameworkSpec | str, kind: str, name: Any, params: Mapping[str, Any], *, key: str,
                    params_key: str, inputs: bool = True) -> Optional[str]:
    """The stablerl ``kind`` that config key ``key`` selects (None, "" and "none": none), checked where the
    config is built: the name (:func:`resolve`; ``inputs=False``: the inputs are checked later), its
    hyper-parameters from ``params_key``, and no hyper-parameters without a name."""
    from .api import get_spec
    from .params import build_params

    if name is None or (isinstance(name, str) and name.strip().lower() in ("", "none")):
        if params:
            raise StableRLError(f"{params_key} is set but {key} is not")
        return None
    resolved = resolve(framework, kind, name, inputs=inputs)
    if resolved is not None:
        build_params(get_spec(kind, resolved), dict(params))
    return resolved


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
        raise StableRLError(f"the {kind.replace('_', ' ')} is set twice: {_declared(framework).selection_keys[kind]}"
                            f"(_params) and {loss_params_key}' {', '.join(sorted(alias))} (an alias of the same "
                            "setting); keep one")
    return alias.get(option) or None, params_dict(alias.get(option_params), f"{loss_params_key}' {option_params}")


def check_shaper_and_components(shaper: Optional[str], spec: AlgorithmSpec, components_given: bool,
                                components_source: str) -> None:
    """Refuse a reward shaper together with an estimator that reads the per-reward components it is given
    (``reward_components`` in ``spec.optional_inputs``): the shaper changes the summed reward, which such an
    estimator does not read, so the shaping would be dropped without a word."""
    if shaper and components_given and "reward_components" in spec.optional_inputs:
        raise StableRLError(
            f"reward shaper {shaper!r} with the advantage estimator {spec.name!r}: the shaper changes the summed "
            f"reward, but {spec.name!r} reads the reward components ({components_source}) instead, so the shaping "
            "would be lost; drop the shaper, or the components"
        )


def check_framework_keys_used(
    framework: FrameworkSpec | str, spec: AlgorithmSpec, framework_values: Optional[Mapping[str, Any]] = None,
    user_set: Optional[Any] = None,
) -> None:
    """Refuse a framework knob the user set that ``spec`` has no hyper-parameter for, where ignoring it
    would silently change the run (``FrameworkKey.refuse_if_unused``: knobs that change advantages)."""
    fw = _declared(framework)
    fields = set(spec.defaults())
    for name, fk in fw.hyperparameter_keys.get(spec.kind, {}).items():
        value = (framework_values or {}).get(name)
        if not fk.refuse_if_unused or name in fields or value is None:
            continue
        explicitly = (name in user_set) if user_set is not None else not _same(value, fk.default)
        if explicitly:
            raise StableRLError(
                f"{fw.name}: {fk.show(value)} has no effect on the stablerl {spec.kind.replace('_', ' ')} "
                f"{spec.name!r} (it has no {name!r}); remove it, or choose an algorithm with that "
                f"hyper-parameter (ignoring it would change your advantages without a word)"
            )


def _same(a: Any, b: Any) -> bool:
    try:
        return a == b or (a is not None and b is not None and float(a) == float(b))
    except (TypeError, ValueError):
        return False


def as_params(settings: list[Setting]) -> dict[str, Any]:
    """The keyword arguments for ``compute_policy_loss`` / ``compute_advantage``: every value that is
    not the paper default (the defaults are the Params dataclass's own)."""
    return {s.name: s.value for s in settings if s.source != FROM_PAPER_DEFAULT}


def format_settings(framework: FrameworkSpec | str, spec: AlgorithmSpec, settings: list[Setting]) -> str:
    """The effective-settings table printed at start-up and by ``stablerl describe --framework``."""
    fw = _declared(framework)
    head = f"stablerl/{fw.name}: {spec.kind.replace('_', ' ')} {spec.name!r} runs with"
    if not settings:
        return head + " no hyper-parameters"
    w = max(len(s.name) for s in settings)
    v = max(len(repr(s.value)) for s in settings)
    lines = [head + ":"]
    for s in settings:
        lines.append(f"  {s.name:<{w}} = {s.value!r:<{v}}  ({s.source}: {s.key})")
        if s.note:
            lines.append(f"  {'':<{w}}   note: {s.note}")
    return "\n".join(lines)


_LOGGED: set = set()


def log_effective_settings(framework: FrameworkSpec | str, spec: AlgorithmSpec, settings: list[Setting],
                           logger: Any = None) -> None:
    """Print the effective-settings table to stderr once per process and selection (Ray forwards a
    worker's stderr to the driver's console, and no logging set-up can hide it), and log each note (a
    framework default that differs from the paper's and was not applied) as a WARNING."""
    import logging
    import sys

    fw = _declared(framework)
    # verl calls this at every loss call: the table is formatted only for settings not printed yet
    key = (fw.name, spec.kind, spec.name, tuple((s.name, repr(s.value), s.source, s.key) for s in settings))
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger = logger or logging.getLogger(f"stablerl.adapters.{fw.name}")
        print(format_settings(fw, spec, settings), file=sys.stderr, flush=True)
        for s in settings:
            if s.note:
                logger.warning("stablerl/%s: %s %s = %r (paper default): %s", fw.name, spec.name, s.name, s.value, s.note)


def switch_names(switch: str) -> str:
    """``"verl: <key>; trl: <key>; ..."`` for a named framework switch (core's error messages name the
    frameworks' keys through the declarations, never by writing them itself)."""
    return "; ".join(f"{fw.name}: {fw.switches[switch]}" for fw in list_frameworks() if switch in fw.switches)

# ----------------------------------------------------------------------------- version policy

#: ``STABLERL_ALLOW_UNSUPPORTED=1``: a framework version outside an adapter's supported range is a warning,
#: not an error (to try a newer release before stablerl declares it)
ALLOW_UNSUPPORTED_ENV = "STABLERL_ALLOW_UNSUPPORTED"


class UnsupportedVersionError(ImportError):
    """The installed framework is outside the range its adapter declares (``FrameworkSpec.supported``)."""


def _release(text: str) -> tuple[int, ...]:
    # "0.11.2+cu121" -> (0, 11, 2); "1.17.0rc1" -> (1, 17, 0); a pre-release counts as its release
    import re

    return tuple(int(x) for x in re.findall(r"\d+", re.split(r"[+a-zA-Z]", text.strip(), maxsplit=1)[0]))


def version_in_range(found_version: str, specifier: str) -> bool:
    """Whether ``found_version`` satisfies ``specifier``: comma-separated ``>=``, ``>``, ``<=``, ``<``, ``==``,
    ``!=`` clauses on release numbers (missing parts count as 0: ``0.10`` == ``0.10.0``)."""
    import operator
    import re

    ops = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq,
           "!=": operator.ne}
    found = _release(found_version)
    for clause in filter(None, (c.strip() for c in specifier.split(","))):
        m = re.fullmatch(r"(>=|<=|==|!=|>|<)\s*([0-9][0-9.]*)", clause)
        if m is None:
            raise ValueError(f"unsupported version clause {clause!r} in {specifier!r}")
        bound = _release(m.group(2))
        width = max(len(found), len(bound))
        pad = lambda v: v + (0,) * (width - len(v))  # noqa: E731
        if not ops[m.group(1)](pad(found), pad(bound)):
            return False
    return True


def installed_version(distribution: str) -> Optional[str]:
    """The installed version of ``distribution`` from its metadata (imports nothing), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def check_version(framework_name: str, found_version: Optional[str], *, error: type = UnsupportedVersionError,
                  allow: Optional[bool] = None) -> Optional[str]:
    """The one version policy of every framework adapter: a version outside the framework's declared
    ``supported`` range (or no framework at all) raises ``error`` naming the found version and the range;
    with ``STABLERL_ALLOW_UNSUPPORTED=1`` (or ``allow=True``) an out-of-range version is a RuntimeWarning
    instead. Returns ``found_version``."""
    import os
    import warnings

    spec = get_framework(framework_name)
    install = f"pip install '{spec.distribution}{spec.supported}'"
    if found_version is None:
        raise error(f"{spec.adapter} needs {spec.distribution}{spec.supported}, which is not installed: {install}")
    if version_in_range(found_version, spec.supported):
        return found_version
    message = (f"{spec.adapter} supports {spec.distribution}{spec.supported}, found {spec.distribution} "
               f"{found_version}: install a supported version ({install})")
    if allow is None:
        allow = os.environ.get(ALLOW_UNSUPPORTED_ENV, "") == "1"
    if not allow:
        raise error(f"{message}, or set {ALLOW_UNSUPPORTED_ENV}=1 to try this one anyway")
    warnings.warn(f"{message}. Continuing because {ALLOW_UNSUPPORTED_ENV}=1.", RuntimeWarning, stacklevel=2)
    return found_version

def check_signatures(framework_name: str, cls: type, required: Mapping[str, Any], found_version: str, *,
                     error: type = UnsupportedVersionError) -> None:
    """Raise ``error`` unless each method of ``cls`` named in ``required`` exists with the parameters listed
    (the framework's private methods an adapter overrides or calls); never waived, unlike the version range."""
    import inspect

    spec = get_framework(framework_name)
    supported = f"{spec.adapter} supports {spec.distribution}{spec.supported}"
    for method, needed in required.items():
        fn = getattr(cls, method, None)
        if fn is None:
            raise error(f"{spec.distribution} {found_version}: {cls.__name__}.{method} no longer exists; {supported}")
        missing = [p for p in needed if p not in inspect.signature(fn).parameters]
        if missing:
            raise error(f"{spec.distribution} {found_version}: {cls.__name__}.{method} lacks parameter(s) {missing}; "
                        f"{supported}")


from .framework_batch import (FilteredBatch, GroupBatchSampler, advantages_from_scores,  # noqa: E402,F401
                              apply_filter_result, check_supplied_inputs, check_whole_groups, declared_inputs,
                              loss_inputs, pending_loss_inputs)
