"""Shared tensor primitives: masked statistics, loss aggregation, group statistics, ratios.

Every plugin uses these instead of writing its own; a formula for a mean, a variance or an
aggregation mode exists once, here.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np
import torch

from .context import Context
from .contracts import AGGREGATION, UNAVAILABLE
from .fast_paths import (clamp_pass_mask, clamp_passes_at_bounds, is_functorch_wrapped,  # noqa: F401  (also
                         row_sums_of_product)  # stablerl.ops')
from .params import StableRLError, build_params, unknown_name_message
# registered aggregations (aggregate's other modes); the registry loads the plugins, which import this module,
# through the plugin manager when first asked for, not when imported
from .registry import get_registry

# log-ratios are clamped before exp, as verl and OpenRLHF do (+-20)
LOG_RATIO_BOUND = 20.0


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    if mask.dtype == torch.bool:
        # the same 0/1 factors through a uint8 view of the same storage: float * bool is several
        # times slower than float * uint8 on CPU, and autograd keeps the same 1-byte storage
        mask = mask.view(torch.uint8)
    if dim is None:
        return (values * mask).sum()
    return (values * mask).sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean over the masked entries; 0 where nothing is masked in (never NaN)."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked entries (Bessel-corrected by default); 0 with fewer than 2."""
    count = mask.sum()
    mean = masked_sum(values, mask) / count.clamp(min=1)
    sq = masked_sum((values - mean) ** 2, mask)
    denom = (count - 1) if unbiased else count
    return sq / denom.clamp(min=1)


def masked_extreme(values: torch.Tensor, mask: torch.Tensor, op: str, empty: float = 0.0,
                   dim: Optional[int] = None) -> torch.Tensor:
    """Min or max of ``values`` over the masked-in entries (``empty`` when there are none); over all
    entries, or along ``dim`` (e.g. ``dim=-1``: one per row)."""
    if values.numel() == 0 or (dim is not None and values.shape[dim] == 0):
        shape = () if dim is None else values.sum(dim).shape
        return torch.full(shape, empty, dtype=values.dtype, device=values.device)
    fill = math.inf if op == "min" else -math.inf
    v = torch.where(mask.bool(), values, torch.full((), fill, dtype=values.dtype, device=values.device))
    if dim is None:
        out = v.amin() if op == "min" else v.amax()
    else:
        out = v.amin(dim) if op == "min" else v.amax(dim)
    return torch.where(torch.isfinite(out), out, torch.full((), empty, dtype=values.dtype, device=values.device))


