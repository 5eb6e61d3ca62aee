"""VESPO: Variational Sequence-Level Soft Policy Optimization (arXiv 2602.10693), TRL's ``loss_type="vespo"``.

    w_i = exp(clamp(sum_t m_t clamp(log r_t, -20, 20) + sum_t m_t log rho_t, log 1e-8, 20))
    phi(w) = exp(lambda + k log w - lambda w)          (a Gamma-shaped weight, phi(1) = 1)
    l_t = -sg(phi(w_i)) A_t log pi_t,   (k, lambda) = (k_pos, lambda_pos) if A >= 0 else (k_neg, lambda_neg)

A smooth, asymmetric weight on the whole sequence's importance ratio replaces hard clipping; rho
are the framework's rollout-correction weights (TRL's vLLM importance-sampling ratio), folded into
w instead of multiplying the loss. Defaults (TRL's): ``k_pos=2``, ``lambda_pos=3``, ``k_neg=3``,
``lambda_neg=2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stablerl import STABLE, Params, hookimpl
from stablerl.ops import aggregate, clamped_log_ratio, masked_mean, masked_sum
from stablerl.params import check

# TRL clamps log w below at log(1e-8) (the reference implementation's floor) and above at 20
LOG_W_MIN, LOG_W_MAX = math.log(1e-8), 20.0
# TRL's floor on lambda
LAMBDA_MIN = 1e-4


@dataclass
class VESPOParams(Params):
    """The Gamma weight's power ``k`` and decay ``lambda`` for A >= 0 (pos) and A < 0 (neg)."""

    k_pos: float = 2.0
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0

    def validate(self) -> None:
        for name in ("k_pos", "lambda_pos", "k_neg", "lambda_neg"):
            value = getattr(self, name)
            check(math.isfinite(value) and value >= 0, f"{name} must be a finite number >= 0, got {value}")


def vespo_loss(b, p: VESPOParams, ctx):
    mask = b.response_mask
    with torch.no_grad():
        log_ratio = clamped_log_ratio(b.log_prob.detach(), b.old_log_prob)
        seq_log_w = masked_sum(log_ratio, mask, dim=-1)
        if b.is_weights is not None:
            log_rho = torch.clamp(torch.log(b.is_weights), LOG_W_MIN, LOG_W_MAX)
            seq_log_w = seq_log_w + masked_sum(log_rho, mask, dim=-1)
        log_w = torch.clamp(seq_log_w, LOG_W_MIN, LOG_W_MAX).unsqueeze(-1)
        w = torch.exp(log_w)
        nonneg = b.advantages >= 0
        k = torch.where(nonneg, p.k_pos, p.k_neg).to(w.dtype)
        lam = torch.where(nonneg, p.lambda_pos, p.lambda_neg).to(w.dtype).clamp(min=LAMBDA_MIN)
        phi = torch.exp(lam + k * log_w - lam * w).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    pg_losses = -phi * b.advantages * b.log_prob
    loss = aggregate(pg_losses, mask, b.loss_agg_mode, ctx, params=b.loss_agg_params)
    with torch.no_grad():
        row_tokens = mask.sum(-1)
        valid_rows = (row_tokens > 0).to(w.dtype)
        # one phi per sequence, averaged over every row (TRL's [B, 1] phi_seq); per-token advantages: the row's
        # token mean of phi
        row_phi = torch.where(row_tokens > 0, masked_sum(phi, mask, dim=-1) / row_tokens.clamp(min=1), phi[:, 0]
                              if phi.shape[-1] else torch.ones_like(row_tokens))
        metrics = {
            "ppo_kl": masked_mean(-log_ratio, mask),
            "vespo/phi_seq_mean": row_phi.mean() if row_phi.numel() else row_phi.new_ones(()),
            "vespo/seq_ratio_mean": masked_mean(w.squeeze(-1), valid_rows),
        }
    return loss, metrics


@hookimpl
def register_policy_losses(register):
    register(
        name="vespo",
        fn=vespo_loss,
        params=VESPOParams,
        paper="2602.10693",
        title="VESPO: Gamma-shaped soft weight on the sequence importance ratio",
        formula="l = -sg(phi(w)) A log pi, phi(w) = exp(lambda + k log w - lambda w), w = prod_t r_t (sequence ratio)",
        status=STABLE,
        output="scalar",
        metrics=("ppo_kl", "vespo/phi_seq_mean", "vespo/seq_ratio_mean"),
        reference="TRL 1.16 GRPOTrainer.get_gamma_weights and _compute_loss (loss_type='vespo')",
        notes="w is the product (not the geometric mean) of the token ratios, each log clamped to +-20, the sum "
        "clamped to [log 1e-8, 20] (TRL). Framework IS weights (TRL's vLLM importance_sampling_ratio, verl's "
        "rollout_is_weights, OpenRLHF's vLLM correction) are folded into w in log space, clamped per token to "
        "[log 1e-8, 20], over the valid tokens, instead of multiplying the loss (TRL; TRL sums over every position). "
        "phi is detached: the gradient is -phi A grad log pi. A = 0 takes the positive-side (k, lambda) (TRL). "
        "Aggregation follows loss_agg_mode; TRL's vespo normalises by the tokens of the whole generation batch, "
        "which is token-mean. TRL recommends importance_sampling_level='token' for it (the sequence ratio is "
        "formed here either way). vespo/phi_seq_mean is the mean of phi over the sequences (TRL's).",
    )
