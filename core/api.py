"""The framework-free entry points: compute a policy loss or an advantage by name."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import torch

from .context import Context
from .contracts import (
    ADVANTAGE_ESTIMATOR,
    BATCH_FILTER,
    CONTROLLER,
    REWARD_SHAPER,
    ESTIMATOR_ONLY_INPUTS,
    Controller,
    FilterBatch,
    FilterResult,
    RewardBatch,
    OPTIONAL_INPUTS,
    POLICY_LOSS,
    ROLLOUT_CORRECTION,
    TRAINER_HOOK,
    UNAVAILABLE,
    AdvantageBatch,
    TrainerHook,
    AlgorithmSpec,
    PolicyLossBatch,
)
from .checks import (  # noqa: F401  (is_binary_mask: also stablerl.api's, as before)
    check_advantages_shape,
    check_aggregation_request,
    check_log_probabilities,
    check_mask,
    check_per_response,
    check_token_leading,
    check_top_entropy_quantile,
    is_binary_mask,
    require_float,
    require_tensor,
)
from .ops import (AGG_MODES, aggregate, as_floats, ensure_same_shape, group_ids, high_entropy_mask, is_functorch_wrapped,
                  masked_tangent)
from .params import MissingInputError, StableRLError, UnknownNameError, build_params, unknown_name_message
from .policy_versions import check_policy_versions
from .registry import get_registry, switch_names

_FLOAT_TYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LOSS_INPUTS = set(OPTIONAL_INPUTS) | {"is_weights"}
#: PolicyLossBatch's own fields: a declared loss input outside them reaches the loss in ``batch.extras``
_POLICY_BATCH_FIELDS = frozenset(f.name for f in dataclasses.fields(PolicyLossBatch))


# integer type of the same width as each compute float type (for zeroing padding bit by bit)
_SAME_WIDTH_INT = {torch.float32: torch.int32, torch.float64: torch.int64}
# CPU only (on GPU torch.where is as fast and the bit path reads more bytes), and from this many
# elements up (below, torch.where's single call costs less than the bit path's extra calls)
_BIT_PATH_MIN_NUMEL = 1 << 15


def _zero_padding_bits(t: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``torch.where(valid, t, +0.0)`` bit for bit: the bits of ``t`` AND a per-token pattern that is
    all ones on valid tokens (the value, NaN and -0.0 included, is kept) and all zeros on padding
    (+0.0). One vectorised integer pass: on CPU about 2.5x faster than ``torch.where`` (whose
    CPU kernel is not vectorised)."""
    return (t.view(bits.dtype) & bits).view(t.dtype)