def masked_tangent(inside: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``where(inside, t, +0.0)``: the gradient (or tangent) of an elementwise op that passes ``t``
    through where ``inside`` and is flat elsewhere (clamp, padding zeroing)."""
    return torch.where(inside, t, torch.zeros((), dtype=t.dtype, device=t.device))


class _ClampKeepingMask(torch.autograd.Function):
    """``torch.clamp(x, lo, hi)`` whose backward keeps a 1-byte in-range mask instead of ``x`` itself
    (4 bytes per element less held for backward). The gradient is clamp's own, bit for bit:
    ``where(lo <= x <= hi, grad, 0)`` (NaN ``x``: 0; strict inequalities with torch >= 2.14, as its
    clamp: :func:`~stablerl.fast_paths.clamp_passes_at_bounds`). New-style (``setup_context``, ``jvp``, generated
    vmap rule), so ``torch.func`` transforms and forward-mode AD keep working."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
        return torch.clamp(x, lo, hi)

    @staticmethod
    def setup_context(fctx, inputs, output) -> None:
        x, lo, hi = inputs
        fctx.inside = clamp_pass_mask(x, lo, hi)
        fctx.save_for_backward(fctx.inside)

    @staticmethod
    def backward(fctx, grad: torch.Tensor):
        (inside,) = fctx.saved_tensors
        return masked_tangent(inside, grad), None, None

    @staticmethod
    def jvp(fctx, x_t: torch.Tensor, lo_t, hi_t) -> torch.Tensor:
        return masked_tangent(fctx.inside, x_t)


def all_within(t: torch.Tensor, lo: float, hi: float, closed: bool = True) -> bool:
    """True when every element of ``t`` lies in ``[lo, hi]`` (``closed=False``: in ``(lo, hi)``; a
    NaN anywhere: False): one read pass
    (``aminmax``) and a read of its two scalars (one device sync on an accelerator; so not for code
    captured in a CUDA graph, which stablerl's loss entry points are not). False under a ``torch.func``
    transform, whose wrapped tensors allow no data-dependent branch, so callers then take their
    general path."""
    if t.numel() == 0:
        return True
    if is_functorch_wrapped(t):
        return False
    low, high = (v.item() for v in torch.aminmax(t.detach()))
    if closed:
        return lo <= low and high <= hi  # a NaN compares False
    return lo < low and high < hi


def within_clamp_pass(t: torch.Tensor, lo: float, hi: float) -> bool:
    """True when ``torch.clamp(t, lo, hi)`` is the identity in value and gradient for every element
    (:func:`all_within` on the range where the installed torch's clamp passes the gradient)."""
    return all_within(t, lo, hi, closed=clamp_passes_at_bounds())


def clamped_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, bound: float = LOG_RATIO_BOUND) -> torch.Tensor:
    """``clamp(log_prob - old_log_prob, -bound, bound)``: a ratio formed in log space, safe to exp.

    When every log-ratio is already within the bound (the usual case), the clamp is the identity in
    value and gradient (clamp passes the gradient on ``[-bound, bound]``, bounds included up to torch
    2.13, excluded from 2.14), so it is skipped: the same bits, without the clamp's passes and in-range
    mask (one ``aminmax`` instead)."""
    diff = log_prob - old_log_prob
    if within_clamp_pass(diff, -bound, bound):
        return diff
    if diff.requires_grad and torch.is_grad_enabled():
        return _ClampKeepingMask.apply(diff, -bound, bound)
    return torch.clamp(diff, -bound, bound)


