"""The policy-loss conformance properties (:func:`check_policy_loss`)."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping, Optional

import torch

from ..api import get_spec
from ..contracts import OPTIONAL_INPUTS, POLICY_LOSS
from ..params import StableRLError
from .batches import (
    EXTRA_COLUMNS,
    GROUP_LOSS,
    _fill_padding,
    _pad_columns,
    _rows,
    _run_loss,
    _synth_input,
    policy_batch,
)
from .common import (
    ConformanceError,
    _assert_close,
    _check_skip,
    _check_spec,
    _fail,
    _fresh_ctx,
    _grad,
    _run_checks,
    _same,
)
from .shared import _check_batch_statistics, _declared_inputs, _declares_batch_statistics


POLICY_LOSS_PROPERTIES = (
    "spec", "output", "masked_tokens", "detached_inputs", "is_weights", "bf16", "padding_length",
    "micro_batch", "batch_statistics", "degenerate", "declared_inputs", "undeclared_inputs", "metrics",
    "non_finite", "refusals",
)


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
        ("non_finite", lambda: _loss_non_finite(spec, data, mask, params)),
        ("refusals", lambda: _loss_refusals(spec, data, params)),
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


def _token_float_inputs(data: dict) -> list[str]:
    """The floating inputs laid out per token ([B, T] or [B, T, ...]): where padding garbage can hide."""
    shape = data["response_mask"].shape
    return [k for k, v in data.items() if k != "response_mask" and isinstance(v, torch.Tensor)
            and v.is_floating_point() and v.dim() >= 2 and tuple(v.shape[:2]) == tuple(shape)]


def _raises_naming(spec, prop, what: str, name: str, call) -> None:
    try:
        call()
    except StableRLError as e:
        if name not in str(e):
            _fail(spec, prop, f"{what} raised an error that does not name {name!r}: {e}")
        return
    except Exception as e:  # noqa: BLE001
        _fail(spec, prop, f"{what} raised {type(e).__name__} instead of a StableRLError naming {name!r}: {e}")
    _fail(spec, prop, f"{what} was accepted (expected a StableRLError naming {name!r})")


def _loss_non_finite(spec, data, mask, params) -> None:
    """NaN / +-inf on padding in any per-token input change nothing (and the padding gets no gradient);
    a NaN on a valid token of any input the loss reads is refused by the input's name."""
    prop = "non_finite"
    loss, _, lp = _run_loss(spec, data, params)
    grad = _grad(spec, prop, loss, lp)
    pad = ~mask
    names = _token_float_inputs(data)
    for value in (float("nan"), float("inf"), float("-inf")):
        dirty = dict(data)
        for k in names:
            p = pad.reshape(pad.shape + (1,) * (data[k].dim() - 2))
            dirty[k] = torch.where(p, torch.full((), value, dtype=data[k].dtype), data[k])
        loss_d, _, lp_d = _run_loss(spec, dirty, params)
        grad_d = _grad(spec, prop, loss_d, lp_d)
        _assert_close(spec, prop, f"loss with {value} on padding vs clean padding", loss_d, loss)
        if not bool(torch.isfinite(grad_d).all()) or bool((grad_d[pad] != 0).any()):
            _fail(spec, prop, f"{value} on padding reaches the gradient (non-finite or non-zero on masked tokens)")
        _assert_close(spec, prop, f"valid-token gradient with {value} on padding", grad_d[mask], grad[mask])
    row, col = 0, 0  # row 0 is full length: (0, 0) is a valid token
    for k in names + (["scores"] if isinstance(data.get("scores"), torch.Tensor) else []):
        bad = data[k].clone()
        if k == "scores":
            bad[row] = float("nan")
        else:
            bad[row, col] = float("nan")
        _raises_naming(spec, prop, f"a NaN in {k} on a valid token", k, lambda: _run_loss(spec, dict(data, **{k: bad}), params))


def _loss_refusals(spec, data, params) -> None:
    """Inputs that cannot be meant are refused by name: a fractional mask, a list or numpy array for a tensor,
    advantages of shape [1], an unknown loss_agg_mode."""
    prop = "refusals"
    mask = data["response_mask"]
    half = mask.to(data["log_prob"].dtype).clone()
    half[0, 0] = 0.5
    _raises_naming(spec, prop, "a 0.5 in response_mask", "response_mask",
                   lambda: _run_loss(spec, dict(data, response_mask=half), params))
    _raises_naming(spec, prop, "old_log_prob given as a list", "old_log_prob",
                   lambda: _run_loss(spec, dict(data, old_log_prob=data["old_log_prob"].tolist()), params))
    _raises_naming(spec, prop, "response_mask given as a numpy array", "response_mask",
                   lambda: _run_loss(spec, dict(data, response_mask=mask.numpy()), params))
    if mask.shape[0] != 1:
        _raises_naming(spec, prop, "advantages of shape [1]", "advantages",
                       lambda: _run_loss(spec, dict(data, advantages=data["advantages"][:1, 0]), params))
    _raises_naming(spec, prop, "loss_agg_mode='token-means'", "loss_agg_mode",
                   lambda: _run_loss(spec, data, params, loss_agg_mode="token-means"))
