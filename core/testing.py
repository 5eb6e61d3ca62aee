"""The conformance suite: what every stablerl policy loss and advantage estimator must satisfy.

Plugin authors run it with pytest against their own package (every built-in passes it too)::

    import pytest
    from stablerl.testing import conformance_cases

    @pytest.mark.parametrize("case", conformance_cases(plugin="my_plugin"))
    def test_conformance(case):
        case.run()

or call the checks directly: ``check_policy_loss("my_loss", clip=0.2)``,
``check_advantage_estimator("my_estimator")``, ``check_two_rank_equality("my_loss")``.
A failed check raises :class:`ConformanceError` (an ``AssertionError``) whose message names the
algorithm and the property, e.g. ``policy loss 'my_loss' fails 'masked_tokens': ...``.

Policy-loss properties (names accepted by ``skip=``):

* ``spec``: ``formula`` non-empty; built-ins also have ``paper``, ``title``, and ``notes`` when
  experimental; every ``Params`` field has a default and the defaults validate.
* ``output``: the loss is a 0-dim, finite tensor (fp32 for fp32/bf16 inputs; fp64, or fp32,
  for fp64 inputs) whose gradient reaches ``log_prob`` on valid tokens and is finite everywhere.
* ``masked_tokens``: masked tokens get exactly zero gradient, and what padded positions hold
  (finite garbage) changes neither the loss nor the gradient of valid tokens.
* ``detached_inputs``: nothing but ``log_prob`` carries gradient (``old_log_prob``,
  ``advantages``, ``is_weights`` and every declared floating input passed with
  ``requires_grad=True`` receive none).
* ``is_weights``: framework IS weights of 1 change nothing; weights of 0.5 are not ignored
  (a loss may instead refuse IS weights with a ``StableRLError`` that says why).
* ``bf16``: bf16 inputs give a finite fp32 loss close to the fp32 loss of the same inputs.
* ``padding_length``: extra padded columns change neither the loss nor the valid gradient.
* ``micro_batch``: with token-mean and the global ``Context.token_count``, the summed losses and
  gradients of two row micro-batches equal the whole-batch ones. Skipped for algorithms that
  take batch statistics (``AlgorithmSpec.batch_statistics=True``, or seen calling
  ``ctx.all_reduce``/``ctx.all_gather``); :func:`check_two_rank_equality` covers those.
* ``batch_statistics``: an algorithm seen reducing over the batch declares
  ``batch_statistics=True`` (users and docs rely on it). The flag may also be set, with the
  reason in ``notes``, by an algorithm whose statistics are per call by design (e.g. verl's
  per-micro-batch Clip-Cov/KL-Cov selection).
* ``degenerate``: an all-masked row and an all-masked batch give a finite loss (0 for the
  latter) and zero gradient there.
* ``declared_inputs``: leaving out an input named in ``spec.requires`` raises
  ``stablerl.MissingInputError``.
* ``undeclared_inputs``: giving every input in neither ``spec.requires`` nor
  ``spec.optional_inputs`` changes nothing, bit for bit (adapters leave those out); an optional
  input, given, still yields a finite loss. Only torch's global generator is reset between the two
  runs: a loss drawing from other random sources (numpy, its own state) skips this property.
* ``metrics``: plain finite floats, the same keys on two calls, each listed in ``spec.metrics``
  (which may also list metrics that only some hyper-parameter settings emit).

Advantage-estimator properties: ``spec``, ``shapes`` (advantages and returns ``[B, T]``),
``masked`` (exactly 0 outside the mask), ``finite``, ``masked_content`` (reward values outside
the mask are ignored), ``padding_length``, ``group_of_one``, ``equal_rewards``, ``permutation``
(shuffling rows with their uids permutes the output identically), ``bf16``,
``declared_inputs``, ``batch_statistics``. An estimator may refuse groups of one with a
``StableRLError`` that says why.

:func:`check_two_rank_equality` is the check for algorithms that reduce through ``ctx``;
:func:`conformance_cases` adds it (case id ``<name>-two_rank``) for every algorithm seen calling
``ctx.all_reduce``/``ctx.all_gather``.

Inputs named in ``spec.requires`` are synthesised (``rollout_log_prob``, ``entropy``,
``old_entropy``, ``token_ids``, ``index``, ``turn_ids``, ``versions``, ``policy_version``,
``scores``, ``old_log_prob``, ``router_log_prob``, ``old_router_log_prob``, ``hidden_states``,
``lm_head_weight``); pass ``inputs={"name": value_or_fn}`` for anything else, where a
function receives the base batch dict and returns the value (an estimator's ``extras`` dict
goes in as ``inputs={"extras": fn}``; its ``[B]`` tensors follow row selections and shuffles).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional

import numpy as np
import torch

from .api import compute_advantage, compute_policy_loss, get_spec
from .context import Context
from .contracts import ADVANTAGE_ESTIMATOR, EXPERIMENTAL, OPTIONAL_INPUTS, POLICY_LOSS, UNAVAILABLE, AlgorithmSpec
from .params import MissingInputError, StableRLError, build_params
from .registry import get_registry

__all__ = [
    "ConformanceError",
    "POLICY_LOSS_PROPERTIES",
    "ADVANTAGE_ESTIMATOR_PROPERTIES",
    "check_policy_loss",
    "check_advantage_estimator",
    "check_two_rank_equality",
    "conformance_cases",
    "ConformanceCase",
    "uses_batch_reductions",
    "run_two_rank",
]

POLICY_LOSS_PROPERTIES = (
    "spec", "output", "masked_tokens", "detached_inputs", "is_weights", "bf16", "padding_length",
    "micro_batch", "batch_statistics", "degenerate", "declared_inputs", "undeclared_inputs", "metrics",
)
ADVANTAGE_ESTIMATOR_PROPERTIES = (
    "spec", "shapes", "masked", "finite", "masked_content", "padding_length", "group_of_one",
    "equal_rewards", "permutation", "bf16", "declared_inputs", "batch_statistics",
)

# sizes of the synthetic batches
B_LOSS, T_LOSS, GROUP_LOSS = 8, 12, 2
B_ADV, T_ADV, GROUP_ADV = 12, 10, 4
EXTRA_COLUMNS = 5
POLICY_VERSION = 10
_FLOAT_INPUTS = ("log_prob", "old_log_prob", "advantages", "rollout_log_prob", "entropy", "old_entropy")


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


# ----------------------------------------------------------------------------- synthetic data


def _lengths(B: int, T: int, g: torch.Generator) -> torch.Tensor:
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    lengths[1] = 1  # a row with a single valid token
    return lengths


def _synth_input(name: str, B: int, T: int, g: torch.Generator, dtype: torch.dtype,
                 old_log_prob: Optional[torch.Tensor] = None) -> Any:
    """A plausible value for a declared input (``None`` if the suite does not know it)."""
    if old_log_prob is None:
        old_log_prob = -(torch.rand(B, T, generator=g, dtype=dtype) * 2 + 0.05)
    if name == "old_log_prob":
        return old_log_prob
    if name == "rollout_log_prob":
        return (old_log_prob + 0.05 * torch.randn(B, T, generator=g, dtype=dtype)).clamp(max=-1e-4)
    if name in ("entropy", "old_entropy"):
        return torch.rand(B, T, generator=g, dtype=dtype) * 1.5 + 0.05
    if name == "token_ids":
        return torch.randint(0, 1000, (B, T), generator=g)
    if name == "index":
        return torch.arange(B) // GROUP_LOSS
    if name == "turn_ids":
        return (torch.arange(T) // 4).unsqueeze(0).expand(B, T).clone()
    if name == "versions":
        return POLICY_VERSION - torch.randint(0, 3, (B, T), generator=g)
    if name == "policy_version":
        return POLICY_VERSION
    if name == "scores":
        return torch.randint(0, 2, (B,), generator=g).to(dtype)
    if name in ("router_log_prob", "old_router_log_prob"):  # [B, T, layers=2, k=2], shared per seed
        gr = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=g)))
        old = torch.log(torch.rand(B, T, 2, 2, generator=gr, dtype=torch.float64) * 0.5 + 0.05)
        if name == "old_router_log_prob":
            return old.to(dtype)
        return (old + 0.05 * torch.randn(B, T, 2, 2, generator=gr, dtype=torch.float64)).clamp(max=0).to(dtype)
    if name == "hidden_states":  # [B, T, H=8] (CAPO's LM-head model)
        return torch.randn(B, T, 8, generator=g, dtype=dtype)
    if name == "lm_head_weight":  # [V=1000, H=8]: covers the synthesised token_ids
        return 0.5 * torch.randn(1000, 8, generator=g, dtype=dtype)
    return None


def _resolve_extra(name: str, inputs: Mapping[str, Any], base: dict, g: torch.Generator, spec) -> Any:
    if name in inputs:
        value = inputs[name]
        return value(base) if callable(value) else value
    B, T = base["response_mask"].shape
    dtype = base["old_log_prob"].dtype if "old_log_prob" in base else torch.float32
    value = _synth_input(name, B, T, torch.Generator().manual_seed(zlib.crc32(name.encode()) % 1000 + int(g.initial_seed())),
                         dtype, base.get("old_log_prob"))
    if value is None:
        _fail(spec, "declared_inputs", f"declares input {name!r}, which the suite cannot synthesise; "
              f"pass inputs={{{name!r}: value_or_fn}}")
    return value


def policy_batch(spec: AlgorithmSpec, seed: int = 0, B: int = B_LOSS, T: int = T_LOSS,
                 dtype: torch.dtype = torch.float64, inputs: Optional[Mapping[str, Any]] = None) -> dict:
    """A random right-padded policy-loss batch with every input ``spec`` declares (and ``inputs``)."""
    g = torch.Generator().manual_seed(seed)
    old = -(torch.rand(B, T, generator=g, dtype=torch.float64) * 2 + 0.05)
    lp = (old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    adv = torch.randn(B, generator=g, dtype=torch.float64).unsqueeze(-1).expand(B, T).clone()
    mask = torch.arange(T).unsqueeze(0) < _lengths(B, T, g).unsqueeze(1)
    base = {"log_prob": lp, "old_log_prob": old, "advantages": adv, "response_mask": mask}
    inputs = dict(inputs or {})
    for name in list(spec.requires) + [k for k in inputs if k not in spec.requires]:
        base[name] = _resolve_extra(name, inputs, base, g, spec)
    return {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in base.items()}


def _token_aligned(v: Any, shape) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() >= 2 and tuple(v.shape[:2]) == tuple(shape)


def _garbage_like(name: str, t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Finite nonsense for padded positions (what a framework may leave there)."""
    if not t.is_floating_point():
        return torch.randint(0, 1000, t.shape, generator=g).to(t.dtype) if name == "token_ids" else t.clone()
    u = torch.rand(t.shape, generator=g, dtype=torch.float64)
    if name.endswith("log_prob"):
        out = -30 * u
    elif name in ("entropy", "old_entropy"):
        out = 20 * u
    else:
        out = 100 * u - 50
    return out.to(t.dtype)


