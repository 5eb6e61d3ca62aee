"""LUSPO: Length-Unbiased Sequence Policy Optimization (arXiv 2602.05261), TRL's ``loss_type="luspo"``.

    s_i = exp(mean_t m (log pi - log pi_old))    (GSPO's sequence ratio, with its gradient)
    l_i = max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high)),   loss = mean_i (L_i l_i)

GSPO (the registered ``gspo`` loss) with each sequence's loss scaled by its length L_i: the per-token
terms are summed per sequence and averaged over sequences (``seq-mean-token-sum``), so long responses
are not down-weighted.
Defaults: ``clip_ratio_low=3e-4``, ``clip_ratio_high=4e-4`` (GSPO's bounds; assumed, see notes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import EXPERIMENTAL, POLICY_LOSS, get_spec, hookimpl
from stablerl.ops import aggregate
from stablerl.primitives import GSPOParams

LUSPO_AGG_MODE = "seq-mean-token-sum"


@dataclass
class LUSPOParams(GSPOParams):
    """Ratio-space bounds on the sequence ratio ``[1 - clip_ratio_low, 1 + clip_ratio_high]`` (GSPO's)."""


def luspo_loss(b, p: LUSPOParams, ctx):
    pg_losses, metrics = get_spec(POLICY_LOSS, "gspo").fn(b, p, ctx)
    if b.is_weights is not None:
        pg_losses = pg_losses * b.is_weights
    loss = aggregate(pg_losses, b.response_mask, LUSPO_AGG_MODE, ctx)
    with torch.no_grad():
        metrics = {k: v for k, v in metrics.items() if not k.startswith("gspo/")} | {
            "luspo/seq_ratio_mean": metrics["gspo/seq_ratio_mean"],
        }
    return loss, metrics


@hookimpl
def register_policy_losses(register):
    register(
        name="luspo",
        fn=luspo_loss,
        params=LUSPOParams,
        paper="2602.05261",
        title="LUSPO: GSPO with each sequence's loss scaled by its length",
        formula="l_i = max(-A_i s_i, -A_i clip(s_i, 1-eps_low, 1+eps_high)), s_i = exp(mean_t(lp - lp_old)); "
        "loss = mean_i sum_t l_i",
        status=EXPERIMENTAL,
        output="scalar",
        aggregation=LUSPO_AGG_MODE,
        metrics=("pg_clipfrac", "pg_clipfrac_lower", "clip_high", "clip_low", "ppo_kl", "luspo/seq_ratio_mean"),
        reference="TRL 1.16 GRPOTrainer._compute_loss (loss_type='luspo', importance_sampling_level='sequence')",
        notes="Experimental: the default bounds 3e-4/4e-4 are GSPO's, assumed (TRL takes its epsilon/epsilon_high, "
        "whose defaults 0.2 are PPO's token bounds; the LUSPO paper's values were not checked). With the same bounds "
        "the loss equals TRL's luspo (parity test). Always aggregates seq-mean-token-sum (sum over the sequence's "
        "tokens, mean over sequences; TRL divides by the local batch's sequences, stablerl by ctx.seq_count). The "
        "sequence ratio is GSPO-token's (log clamped at 10, as verl's GSPO; TRL does not clamp). IS weights multiply "
        "the per-token loss.",
    )
