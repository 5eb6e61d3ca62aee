"""GPG: Group Policy Gradient (Chu et al., arXiv 2504.02546), verl's built-in loss and estimator.

    loss:       l_t = -A_t log pi(o_t)                        (plain policy gradient: no ratio, no clip)
    estimator:  A_i = alpha (S_i - mean_g) / f_norm,   alpha = B / max(#{i: S_i != 0}, 1)

alpha rescales the gradient by the share of responses with a non-zero score over the whole batch
(verl's form of the paper's B / (B - M) correction). Defaults: ``f_norm=1.0`` (verl's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import STABLE, NoParams, Params, hookimpl
from stablerl.ops import broadcast_to_tokens, group_stats, masked_mean
from stablerl.params import check
from stablerl.primitives import singleton_convention


@dataclass
class GPGParams(Params):
    """verl's ``f_norm`` (the advantage divisor)."""

    f_norm: float = 1.0

    def validate(self) -> None:
        check(self.f_norm > 0, f"f_norm must be > 0, got {self.f_norm}")


def gpg_loss(b, p, ctx):
    pg_losses = -b.advantages * b.log_prob
    with torch.no_grad():
        ppo_kl = masked_mean(b.old_log_prob - b.log_prob.detach(), b.response_mask)
    return pg_losses, {"ppo_kl": ppo_kl}


def gpg_advantage(b, p: GPGParams, ctx):
    scores = b.scores
    counts = ctx.all_reduce(torch.stack([
        torch.tensor(float(scores.numel()), dtype=scores.dtype, device=scores.device),
        (scores != 0).sum().to(scores.dtype),
    ]), "sum")
    alpha = counts[0] / counts[1].clamp(min=1)
    mean, std, count = group_stats(scores, b.index)
    mean, _ = singleton_convention(mean, std, count)
    adv = broadcast_to_tokens(alpha * (scores - mean) / p.f_norm, b.response_mask)
    return adv, adv


@hookimpl
def register_policy_losses(register):
    register(
        name="gpg",
        fn=gpg_loss,
        params=NoParams,
        paper="2504.02546",
        title="GPG: Group Policy Gradient (plain policy-gradient loss)",
        formula="l_t = -A_t log pi(o_t)",
        status=STABLE,
        metrics=("ppo_kl",),
        reference="verl core_algos.compute_policy_loss_gpg (loss_mode=gpg)",
        notes="No ratio, no clipping: the gradient is -A grad log pi at any old policy, so use one update per batch "
        "(the paper's setting). The value of the loss is -A log pi, not -A r (verl's). IS weights multiply the "
        "per-token loss (verl). ppo_kl is reported for monitoring (verl reports no metric).",
    )


@hookimpl
def register_advantage_estimators(register):
    register(
        name="gpg",
        fn=gpg_advantage,
        params=GPGParams,
        paper="2504.02546",
        title="GPG: group-mean advantage rescaled by the share of non-zero-score responses",
        formula="A_i = alpha (S_i - mean_g) / f_norm, alpha = B / max(#{i: S_i != 0}, 1)",
        status=STABLE,
        batch_statistics=True,
        reference="verl core_algos.compute_gpg_outcome_advantage (adv_estimator=gpg)",
        notes="alpha counts non-zero scores over the whole batch (all DP ranks, ctx.all_reduce), as verl; the paper "
        "writes alpha = B / (B - M) with M the responses that give no gradient. Group of one: baseline 0 (verl). No "
        "std division (verl computes the group std and does not use it). S = sum of token rewards over "
        "response_mask. returns == advantages.",
    )
