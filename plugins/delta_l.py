"""ΔL Normalization: length-aware loss aggregation (He et al., arXiv 2509.07558).

Each sequence's gradient is an estimate whose variance grows with its length L_i; the
minimum-variance unbiased combination weights sequence i by x_i proportional to L_i^(-alpha),
normalised to mean 1 over the batch:

    x_i  = (L_i / mean L)^(-alpha) / mean_j (L_j / mean L)^(-alpha)  =  L_i^(-alpha) / mean_j L_j^(-alpha)
    loss = sum_i x_i sum_t m_it l_it / N_tokens * dp_size

with N_tokens the global token count (``ctx.token_count``; this call's own valid tokens when
unset, as ``token-mean``) and the mean over the sequences with at least one valid token of the
whole DP batch (``ctx.all_reduce``). alpha = 0 is token-sum with a constant normaliser
(Dr. GRPO-like); alpha = 1 weights every sequence by 1/L_i. Default ``alpha=1.0`` (the
authors' CountDown scripts; their Math scripts use 0.75).

Use it as ``compute_policy_loss(..., loss_agg_mode="delta_l")`` (``loss_agg_params={"alpha":
0.75}`` to change alpha) or ``stablerl.ops.aggregate(loss_mat, mask, "delta_l", ctx, params=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import EXPERIMENTAL, Params, hookimpl
from stablerl.ops import masked_sum
from stablerl.params import StableRLError, check


@dataclass
class DeltaLParams(Params):
    """``alpha``: the length exponent of the per-sequence weight L^(-alpha)."""

    alpha: float = 1.0

    def validate(self) -> None:
        check(0.0 <= self.alpha, f"alpha must be >= 0, got {self.alpha}")


def delta_l_weights(mask: torch.Tensor, alpha: float, ctx) -> torch.Tensor:
    """Per-sequence weights ``[B]`` (detached), mean 1 over the valid sequences of every DP rank; 0 for empty rows."""
    lengths = mask.detach().to(torch.float64).sum(-1)
    valid = lengths > 0
    raw = torch.where(valid, lengths.clamp(min=1) ** (-alpha), torch.zeros_like(lengths))
    total = ctx.all_reduce(torch.stack([raw.sum(), valid.sum().to(torch.float64)]), "sum")
    mean = total[0] / total[1].clamp(min=1)
    return torch.where(valid, raw / torch.where(mean > 0, mean, torch.ones_like(mean)), torch.zeros_like(raw))


def delta_l_aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, p: DeltaLParams, ctx) -> torch.Tensor:
    if ctx.dp_size > 1 and ctx.token_count is None:
        raise StableRLError("loss aggregation 'delta_l' with dp_size > 1 needs the global token_count in the Context")
    mask = mask.to(loss_mat.dtype)
    weights = delta_l_weights(mask, p.alpha, ctx).to(loss_mat.dtype)
    total = masked_sum(loss_mat * weights.unsqueeze(-1), mask)
    denom = ctx.token_count if ctx.token_count is not None else mask.sum()
    if isinstance(denom, torch.Tensor):
        denom = denom.clamp(min=1)
    else:
        denom = max(float(denom), 1.0)
    return total / denom * ctx.dp_size


@hookimpl
def register_aggregations(register):
    register(
        name="delta_l",
        fn=delta_l_aggregate,
        params=DeltaLParams,
        paper="2509.07558",
        title="ΔL Normalization: minimum-variance length-aware loss aggregation",
        formula="loss = sum_i x_i sum_t m l / N_tokens, x_i = L_i^(-alpha) / mean_j L_j^(-alpha)",
        status=EXPERIMENTAL,
        batch_statistics=True,
        reference="authors' verl fork zerolllin/Delta-L-Normalization 89da5b9: compute_grpo_outcome_advantage"
        "(use_grpopp) weights + masked_mean_allavg",
        notes="The reference multiplies the GRPO advantage by x_i over the whole training batch (mean L, mean x "
        "over every response) and aggregates with masked_mean_allavg = sum(m*l) / (B_micro * T_padded), the padded "
        "micro-batch size. Here x_i is applied in the aggregation (equal, since a PPO-clip loss is positively "
        "homogeneous in A, dual clip included) and the normaliser is the global token count (ctx.token_count, "
        "else this call's valid tokens), which does not change with padding; the two differ by the constant "
        "factor T_padded / mean L (a learning-rate scale). mean_j L_j^(-alpha) is over the valid sequences of "
        "this call on every DP rank (ctx.all_reduce), not over gradient-accumulation micro-batches: "
        "micro-batches normalise their weights separately (batch_statistics). Rows with no valid token get "
        "weight 0. The weights are detached (they depend on the mask only). Output='scalar' losses that "
        "aggregate themselves use the default alpha.",
    )
