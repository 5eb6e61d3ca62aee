"""REBEL: REinforcement learning via regressing relative rewards (Gao et al., arXiv 2404.16767).

For two responses y, y' of the same prompt, regress the difference of their log-ratios on the difference of
their rewards:

    l(y, y') = ((s(y) - s(y')) - eta (r(y) - r(y')))^2,    s(y) = sum_t m_t (log pi(y_t) - log pi_old(y_t))

(the paper writes ``((1/eta)(s - s') - (r - r'))^2``, the authors' code ``(s - s' - eta (r - r'))^2``: the same
minimiser, the code's scale, which is this one). The loss is the mean of l over the pairs. Default ``eta=1.0``
(the authors' ``REBELHParams.eta``). ``scores`` are the rewards r, ``index`` the prompt groups.

Groups of more than two responses (assumed, hence experimental): every unordered pair of the group, each
group's pair mean weighted by its number of responses, i.e. with ``d = s - eta r``,
``loss = (1/N) sum_i 2 k/(k-1) (d_i - mean_g d)^2`` (``sum_{i<j} (d_i - d_j)^2 = k sum_i (d_i - mean d)^2``);
for groups of two this is exactly the authors' mean over pairs, for equal group sizes the mean over all pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import EXPERIMENTAL, Params, hookimpl
from stablerl.ops import masked_mean, masked_sum
from stablerl.params import check
from stablerl.primitives import group_sum, refuse_token_weights, score_labels, sequence_mean_loss, valid_rows


@dataclass
class REBELParams(Params):
    """``eta``: the reward scale of the regression target (the authors' code; the paper's 1/eta scaling)."""

    eta: float = 1.0

    def validate(self) -> None:
        check(self.eta > 0, f"eta must be > 0, got {self.eta}")


def rebel_loss(b, p: REBELParams, ctx):
    refuse_token_weights(b, "rebel")
    mask = b.response_mask
    rewards = score_labels(b, "rebel")
    gid = b.index
    valid = valid_rows(b)
    k = group_sum(valid, gid)  # responses without a trained token take no part in any pair
    paired = valid * (k >= 2).to(valid.dtype)  # a group of one has no pair
    s = masked_sum(b.log_prob - b.old_log_prob, mask, dim=-1)
    d = (s - p.eta * rewards) * valid
    centred = d - group_sum(d, gid) / k.clamp(min=1)
    per_seq = 2.0 * k / (k - 1).clamp(min=1) * centred**2 * paired
    metrics = {
        # the mean |(s - s') - eta (r - r')| is not cheap for large groups; the centred residual is its analogue
        "rebel/residual_abs_mean": masked_mean(centred.detach().abs(), paired),
        "rebel/unpaired_fraction": masked_mean(valid - paired, valid),
        "ppo_kl": masked_mean(b.old_log_prob - b.log_prob.detach(), mask),
    }
    return sequence_mean_loss(per_seq, valid, ctx), metrics


@hookimpl
def register_policy_losses(register):
    register(
        name="rebel",
        aggregation="mean over pairs of responses of a prompt (per response: seq-mean-token-sum)",
        fn=rebel_loss,
        params=REBELParams,
        output="scalar",
        paper="2404.16767",
        title="REBEL: regress the difference of two responses' log-ratios on the difference of their rewards",
        formula="l = ((s_i - s_j) - eta (r_i - r_j))^2 over pairs i, j of a group, s = sum_t (lp - lp_old); mean over pairs",
        status=EXPERIMENTAL,
        requires=("scores", "index"),
        metrics=("rebel/residual_abs_mean", "rebel/unpaired_fraction", "ppo_kl"),
        reference="ZhaolinGao/REBEL src/tldr/rebel.py (reg_diff = ratio_logprob - eta * (r - r'); loss = mean(reg_diff^2))",
        notes=(
            "Groups of two reproduce the authors' loss (checked against their formula, value and gradient); groups of "
            "more are the assumed all-pairs generalisation (each group's pair mean weighted by its size), hence "
            "experimental. scores are the rewards r: the authors subtract kl_coef * the sequence KL to the "
            "reference from the reward model's score first (the framework's KL-in-reward does that) and optionally "
            "whiten them. All responses of a prompt must be in the same call. With all pairs REBEL is GVPO's "
            "residual (arXiv 2504.19599) up to its scale: 2k/(k-1) (d - mean d)^2 here, 1/(2(k-1)) there."
        ),
    )