def _fill_padding(data: dict, seed: int = 99) -> dict:
    """The same batch with finite garbage in every padded position."""
    g = torch.Generator().manual_seed(seed)
    pad = ~data["response_mask"].bool()
    out = dict(data)
    for k, v in data.items():
        if k != "response_mask" and _token_aligned(v, pad.shape):
            p = pad.reshape(pad.shape + (1,) * (v.dim() - 2))
            out[k] = torch.where(p, _garbage_like(k, v, g), v)
    return out


def _pad_columns(data: dict, extra: int, seed: int = 7) -> dict:
    g = torch.Generator().manual_seed(seed)
    shape = data["response_mask"].shape
    out = {}
    for k, v in data.items():
        if _token_aligned(v, shape):
            cols = torch.zeros((shape[0], extra) + tuple(v.shape[2:]), dtype=v.dtype)
            if k != "response_mask":
                cols = _garbage_like(k, cols, g)
            out[k] = torch.cat([v, cols], dim=1)
        else:
            out[k] = v
    return out


def _rows(data: dict, rows: Any, B: int) -> dict:
    """Select rows (a slice or an index tensor) of every per-response entry, also inside ``extras``."""
    out = {}
    for k, v in data.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == B:
            out[k] = v[rows]
        elif isinstance(v, np.ndarray) and v.shape[:1] == (B,):
            out[k] = v[rows.numpy() if isinstance(rows, torch.Tensor) else rows]
        elif isinstance(v, dict):
            out[k] = _rows(v, rows, B)
        else:
            out[k] = v
    return out


