"""Probes and properties both kinds share: batch reductions, ``batch_statistics``, ``declared_inputs``."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ..api import compute_advantage, get_spec
from ..contracts import ADVANTAGE_ESTIMATOR, POLICY_LOSS
from ..params import MissingInputError
from .batches import _run_loss, advantage_batch, policy_batch
from .common import _fail, _fresh_ctx


def uses_batch_reductions(name: str, kind: str = POLICY_LOSS, params: Optional[Mapping[str, Any]] = None,
                          inputs: Optional[Mapping[str, Any]] = None) -> bool:
    """Whether the algorithm ``name`` calls ``ctx.all_reduce`` / ``ctx.all_gather`` on a regular batch."""
    spec = get_spec(kind, name)
    calls: list[str] = []

    def reduce(t, op):
        calls.append("all_reduce")
        return t

    def gather(t):
        calls.append("all_gather")
        return t

    ctx = _fresh_ctx(all_reduce_fn=reduce, all_gather_fn=gather)
    if kind == POLICY_LOSS:
        _run_loss(spec, policy_batch(spec, inputs=inputs), dict(params or {}), ctx=ctx)
    else:
        compute_advantage(name, ctx=ctx, **advantage_batch(spec, inputs=inputs), **dict(params or {}))
    return bool(calls)


def _declares_batch_statistics(spec, params, inputs) -> tuple[bool, bool]:
    observed = uses_batch_reductions(spec.name, spec.kind, params, inputs)
    return spec.batch_statistics or observed, observed


def _check_batch_statistics(spec, params, inputs) -> None:
    _, observed = _declares_batch_statistics(spec, params, inputs)
    if observed and not spec.batch_statistics:
        _fail(spec, "batch_statistics", "calls ctx.all_reduce/all_gather (takes statistics over the batch) "
              "but its spec does not declare batch_statistics=True")


def _declared_inputs(spec, data, params) -> None:
    prop = "declared_inputs"
    for need in spec.requires:
        if spec.kind == ADVANTAGE_ESTIMATOR and need == "index":
            continue  # always given to an estimator
        kw = {k: v for k, v in data.items() if k != need}
        try:
            if spec.kind == POLICY_LOSS:
                _run_loss(spec, kw, params, requires_grad=False)
            else:
                compute_advantage(spec.name, ctx=_fresh_ctx(), **kw, **params)
        except MissingInputError:
            continue
        except Exception as e:  # noqa: BLE001
            _fail(spec, prop, f"without declared input {need!r} it raised {type(e).__name__}: {e} "
                  "instead of stablerl.MissingInputError")
        _fail(spec, prop, f"ran without its declared input {need!r} instead of raising stablerl.MissingInputError")
