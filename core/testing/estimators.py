"""The advantage-estimator conformance properties (:func:`check_advantage_estimator`)."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import numpy as np
import torch

from ..api import get_spec
from ..contracts import ADVANTAGE_ESTIMATOR
from ..params import StableRLError
from .batches import EXTRA_COLUMNS, _fill_padding, _pad_columns, _rows, _run_adv, advantage_batch
from .common import _assert_close, _check_skip, _check_spec, _fail, _run_checks
from .shared import _check_batch_statistics, _declared_inputs


ADVANTAGE_ESTIMATOR_PROPERTIES = (
    "spec", "shapes", "masked", "finite", "masked_content", "padding_length", "group_of_one",
    "equal_rewards", "permutation", "bf16", "declared_inputs", "batch_statistics", "refusals",
)


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
        ("equal_rewards", lambda: _adv_equal_rewards(spec, data, params, inputs)),
        ("permutation", lambda: _adv_permutation(spec, data, params, reference())),
        ("bf16", lambda: _adv_bf16(spec, data, params)),
        ("declared_inputs", lambda: _declared_inputs(spec, data, params)),
        ("batch_statistics", lambda: _check_batch_statistics(spec, params, inputs)),
        ("refusals", lambda: _adv_refusals(spec, data, params, reference())),
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


def _adv_equal_rewards(spec, data, params, inputs=None) -> None:
    """Equal rewards give finite results; an estimator that gives exactly zero advantages to groups of
    equal 0/1 rewards gives (within a few ulp) zero for any equal value and group size (no rounding
    amplified into signal)."""
    mask = data["response_mask"].bool()
    B, T = mask.shape
    last = mask.long().sum(-1) - 1
    zero = True
    for value in (0.0, 1.0):
        rewards = torch.zeros(B, T)
        rewards[torch.arange(B), last] = value
        a, r = _run_adv(spec, dict(data, token_level_rewards=rewards), params)
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(r).all())):
            _fail(spec, "equal_rewards", f"all rewards equal to {value} give non-finite advantages/returns")
        zero = zero and not bool((a != 0).any())
    if not zero:
        return
    big = advantage_batch(spec, seed=5, B=128, group=64, inputs=inputs)
    big_mask = big["response_mask"].bool()
    big_last = big_mask.long().sum(-1) - 1
    for value in (0.7, 0.3, -3.1, 1e3 / 7):
        rewards = torch.zeros(big_mask.shape)
        rewards[torch.arange(big_mask.shape[0]), big_last] = value
        try:
            a, _ = _run_adv(spec, dict(big, token_level_rewards=rewards), params)
        except StableRLError:
            if 0 <= value <= 1:
                raise
            continue  # an estimator defined for rewards in [0, 1] may refuse others (bnpo)
        # a mean's rounding may leave an ulp; its amplification (by 1/std) into signal is the failure
        if float(a.abs().max()) > 1e-5 * max(1.0, abs(value)):
            _fail(spec, "equal_rewards", f"groups of 64 equal rewards {value} give advantages up to "
                  f"{float(a.abs().max()):.3e}, where equal 0/1 rewards give exactly 0")


def _adv_refusals(spec, data, params, out) -> None:
    """A fractional mask and a NaN reward on a valid token are refused by name; NaN/inf on padding is ignored."""
    def raises(what, name, **change):
        try:
            _run_adv(spec, dict(data, **change), params)
        except StableRLError as e:
            if name not in str(e):
                _fail(spec, "refusals", f"{what} raised an error that does not name {name!r}: {e}")
            return
        except Exception as e:  # noqa: BLE001
            _fail(spec, "refusals", f"{what} raised {type(e).__name__}, not a StableRLError naming {name!r}: {e}")
        _fail(spec, "refusals", f"{what} was accepted (expected a StableRLError naming {name!r})")

    mask = data["response_mask"]
    half = mask.float().clone()
    half[0, 0] = 0.5
    raises("a 0.5 in response_mask", "response_mask", response_mask=half)
    rewards = data["token_level_rewards"]
    bad = rewards.clone()
    bad[0, 0] = float("nan")
    raises("a NaN reward on a valid token", "token_level_rewards", token_level_rewards=bad)
    for value in (float("nan"), float("inf")):
        dirty = torch.where(mask.bool(), rewards, torch.full((), value, dtype=rewards.dtype))
        a, r = _run_adv(spec, dict(data, token_level_rewards=dirty), params)
        _assert_close(spec, "refusals", f"advantages with {value} rewards on padding", a, out[0])
        _assert_close(spec, "refusals", f"returns with {value} rewards on padding", r, out[1])


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
