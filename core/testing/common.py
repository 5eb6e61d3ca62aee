"""What every conformance check shares: the error, failing and comparing, the ``spec`` property."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

import torch

from ..context import Context
from ..contracts import EXPERIMENTAL, AlgorithmSpec
from ..params import build_params


class ConformanceError(AssertionError):
    """A plugin violates a conformance property (the message names algorithm and property)."""


def _fail(spec: AlgorithmSpec, prop: str, message: str) -> None:
    raise ConformanceError(f"{spec.kind.replace('_', ' ')} {spec.name!r} fails {prop!r}: {message}")


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def _assert_close(spec, prop, what, a, b, rtol=1e-5, atol=1e-7) -> None:
    a, b = torch.as_tensor(a).detach().double(), torch.as_tensor(b).detach().double()
    if a.shape != b.shape:
        _fail(spec, prop, f"{what}: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}")
    if not torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=False):
        _fail(spec, prop, f"{what}: max |difference| {_max_diff(a, b):.3e} (rtol {rtol}, atol {atol}); "
              f"values {a.flatten()[:4].tolist()} vs {b.flatten()[:4].tolist()}")


def _fresh_ctx(**kwargs: Any) -> Context:
    return Context(generator=torch.Generator().manual_seed(1234), **kwargs)


def _check_skip(skip: Iterable[str], valid: tuple[str, ...]) -> set[str]:
    skip = set(skip)
    unknown = skip - set(valid)
    if unknown:
        raise ValueError(f"unknown conformance properties in skip: {sorted(unknown)}; valid: {list(valid)}")
    return skip


def _run_checks(spec, checks, skip) -> None:
    for prop, run in checks:
        if prop in skip:
            continue
        try:
            run()
        except ConformanceError:
            raise
        except Exception as e:  # noqa: BLE001 - an unexpected error is a failure of that property
            raise ConformanceError(
                f"{spec.kind.replace('_', ' ')} {spec.name!r} fails {prop!r}: raised {type(e).__name__}: {e}"
            ) from e


def _is_builtin(spec: AlgorithmSpec) -> bool:
    return spec.plugin.startswith("stablerl.plugins")


def _check_spec(spec: AlgorithmSpec) -> None:
    prop = "spec"
    if not spec.formula.strip():
        _fail(spec, prop, "spec.formula is empty (one line: the formula)")
    if _is_builtin(spec):
        if not spec.paper.strip():
            _fail(spec, prop, "built-in without spec.paper (the arXiv id)")
        if not spec.title.strip():
            _fail(spec, prop, "built-in without spec.title")
        if spec.status == EXPERIMENTAL and not spec.notes.strip():
            _fail(spec, prop, "experimental built-in without spec.notes (state the assumptions)")
    missing = [f.name for f in dataclasses.fields(spec.params)
               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        _fail(spec, prop, f"Params fields without a default: {missing} (defaults are the paper's)")
    try:
        build_params(spec)
    except Exception as e:  # noqa: BLE001
        _fail(spec, prop, f"the default hyper-parameters do not validate: {type(e).__name__}: {e}")


def _grad(spec, prop, loss, lp) -> torch.Tensor:
    if not loss.requires_grad:
        _fail(spec, prop, "the loss does not depend on log_prob (no gradient path)")
    (g,) = torch.autograd.grad(loss, lp, allow_unused=True)
    return torch.zeros_like(lp) if g is None else g


def _same(a: Any, b: Any) -> bool:
    """Equal bit for bit (tensors: dtype, shape, values with NaN in the same places; floats likewise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(torch.nan_to_num(a, 0.5), torch.nan_to_num(b, 0.5))
                and torch.equal(torch.isnan(a), torch.isnan(b)))
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b
