"""Pytest parametrisation: :func:`conformance_cases` and :class:`ConformanceCase`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

from ..contracts import (
    ADVANTAGE_ESTIMATOR,
    BATCH_FILTER,
    CONTROLLER,
    POLICY_LOSS,
    REWARD_SHAPER,
    ROLLOUT_CORRECTION,
    ROUTER_FAMILY,
    TRAINER_HOOK,
    UNAVAILABLE,
    AlgorithmSpec,
)
from ..registry import get_registry
from .distributed import _TwoRankBatch, check_two_rank_equality
from .estimators import check_advantage_estimator
from .extensions import EXTENSION_CHECKS
from .losses import check_policy_loss
from .shared import uses_batch_reductions


#: every kind the suite checks (aggregations are covered through the policy losses that use them)
CONFORMANCE_KINDS = (POLICY_LOSS, ADVANTAGE_ESTIMATOR, REWARD_SHAPER, BATCH_FILTER, CONTROLLER, ROLLOUT_CORRECTION,
                     ROUTER_FAMILY, TRAINER_HOOK)


@dataclass
class ConformanceCase:
    """One conformance test: ``check`` is ``"conformance"`` or ``"two_rank"``. ``run()`` runs it."""

    kind: str
    name: str
    check: str = "conformance"
    params: dict = field(default_factory=dict)
    skip: tuple = ()
    inputs: dict = field(default_factory=dict)
    _batch: Optional[_TwoRankBatch] = field(default=None, repr=False, compare=False)
    _job: int = field(default=-1, repr=False, compare=False)

    def run(self) -> None:
        if self.check == "two_rank" and self._batch is not None:
            self._batch.check(self._job)
        elif self.check == "two_rank":
            check_two_rank_equality(self.name, self.kind, params=self.params)
        elif self.kind == POLICY_LOSS:
            check_policy_loss(self.name, inputs=self.inputs, skip=self.skip, **self.params)
        elif self.kind == ADVANTAGE_ESTIMATOR:
            check_advantage_estimator(self.name, inputs=self.inputs, skip=self.skip, **self.params)
        else:  # reward shapers, batch filters, controllers, rollout corrections, router families
            extra = {"inputs": self.inputs} if self.inputs else {}
            EXTENSION_CHECKS[self.kind](self.name, skip=self.skip, **extra, **self.params)

    @property
    def id(self) -> str:
        return f"{self.name}" + ("-two_rank" if self.check == "two_rank" else "")

    def __str__(self) -> str:
        return self.id


def _reduces(spec: AlgorithmSpec, params, inputs) -> bool:
    try:
        return uses_batch_reductions(spec.name, spec.kind, params, inputs)
    except Exception:  # noqa: BLE001 - the conformance case reports the error
        return False


def _plugin_matches(label: str, wanted: str) -> bool:
    ep_name, _, rest = label.partition(" (")
    value = rest[:-1] if rest.endswith(")") else label
    module = value.split(":")[0]
    return wanted in (label, ep_name, value, module) or module.startswith(wanted + ".")


def conformance_cases(
    names: Optional[Iterable[str]] = None,
    *,
    plugin: Optional[str] = None,
    kinds: Iterable[str] = CONFORMANCE_KINDS,
    params: Optional[Mapping[str, Mapping[str, Any]]] = None,
    skip: Optional[Mapping[str, Iterable[str]]] = None,
    inputs: Optional[Mapping[str, Mapping[str, Any]]] = None,
    two_rank: bool = True,
) -> list:
    """The conformance cases of the registered algorithms, ready for ``pytest.mark.parametrize``.

    Select by ``names`` and/or ``plugin`` (an entry-point name such as ``"example"``, a module such
    as ``"stablerl_example"``, or ``"stablerl.plugins"`` for the built-ins). ``params``, ``skip`` and
    ``inputs`` are per-algorithm-name dicts. Algorithms seen calling ``ctx.all_reduce`` /
    ``ctx.all_gather`` also get a ``two_rank`` case. ``kinds`` defaults to every kind the suite checks
    (:data:`CONFORMANCE_KINDS`: also reward shapers, batch filters, controllers, rollout corrections
    and router families; ``params`` of a controller may hold ``stats``, of a router family ``module``). ``unavailable`` algorithms are skipped. Returns ``pytest.param``s when
    pytest is importable, else :class:`ConformanceCase`s.
    """
    registry = get_registry()
    kinds = tuple(kinds)
    wanted = None if names is None else set(names)
    specs = [s for s in registry.list() if s.kind in kinds
             and (wanted is None or s.name in wanted)
             and (plugin is None or _plugin_matches(s.plugin, plugin))]
    if not specs:
        failures = "; ".join(f"{f.plugin}: {f.error}" for f in registry.failures) or "none"
        raise LookupError(
            f"no {'/'.join(kinds)} registered{' by plugin ' + repr(plugin) if plugin else ''}"
            f"{' named ' + repr(sorted(wanted)) if wanted else ''}; is the package installed (pip install -e .) "
            f"and allowed by STABLERL_PLUGINS? loaded plugins: {registry.plugins}; plugin failures: {failures}"
        )
    if wanted is not None and wanted - {s.name for s in specs}:
        raise LookupError(f"not registered: {sorted(wanted - {s.name for s in specs})}")
    params, skip, inputs = dict(params or {}), dict(skip or {}), dict(inputs or {})
    cases = []
    batch = _TwoRankBatch()
    for s in specs:
        cases.append((s, ConformanceCase(s.kind, s.name, "conformance", dict(params.get(s.name, {})),
                                         tuple(skip.get(s.name, ())), dict(inputs.get(s.name, {})))))
        if two_rank and s.kind in (POLICY_LOSS, ADVANTAGE_ESTIMATOR) and s.status != UNAVAILABLE \
                and _reduces(s, params.get(s.name), inputs.get(s.name)):
            p = dict(params.get(s.name, {}))
            cases.append((s, ConformanceCase(s.kind, s.name, "two_rank", p, _batch=batch, _job=batch.add(s.kind, s.name, p))))
    try:
        import pytest
    except ImportError:  # pragma: no cover
        return [c for s, c in cases if s.status != UNAVAILABLE]
    return [
        pytest.param(c, id=f"{s.kind}:{c.id}",
                     marks=[pytest.mark.skip(reason=f"unavailable: {s.notes}")] if s.status == UNAVAILABLE else [])
        for s, c in cases
    ]