class _ZeroPadding(torch.autograd.Function):
    """:func:`_zero_padding_bits` for a tensor with gradient; backward is ``torch.where``'s (the
    gradient on valid tokens, +0.0 on padding), keeping the bool mask as ``torch.where`` would.
    New-style (``setup_context``, ``jvp``) so forward-mode AD and ``torch.func.grad`` keep working."""

    @staticmethod
    def forward(t: torch.Tensor, valid: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        return _zero_padding_bits(t, bits)

    @staticmethod
    def setup_context(fctx, inputs, output) -> None:
        fctx.valid = inputs[1]
        fctx.save_for_backward(fctx.valid)

    @staticmethod
    def backward(fctx, grad: torch.Tensor):
        (valid,) = fctx.saved_tensors
        int_type = _SAME_WIDTH_INT.get(grad.dtype)
        if int_type is None or grad.requires_grad or is_functorch_wrapped(grad):
            return masked_tangent(valid, grad), None, None
        # the bit path again (same bits as torch.where); the pattern is rebuilt from the 1-byte mask
        # rather than kept from forward (4 bytes per token)
        return _zero_padding_bits(grad, (-valid.view(torch.int8)).to(int_type)), None, None

    @staticmethod
    def jvp(fctx, t_t: torch.Tensor, valid_t, bits_t) -> torch.Tensor:
        return masked_tangent(fctx.valid, t_t)


class _LazyAdvantagesBatch(PolicyLossBatch):
    """The batch of a loss registered with ``seq_advantages=True`` whose advantages are one per
    sequence: ``seq_advantages`` is set, and ``advantages`` (today's cleaned ``[B, T]`` tensor, bit for
    bit) is built on first read only, so a loss that broadcasts ``seq_advantages`` never pays for it."""

    _advantages_thunk = None

    @property
    def advantages(self) -> torch.Tensor:
        if self._advantages_thunk is not None:
            self._advantages, self._advantages_thunk = self._advantages_thunk(), None
        return self._advantages

    def __getstate__(self):  # pickle / deepcopy: build the per-token advantages (the thunk is a closure)
        _ = self.advantages
        return {**self.__dict__, "_advantages_thunk": None}

    @advantages.setter
    def advantages(self, value) -> None:
        if callable(value) and not isinstance(value, torch.Tensor):
            self._advantages, self._advantages_thunk = None, value
        else:
            self._advantages, self._advantages_thunk = value, None


def get_spec(kind: str, name: str) -> AlgorithmSpec:
    spec = get_registry().get(kind, name)
    if spec.status == UNAVAILABLE:
        raise StableRLError(f"{kind.replace('_', ' ')} {name!r} is listed but not implemented: {spec.notes}")
    return spec


def list_algorithms(kind: Optional[str] = None) -> list[AlgorithmSpec]:
    """Every registered algorithm (of one kind), with name, kind, paper, status and defaults."""
    return get_registry().list(kind)


def _as_compute_dtype(t: torch.Tensor) -> torch.Tensor:
    # half-precision inputs are computed in fp32 (the cast keeps the gradient path)
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _detached(t: Any) -> Any:
    """Only log_prob carries gradient: every other tensor input is detached."""
    return t.detach() if isinstance(t, torch.Tensor) else t


def _check_missing(spec: AlgorithmSpec, available: dict[str, Any]) -> None:
    for need in spec.requires:
        if available.get(need) is None:
            raise MissingInputError(
                f"{spec.kind.replace('_', ' ')} {spec.name!r} needs input {need!r} ({OPTIONAL_INPUTS.get(need) or ESTIMATOR_ONLY_INPUTS.get(need, '')}), "
                "but it was not given"
            )


def _check_finite(names, tensors, mask: torch.Tensor) -> None:
    # isfinite(t) | padding over the whole tensor (no boolean-index gather of the valid tokens,
    # which dominated the loss's cost on CPU), and one host sync for all tensors together
    present = [(name, t) for name, t in zip(names, tensors) if t is not None]
    if not present:
        return
    padding = ~mask.bool()
    ok = torch.stack([torch.isfinite(t).logical_or_(padding).all() for _, t in present])
    if bool(ok.all()):
        return
    for (name, _), good in zip(present, ok.tolist()):
        if not good:
            raise StableRLError(f"{name} has non-finite values (NaN or inf) on tokens where response_mask is 1")


def _check_finite_cleaned(names, tensors) -> None:
    """Like :func:`_check_finite` for tensors already zeroed on padding (``clean``): a sum propagates
    NaN and +-inf (inf - inf is NaN), so one vectorised read pass per tensor (a sum, several times
    faster than ``aminmax`` on CPU) and one host sync find a non-finite value on a valid token. A
    sum of finite values can overflow: then min and max decide, which are finite exactly when every
    value is."""
    present = [(name, t) for name, t in zip(names, tensors) if t is not None and t.numel() > 0]
    if not present:
        return
    # one stack of the sums (promoted to a common dtype), one isfinite, one host sync
    if bool(torch.isfinite(torch.stack([t.sum() for _, t in present])).all()):
        return
    extremes = torch.stack([e for _, t in present for e in torch.aminmax(t)])
    if bool(torch.isfinite(extremes).all()):
        return
    ok = torch.isfinite(extremes).view(len(present), 2).all(-1)
    for (name, _), good in zip(present, ok.tolist()):
        if not good:
            raise StableRLError(f"{name} has non-finite values (NaN or inf) on tokens where response_mask is 1")


def compute_policy_loss(
    name: str,
    *,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_log_prob: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    loss_agg_mode: str = "token-mean",
    ctx: Optional[Context] = None,
    loss_agg_params: Optional[dict[str, Any]] = None,
    rollout_correction: Optional[str] = None,
    rollout_correction_params: Optional[dict[str, Any]] = None,
    check_finite: bool = True,
    recompute_half: Optional[bool] = None,
    fused: Optional[bool] = None,
    top_entropy_quantile: float = 1.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Compute the registered policy loss ``name``.

    Tensors are ``[B, T]`` (``advantages`` may be ``[B]``); only ``log_prob`` carries gradient.
    Extra declared inputs (``token_ids``, ``turn_ids``, ``versions``, ``index``, ...) and the
    algorithm's hyper-parameters are keyword arguments. ``rollout_correction`` names a registered
    training-inference mismatch correction (``tis``, ``icepop``, ``seq_mis``, ``geo_rs``, ``opsm``)
    applied with any loss from ``rollout_log_prob``; it is refused when the framework already
    passed its own correction weights (``is_weights``), so nothing is applied twice.
    ``loss_agg_mode`` may also name a registered aggregation (``delta_l``), whose
    hyper-parameters are ``loss_agg_params`` (per-token losses only). Returns the
    scalar loss and a dict of plain-float metrics.

    Half-precision ``log_prob`` (bf16/fp16) is computed in fp32. With ``recompute_half=True`` (or
    ``STABLERL_RECOMPUTE_HALF=1``; only where it is safe, see :func:`_recomputes`) autograd keeps
    only the inputs in their own dtype, and backward recomputes the fp32 forward
    (``torch.utils.checkpoint``): the loss and the gradient are bit for bit those of the fp32
    computation, with nothing but the scalar loss held for backward, for one more forward.

    A loss with a fused form (``vanilla``, ``gspo``, ``gmpo``, ``cispo``, ``sapo``, ``bapo``,
    ``decoupled_ppo``, ``a3po``; see :mod:`stablerl.fused`) runs it whenever ``log_prob`` needs a reverse-mode gradient and no
    ``torch.func`` transform or forward-mode tangent is involved: the same loss, metrics and gradient
    values, without an autograd graph for the formula, keeping one or two fp32 per-token factors
    (for any input dtype) instead of the eager intermediates. ``fused=False`` or ``STABLERL_FUSED=0``
    turns it off. It takes precedence over ``recompute_half``.

    ``top_entropy_quantile < 1`` (TRL's option, arXiv 2506.01939) trains only on the valid tokens whose
    current ``entropy`` is in that top fraction over every DP rank (:func:`stablerl.ops.high_entropy_mask`):
    the mask multiplies the per-token loss as a weight, like TRL, so the aggregation's denominator
    (token or sequence counts) is unchanged. Per-token losses only; it needs ``entropy``.
    """
    spec = get_spec(POLICY_LOSS, name)
    inputs = {k: kwargs.pop(k) for k in list(kwargs) if k in _LOSS_INPUTS}
    params = build_params(spec, kwargs)
    correction = None
    if rollout_correction is not None:
        correction = get_spec(ROLLOUT_CORRECTION, rollout_correction)
        correction_params = build_params(correction, rollout_correction_params)
        if inputs.get("is_weights") is not None:
            raise StableRLError(
                f"rollout_correction={rollout_correction!r} would be applied on top of the framework's own "
                f"rollout-correction weights (is_weights); disable one of them ({switch_names('rollout_correction')})"
            )
        if rollout_log_prob is None:
            raise MissingInputError(
                f"rollout_correction={rollout_correction!r} needs rollout_log_prob ({OPTIONAL_INPUTS['rollout_log_prob']})"
            )
    elif rollout_correction_params:
        raise StableRLError("rollout_correction_params given without rollout_correction")
    ctx = ctx or Context()
    check_aggregation_request(spec, params, loss_agg_mode, loss_agg_params, ctx)
    top_entropy_quantile = check_top_entropy_quantile(top_entropy_quantile)
    if top_entropy_quantile < 1.0:
        if spec.output != "per_token":
            raise StableRLError(
                f"top_entropy_quantile={top_entropy_quantile} weights the per-token loss before aggregation; policy loss "
                f"{name!r} returns a {spec.output} (its own aggregation over the sequence), so there is no per-token "
                "loss to mask (use a per-token loss, or top_entropy_quantile=1.0)"
            )
        if entropy is None:
            raise MissingInputError(
                f"top_entropy_quantile={top_entropy_quantile} needs entropy ({OPTIONAL_INPUTS['entropy']})")

    require_tensor("log_prob", log_prob, "[B, T]")
    if log_prob.dim() != 2:
        raise StableRLError(f"log_prob must be a [B, T] tensor, got shape {tuple(log_prob.shape)}")
    if log_prob.dtype not in _FLOAT_TYPES:
        raise StableRLError(f"log_prob must be a floating tensor, got {log_prob.dtype}")
    shape = log_prob.shape
    check_advantages_shape(advantages, shape)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand(shape)
    if not advantages.is_floating_point():  # integer / bool advantages: computed in log_prob's precision
        advantages = advantages.to(_as_compute_dtype(log_prob[:0]).dtype)
    ensure_same_shape(
        ("old_log_prob", "advantages", "response_mask", "rollout_log_prob", "entropy"),
        (old_log_prob, advantages, response_mask, rollout_log_prob, entropy),
        shape,
    )
    for k in ("old_entropy", "token_ids", "turn_ids", "versions", "is_weights"):
        ensure_same_shape((k,), (inputs.get(k),), shape)
    for k, t in (("old_log_prob", old_log_prob), ("rollout_log_prob", rollout_log_prob)):
        if t is not None:
            require_float(k, t)
    check_mask(response_mask)
    if inputs.get("versions") is not None or inputs.get("policy_version") is not None:
        # a token newer than the weights being trained is refused (A-3PO's alpha would clamp it to 0 silently)
        inputs["policy_version"] = check_policy_versions(inputs.get("versions"), inputs.get("policy_version"),
                                                         response_mask)
    if inputs.get("scores") is not None:
        scores = check_per_response("scores", inputs["scores"], shape[0])
        if not bool(torch.isfinite(scores).all()):
            raise StableRLError("scores has non-finite values (NaN or inf)")
    index = inputs.get("index")
    if index is not None:
        index = group_ids(index, n=shape[0], device=log_prob.device)
    # MoE router log-probs [B, T, layers, k]: zeroed on padding, finite and <= 0 on valid tokens
    router_log_prob, old_router_log_prob = (
        check_token_leading(k, inputs.get(k), shape, response_mask) for k in ("router_log_prob", "old_router_log_prob")
    )
    check_log_probabilities("router_log_prob", router_log_prob)
    check_log_probabilities("old_router_log_prob", old_router_log_prob)
    if inputs.get("hidden_states") is not None:
        hidden = require_tensor("hidden_states", inputs["hidden_states"], "[B, T, H]")
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != tuple(shape):
            raise StableRLError(f"hidden_states must have shape [B, T, H] with [B, T] = {tuple(shape)}, got {tuple(hidden.shape)}")

    from .fused import FusedInputs, attach, fusable, fused_requested

    fused_form = spec.fused if spec.fused is not None and fused_requested(fused) and fusable(log_prob) else None

    def loss_of(lp: torch.Tensor):
        # everything from the inputs to the loss: on the recompute path this runs again in backward,
        # so the fp32 copies of half-precision inputs are rebuilt there, not held until then
        if response_mask.dtype == torch.bool:
            # bool -> float through a uint8 view: same 0/1 values, and a vectorised cast (the direct
            # bool -> float cast is several times slower on CPU)
            valid = response_mask
            mask = response_mask.view(torch.uint8).to(torch.float32)
        else:
            mask = response_mask.to(torch.float32)
            valid = mask.bool()

        bit_masks: dict[torch.dtype, torch.Tensor] = {}  # per integer width: -1 (all ones) on valid tokens, 0 on padding

        def clean(t: Optional[torch.Tensor], detach: bool = True) -> Optional[torch.Tensor]:
            # padding may hold garbage (NaN/inf) in framework tensors: zero it before any arithmetic,
            # so neither the loss nor its gradient can pick up a NaN from a masked position
            if t is None:
                return None
            source = t
            t = _as_compute_dtype(t.detach() if detach else t)
            int_type = _SAME_WIDTH_INT.get(t.dtype)
            if int_type is None or t.numel() < _BIT_PATH_MIN_NUMEL or t.device.type != "cpu":  # e.g. integer advantages
                return torch.where(valid, t, torch.zeros((), dtype=t.dtype, device=t.device))
            bits = bit_masks.get(int_type)
            if bits is None:
                bits = bit_masks[int_type] = (-valid.view(torch.int8)).to(int_type)
            if not detach:  # log_prob: may carry a gradient, a forward-mode tangent or a torch.func wrapper
                return _ZeroPadding.apply(t, valid, bits)
            if t.dtype != source.dtype and not is_functorch_wrapped(t):
                # a fresh upcast copy (half precision in): zero its padding in place, no second [B, T] tensor
                t.view(int_type).bitwise_and_(bits)
                return t
            return _zero_padding_bits(t, bits)

        # sequence-level advantages ([B], or [B, T] expanded along T) for a loss that opted in: a cleaned
        # [B, 1] tensor (+0.0 on a row without a valid token, so garbage there reaches nothing) and the
        # [B, T] copy only if something reads batch.advantages; every other loss gets today's batch.
        # Only with check_finite: the losses' products with A on padding are then finite, so the mask
        # product zeroes them (a non-finite A on a valid token, let through by check_finite=False,
        # would turn padding into NaN where today's zeroed advantages give +-inf)
        seq_advantages = None
        if spec.seq_advantages and check_finite and shape[1] > 0 and advantages.stride(1) == 0:
            # = valid.any(-1, keepdim=True); a max over the uint8 view is vectorised (any over bool is not)
            row_valid = valid.view(torch.uint8).amax(-1, keepdim=True).bool()
            per_row = _as_compute_dtype(advantages[:, :1].detach())
            seq_advantages = torch.where(row_valid, per_row, torch.zeros((), dtype=per_row.dtype, device=per_row.device))
        batch_type = PolicyLossBatch if seq_advantages is None else _LazyAdvantagesBatch
        batch = batch_type(
            # the fused form reads a detached log_prob and attaches its own backward to lp
            log_prob=clean(lp, detach=fused_form is not None),
            old_log_prob=clean(old_log_prob),
            advantages=clean(advantages) if seq_advantages is None else (lambda: clean(advantages)),
            response_mask=mask,
            rollout_log_prob=clean(rollout_log_prob),
            entropy=clean(entropy),
            old_entropy=clean(inputs.get("old_entropy")),
            token_ids=inputs.get("token_ids"),
            index=index,
            turn_ids=inputs.get("turn_ids"),
            versions=inputs.get("versions"),
            policy_version=inputs.get("policy_version"),
            scores=_detached(inputs.get("scores")),
            router_log_prob=router_log_prob,
            old_router_log_prob=old_router_log_prob,
            hidden_states=_detached(inputs.get("hidden_states")),
            lm_head_weight=_detached(inputs.get("lm_head_weight")),
            lm_head_exp_avg=_detached(inputs.get("lm_head_exp_avg")),
            lm_head_exp_avg_sq=_detached(inputs.get("lm_head_exp_avg_sq")),
            is_weights=clean(inputs.get("is_weights")),  # zero on padding: garbage there reaches nothing
            loss_agg_mode=loss_agg_mode,
            loss_agg_params=loss_agg_params,
            seq_advantages=seq_advantages,
            valid_tokens=valid,
            # declared inputs without a field of their own (teacher_topk_log_prob, ...), as given
            extras={k: v for k, v in inputs.items() if k not in _POLICY_BATCH_FIELDS},
        )
        if check_finite:
            # seq_advantages is non-finite exactly where the cleaned [B, T] advantages would be
            reads = set(spec.requires) | set(spec.optional_inputs)
            _check_finite_cleaned(
                ("log_prob", "old_log_prob", "advantages", "rollout_log_prob", "entropy", "old_entropy", "is_weights"),
                (batch.log_prob.detach(), batch.old_log_prob,
                 batch.advantages if seq_advantages is None else seq_advantages, batch.rollout_log_prob,
                 batch.entropy if "entropy" in reads or top_entropy_quantile < 1.0 else None,
                 batch.old_entropy if "old_entropy" in reads else None,
                 batch.is_weights),
            )
        _check_missing(spec, {**inputs, "rollout_log_prob": rollout_log_prob, "entropy": entropy, "index": index})
        correction_metrics: dict[str, Any] = {}
        if correction is not None:
            weights, correction_metrics = correction.fn(batch, correction_params, ctx)
            batch.is_weights = weights.detach()
        if top_entropy_quantile < 1.0:  # before the fused/eager split: both multiply their per-token loss by it
            keep = high_entropy_mask(batch.entropy, valid, top_entropy_quantile, ctx).to(batch.log_prob.dtype)
            batch.is_weights = keep if batch.is_weights is None else batch.is_weights * keep
        fused_out = None
        if fused_form is not None:
            batch.fused_inputs = FusedInputs(lp.detach(), old_log_prob.detach(), advantages.detach(), valid)
            fused_out = fused_form(batch, params, ctx)
        zero_padded = False
        if fused_out is not None:
            if spec.output == "per_token" and fused_out.value.shape != shape:
                raise StableRLError(
                    f"the fused form of {name!r} returned shape {tuple(fused_out.value.shape)}, expected {tuple(shape)}")
            out, metrics = attach(lp, fused_out, valid), fused_out.metrics
            if fused_out.then is not None:
                out = fused_out.then(out)
            zero_padded = fused_out.zero_padded and loss_agg_mode in AGG_MODES
        else:
            if fused_form is not None:  # no fused form for this batch: the eager path, with lp's gradient
                batch.log_prob = clean(lp, detach=False)
            out, metrics = spec.fn(batch, params, ctx)
        metrics = {**metrics, **correction_metrics}
        if spec.output == "per_token":
            if batch.is_weights is not None:
                out = out * batch.is_weights
            # zero_padded: the loss is exactly zero on padding and the IS weights are finite there
            # (core zeroes them), so the sums skip the mask product (the same bits)
            loss = aggregate(out, valid, loss_agg_mode, ctx, params=loss_agg_params, zero_padded=zero_padded)
        else:
            loss = out
        bit_masks.clear()  # the pattern is rebuilt on a recompute, not held until backward
        return loss, metrics

    # an input other than log_prob that carries gradient (generalized_jsd's student_topk_log_prob): kept, not recomputed
    grad_inputs = any(isinstance(v, torch.Tensor) and v.requires_grad for v in inputs.values())
    if fused_form is None and not grad_inputs and _recomputes(recompute_half, log_prob, spec, ctx, correction,
                                                              loss_agg_mode, loss_agg_params):
        from torch.utils.checkpoint import checkpoint

        loss, metrics = checkpoint(loss_of, log_prob, use_reentrant=False)
    else:
        loss, metrics = loss_of(log_prob)
    if loss.dim() != 0:
        raise StableRLError(f"policy loss {name!r} returned shape {tuple(loss.shape)}, expected a scalar")
    return loss, as_floats(metrics)


def _recomputes(recompute_half: Optional[bool], log_prob: torch.Tensor, spec: AlgorithmSpec, ctx: Context,
                correction, loss_agg_mode: str, loss_agg_params) -> bool:
    """Whether the fp32 forward of a half-precision ``log_prob`` is recomputed in backward instead
    of kept. Only where a second forward is the same pure function of the inputs: reverse-mode
    autograd on a plain tensor (no ``torch.func`` transform), a loss without batch statistics
    (which may reduce over ranks or keep state), no collective in ``ctx``, no rollout correction,
    a built-in aggregation. Off by default: the second forward costs time (measured 1.2-3.5x verl's
    bf16 step on CPU, docs/benchmarks.md); ``recompute_half=True`` or the environment variable
    ``STABLERL_RECOMPUTE_HALF=1`` (for the framework adapters, which do not pass the keyword) turn
    it on, still only where safe."""
    from .ops import AGG_MODES

    if recompute_half is None:
        recompute_half = os.environ.get("STABLERL_RECOMPUTE_HALF", "0") not in ("", "0", "false", "False")
    if not recompute_half or log_prob.dtype not in (torch.float16, torch.bfloat16):
        return False
    return (
        log_prob.requires_grad
        and torch.is_grad_enabled()
        and not is_functorch_wrapped(log_prob)
        and not spec.batch_statistics
        and ctx.all_reduce_fn is None
        and ctx.all_gather_fn is None
        and correction is None
        and loss_agg_mode in AGG_MODES
        and not loss_agg_params
    )


def compute_advantage(
    name: str,
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    ctx: Optional[Context] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute the registered advantage estimator ``name``.

    ``index`` groups responses by prompt (numpy object array of ids, list, or integer tensor).
    Returns ``(advantages, returns)``, both ``[B, T]`` and zero outside the mask.
    """
    spec = get_spec(ADVANTAGE_ESTIMATOR, name)
    # declared extra inputs (entropy, old_log_prob, turn_ids, ...) are keywords; those without a
    # field of their own travel in batch.extras
    inputs = {k: kwargs.pop(k) for k in list(kwargs) if k in OPTIONAL_INPUTS or k in ("old_log_prob", "extras")}
    params = build_params(spec, kwargs)
    ctx = ctx or Context()
    if not isinstance(token_level_rewards, torch.Tensor) or token_level_rewards.dim() != 2:
        raise StableRLError(
            f"token_level_rewards must be a [B, T] tensor, got {getattr(token_level_rewards, 'shape', type(token_level_rewards))}"
        )
    ensure_same_shape(("response_mask",), (response_mask,), token_level_rewards.shape)
    rewards = token_level_rewards.float() if token_level_rewards.dtype != torch.float64 else token_level_rewards
    # = .to(float32).to(rewards.dtype) (0/1 are exact in both); a bool mask through its uint8 view
    # (same values; the direct bool -> float cast is several times slower on CPU)
    mask = (response_mask.view(torch.uint8) if response_mask.dtype == torch.bool else response_mask).to(rewards.dtype)
    binary = is_binary_mask(response_mask, mask)
    if not binary and not is_functorch_wrapped(response_mask):
        check_mask(response_mask)  # says which value is not 0/1
    gid = group_ids(index, n=rewards.shape[0], device=rewards.device)
    batch = AdvantageBatch(
        token_level_rewards=rewards,
        response_mask=mask,
        index=gid,
        entropy=inputs.get("entropy"),
        old_log_prob=inputs.get("old_log_prob"),
        extras={
            **(inputs.get("extras") or {}),
            **{k: v for k, v in inputs.items() if k not in ("entropy", "old_log_prob", "extras")},
        },
    )
    batch.mask_is_binary = binary
    # finite on every valid token <=> every score (the masked row sum the estimators read) is finite,
    # except when finite rewards overflow a sum: then the full check (which passes) decides, as before
    if not bool(torch.isfinite(batch.scores).all()):
        _check_finite(("token_level_rewards",), (rewards,), mask)
    _check_missing(spec, {**batch.extras, **inputs, "index": gid})
    _check_input_shapes(name, inputs, rewards.shape)
    if rewards.shape[1] == 0:  # no response token in the batch: the one possible result, for every estimator
        empty = rewards.new_zeros(rewards.shape)
        return empty, empty
    advantages, returns = spec.fn(batch, params, ctx)
    m = batch.response_mask
    # built by batch.on_response_tokens with a 0/1 mask: masking it again is the identity
    masked, per_response = batch._masked_output or (None, None)
    same = returns is advantages  # most estimators return one tensor twice: mask it once
    prebuilt = masked is not None and advantages is masked
    advantages = advantages if prebuilt else advantages * m
    returns = advantages if same else (returns if masked is not None and returns is masked else returns * m)
    if advantages.numel() == 0:
        finite = True
    elif prebuilt:  # x * m (m 0/1, every row non-empty) is finite everywhere exactly where x is
        finite = bool(torch.isfinite(per_response).all())
    else:  # min and max propagate NaN and +-inf: one vectorised read pass instead of isfinite's
        finite = bool(torch.isfinite(torch.stack(torch.aminmax(advantages))).all())
    if not finite:
        raise StableRLError(f"advantage estimator {name!r} produced non-finite advantages")
    return advantages, returns


#: estimator inputs laid out like the rewards, one value per response token
_PER_TOKEN_INPUTS = ("old_log_prob", "sum_pi_squared", "entropy", "old_entropy", "rollout_log_prob", "turn_ids",
                     "teacher_log_prob")


def _check_input_shapes(name: str, inputs: dict[str, Any], shape: torch.Size) -> None:
    """A declared input of the wrong shape is refused naming it and both shapes (not a bare size-mismatch error
    from inside the estimator): per-token inputs are ``[B, T]``, per-response tensors have ``B`` rows."""
    for key, value in inputs.items():
        if not isinstance(value, torch.Tensor):
            continue
        want = tuple(shape) if key in _PER_TOKEN_INPUTS else (shape[0],)
        got = tuple(value.shape) if key in _PER_TOKEN_INPUTS else tuple(value.shape[:1])
        if got != want:
            layout = "[B, T]" if key in _PER_TOKEN_INPUTS else "B rows"
            raise StableRLError(f"advantage estimator {name!r}: input {key!r} has shape {tuple(value.shape)}, but the "
                                f"rewards are {tuple(shape)} ({key} must have {layout} = {want})")


def _split_extras(spec: AlgorithmSpec, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Pop the per-response inputs out of ``kwargs`` (the rest are hyper-parameters).

    A keyword must be a hyper-parameter of the algorithm or a known input name
    (``OPTIONAL_INPUTS``); anything else -- usually a misspelt hyper-parameter -- is an error.
    Inputs without a registered name travel in an explicit ``extras={...}`` dict.
    """
    valid = set(spec.params.field_names())
    extras = dict(kwargs.pop("extras", None) or {})
    for key in list(kwargs):
        if key in valid:
            continue
        if key not in OPTIONAL_INPUTS:
            raise UnknownNameError(
                unknown_name_message(f"hyper-parameter or input for {spec.name!r}", key, valid | set(OPTIONAL_INPUTS))
                + " (pass other per-response inputs as extras={...})"
            )
        extras[key] = kwargs.pop(key)
    return extras


def shape_rewards(
    name: str, *, scores: torch.Tensor, index: Any, ctx: Optional[Context] = None, **kwargs: Any
) -> tuple[torch.Tensor, dict[str, float]]:
    """Apply the registered reward shaper ``name`` to per-response rewards ``[B]``.

    Shapers run before the advantage estimator. Extra per-response inputs (``lengths``,
    ``correct``, ``flawed``, ...) are keyword arguments that are not hyper-parameters of the shaper.
    Returns the shaped rewards ``[B]`` and metrics.
    """
    spec = get_spec(REWARD_SHAPER, name)
    extras = _split_extras(spec, kwargs)
    params = build_params(spec, kwargs)
    if not isinstance(scores, torch.Tensor) or scores.dim() != 1:
        raise StableRLError(f"scores must be a [B] tensor, got {getattr(scores, 'shape', type(scores))}")
    if not bool(torch.isfinite(scores).all()):
        raise StableRLError("scores has non-finite values (NaN or inf)")
    gid = group_ids(index, n=scores.shape[0], device=scores.device)
    batch = RewardBatch(scores=scores.float() if scores.dtype != torch.float64 else scores, index=gid, extras=extras)
    _check_missing(spec, {**extras, "index": gid})
    shaped, metrics = spec.fn(batch, params, ctx or Context())
    if shaped.shape != scores.shape or not bool(torch.isfinite(shaped).all()):
        raise StableRLError(f"reward shaper {name!r} must return finite rewards of shape {tuple(scores.shape)}")
    return shaped, as_floats(metrics)


def filter_batch(
    name: str,
    *,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any,
    scores: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    ctx: Optional[Context] = None,
    **kwargs: Any,
) -> FilterResult:
    """Apply the registered batch filter / sampler ``name`` (after advantage estimation).

    Returns a :class:`FilterResult`: the rows to keep (in order, possibly repeated), their token
    mask and, where the filter changes them, their advantages. Per-response extras that are not
    hyper-parameters are keyword arguments.
    """
    spec = get_spec(BATCH_FILTER, name)
    extras = _split_extras(spec, kwargs)
    params = build_params(spec, kwargs)
    require_tensor("response_mask", response_mask, "[B, T] of 0/1 (or bool)")
    if response_mask.dim() != 2:
        raise StableRLError(f"response_mask must have shape [B, T], got {tuple(response_mask.shape)}")
    check_advantages_shape(advantages, response_mask.shape)
    check_mask(response_mask)
    if scores is not None:
        check_per_response("scores", scores, response_mask.shape[0])
    advantages = _as_compute_dtype(advantages.detach())
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1) * response_mask.to(advantages.dtype)
    ensure_same_shape(("response_mask", "entropy"), (response_mask, entropy), advantages.shape)
    _check_finite(("advantages", "entropy"), (advantages, entropy), response_mask.to(torch.float32))
    if scores is not None and not bool(torch.isfinite(scores).all()):
        raise StableRLError("scores has non-finite values (NaN or inf)")
    gid = group_ids(index, n=advantages.shape[0], device=advantages.device)
    batch = FilterBatch(
        advantages=advantages, response_mask=response_mask.to(advantages.dtype), index=gid,
        scores=scores, entropy=entropy, extras=extras,
    )
    _check_missing(spec, {**extras, "index": gid, "entropy": entropy, "scores": scores})
    result = spec.fn(batch, params, ctx or Context())
    if not isinstance(result, FilterResult):
        raise StableRLError(f"batch filter {name!r} must return a FilterResult, got {type(result).__name__}")
    result.metrics = as_floats(result.metrics)
    return result


def _make_stateful(kind: str, base: type, name: str, params: dict) -> Any:
    """A fresh instance of the registered ``kind`` algorithm ``name`` (its ``fn`` is the class), checked to be a
    ``base``."""
    spec = get_spec(kind, name)
    obj = spec.fn(build_params(spec, params))
    if not isinstance(obj, base):
        raise StableRLError(f"{kind.replace('_', ' ')} {name!r} must build a stablerl {base.__name__}, "
                            f"got {type(obj).__name__}")
    return obj


def make_trainer_hook(name: str, **params: Any) -> TrainerHook:
    """A fresh instance of the registered trainer hook ``name`` (its ``fn`` is the class)."""
    return _make_stateful(TRAINER_HOOK, TrainerHook, name, params)


def make_controller(name: str, **params: Any) -> Controller:
    """A fresh instance of the registered stateful controller ``name`` (its ``fn`` is the class)."""
    return _make_stateful(CONTROLLER, Controller, name, params)
