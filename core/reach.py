"""Reach: whether a user of each framework can select each algorithm (selectable, partial: with a setting
the user must supply, or refused: why), and the config lines that select it. One source for ``stablerl
list`` / ``describe``, README's algorithm table and the generated docs."""

from __future__ import annotations

from typing import Any, Optional

from .api import list_algorithms
from .call_options import CALL_OPTION_OF_KIND, POLICY_LOSS_KIND, TOP_ENTROPY_INPUT, stablerl_key
from .contracts import UNAVAILABLE, AlgorithmSpec
from .framework_spec import FrameworkSpec
from .registry import framework_of, list_frameworks
from .resolve import framework_names, missing_inputs, why_missing


#: the three answers of :func:`reach`
SELECTABLE, PARTIAL, REFUSED = "selectable", "partial", "refused"


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


def runnable_names(framework: FrameworkSpec | str, kind: str) -> list[str]:
    """The algorithms of ``kind`` (registry order) that ``framework`` can run: selectable or partial there (what an
    adapter registers in its framework's registry)."""
    fw = framework_of(framework)
    return [spec.name for spec in list_algorithms(kind) if reach(fw, spec)[0] != REFUSED]


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
    fw = framework_of(framework)
    if TOP_ENTROPY_INPUT not in fw.feedable.get(POLICY_LOSS_KIND, ()):
        return REFUSED, [fw.why(POLICY_LOSS_KIND, TOP_ENTROPY_INPUT)]
    lines = [stablerl_key(fw, POLICY_LOSS_KIND, "top_entropy_quantile", 0.2)]
    condition = fw.condition(POLICY_LOSS_KIND, TOP_ENTROPY_INPUT)
    if condition:
        lines.append(f"(needs {TOP_ENTROPY_INPUT}: {condition})")
    return (PARTIAL if condition else SELECTABLE), lines