def _run_loss(spec, data, params, ctx=None, requires_grad=True, **overrides):
    kw = dict(data)
    kw.update(overrides)
    lp = kw["log_prob"].detach().clone().requires_grad_(requires_grad)
    kw["log_prob"] = lp
    loss, metrics = compute_policy_loss(spec.name, ctx=ctx if ctx is not None else _fresh_ctx(), **kw, **params)
    return loss, metrics, lp


def _grad(spec, prop, loss, lp) -> torch.Tensor:
    if not loss.requires_grad:
        _fail(spec, prop, "the loss does not depend on log_prob (no gradient path)")
    (g,) = torch.autograd.grad(loss, lp, allow_unused=True)
    return torch.zeros_like(lp) if g is None else g


# ----------------------------------------------------------------------------- shared: spec


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


# ----------------------------------------------------------------------------- policy losses


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


def check_policy_loss(name: str, *, inputs: Optional[Mapping[str, Any]] = None, skip: Iterable[str] = (),
                      **params: Any) -> None:
    """Run every policy-loss conformance property on the registered loss ``name``.

    ``params`` are hyper-parameters (default: the spec's), ``inputs`` supplies declared inputs
    the suite cannot synthesise, ``skip`` names properties to leave out (see the module doc).
    Raises :class:`ConformanceError` on the first violated property.
    """
    spec = get_spec(POLICY_LOSS, name)
    skip = _check_skip(skip, POLICY_LOSS_PROPERTIES)
    inputs = dict(inputs or {})
    data = policy_batch(spec, seed=0, inputs=inputs)
    mask = data["response_mask"].bool()
    checks: list[tuple[str, Callable[[], None]]] = [
        ("spec", lambda: _check_spec(spec)),
        ("output", lambda: _loss_output(spec, data, params)),
        ("masked_tokens", lambda: _loss_masked_tokens(spec, data, mask, params)),
        ("detached_inputs", lambda: _loss_detached_inputs(spec, data, params)),
        ("is_weights", lambda: _loss_is_weights(spec, data, mask, params)),
        ("bf16", lambda: _loss_bf16(spec, data, params)),
        ("padding_length", lambda: _loss_padding_length(spec, data, mask, params)),
        ("batch_statistics", lambda: _check_batch_statistics(spec, params, inputs)),
        ("micro_batch", lambda: _loss_micro_batch(spec, data, params, inputs)),
        ("degenerate", lambda: _loss_degenerate(spec, data, params)),
        ("declared_inputs", lambda: _declared_inputs(spec, data, params)),
        ("undeclared_inputs", lambda: _loss_undeclared_inputs(spec, data, params)),
        ("metrics", lambda: _loss_metrics(spec, data, params, inputs)),
    ]
    _run_checks(spec, checks, skip)


def _loss_output(spec, data, params) -> None:
    prop = "output"
    for dtype, want in ((torch.float32, (torch.float32,)), (torch.float64, (torch.float64, torch.float32))):
        d = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in data.items()}
        loss, _, lp = _run_loss(spec, d, params)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            _fail(spec, prop, f"loss is not a 0-dim tensor: {type(loss).__name__} {getattr(loss, 'shape', '')}")
        if loss.dtype not in want:
            _fail(spec, prop, f"{dtype} inputs gave a {loss.dtype} loss, expected {want[0]}")
        if not torch.isfinite(loss):
            _fail(spec, prop, f"non-finite loss {float(loss.detach())} on a regular {dtype} batch")
        grad = _grad(spec, prop, loss, lp)
        if not bool(torch.isfinite(grad).all()):
            _fail(spec, prop, f"non-finite gradient on log_prob ({dtype})")
        if not bool((grad[d["response_mask"].bool()] != 0).any()):
            _fail(spec, prop, "the gradient is zero on every valid token")


