"""Divergence-gated rollout corrections: verl's K2/K3 rejection sampling and OpenRLHF's binary-KL / TV gating.

With ``log rho_t = lp_old - lp_roll`` (train over inference policy, clamped to +-20) and ``p`` / ``q`` the
sampled token's probability under the inference / train policy:

* ``kl_rs`` (verl ``rollout_rs=<level>_k2|k3``): per-token divergence ``k2 = (log rho)^2 / 2`` or
  ``k3 = rho - 1 - log rho``; the statistic is the token's (``level=token``) or the sequence's sum, mean
  or max over its valid tokens; keep iff ``stat <= threshold``. Rejection only: weight 1 inside.
* ``divergence_is`` (OpenRLHF ``--algo.advantage.is_correction_gating binary_kl|tv`` with mode ``mask``,
  FlashREINFORCE's trust region): ``binary_kl = p log(p/q) + (1-p) log((1-p)/(1-q))`` or ``tv = |p - q|``
  (p, q clamped to [1e-6, 1 - 1e-6]); per token or the sequence's mean; keep iff ``stat <= threshold``,
  and a kept token carries its IS weight ``rho_t``.

Defaults: ``kl_rs``: ``estimator="k3"``, ``level="token"``, ``threshold=0.01`` (assumed: verl requires the
threshold to be set); ``divergence_is``: ``gating="binary_kl"``, ``level="sequence"``, ``threshold=0.01``
(assumed; OpenRLHF's default upper bound 5.0 is a ratio bound, not a divergence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import EXPERIMENTAL, Params, hookimpl
from stablerl.ops import masked_extreme, masked_mean, masked_sum, seq_mean
from stablerl.params import check
from stablerl.primitives import rollout_log_rho, rollout_mismatch_metrics

KL_RS_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")
# OpenRLHF clamps both probabilities so that the binary-KL logarithms stay finite
PROB_CLAMP = 1e-6


@dataclass
class KLRSParams(Params):
    """verl's ``rollout_rs`` option split into the divergence estimator and the level, and its threshold."""

    estimator: str = "k3"
    level: str = "token"
    threshold: float = 0.01

    def validate(self) -> None:
        check(self.estimator in ("k2", "k3"), f"estimator must be 'k2' or 'k3', got {self.estimator!r}")
        check(self.level in KL_RS_LEVELS, f"level must be one of {list(KL_RS_LEVELS)}, got {self.level!r}")
        check(self.threshold > 0, f"threshold must be > 0, got {self.threshold}")


def kl_rs_weights(b, p: KLRSParams, ctx):
    mask = b.response_mask
    log_rho = rollout_log_rho(b)
    div = 0.5 * log_rho * log_rho if p.estimator == "k2" else torch.exp(log_rho) - 1.0 - log_rho
    if p.level == "token":
        keep = div <= p.threshold
    else:
        if p.level == "seq_sum":
            stat = masked_sum(div, mask, dim=-1)
        elif p.level == "seq_mean":
            stat = seq_mean(div, mask)
        else:  # seq_max: 0 for a row without a valid token (verl)
            stat = masked_extreme(div, mask, "max", dim=-1)
        keep = (stat <= p.threshold).unsqueeze(-1).expand_as(div)
    w = keep.to(log_rho.dtype)
    metrics = rollout_mismatch_metrics(log_rho, w, mask)
    metrics["rollout_corr/divergence_mean"] = masked_mean(div, mask)
    return w * mask, metrics


@dataclass
class DivergenceISParams(Params):
    """OpenRLHF's gating statistic, level and (upper) threshold."""

    gating: str = "binary_kl"
    level: str = "sequence"
    threshold: float = 0.01

    def validate(self) -> None:
        check(self.gating in ("binary_kl", "tv"), f"gating must be 'binary_kl' or 'tv', got {self.gating!r}")
        check(self.level in ("token", "sequence"), f"level must be 'token' or 'sequence', got {self.level!r}")
        check(self.threshold > 0, f"threshold must be > 0, got {self.threshold}")


def divergence_is_weights(b, p: DivergenceISParams, ctx):
    mask = b.response_mask
    log_rho = rollout_log_rho(b)
    q_roll = torch.exp(b.rollout_log_prob).clamp(PROB_CLAMP, 1 - PROB_CLAMP)
    q_train = torch.exp(b.old_log_prob).clamp(PROB_CLAMP, 1 - PROB_CLAMP)
    if p.gating == "binary_kl":
        stat = q_roll * torch.log(q_roll / q_train) + (1 - q_roll) * torch.log((1 - q_roll) / (1 - q_train))
    else:
        stat = (q_roll - q_train).abs()
    if p.level == "sequence":
        stat = seq_mean(stat, mask).unsqueeze(-1)
    keep = stat <= p.threshold
    w = torch.where(keep, torch.exp(log_rho), torch.zeros_like(log_rho))
    metrics = rollout_mismatch_metrics(log_rho, w, mask)
    metrics["rollout_corr/divergence_mean"] = masked_mean(stat.expand_as(log_rho), mask)
    return w * mask, metrics


_METRICS = ("rollout_corr/weight_mean", "rollout_corr/masked_fraction", "rollout_corr/kl", "rollout_corr/k3_kl",
            "rollout_corr/divergence_mean")


@hookimpl
def register_rollout_corrections(register):
    register(
        name="kl_rs",
        fn=kl_rs_weights,
        params=KLRSParams,
        title="K2/K3 divergence rejection sampling of the train/inference mismatch (verl rollout_rs)",
        formula="keep iff stat <= threshold, stat = k2 = (log rho)^2/2 or k3 = rho - 1 - log rho, per token or the "
        "sequence's sum / mean / max",
        status=EXPERIMENTAL,
        requires=("rollout_log_prob",),
        metrics=_METRICS,
        reference="verl rollout_corr_helper.compute_rollout_rejection_mask (rollout_rs=token_k2|token_k3|seq_sum_k*|"
        "seq_mean_k*|seq_max_k*)",
        notes="Experimental: the default threshold 0.01 is assumed (verl requires rollout_rs_threshold). The kept "
        "set equals verl's for the same option and threshold (parity test); verl then drops rejected tokens from "
        "the response mask (and the loss denominator), stablerl gives them weight 0 and keeps the denominator "
        "(the convention of every stablerl rollout correction). One option per call (verl chains several with "
        "commas; chain by selecting the strictest). K1 bands are geo_rs / seq_mis.",
    )
    register(
        name="divergence_is",
        fn=divergence_is_weights,
        params=DivergenceISParams,
        title="Binary-KL / TV gated importance sampling (OpenRLHF is_correction_gating, FlashREINFORCE's trust region)",
        formula="w = rho [stat <= threshold], stat = binary KL(p_roll || q_train) or |p_roll - q_train| of the sampled "
        "token, per token or the sequence's mean",
        status=EXPERIMENTAL,
        requires=("rollout_log_prob",),
        metrics=_METRICS,
        reference="OpenRLHF 0.11.2 models/loss.py PolicyLoss (is_correction_mode=mask, is_correction_gating="
        "binary_kl|tv)",
        notes="Experimental: the default threshold 0.01 is assumed (OpenRLHF takes the upper end of "
        "--algo.advantage.is_correction_threshold, whose default 5.0 is meant for ratios). Probabilities clamped to "
        "[1e-6, 1-1e-6] (OpenRLHF). A kept token is weighted by its token IS ratio rho_t (OpenRLHF's mask mode); a "
        "rejected one gets 0 and keeps its place in the denominator.",
    )