def seq_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean over valid tokens, ``[B]`` (0 for an all-masked row)."""
    return masked_mean(values, mask, dim=-1)


# ----------------------------------------------------------------------------- aggregation

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def check_mode_settings(mode: str, ctx: Optional[Context]) -> None:
    """Refuse a built-in ``loss_agg_mode`` whose setting the call lacks (``seq-mean-token-sum-norm`` without
    ``loss_scale_factor``), also where the loss aggregates itself and would otherwise ignore the mode silently."""
    if mode == "seq-mean-token-sum-norm" and (ctx is None or ctx.loss_scale_factor is None):
        raise StableRLError(
            "loss aggregation 'seq-mean-token-sum-norm' (Dr. GRPO) needs a constant normaliser: "
            "pass loss_scale_factor (e.g. the maximum response length); verl: "
            "actor_rollout_ref.actor.loss_scale_factor=<max_response_length>"
        )


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    ctx: Optional[Context] = None,
    params: Optional[dict] = None,
    *,
    zero_padded: bool = False,
) -> torch.Tensor:
    """Aggregate a per-token loss ``[B, T]`` into a scalar.

    Normalisers come from ``ctx`` (global over DP ranks and gradient accumulation) so that
    summing the gradients of every micro-batch on every rank, then averaging over ranks,
    equals the gradient of the whole-batch loss:

    * ``token-mean``: ``sum(l*m) / token_count * dp_size``
    * ``seq-mean-token-sum``: ``sum_i sum_t l*m / seq_count * dp_size`` (``seq_count`` defaults
      to the rows with at least one valid token)
    * ``seq-mean-token-mean``: ``sum_i (sum_t l*m / L_i) / seq_count * dp_size``
    * ``seq-mean-token-sum-norm``: ``sum(l*m) / (seq_count * C) * dp_size`` with ``C`` the
      constant ``ctx.loss_scale_factor`` (Dr. GRPO's generation budget; required, since the
      padded length changes from batch to batch).

    Any other ``mode`` is looked up among the aggregations registered through the
    ``register_aggregations`` hook (e.g. ``delta_l``); ``params`` sets its hyper-parameters.

    ``zero_padded=True`` promises that ``loss_mat`` is finite and exactly zero (+0 or -0) wherever
    ``mask`` is 0 (e.g. a product with the advantages, which core zeroes on padding). The built-in
    modes then sum ``loss_mat`` without the mask product: ``x * 1 == x`` and ``(+-0) * 0 == +-0``,
    so every sum, the loss and the gradient on valid tokens are bit-identical, one [B, T] pass
    fewer each way, and autograd keeps no mask for backward. ``mask`` still gives the counts. The
    gradient on padding is then not stopped here: core's zeroing of ``log_prob`` stops it.
    """
    ctx = ctx or Context()
    if mode not in AGG_MODES or params:
        return _registered_aggregation(loss_mat, mask.to(loss_mat.dtype), mode, ctx, params)
    # a bool mask is used as is: loss * bool is exact, and autograd then keeps the 1-byte mask for
    # backward instead of a float copy (token counts are integer sums, exact)
    if mask.dtype != torch.bool:
        mask = mask.to(loss_mat.dtype)
    if ctx.dp_size > 1 and (ctx.token_count is None if mode == "token-mean" else ctx.seq_count is None):
        needed = "token_count" if mode == "token-mean" else "seq_count"
        raise StableRLError(f"loss aggregation {mode!r} with dp_size > 1 needs the global {needed} in the Context")

    row_tokens = None  # per-row token counts, computed once when a mode needs them

    def loss_sum(dim: Optional[int] = None) -> torch.Tensor:
        # contiguous only: then the sum reduces the same elements in the same order as the product would
        if not zero_padded or not loss_mat.is_contiguous():
            return masked_sum(loss_mat, mask, dim)
        return loss_mat.sum() if dim is None else loss_mat.sum(dim)

    def sequences():
        # rows without a single valid token are not sequences (verl's convention)
        if ctx.seq_count is not None:
            return ctx.seq_count
        return ((mask.sum(-1) if row_tokens is None else row_tokens) > 0).sum()

    if mode == "token-mean":
        denom = ctx.token_count if ctx.token_count is not None else mask.sum()
        total = loss_sum()
    elif mode == "seq-mean-token-sum":
        denom = sequences()
        total = loss_sum()
    elif mode == "seq-mean-token-mean":
        row_tokens = mask.sum(-1)  # = masked_mean(loss_mat, mask, dim=-1), sharing the row counts
        denom = sequences()
        total = (loss_sum(-1) / row_tokens.clamp(min=1)).sum()
    elif mode == "seq-mean-token-sum-norm":
        check_mode_settings(mode, ctx)
        denom = sequences() * float(ctx.loss_scale_factor)
        total = loss_sum()
    else:
        raise StableRLError(unknown_name_message("loss_agg_mode", mode, AGG_MODES))
    if isinstance(denom, torch.Tensor):
        denom = denom.clamp(min=1)
    else:
        denom = max(float(denom), 1.0)
    if type(ctx.dp_size) is int and ctx.dp_size == 1:  # x * 1 is x (value and gradient): one op fewer each way
        return total / denom
    return total / denom * ctx.dp_size


def _registered_aggregation(loss_mat, mask, mode: str, ctx: Context, params: Optional[dict]) -> torch.Tensor:
    """A mode registered through ``register_aggregations``: ``fn(loss_mat, mask, params, ctx) -> scalar``.

    ``params`` (a dict of its hyper-parameters) is only accepted by registered modes.
    """
    if mode in AGG_MODES:
        raise StableRLError(f"loss aggregation {mode!r} takes no parameters, got {sorted(params or {})}")
    registry = get_registry()
    spec = registry.specs.get((AGGREGATION, mode))
    if spec is None:
        raise StableRLError(unknown_name_message("loss_agg_mode", mode, list(AGG_MODES) + registry.names(AGGREGATION)))
    if spec.status == UNAVAILABLE:
        raise StableRLError(f"loss aggregation {mode!r} is listed but not implemented: {spec.notes}")
    return spec.fn(loss_mat, mask, build_params(spec, params), ctx)


# ----------------------------------------------------------------------------- groups


def group_ids(index: Any, n: Optional[int] = None, device: Optional[torch.device] = None) -> torch.Tensor:
    """Normalise group ids to an int64 tensor of ``0..n_groups-1`` (first-appearance order).

    Accepts a numpy (object) array of ids such as verl's ``uid``, a list, or an integer tensor.
    Ids are equal when Python's ``==``/``hash`` say so (a dict's rule); the mapping is one hashing
    pass at C speed (``dict.fromkeys`` keeps first appearances in order) and one C-level lookup
    per id, or ``torch.unique`` for an integer tensor.
    """
    if isinstance(index, torch.Tensor):
        if index.dtype.is_floating_point or index.dtype == torch.bool:
            raise StableRLError(f"index must hold integer group ids, got dtype {index.dtype}")
        if index.dtype.is_complex:
            values = index.detach().cpu().reshape(-1).tolist()
        else:
            flat = index.detach().reshape(-1)
            if n is not None and flat.numel() != n:
                raise StableRLError(f"index has {flat.numel()} entries but the batch has {n} responses")
            return _first_appearance_ids(flat).to(device or "cpu")
    elif isinstance(index, np.ndarray):
        values = index.reshape(-1).tolist()
    elif isinstance(index, (list, tuple)):
        values = list(index)
    else:
        raise StableRLError(
            f"index must be a numpy array, list or integer tensor of group ids, got {type(index).__name__}"
        )
    if n is not None and len(values) != n:
        raise StableRLError(f"index has {len(values)} entries but the batch has {n} responses")
    firsts = dict.fromkeys(values)  # unique ids in first-appearance order
    for i, key in enumerate(firsts):
        firsts[key] = i
    ids = np.fromiter(map(firsts.__getitem__, values), dtype=np.int64, count=len(values))
    return torch.from_numpy(ids).to(device)


def _first_appearance_ids(flat: torch.Tensor) -> torch.Tensor:
    """Integer ids -> ``0..n_groups-1`` numbered in order of first appearance (vectorised)."""
    if flat.numel() == 0:
        return torch.zeros(0, dtype=torch.long, device=flat.device)
    uniq, inverse = torch.unique(flat, return_inverse=True)
    positions = torch.arange(flat.numel(), device=flat.device)
    first = torch.full((uniq.numel(),), flat.numel(), dtype=torch.long, device=flat.device)
    first.scatter_reduce_(0, inverse, positions, reduce="amin")
    rank = torch.empty_like(first)
    rank[torch.argsort(first)] = torch.arange(uniq.numel(), device=flat.device)
    return rank[inverse]


def group_stats(scores: torch.Tensor, gid: torch.Tensor, ctx: Optional[Context] = None):
    """Per-response group ``(mean, std, count)`` of ``scores`` ``[B]`` (std unbiased).

    Groups are whole within a call (advantages are computed on the full batch); ``ctx`` is not
    used to reduce across ranks here because verl, TRL and OpenRLHF all compute advantages on
    the gathered batch.
    """
    n_groups = int(gid.max().item()) + 1 if gid.numel() else 0
    s = scores.to(torch.float64) if scores.dtype == torch.float64 else scores.float()
    count = torch.zeros(n_groups, dtype=s.dtype, device=s.device).index_add_(0, gid, torch.ones_like(s))
    # the mean is taken of the deviations from one member of the group (the first): a group of equal
    # scores then has mean == that score and std == 0 exactly, so its advantages are exactly 0 at any
    # group size (a plain fp32 sum of 4096 x 0.7 is off by ulps that std + eps turned into |A| ~ 1)
    first = torch.full((n_groups,), s.shape[0], dtype=torch.long, device=s.device).scatter_reduce_(
        0, gid, torch.arange(s.shape[0], device=s.device), "amin")
    pivot = s[first.clamp(max=max(s.shape[0] - 1, 0))] if n_groups else s[:0]
    shifted = s - pivot[gid]
    mean = pivot + torch.zeros_like(count).index_add_(0, gid, shifted) / count.clamp(min=1)
    sq = torch.zeros_like(count).index_add_(0, gid, (s - mean[gid]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return mean[gid], std[gid], count[gid]


def reward_component_matrix(comps: Any, mask: torch.Tensor, who: str, allow_nan: bool = False) -> torch.Tensor:
    """Per-response reward components ``[B, K]`` (float64) from ``extras['reward_components']``: a ``[B, K]``
    (or ``[B]``) tensor, or a dict of ``[B]`` per-response / ``[B, T]`` token-level tensors (summed over
    ``mask``), in the dict's order. ``who`` prefixes the errors. NaN marks a component a reward function did
    not score (TRL's None); it raises unless ``allow_nan``; inf always raises."""
    B = mask.shape[0]
    device = mask.device
    if isinstance(comps, dict):
        if not comps:
            raise StableRLError(f"{who}: extras['reward_components'] is an empty dict")
        cols = []
        for key, t in comps.items():
            t = torch.as_tensor(np.asarray(t, dtype=np.float64) if not isinstance(t, torch.Tensor) else t,
                                device=device).to(torch.float64)
            if t.dim() == 2 and tuple(t.shape) == tuple(mask.shape):
                t = (t * mask.to(torch.float64)).sum(-1)
            if tuple(t.shape) != (B,):
                raise StableRLError(
                    f"{who}: reward component {key!r} has shape {tuple(t.shape)}, expected [{B}] or {list(mask.shape)}"
                )
            cols.append(t)
        out = torch.stack(cols, dim=-1)
    else:
        out = torch.as_tensor(comps, device=device).to(torch.float64)
        if out.dim() == 1:
            out = out.unsqueeze(-1)
        if out.dim() != 2 or out.shape[0] != B or out.shape[1] == 0:
            raise StableRLError(f"{who}: extras['reward_components'] has shape {tuple(out.shape)}, expected [{B}, K]")
    if bool(torch.isinf(out).any()) or (not allow_nan and bool(torch.isnan(out).any())):
        raise StableRLError(f"{who}: extras['reward_components'] has non-finite values (NaN or inf)")
    return out


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` position of each row's last valid token (0 for a row without one)."""
    last = mask.shape[-1] - 1 - torch.flip(mask.to(torch.int64), [-1]).argmax(-1)
    return torch.where(mask.to(torch.bool).any(-1), last, torch.zeros_like(last))


def mask_runs(mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` index (0, 1, ...) of the contiguous run of valid tokens each token belongs to, -1 where the
    mask is 0. With a loss mask that leaves out tool/environment tokens (verl's agent-loop ``response_mask``,
    TRL's ``completion_mask * tool_mask``, OpenRLHF's ``action_mask`` over ``action_ranges``) the runs are the
    assistant turns of a multi-turn trace; a single-turn response is one run."""
    on = mask.to(torch.bool)
    starts = on.clone()
    starts[..., 1:] &= ~on[..., :-1]
    ids = starts.to(torch.int64).cumsum(-1) - 1
    return torch.where(on, ids, torch.full_like(ids, -1))


def scores_on_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place per-response scalar rewards ``[B]`` on each row's last valid token: the ``[B, T]``
    token-level rewards whose sum is the score (verl's convention for outcome rewards)."""
    out = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    out[torch.arange(mask.shape[0], device=scores.device), last_valid_index(mask).to(scores.device)] = scores
    return out


def broadcast_to_tokens(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B] -> [B, T]``, zero outside the mask."""
    if mask.dtype == torch.bool:  # same values; autograd keeps the 1-byte mask, not a float copy
        return per_seq.unsqueeze(-1) * mask.view(torch.uint8)
    return per_seq.unsqueeze(-1) * mask.to(per_seq.dtype)


def high_entropy_mask(entropy: torch.Tensor, valid: torch.Tensor, top_quantile: float,
                      ctx: Optional[Context] = None) -> torch.Tensor:
    """The valid tokens whose entropy is in the top ``top_quantile`` fraction (a bool ``[B, T]`` mask).

    Wang et al., "Beyond the 80/20 Rule" (arXiv 2506.01939), as TRL 1.16's ``get_high_entropy_mask``
    (``top_entropy_quantile``): threshold ``tau = torch.quantile(H over the valid tokens of every DP
    rank, 1 - top_quantile)`` (linear interpolation), keep ``H >= tau`` (ties at tau are kept); no
    valid token on any rank -> all False. The valid entropies are gathered with ``ctx.all_gather`` so
    every rank uses one threshold. A primitive (not a plugin): core applies it to every policy loss."""
    local = entropy.detach()[valid].float()
    gathered = ctx.all_gather(local) if ctx is not None else local
    if gathered.numel() == 0:
        return torch.zeros_like(valid, dtype=torch.bool)
    threshold = torch.quantile(gathered.float(), 1.0 - top_quantile)
    return (entropy.detach().float() >= threshold) & valid


def sum_pi_squared(logits: torch.Tensor) -> torch.Tensor:
    """``sum_v softmax(logits)_v^2`` over the last dim, ``[..., V] -> [...]``, computed as verl's
    ``calculate_sum_pi_squared_from_logits``: ``exp(logsumexp(2 z) - 2 logsumexp(z))`` (no softmax materialised;
    pass the logits already divided by the sampling temperature). The per-token statistic the
    ``optimal_token_baseline`` estimators read as ``sum_pi_squared``; a primitive adapters compute in an
    old-log-prob pass."""
    return torch.exp(torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * torch.logsumexp(logits, dim=-1))


# ----------------------------------------------------------------------------- metrics


def as_floats(metrics: dict[str, Any]) -> dict[str, float]:
    """Turn a dict of 0-dim tensors / numbers into plain floats with a single device sync."""
    keys = list(metrics)
    tensors = [k for k in keys if isinstance(metrics[k], torch.Tensor)]
    if tensors and len(tensors) == len(keys):
        values = [metrics[k] for k in keys]
        first = values[0]
        # the usual case (every metric a 0-dim fp32 tensor on one device): one stack, no per-metric
        # detach / cast / reshape calls (the same floats)
        if all(t.dim() == 0 and t.dtype == torch.float32 and t.device == first.device for t in values):
            with torch.no_grad():
                return dict(zip(keys, torch.stack(values).tolist()))
    out: dict[str, float] = {k: float(metrics[k]) for k in keys if k not in tensors}
    if tensors:
        values = torch.stack([metrics[k].detach().float().reshape(()) for k in tensors]).cpu().tolist()
        out.update(zip(tensors, values))
    return {k: out[k] for k in keys}


def ensure_same_shape(names: Sequence[str], tensors: Sequence[Optional[torch.Tensor]], shape) -> None:
    for name, t in zip(names, tensors):
        if t is not None and not isinstance(t, torch.Tensor):
            raise StableRLError(f"{name} must be a torch.Tensor of shape {tuple(shape)}, got a {type(t).__name__}")
        if t is not None and tuple(t.shape) != tuple(shape):
            raise StableRLError(f"{name} has shape {tuple(t.shape)} but log_prob has shape {tuple(shape)}")
