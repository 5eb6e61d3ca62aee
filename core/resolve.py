"""Name resolution: which stablerl algorithm a framework's config value selects, and whether the framework
can feed the inputs it requires (one rule for every framework; the reasons in the framework's words)."""

from __future__ import annotations

from typing import Any, Optional

from .api import get_spec, list_algorithms
from .contracts import UNAVAILABLE, AlgorithmSpec
from .framework_spec import FrameworkSpec
from .params import MissingInputError, StableRLError, UnknownNameError, build_params, unknown_name_message
from .registry import framework_of, get_registry


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


def selectable_names(framework: FrameworkSpec, kind: str, extra_inputs: Any = ()) -> list[str]:
    """The framework's own names of ``kind``, then every stablerl algorithm it can feed, as selected."""
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
    fw = framework_of(framework)
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
    fw = framework_of(framework)
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


def check_selection(framework: FrameworkSpec | str, kind: str, name: Any, params: Mapping[str, Any], *, key: str,
                    params_key: str, inputs: bool = True) -> Optional[str]:
    """The stablerl ``kind`` that config key ``key`` selects (None, "" and "none": none), checked where the
    config is built: the name (:func:`resolve`; ``inputs=False``: the inputs are checked later), its
    hyper-parameters from ``params_key``, and no hyper-parameters without a name."""
    if name is None or (isinstance(name, str) and name.strip().lower() in ("", "none")):
        if params:
            raise StableRLError(f"{params_key} is set but {key} is not")
        return None
    resolved = resolve(framework, kind, name, inputs=inputs)
    if resolved is not None:
        build_params(get_spec(kind, resolved), dict(params))
    return resolved


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
