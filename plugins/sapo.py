"""SAPO: Soft Adaptive Policy Optimization (Qwen, arXiv 2511.20347).

    r = exp(clamp(lp - lp_old, -20, 20));  tau = tau_pos if A > 0 else tau_neg
    l = -(4 / tau) * sigmoid(tau * (r - 1)) * A          (a smooth gate instead of a hard clip)

The gate has value 2/tau and slope 1 at r = 1 (so the on-policy gradient is -A grad lp, as
PPO's); away from r = 1 the gradient ``-4 s (1 - s) r A grad lp`` (s = sigmoid(tau (r - 1)))
decays smoothly instead of dropping to zero at a clip boundary.

Defaults (paper and verl): ``tau_pos=1.0``, ``tau_neg=1.05``. Aggregation is forced to
seq-mean-token-mean, as verl's ``compute_policy_loss_sapo`` and TRL's ``loss_type="sapo"`` do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import POLICY_LOSS, STABLE, Params, hookimpl
from stablerl.fused import FusedLoss, fused_log_ratio, sign_of_
from stablerl.ops import aggregate, clamped_log_ratio, masked_sum
from stablerl.params import check

SAPO_AGG_MODE = "seq-mean-token-mean"


@dataclass
class SAPOParams(Params):
    """Gate temperatures for positive-advantage (``tau_pos``) and other (``tau_neg``) tokens."""

    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def validate(self) -> None:
        check(self.tau_pos > 0, f"tau_pos must be > 0, got {self.tau_pos}")
        check(self.tau_neg > 0, f"tau_neg must be > 0, got {self.tau_neg}")


class _ScaleByFourOverTau(torch.autograd.Function):
    """``s * (4 / tau)`` for a ``tau`` without gradient, keeping ``tau`` for backward (autograd keeps
    it anyway, for ``tau * (r - 1)``) instead of a second [B, T] tensor ``4 / tau``. Same forward;
    the backward recomputes ``4 / tau`` and forms ``grad * (4 / tau)`` as autograd's would."""

    generate_vmap_rule = True

    @staticmethod
    def forward(s: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        return s * (4.0 / tau)

    @staticmethod
    def setup_context(fctx, inputs, output) -> None:
        fctx.tau = inputs[1]
        fctx.save_for_backward(fctx.tau)

    @staticmethod
    def backward(fctx, grad: torch.Tensor):
        (tau,) = fctx.saved_tensors
        return grad * (4.0 / tau), None

    @staticmethod
    def jvp(fctx, s_t: torch.Tensor, tau_t) -> torch.Tensor:  # tau carries no gradient (from A's sign)
        return s_t * (4.0 / fctx.tau)


def sapo_loss(b, p: SAPOParams, ctx):
    mask = b.response_mask
    # sequence-level advantages stay [B, 1] (as TRL keeps them): tau, 4 / tau and the product with A
    # broadcast instead of running over [B, T], and autograd keeps no [B, T] advantage copy
    per_row = b.seq_advantages is not None
    adv = b.broadcast_advantages
    log_ratio = clamped_log_ratio(b.log_prob, b.old_log_prob)
    ratio = torch.exp(log_ratio)
    # A == 0 takes tau_neg (as verl); the loss is 0 there either way (0-dim bounds: no [B, T] fills).
    # The temperatures take the ratio's (compute) dtype, not the advantages': fp32 advantages with fp64
    # log-probs would otherwise round tau_neg=1.05 to fp32, and integer advantages would truncate it.
    tau = torch.where(
        adv > 0,
        torch.tensor(p.tau_pos, dtype=ratio.dtype, device=adv.device),
        torch.tensor(p.tau_neg, dtype=ratio.dtype, device=adv.device),
    )
    s = torch.sigmoid(tau * (ratio - 1.0))
    # a [B, 1] tau makes 4 / tau [B, 1] too: the plain product keeps nothing large for backward and
    # skips the custom Function's per-call cost (the same bits either way)
    gate = s * (4.0 / tau) if per_row else _ScaleByFourOverTau.apply(s, tau)
    # = -gate * A bit for bit (negation is exact); its backward needs no separate negation pass
    pg_losses = gate * -adv
    return _sapo_aggregate(b, pg_losses, ctx), _sapo_metrics(log_ratio.detach(), mask)


def _sapo_aggregate(b, pg_losses, ctx):
    if b.is_weights is not None:
        pg_losses = pg_losses * b.is_weights
    per_row = b.seq_advantages is not None
    # core zeroes the per-token advantages on padding and the gate is finite there (r = 1), so
    # pg_losses is exactly +-0 on padding: aggregate without the mask product (bit-identical sums,
    # one [B, T] pass fewer each way, no mask kept for backward); non-finite IS weights on padding
    # make the loss NaN either way. [B, 1] advantages are not zero on padding: the mask product
    # zeroes it there (x * 1 == x on valid tokens, so the sums are the same bit for bit), with a
    # bool mask so that autograd keeps 1 byte per token for backward, not a float copy
    return aggregate(pg_losses, b.bool_mask if per_row else b.response_mask, SAPO_AGG_MODE, ctx,
                     zero_padded=not per_row)


def _sapo_metrics(log_ratio, mask):
    with torch.no_grad():
        zero = torch.zeros((), dtype=mask.dtype, device=mask.device)
        return {
            "pg_clipfrac": zero,  # no hard clip (verl reports 0 for compatibility)
            "pg_clipfrac_lower": zero,
            # = masked_mean(-log_ratio, mask); 0.0 - s (not -s) so an empty sum stays +0.0
            "ppo_kl": (0.0 - masked_sum(log_ratio, mask)) / mask.sum().clamp(min=1),
        }


def _temperatures(adv, tau_pos: float, tau_neg: float, dtype):
    """``where(A > 0, tau_pos, tau_neg)`` in ``dtype`` without ``torch.where`` (not vectorised on
    CPU): ``pos * tau_pos + (1 - pos) * tau_neg`` with ``pos`` in {0, 1} is exact (``1 * t + 0 == t``)."""
    pos = torch.relu_(sign_of_(adv.to(dtype) * 1.0))
    other = (1.0 - pos).mul_(tau_neg)
    return pos.mul_(tau_pos).add_(other)


def sapo_fused(b, p: SAPOParams, ctx):
    """:func:`sapo_loss` as a fused form. Autograd's gradient of ``(sigmoid(tau (r - 1)) * (4 / tau))
    * -A`` with respect to lp, step by step: ``sigmoid_backward((g * -A) * (4 / tau), s) * tau * r``
    (times the +-20 clamp's pass factor). Keeps ``s``, ``r``, ``-A`` and ``tau``; for half-precision
    inputs with per-token advantages, ``-A`` and ``tau`` are rebuilt from the caller's advantages
    instead (8 bytes a token instead of 16)."""
    mask = b.response_mask
    per_row = b.seq_advantages is not None
    adv = b.broadcast_advantages
    with torch.no_grad():
        log_ratio, in_range = fused_log_ratio(b.log_prob, b.old_log_prob)
        metrics = _sapo_metrics(log_ratio, mask)
        # in place on temporaries: each fresh [B, T] tensor costs its page faults on CPU
        ratio = torch.exp(log_ratio, out=log_ratio) if in_range is None else torch.exp(log_ratio)
        tau = _temperatures(adv, p.tau_pos, p.tau_neg, ratio.dtype)
        s = torch.sub(ratio, 1.0).mul_(tau).sigmoid_()  # = sigmoid(tau * (r - 1)) (the product commutes)
        four_over_tau = 4.0 / tau
        gate = four_over_tau.mul_(s) if four_over_tau.shape == s.shape else s * four_over_tau
        neg_adv = -adv
        pg_losses = gate.mul_(neg_adv)  # = (s * (4 / tau)) * -A
        if in_range is not None:
            ratio = ratio.mul_(in_range)  # the clamp's pass factor (0/1), exact; applied last in backward
    taus = (p.tau_pos, p.tau_neg)
    half = b.fused_inputs is not None and b.fused_inputs.log_prob.dtype in (torch.float16, torch.bfloat16)
    if per_row or not half:  # keep -A and tau (fp32 in: 16 bytes a token, verl's sapo keeps 20)
        saved = (neg_adv, tau, s, ratio)
        backward = _sapo_grad
    else:  # half precision: 8 bytes a token (verl's bf16 sapo keeps 10); -A from the caller's tensor
        inputs = b.fused_inputs

        def backward(g, advantages, valid, s, ratio):
            neg_adv = -inputs.clean(advantages, valid)
            tau = _temperatures(-neg_adv, *taus, s.dtype)
            return _sapo_grad(g, neg_adv, tau, s, ratio)

        saved = (inputs.advantages, inputs.valid, s, ratio)
    return FusedLoss(pg_losses, metrics, backward, saved, then=lambda out: _sapo_aggregate(b, out, ctx))


def _sapo_grad(g, neg_adv, tau, s, ratio):
    return torch.ops.aten.sigmoid_backward((g * neg_adv) * (4.0 / tau), s).mul_(tau).mul_(ratio)


@hookimpl
def register_policy_losses(register):
    register(
        name="sapo",
        aggregation=SAPO_AGG_MODE,
        kind=POLICY_LOSS,
        fn=sapo_loss,
        fused=sapo_fused,
        params=SAPOParams,
        paper="2511.20347",
        title="SAPO: soft adaptive policy optimization (sigmoid gate on the token ratio instead of a hard clip)",
        formula="l = -(4/tau) sigmoid(tau (r - 1)) A,  tau = tau_pos if A > 0 else tau_neg",
        status=STABLE,
        output="scalar",
        seq_advantages=True,
        metrics=("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"),
        reference="verl core_algos.compute_policy_loss_sapo (loss_mode=sapo); TRL loss_type='sapo'",
        notes=(
            "Aggregation is always seq-mean-token-mean, whatever loss_agg_mode says (as verl and TRL do); "
            "the sequence count comes from ctx.seq_count (verl: global_batch_size). Framework IS weights "
            "multiply the per-token loss before aggregation. Log-ratio clamped to +-20 before exp (as verl). "
            "pg_clipfrac / pg_clipfrac_lower are always 0 (no hard clip), as in verl."
        ),
    )