def _loss_masked_tokens(spec, data, mask, params) -> None:
    prop = "masked_tokens"
    loss, _, lp = _run_loss(spec, data, params)
    grad = _grad(spec, prop, loss, lp)
    garbage = _fill_padding(data)
    loss_g, _, lp_g = _run_loss(spec, garbage, params)
    grad_g = _grad(spec, prop, loss_g, lp_g)
    for label, g in (("random padding", grad), ("garbage padding", grad_g)):
        leaked = g[~mask]
        if bool((leaked != 0).any()):
            _fail(spec, prop, f"masked tokens receive gradient with {label}: max |grad| "
                  f"{float(leaked.abs().max()):.3e} over {int((leaked != 0).sum())} masked tokens (must be exactly 0)")
    _assert_close(spec, prop, "loss with garbage vs random values in padded positions", loss_g, loss)
    _assert_close(spec, prop, "valid-token gradient with garbage vs random padding", grad_g[mask], grad[mask])


def _loss_detached_inputs(spec, data, params) -> None:
    prop = "detached_inputs"
    leaves = {}
    kw = dict(data)
    for k, v in data.items():
        if k not in ("log_prob", "response_mask") and isinstance(v, torch.Tensor) and v.is_floating_point():
            leaves[k] = kw[k] = v.detach().clone().requires_grad_(True)
    if _accepts_is_weights(spec, data, params):
        leaves["is_weights"] = kw["is_weights"] = torch.ones_like(data["log_prob"]).requires_grad_(True)
    loss, _, lp = _run_loss(spec, kw, params)
    loss.backward()
    carrying = {k: float(v.grad.abs().max()) for k, v in leaves.items() if v.grad is not None and bool((v.grad != 0).any())}
    if carrying:
        _fail(spec, prop, f"gradient reaches inputs other than log_prob (max |grad|): {carrying}; they must be detached")


def _accepts_is_weights(spec, data, params) -> bool:
    """False when the loss refuses framework IS weights with a clear StableRLError (sequence-level
    objectives may); accepting them silently and ignoring them is what ``is_weights`` catches."""
    try:
        _run_loss(spec, data, params, requires_grad=False, is_weights=torch.ones_like(data["log_prob"]))
    except StableRLError:
        return False
    return True


def _loss_is_weights(spec, data, mask, params) -> None:
    prop = "is_weights"
    if not _accepts_is_weights(spec, data, params):
        return
    loss, _, lp = _run_loss(spec, data, params)
    grad = _grad(spec, prop, loss, lp)
    ones = torch.ones_like(data["log_prob"])
    loss_1, _, lp_1 = _run_loss(spec, data, params, is_weights=ones)
    _assert_close(spec, prop, "loss with is_weights=1 vs none", loss_1, loss)
    _assert_close(spec, prop, "gradient with is_weights=1 vs none", _grad(spec, prop, loss_1, lp_1), grad)
    loss_h, _, lp_h = _run_loss(spec, data, params, is_weights=0.5 * ones)
    grad_h = _grad(spec, prop, loss_h, lp_h)
    if torch.allclose(grad_h[mask], grad[mask], rtol=1e-6, atol=1e-9) and float(grad[mask].abs().max()) > 0:
        _fail(spec, prop, "is_weights=0.5 leaves the gradient unchanged: framework IS weights are ignored "
              "(an output='scalar' loss must apply batch.is_weights itself)")


def _loss_bf16(spec, data, params) -> None:
    prop = "bf16"
    bf = {k: (v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in data.items()}
    loss_bf, _, lp_bf = _run_loss(spec, bf, params)
    if loss_bf.dtype != torch.float32:
        _fail(spec, prop, f"bf16 inputs gave a {loss_bf.dtype} loss; half precision is computed in fp32")
    if not torch.isfinite(loss_bf):
        _fail(spec, prop, f"non-finite loss {float(loss_bf.detach())} with bf16 inputs")
    grad_bf = _grad(spec, prop, loss_bf, lp_bf)
    if grad_bf.dtype != torch.bfloat16 or not bool(torch.isfinite(grad_bf.float()).all()):
        _fail(spec, prop, f"gradient on bf16 log_prob is {grad_bf.dtype} / non-finite")
    # same (bf16-representable) values in fp32: the plugin sees identical numbers
    rounded = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in bf.items()}
    loss_32, _, _ = _run_loss(spec, rounded, params)
    _assert_close(spec, prop, "loss of bf16 inputs vs fp32 of the same values", loss_bf, loss_32, rtol=1e-4, atol=1e-6)
    # and close to the loss of the unrounded inputs
    loss_ref, _, _ = _run_loss(spec, data, params)
    scale = float(loss_ref.detach().abs()) + float(data["advantages"][data["response_mask"].bool()].abs().mean())
    if abs(float(loss_bf.detach()) - float(loss_ref.detach())) > 0.05 * scale:
        _fail(spec, prop, f"bf16 loss {float(loss_bf):.6g} is far from the fp64 loss {float(loss_ref):.6g} "
              f"(allowed {0.05 * scale:.3g})")


def _loss_padding_length(spec, data, mask, params) -> None:
    prop = "padding_length"
    T = mask.shape[1]
    loss, _, lp = _run_loss(spec, data, params)
    grad = _grad(spec, prop, loss, lp)
    longer = _pad_columns(data, EXTRA_COLUMNS)
    loss_p, _, lp_p = _run_loss(spec, longer, params)
    grad_p = _grad(spec, prop, loss_p, lp_p)
    _assert_close(spec, prop, f"token-mean loss with {EXTRA_COLUMNS} extra padded columns vs without", loss_p, loss)
    _assert_close(spec, prop, "valid-token gradient with extra padded columns vs without", grad_p[:, :T][mask], grad[mask])
    if bool((grad_p[:, T:] != 0).any()):
        _fail(spec, prop, "the extra padded columns receive gradient")


def _declares_batch_statistics(spec, params, inputs) -> tuple[bool, bool]:
    observed = uses_batch_reductions(spec.name, spec.kind, params, inputs)
    return spec.batch_statistics or observed, observed


