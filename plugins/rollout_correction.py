"""Training-inference mismatch corrections, usable with any policy loss.

Selected with ``compute_policy_loss(..., rollout_correction="tis", rollout_correction_params={...})``.
Each returns detached per-token weights that multiply the per-token loss; the aggregation
denominator is unchanged (TRL's convention: rejected tokens still count), and the masked fraction
is logged so the effective learning rate is visible.

With ``rho_t = exp(lp_old - lp_roll)`` (the train/inference ratio, formed in log space):

* ``tis`` (FlashRL blog; verl ``rollout_is``): ``w = min(rho, C)`` per token, or per sequence
  ``min(exp(sum_t log rho_t), C)``; ``C = 2``.
* ``icepop`` (Ring-1T report, arXiv 2510.18855): ``w = rho`` if ``low <= rho <= high`` else 0; 0.5 / 5.
* ``seq_mis`` ("When Speed Kills Stability" blog): ``w = rho_seq * 1[low <= rho_seq <= C]``, ``rho_seq = prod_t rho_t``.
* ``geo_rs`` (same blog; verl ``seq_mean_k1``): keep a sequence iff ``low <= exp(mean_t log rho_t) <= high``.
* ``opsm`` (DeepSeek-V3.2, arXiv 2512.02556, Eq. 9): keep sequence i iff ``A_i >= 0`` or
  ``mean_t(lp_roll - lp) <= delta`` (current policy, detached).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from stablerl import EXPERIMENTAL, Params, hookimpl
from stablerl.ops import LOG_RATIO_BOUND, masked_mean, masked_sum, seq_mean
from stablerl.params import check
from stablerl.primitives import rollout_log_rho, rollout_mismatch_metrics


def _seq_log_rho_sum(log_rho, mask):
    return masked_sum(log_rho, mask, dim=-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


@dataclass
class TISParams(Params):
    threshold: float = 2.0  # C, verl rollout_is_threshold
    level: str = "token"  # token | sequence

    def validate(self) -> None:
        check(self.threshold > 0, f"threshold must be > 0, got {self.threshold}")
        check(self.level in ("token", "sequence"), f"level must be 'token' or 'sequence', got {self.level!r}")


def tis_weights(b, p: TISParams, ctx):
    log_rho = rollout_log_rho(b)
    mask = b.response_mask
    if p.level == "token":
        w = torch.exp(log_rho).clamp(max=p.threshold)
    else:
        w = torch.exp(_seq_log_rho_sum(log_rho, mask)).clamp(max=p.threshold).unsqueeze(-1).expand_as(log_rho)
    return w * mask, rollout_mismatch_metrics(log_rho, w, mask)


@dataclass
class BandParams(Params):
    """A two-sided band ``[low, high]`` on a ratio."""

    low: Optional[float] = 0.5
    high: float = 5.0

    def validate(self) -> None:
        check(self.high > 0, f"high must be > 0, got {self.high}")
        check(self.low is None or 0 <= self.low <= self.high, f"low must be in [0, high], got {self.low}")


def icepop_weights(b, p: BandParams, ctx):
    log_rho = rollout_log_rho(b)
    rho = torch.exp(log_rho)
    low = 0.0 if p.low is None else p.low
    w = torch.where((rho >= low) & (rho <= p.high), rho, torch.zeros_like(rho))
    return w * b.response_mask, rollout_mismatch_metrics(log_rho, w, b.response_mask)


@dataclass
class SeqMISParams(BandParams):
    low: Optional[float] = None  # one-sided by default (the blog's Seq-MIS); verl's preset uses 0.5
    high: float = 2.0


def seq_mis_weights(b, p: SeqMISParams, ctx):
    log_rho = rollout_log_rho(b)
    mask = b.response_mask
    log_seq = _seq_log_rho_sum(log_rho, mask)
    rho_seq = torch.exp(log_seq)
    low = 0.0 if p.low is None else p.low
    keep = (rho_seq >= low) & (rho_seq <= p.high)
    w = torch.where(keep, rho_seq, torch.zeros_like(rho_seq)).unsqueeze(-1).expand_as(log_rho)
    return w * mask, rollout_mismatch_metrics(log_rho, w, mask)


@dataclass
class GeoRSParams(BandParams):
    low: Optional[float] = 0.999  # verl rollout_rs_threshold "0.999_1.001"
    high: float = 1.001


def geo_rs_weights(b, p: GeoRSParams, ctx):
    log_rho = rollout_log_rho(b)
    mask = b.response_mask
    geo = torch.exp(seq_mean(log_rho, mask))
    low = 0.0 if p.low is None else p.low
    keep = ((geo >= low) & (geo <= p.high)).to(log_rho.dtype)
    w = keep.unsqueeze(-1).expand_as(log_rho)
    return w * mask, rollout_mismatch_metrics(log_rho, w, mask)


@dataclass
class OPSMParams(Params):
    threshold: Optional[float] = None  # delta; the paper gives no value, so it must be set

    def validate(self) -> None:
        check(
            self.threshold is not None,
            "opsm needs threshold (delta of DeepSeek-V3.2 Eq. 9; the paper gives no default, TRL's "
            "off_policy_mask_threshold is user-set, e.g. 0.5)",
        )
        check(self.threshold >= 0, f"threshold must be >= 0, got {self.threshold}")


def opsm_weights(b, p: OPSMParams, ctx):
    mask = b.response_mask
    divergence = seq_mean(b.rollout_log_prob - b.log_prob.detach(), mask)  # mean_t log(mu / pi)
    keep = (seq_mean(b.advantages, mask) >= 0) | (divergence <= p.threshold)
    w = keep.to(b.log_prob.dtype).unsqueeze(-1).expand_as(mask)
    log_rho = rollout_log_rho(b)
    metrics = rollout_mismatch_metrics(log_rho, w, mask)
    metrics["rollout_corr/opsm_divergence"] = masked_mean(divergence, (mask.sum(-1) > 0).to(mask.dtype))
    return w * mask, metrics


_COMMON = dict(
    status=EXPERIMENTAL,
    metrics=("rollout_corr/weight_mean", "rollout_corr/masked_fraction", "rollout_corr/kl", "rollout_corr/k3_kl"),
    requires=("rollout_log_prob",),
)


@hookimpl
def register_rollout_corrections(register):
    register(
        name="tis",
        fn=tis_weights,
        params=TISParams,
        title="Truncated importance sampling (FlashRL) of the train/inference mismatch",
        formula="w = min(exp(lp_old - lp_roll), C) per token (level=sequence: min(prod_t rho_t, C))",
        reference="verl rollout_corr_helper.compute_rollout_correction_weights (rollout_is=token|sequence); TRL token_truncate",
        notes="Source: blog (no arXiv id). Upper truncation only, as verl; weights detached; denominators unchanged.",
        **_COMMON,
    )
    register(
        name="icepop",
        fn=icepop_weights,
        params=BandParams,
        paper="2510.18855",
        title="IcePop: two-sided masked token IS (Ring-1T)",
        formula="w = rho if low <= rho <= high else 0,  rho = exp(lp_old - lp_roll)",
        reference="OpenRLHF is_correction_level=token, mode=mask; TRL token_mask",
        notes="Masked tokens keep their place in the denominator (TRL convention; verl's RS drops them).",
        **_COMMON,
    )
    register(
        name="seq_mis",
        fn=seq_mis_weights,
        params=SeqMISParams,
        title="Sequence-level masked IS ('When Speed Kills Stability')",
        formula="w_i = rho_seq * 1[low <= rho_seq <= C],  rho_seq = prod_t exp(lp_old - lp_roll)",
        reference="verl preset decoupled_seq_is_rs; TRL sequence_mask",
        notes="Source: blog (no arXiv id). Product formed as a clamped log-sum (+-20) before exp.",
        **_COMMON,
    )
    register(
        name="geo_rs",
        fn=geo_rs_weights,
        params=GeoRSParams,
        title="Geometric-mean rejection sampling (length-invariant)",
        formula="keep i iff low <= exp(mean_t log rho_t) <= high",
        reference="verl rollout_rs=seq_mean_k1 (default threshold 0.999_1.001); OpenRLHF seq-mask-tis filter",
        notes="Source: blog (no arXiv id). Rejection only (weight 1 inside the band).",
        **_COMMON,
    )
    register(
        name="opsm",
        fn=opsm_weights,
        params=OPSMParams,
        paper="2512.02556",
        title="DeepSeek-V3.2 off-policy sequence masking",
        formula="keep i iff A_i >= 0 or mean_t(lp_roll - sg(lp)) <= delta",
        reference="TRL off_policy_mask_threshold",
        notes="delta (threshold) has no published default and must be set.",
        **_COMMON,
    )
