"""Input checks shared by the entry points (``compute_policy_loss``, ``compute_advantage``,
``filter_batch``, ...): each refuses a bad input by the argument's name and says what is accepted.

They run before any plugin sees a batch, so a plugin may rely on: tensors are tensors, masks are
0/1, per-response tensors have one entry per response, and a loss's aggregation request is one it
can honour (or the user was told that it cannot).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from .ops import check_mode_settings, is_functorch_wrapped
from .params import StableRLError, unknown_name_message

_warned_fixed_aggregation: set[tuple[str, str]] = set()


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def require_tensor(name: str, value: Any, what: str = "") -> torch.Tensor:
    """``value`` must be a ``torch.Tensor`` (not a list or a numpy array: nothing converts silently)."""
    if not isinstance(value, torch.Tensor):
        hint = " (convert with torch.as_tensor)" if hasattr(value, "__len__") else ""
        raise StableRLError(f"{name} must be a torch.Tensor{' ' + what if what else ''}, got {_describe(value)}{hint}")
    return value


def require_float(name: str, value: torch.Tensor) -> None:
    if not value.is_floating_point():
        raise StableRLError(f"{name} must be a floating-point tensor (log-probabilities), got {value.dtype}")


def is_binary_mask(response_mask: torch.Tensor, as_float: torch.Tensor) -> bool:
    """True when every mask value is exactly 0 or 1 (then a product with it is a select). A bool mask
    is; an integer one when its min and max are in [0, 1] (one read pass); a float one when
    ``m - m * m`` is 0 everywhere (one fused pass and a min/max)."""
    if response_mask.dtype == torch.bool or response_mask.numel() == 0:
        return True
    if is_functorch_wrapped(response_mask):
        return False
    if response_mask.dtype.is_complex:
        return False
    if not response_mask.dtype.is_floating_point:
        # integers: 0/1 iff min and max lie in [0, 1]; read on the float copy (half the bytes of an
        # int64 mask), which keeps 0 and 1 and turns no other integer into either
        low, high = torch.aminmax(as_float)
        return bool(low >= 0) and bool(high <= 1)
    # m - m*m is 0 exactly for m in {0, -0, 1} (below 1 it is positive, above 1 negative, NaN NaN)
    low, high = torch.aminmax(torch.addcmul(as_float, as_float, as_float, value=-1))
    return bool(low == 0) and bool(high == 0)


def check_mask(mask: Any, name: str = "response_mask") -> torch.Tensor:
    """A mask is bool or holds only 0 and 1.

    Fractional weights are refused rather than defined: per-token losses, metrics and the group
    estimators would each read a 0.5 differently (as 1 in a loss, as 0.5 in a metric, squared in an
    estimator that masks rewards and advantages), so a weight must be applied by the caller where it
    means something (e.g. as ``is_weights``).
    """
    require_tensor(name, mask, "[B, T] of 0/1 (or bool)")
    if is_binary_mask(mask, mask):
        return mask
    bad = (mask != 0) & (mask != 1)  # NaN counts as bad
    if bool(bad.any()):
        example = mask[bad].reshape(-1)[0].item()
        raise StableRLError(
            f"{name} must hold only 0 and 1 (or be bool), got {example!r}; fractional token weights are not "
            "supported (pass them as is_weights, or make the mask binary)"
        )
    return mask


def check_per_response(name: str, value: Any, n: int) -> torch.Tensor:
    """A per-response tensor: shape ``[B]``."""
    require_tensor(name, value, f"[B] with B = {n}")
    if value.dim() != 1 or value.shape[0] != n:
        raise StableRLError(f"{name} must have shape [B] = ({n},) (one value per response), got {tuple(value.shape)}")
    return value


def check_advantages_shape(advantages: Any, shape, name: str = "advantages") -> torch.Tensor:
    """Advantages are ``[B, T]`` or one per response ``[B]``; ``[1]`` or ``[T]`` is not broadcast."""
    require_tensor(name, advantages, f"[B, T] or [B] with [B, T] = {list(shape)}")
    if advantages.dim() == 1 and advantages.shape[0] != shape[0]:
        raise StableRLError(
            f"{name} must have shape [B, T] = {tuple(shape)} or [B] = ({shape[0]},) (one per response), "
            f"got {tuple(advantages.shape)}; nothing is broadcast"
        )
    if advantages.dim() not in (1, 2):
        raise StableRLError(f"{name} must have shape [B, T] = {tuple(shape)} or [B] = ({shape[0]},), got {tuple(advantages.shape)}")
    return advantages


def check_token_leading(name: str, value: Any, shape, mask: torch.Tensor) -> Optional[torch.Tensor]:
    """A per-token tensor with trailing dimensions (``router_log_prob`` ``[B, T, L, k]``,
    ``hidden_states`` ``[B, T, H]``): its leading dimensions must be ``[B, T]``, it must be finite
    on valid tokens, and it is returned zeroed on padding (where frameworks leave garbage)."""
    if value is None:
        return None
    require_tensor(name, value, f"[B, T, ...] with [B, T] = {list(shape)}")
    if value.dim() < 2 or tuple(value.shape[:2]) != tuple(shape):
        raise StableRLError(
            f"{name} must start with the [B, T] = {tuple(shape)} of log_prob, got shape {tuple(value.shape)}"
        )
    if not value.is_floating_point():
        return value
    valid = mask.bool().reshape(*shape, *([1] * (value.dim() - 2)))
    cleaned = torch.where(valid, value.detach(), torch.zeros((), dtype=value.dtype, device=value.device))
    if cleaned.numel() and not bool(torch.isfinite(cleaned).all()):
        raise StableRLError(f"{name} has non-finite values (NaN or inf) on tokens where response_mask is 1")
    return cleaned


def check_log_probabilities(name: str, value: Optional[torch.Tensor], tolerance: float = 1e-4) -> None:
    """Log-probabilities are <= 0 (a small positive rounding error of a log-softmax is allowed)."""
    if value is None or value.numel() == 0:
        return
    top = float(value.max())
    if top > tolerance:
        raise StableRLError(f"{name} must be log-probabilities (<= 0), got a value of {top:.4g}")


def check_top_entropy_quantile(value: Any) -> float:
    """``top_entropy_quantile``: a real number in (0, 1] (1.0, the default, trains on every token)."""
    import math
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise StableRLError(
            f"top_entropy_quantile must be a number in (0, 1] (the fraction of highest-entropy tokens trained on; "
            f"1.0 = all), got {value!r} ({type(value).__name__})"
        )
    value = float(value)
    if math.isnan(value) or not 0.0 < value <= 1.0:
        raise StableRLError(
            f"top_entropy_quantile must be in (0, 1] (the fraction of highest-entropy tokens trained on; "
            f"1.0 = all), got {value!r}"
        )
    return value


def known_aggregation(mode: Any) -> None:
    """``loss_agg_mode`` names a built-in mode or a registered aggregation (a typo is an error)."""
    from .contracts import AGGREGATION
    from .ops import AGG_MODES
    from .registry import get_registry

    if isinstance(mode, str) and mode in AGG_MODES:
        return
    names = get_registry().names(AGGREGATION)
    if not isinstance(mode, str) or mode not in names:
        raise StableRLError(unknown_name_message("loss_agg_mode", str(mode), list(AGG_MODES) + names))


def check_aggregation_request(spec, params, mode: str, agg_params: Optional[dict], ctx: Any = None) -> None:
    """A loss with its own fixed aggregation refuses ``loss_agg_params`` and says, once, that it
    ignores a different ``loss_agg_mode`` (``token-mean``, every framework's default, passes
    silently: it is what a framework sends when the user chose nothing). With the call's ``ctx``, a mode whose
    own setting is missing (``seq-mean-token-sum-norm`` without ``loss_scale_factor``) is refused for every loss,
    as the aggregation itself refuses it: an incomplete setting is never swallowed."""
    known_aggregation(mode)
    fixed = spec.fixed_aggregation(params)
    if not fixed:
        return
    if ctx is not None and mode != fixed:
        check_mode_settings(mode, ctx)
    if agg_params:
        raise StableRLError(
            f"policy loss {spec.name!r} always aggregates with {fixed!r}; loss_agg_params {sorted(agg_params)} "
            f"cannot apply (remove them, or choose a loss that follows loss_agg_mode)"
        )
    if mode not in (fixed, "token-mean") and (spec.name, mode) not in _warned_fixed_aggregation:
        _warned_fixed_aggregation.add((spec.name, mode))
        warnings.warn(
            f"stablerl: policy loss {spec.name!r} always aggregates with {fixed!r} (its paper's form); "
            f"loss_agg_mode={mode!r} is ignored",
            stacklevel=3,
        )
