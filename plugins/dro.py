"""DRO-style policy gradient with a quadratic log-ratio penalty (verl's ``dro`` loss).

    l_t = -(A_t log pi_t - beta/2 (log pi_t - log pi_old_t)^2)

The quadratic term is the regulariser of Direct Reward Optimization (Richemond et al., arXiv
2405.19107, an offline single-trajectory objective), here applied to the old policy as verl does.
Default: ``dro_beta = 0.1`` (assumed: verl has no default and refuses the loss until
``policy_loss.dro_beta`` is set; 0.1 is what ports of this loss default to).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import EXPERIMENTAL, Params, hookimpl
from stablerl.ops import masked_mean
from stablerl.params import check


@dataclass
class DROParams(Params):
    """verl's ``policy_loss.dro_beta``: the weight of the quadratic log-ratio penalty."""

    dro_beta: float = 0.1

    def validate(self) -> None:
        check(self.dro_beta > 0, f"dro_beta must be > 0, got {self.dro_beta}")


def dro_loss(b, p: DROParams, ctx):
    log_ratio = b.log_prob - b.old_log_prob
    pg_losses = -(b.advantages * b.log_prob - 0.5 * p.dro_beta * log_ratio * log_ratio)
    with torch.no_grad():
        ppo_kl = masked_mean(-log_ratio.detach(), b.response_mask)
    return pg_losses, {"ppo_kl": ppo_kl}


@hookimpl
def register_policy_losses(register):
    register(
        name="dro",
        fn=dro_loss,
        params=DROParams,
        paper="2405.19107",
        title="DRO-style loss: policy gradient with a quadratic penalty on the log-ratio to the old policy",
        formula="l = -(A log pi - beta/2 (log pi - log pi_old)^2)",
        status=EXPERIMENTAL,
        metrics=("ppo_kl",),
        reference="verl core_algos.compute_policy_loss_dro (loss_mode=dro)",
        notes="Experimental because the default dro_beta=0.1 is assumed (verl has none: it raises until "
        "policy_loss.dro_beta is set); with the same beta the loss equals verl's (parity test). The log-ratio is not "
        "clamped (verl). IS weights multiply the per-token loss (verl's rollout_is_weights). The paper's DRO is an "
        "offline objective with a learned value baseline and a reference policy; verl's form keeps only its "
        "quadratic regulariser, against the old policy.",
    )