def _check_batch_statistics(spec, params, inputs) -> None:
    _, observed = _declares_batch_statistics(spec, params, inputs)
    if observed and not spec.batch_statistics:
        _fail(spec, "batch_statistics", "calls ctx.all_reduce/all_gather (takes statistics over the batch) "
              "but its spec does not declare batch_statistics=True")


def _loss_micro_batch(spec, data, params, inputs) -> None:
    prop = "micro_batch"
    takes_stats, _ = _declares_batch_statistics(spec, params, inputs)
    if takes_stats:
        return  # per-call batch statistics: covered by check_two_rank_equality
    mask = data["response_mask"].bool()
    B = mask.shape[0]
    loss, _, lp = _run_loss(spec, data, params)
    grad = _grad(spec, prop, loss, lp)
    n_tokens, total, grads = float(mask.sum()), 0.0, []
    half = (B // 2) // GROUP_LOSS * GROUP_LOSS  # split on a group boundary
    for rows in (slice(0, half), slice(half, B)):
        ctx = _fresh_ctx(token_count=n_tokens, seq_count=float(B))
        loss_mb, _, lp_mb = _run_loss(spec, _rows(data, rows, B), params, ctx=ctx)
        total = total + loss_mb.detach()
        grads.append(_grad(spec, prop, loss_mb, lp_mb))
    hint = (" (if the algorithm takes statistics over the batch by design, declare batch_statistics=True "
            "and take them through ctx.all_reduce/all_gather)")
    try:
        _assert_close(spec, prop, "sum of 2 micro-batch losses (global token_count) vs whole-batch loss", total, loss)
        _assert_close(spec, prop, "concatenated micro-batch gradients vs whole-batch gradient", torch.cat(grads), grad)
    except ConformanceError as e:
        raise ConformanceError(str(e) + hint) from None


def _loss_degenerate(spec, data, params) -> None:
    prop = "degenerate"
    B, T = data["response_mask"].shape
    one_row = dict(data)
    m = data["response_mask"].clone()
    m[2] = False
    one_row["response_mask"] = m
    loss, _, lp = _run_loss(spec, one_row, params)
    grad = _grad(spec, prop, loss, lp)
    if not torch.isfinite(loss) or not bool(torch.isfinite(grad).all()):
        _fail(spec, prop, f"an all-masked row gives loss {float(loss.detach())} / non-finite gradient")
    if bool((grad[2] != 0).any()):
        _fail(spec, prop, "an all-masked row receives gradient")
    empty = dict(data)
    empty["response_mask"] = torch.zeros_like(data["response_mask"])
    loss, _, lp = _run_loss(spec, empty, params)
    value = float(loss.detach())
    if not math.isfinite(value) or value != 0.0:
        _fail(spec, prop, f"an all-masked batch gives loss {value}, expected 0")
    if loss.requires_grad:
        grad = _grad(spec, prop, loss, lp)
        if not bool(torch.isfinite(grad).all()) or bool((grad != 0).any()):
            _fail(spec, prop, "an all-masked batch gives a non-zero or non-finite gradient")


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


def _same(a: Any, b: Any) -> bool:
    """Equal bit for bit (tensors: dtype, shape, values with NaN in the same places; floats likewise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(torch.nan_to_num(a, 0.5), torch.nan_to_num(b, 0.5))
                and torch.equal(torch.isnan(a), torch.isnan(b)))
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


def _loss_undeclared_inputs(spec, data, params) -> None:
    """An input in neither ``requires`` nor ``optional_inputs`` is never read: giving every such input the
    suite can make changes nothing, bit for bit (adapters rely on it to leave them out). Each optional
    input, given, still yields a finite loss and gradient."""
    prop = "undeclared_inputs"
    B, T = data["response_mask"].shape
    dtype, old = data["old_log_prob"].dtype, data["old_log_prob"]
    g = torch.Generator().manual_seed(11)
    undeclared = {}
    for name in OPTIONAL_INPUTS:
        if name not in spec.reads and name not in data:
            value = _synth_input(name, B, T, g, dtype, old)
            if value is not None:
                undeclared[name] = value

    def run(kw):
        # losses that sample from torch's global generator (clip_cov) draw the same numbers in both runs,
        # forward and backward; other sources of randomness (numpy, module-level state) are not controlled:
        # such a plugin skips this property
        with torch.random.fork_rng():
            torch.manual_seed(0)
            loss, metrics, lp = _run_loss(spec, kw, params)
            grad = torch.autograd.grad(loss, lp, allow_unused=True)[0] if loss.requires_grad else None
        return loss.detach(), grad, metrics

    (l1, g1, m1), (l2, g2, m2) = run(data), run({**data, **undeclared})
    if not (_same(l1, l2) and (g1 is None) == (g2 is None) and (g1 is None or _same(g1, g2))
            and m1.keys() == m2.keys() and all(_same(m1[k], m2[k]) for k in m1)):
        _fail(spec, prop, f"its result changes when it is also given {sorted(undeclared)}: it reads an input it does "
              "not declare (name it in requires, or in optional_inputs if it has a fallback)")
    for name in spec.optional_inputs:
        value = _synth_input(name, B, T, g, dtype, old)
        if value is None:
            continue
        loss, _, metrics = run({**data, name: value})
        if not bool(torch.isfinite(loss)) or not all(math.isfinite(v) for v in metrics.values()):
            _fail(spec, prop, f"given its optional input {name!r}, the loss or a metric is not finite")


def _loss_metrics(spec, data, params, inputs) -> None:
    prop = "metrics"
    _, m1, _ = _run_loss(spec, data, params)
    _, m2, _ = _run_loss(spec, policy_batch(spec, seed=1, inputs=inputs), params)
    for m in (m1, m2):
        bad = {k: type(v).__name__ for k, v in m.items() if type(v) is not float}
        if bad:
            _fail(spec, prop, f"metrics must be plain floats, got {bad}")
    nonfinite = [k for k, v in m1.items() if not math.isfinite(v)]
    if nonfinite:
        _fail(spec, prop, f"non-finite metrics on a regular batch: {nonfinite}")
    if list(m1) != list(m2):
        _fail(spec, prop, f"different metric keys on two calls: {sorted(m1)} vs {sorted(m2)}")
    undeclared = [k for k in m1 if k not in spec.metrics]
    if undeclared:
        _fail(spec, prop, f"emits metrics {undeclared} that spec.metrics does not list (lists {list(spec.metrics)})")


# ----------------------------------------------------------------------------- advantage estimators


def advantage_batch(spec: AlgorithmSpec, seed: int = 0, B: int = B_ADV, T: int = T_ADV, group: int = GROUP_ADV,
                    dtype: torch.dtype = torch.float32, inputs: Optional[Mapping[str, Any]] = None) -> dict:
    """Outcome rewards on the last valid token, verl-style string uids, groups of ``group``."""
    g = torch.Generator().manual_seed(seed)
    lengths = _lengths(B, T, g)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    scores = torch.randint(0, 2, (B,), generator=g).double()
    scores[group: 2 * group] = torch.rand(group, generator=g, dtype=torch.float64) * 2 - 0.5  # continuous group
    rewards = torch.zeros(B, T, dtype=torch.float64)
    rewards[torch.arange(B), lengths - 1] = scores
    uid = np.array([f"prompt-{i // group}" for i in range(B)], dtype=object)
    base = {"token_level_rewards": rewards.to(dtype), "response_mask": mask, "index": uid}
    inputs = dict(inputs or {})
    for name in list(spec.requires) + [k for k in inputs if k not in spec.requires]:
        if name != "index":
            base[name] = _resolve_extra(name, inputs, base, g, spec)
    return base


def _run_adv(spec, data, params):
    return compute_advantage(spec.name, ctx=_fresh_ctx(), **data, **params)


def check_advantage_estimator(name: str, *, inputs: Optional[Mapping[str, Any]] = None, skip: Iterable[str] = (),
                              **params: Any) -> None:
    """Run every advantage-estimator conformance property on the registered estimator ``name``.

    Same arguments as :func:`check_policy_loss`; raises :class:`ConformanceError`.
    """
    spec = get_spec(ADVANTAGE_ESTIMATOR, name)
    skip = _check_skip(skip, ADVANTAGE_ESTIMATOR_PROPERTIES)
    inputs = dict(inputs or {})
    data = advantage_batch(spec, inputs=inputs)
    ref: dict[str, torch.Tensor] = {}

    def reference():  # the regular batch's output, computed by the first property that needs it
        if not ref:
            ref["adv"], ref["ret"] = _run_adv(spec, data, params)
        return ref["adv"], ref["ret"]

    checks = [
        ("spec", lambda: _check_spec(spec)),
        ("shapes", lambda: _adv_shapes(spec, data, reference())),
        ("masked", lambda: _adv_masked(spec, data, reference())),
        ("finite", lambda: _adv_finite(spec, data, reference())),
        ("masked_content", lambda: _adv_masked_content(spec, data, params, reference())),
        ("padding_length", lambda: _adv_padding_length(spec, data, params, reference())),
        ("group_of_one", lambda: _adv_group_of_one(spec, data, params)),
        ("equal_rewards", lambda: _adv_equal_rewards(spec, data, params)),
        ("permutation", lambda: _adv_permutation(spec, data, params, reference())),
        ("bf16", lambda: _adv_bf16(spec, data, params)),
        ("declared_inputs", lambda: _declared_inputs(spec, data, params)),
        ("batch_statistics", lambda: _check_batch_statistics(spec, params, inputs)),
    ]
    _run_checks(spec, checks, skip)


def _adv_shapes(spec, data, out) -> None:
    B, T = data["response_mask"].shape
    for what, t in zip(("advantages", "returns"), out):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (B, T):
            _fail(spec, "shapes", f"{what} has shape {tuple(getattr(t, 'shape', ()))}, expected {(B, T)}")
        if t.dtype != torch.float32:
            _fail(spec, "shapes", f"{what} is {t.dtype} for fp32 rewards, expected torch.float32")


def _adv_masked(spec, data, out) -> None:
    mask = data["response_mask"].bool()
    for what, t in zip(("advantages", "returns"), out):
        if bool((t[~mask] != 0).any()):
            _fail(spec, "masked", f"{what} non-zero outside the mask")


def _adv_finite(spec, data, out) -> None:
    mask = data["response_mask"].bool()
    for what, t in zip(("advantages", "returns"), out):
        if not bool(torch.isfinite(t).all()):
            _fail(spec, "finite", f"{what} has non-finite values on a regular batch")
    if not bool((out[0][mask] != 0).any()):
        _fail(spec, "finite", "advantages are zero on every valid token of a batch with distinct rewards")


def _adv_masked_content(spec, data, params, out) -> None:
    mask = data["response_mask"].bool()
    noise = torch.randn(mask.shape, generator=torch.Generator().manual_seed(5)) * 10
    noisy = _fill_padding(dict(data, token_level_rewards=torch.where(mask, data["token_level_rewards"], noise)))
    adv_n, ret_n = _run_adv(spec, noisy, params)
    _assert_close(spec, "masked_content", "advantages with garbage vs zero rewards outside the mask", adv_n, out[0], atol=1e-6)
    _assert_close(spec, "masked_content", "returns with garbage vs zero rewards outside the mask", ret_n, out[1], atol=1e-6)


def _adv_padding_length(spec, data, params, out) -> None:
    B, T = data["response_mask"].shape
    longer = _pad_columns(data, EXTRA_COLUMNS)
    longer["token_level_rewards"] = torch.cat([data["token_level_rewards"], torch.zeros(B, EXTRA_COLUMNS)], 1)
    adv_p, ret_p = _run_adv(spec, longer, params)
    _assert_close(spec, "padding_length", f"advantages with {EXTRA_COLUMNS} extra padded columns", adv_p[:, :T], out[0], atol=1e-6)
    _assert_close(spec, "padding_length", f"returns with {EXTRA_COLUMNS} extra padded columns", ret_p[:, :T], out[1], atol=1e-6)


def _adv_group_of_one(spec, data, params) -> None:
    B = data["response_mask"].shape[0]
    try:
        a, r = _run_adv(spec, dict(data, index=np.array([f"solo-{i}" for i in range(B)], dtype=object)), params)
    except StableRLError as e:
        if "non-finite" in str(e):  # core's guard caught a NaN/inf the estimator produced
            _fail(spec, "group_of_one", f"groups of one response give non-finite advantages ({e})")
        return  # refusing groups of one with a clear error is fine; a NaN is not
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(r).all())):
        _fail(spec, "group_of_one", "groups of one response give non-finite advantages/returns")


def _adv_equal_rewards(spec, data, params) -> None:
    mask = data["response_mask"].bool()
    B, T = mask.shape
    last = mask.long().sum(-1) - 1
    for value in (0.0, 1.0):
        rewards = torch.zeros(B, T)
        rewards[torch.arange(B), last] = value
        a, r = _run_adv(spec, dict(data, token_level_rewards=rewards), params)
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(r).all())):
            _fail(spec, "equal_rewards", f"all rewards equal to {value} give non-finite advantages/returns")


def _adv_permutation(spec, data, params, out) -> None:
    B = data["response_mask"].shape[0]
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(3))
    adv_s, ret_s = _run_adv(spec, _rows(data, perm, B), params)
    _assert_close(spec, "permutation", "advantages of shuffled rows vs shuffled advantages", adv_s, out[0][perm], atol=1e-5)
    _assert_close(spec, "permutation", "returns of shuffled rows vs shuffled returns", ret_s, out[1][perm], atol=1e-5)


def _adv_bf16(spec, data, params) -> None:
    bf = {k: (v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in data.items()}
    adv_b, ret_b = _run_adv(spec, bf, params)
    if not (bool(torch.isfinite(adv_b).all()) and bool(torch.isfinite(ret_b).all())):
        _fail(spec, "bf16", "bf16 inputs give non-finite advantages/returns")
    rounded = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in bf.items()}
    adv_r, _ = _run_adv(spec, rounded, params)
    scale = max(1.0, float(adv_r.abs().max()))
    _assert_close(spec, "bf16", "advantages of bf16 inputs vs fp32 of the same values", adv_b.float(), adv_r,
                  rtol=2e-2, atol=2e-2 * scale)


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


# ----------------------------------------------------------------------------- two ranks (gloo)


def _two_rank_data(spec, seed=0):
    return policy_batch(spec, seed=seed) if spec.kind == POLICY_LOSS else advantage_batch(spec, seed=seed, dtype=torch.float64)


def _rank_rows(spec, data, rank: int, world: int) -> slice:
    """Contiguous rows for ``rank``, cut on group boundaries."""
    B = data["response_mask"].shape[0]
    group = GROUP_LOSS if spec.kind == POLICY_LOSS else GROUP_ADV
    per = -(-(B // group) // world)
    return slice(min(B, rank * per * group), min(B, (rank + 1) * per * group))


def _two_rank_worker(rank: int, world: int, init_file: str, jobs_json: str, out: str) -> None:
    """Entry point of one spawned rank: run every job, save ``{job index: result or error}``."""
    import traceback

    import torch.distributed as dist

    from .context import torch_distributed_context

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results: dict[int, Any] = {}
    try:
        for i, (kind, name, params) in enumerate(json.loads(jobs_json)):
            try:
                spec = get_spec(kind, name)
                data = _two_rank_data(spec)
                mask = data["response_mask"].bool()
                B = mask.shape[0]
                local = _rows(data, _rank_rows(spec, data, rank, world), B)
                ctx = torch_distributed_context(token_count=float(mask.sum()), seq_count=float(B),
                                                generator=torch.Generator().manual_seed(1234))
                if kind == POLICY_LOSS:
                    loss, _, lp = _run_loss(spec, local, params, ctx=ctx)
                    grad = torch.autograd.grad(loss, lp, allow_unused=True)[0] if loss.requires_grad else None
                    results[i] = {"loss": loss.detach(), "grad": torch.zeros_like(lp) if grad is None else grad}
                else:
                    adv, ret = compute_advantage(spec.name, ctx=ctx, **local, **params)
                    results[i] = {"advantages": adv, "returns": ret}
            except Exception:  # noqa: BLE001 - reported per job by the parent
                results[i] = traceback.format_exc()
            dist.barrier()  # a job that failed on one rank must not leave the other waiting in a collective
        torch.save(results, out)
    finally:
        dist.destroy_process_group()


def run_two_rank(jobs: list[tuple[str, str, Mapping[str, Any]]], world_size: int = 2, timeout: float = 120.0) -> list:
    """Run ``(kind, name, params)`` jobs on ``world_size`` gloo ranks (one spawn for all jobs).

    Returns, per job, the list of per-rank results (dicts of tensors) or an error string.
    """
    jobs = [(k, n, dict(p or {})) for k, n, p in jobs]
    with tempfile.TemporaryDirectory(prefix="stablerl-2rank-") as tmp:
        init_file = os.path.join(tmp, "store")
        outs = [os.path.join(tmp, f"rank{r}.pt") for r in range(world_size)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        code = ("import sys; from stablerl.testing import _two_rank_worker; "
                "_two_rank_worker(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])")
        procs = [
            subprocess.Popen([sys.executable, "-W", "ignore", "-c", code, str(r), str(world_size), init_file,
                              json.dumps(jobs), outs[r]],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(world_size)
        ]
        errors = []
        for r, p in enumerate(procs):
            try:
                _, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                    q.communicate()
                return [f"rank {r} did not finish within {timeout} s"] * len(jobs)
            if p.returncode != 0:
                errors.append(f"rank {r} exited {p.returncode}:\n{err[-3000:]}")
        if errors:
            return ["\n".join(errors)] * len(jobs)
        per_rank = [torch.load(o) for o in outs]
    out = []
    for i in range(len(jobs)):
        failed = [r[i] for r in per_rank if isinstance(r[i], str)]
        out.append(failed[0] if failed else [r[i] for r in per_rank])
    return out


def _compare_two_rank(spec, params, results, world_size: int) -> None:
    if isinstance(results, str):
        _fail(spec, "two_rank", f"the distributed run failed:\n{results}")
    data = _two_rank_data(spec)
    if spec.kind == POLICY_LOSS:
        loss, _, lp = _run_loss(spec, data, params)
        grad = _grad(spec, "two_rank", loss, lp)
        mean_loss = sum(float(r["loss"]) for r in results) / world_size
        _assert_close(spec, "two_rank", f"mean of {world_size} rank losses vs 1-rank loss", mean_loss, loss.detach(),
                      rtol=1e-6, atol=1e-9)
        cat = torch.cat([r["grad"] for r in results]) / world_size
        _assert_close(spec, "two_rank", f"{world_size}-rank gradients / dp_size vs 1-rank gradient", cat, grad,
                      rtol=1e-6, atol=1e-9)
    else:
        adv, ret = compute_advantage(spec.name, ctx=_fresh_ctx(), **data, **params)
        _assert_close(spec, "two_rank", f"{world_size}-rank advantages vs 1-rank",
                      torch.cat([r["advantages"] for r in results]), adv, rtol=1e-6, atol=1e-9)
        _assert_close(spec, "two_rank", f"{world_size}-rank returns vs 1-rank",
                      torch.cat([r["returns"] for r in results]), ret, rtol=1e-6, atol=1e-9)


def check_two_rank_equality(name: str, kind: str = POLICY_LOSS, *, params: Optional[Mapping[str, Any]] = None,
                            world_size: int = 2, timeout: float = 120.0) -> None:
    """Two data-parallel ranks (gloo, CPU, separate processes) equal one rank with the whole batch.

    For a policy loss each rank gets half of the rows (whole groups) with
    ``torch_distributed_context`` (global token count and ``seq_count``, ``dp_size=2``); the rank
    losses averaged, and each rank's gradient divided by ``dp_size``, must equal the whole-batch
    loss and gradient (what DP gradient averaging computes). For an estimator each rank gets
    whole groups and the concatenated advantages must equal the whole-batch ones. The algorithm
    must be loadable in a fresh interpreter (an installed plugin; ``STABLERL_PLUGINS`` and
    ``sys.path`` are passed on). ``params`` must be JSON-serialisable. A few seconds (two
    interpreters importing torch).
    """
    spec = get_spec(kind, name)
    params = dict(params or {})
    (results,) = run_two_rank([(kind, name, params)], world_size=world_size, timeout=timeout)
    _compare_two_rank(spec, params, results, world_size)


class _TwoRankBatch:
    """All two-rank cases of one :func:`conformance_cases` call share one spawn (run lazily, once)."""

    def __init__(self) -> None:
        self.jobs: list[tuple[str, str, dict]] = []
        self.results: Optional[list] = None

    def add(self, kind: str, name: str, params: dict) -> int:
        self.jobs.append((kind, name, params))
        return len(self.jobs) - 1

    def check(self, i: int) -> None:
        if self.results is None:
            self.results = run_two_rank(self.jobs)
        kind, name, params = self.jobs[i]
        _compare_two_rank(get_spec(kind, name), params, self.results[i], 2)


# ----------------------------------------------------------------------------- pytest parametrisation


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
        else:
            check_advantage_estimator(self.name, inputs=self.inputs, skip=self.skip, **self.params)

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
    kinds: Iterable[str] = (POLICY_LOSS, ADVANTAGE_ESTIMATOR),
    params: Optional[Mapping[str, Mapping[str, Any]]] = None,
    skip: Optional[Mapping[str, Iterable[str]]] = None,
    inputs: Optional[Mapping[str, Mapping[str, Any]]] = None,
    two_rank: bool = True,
) -> list:
    """The conformance cases of the registered algorithms, ready for ``pytest.mark.parametrize``.

    Select by ``names`` and/or ``plugin`` (an entry-point name such as ``"example"``, a module such
    as ``"stablerl_example"``, or ``"stablerl.plugins"`` for the built-ins). ``params``, ``skip`` and
    ``inputs`` are per-algorithm-name dicts. Algorithms seen calling ``ctx.all_reduce`` /
    ``ctx.all_gather`` also get a ``two_rank`` case. ``unavailable`` algorithms are skipped. Returns ``pytest.param``s when
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
        if two_rank and s.status != UNAVAILABLE and _reduces(s, params.get(s.name), inputs.get(s.name)):
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
