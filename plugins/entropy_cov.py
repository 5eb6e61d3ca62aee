"""Clip-Cov and KL-Cov: covariance-based token selection (Cui et al., arXiv 2505.22617).

"The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models". Both use the
centred covariance of advantage and log-prob over the valid tokens of the call (micro-batch):

    cov_t = (A_t - mean_m(A)) * (sg(lp_t) - mean_m(sg(lp)))

Clip-Cov (``clip_cov``): PPO-clip, then a RANDOM subset of ``max(int(clip_cov_ratio * N), 1)``
tokens among those not already clipped with ``clip_cov_lb < cov < clip_cov_ub`` is detached
(value and gradient set to 0); no dual clip.
    l = max(-A r, -A clamp(r, 1 - eps_l, 1 + eps_h)) * (1 - sel)
Defaults (authors' scripts): ``clip_cov_ratio=2e-4, clip_cov_lb=1, clip_cov_ub=5,
clip_ratio_low=clip_ratio_high=1`` (ratio band [0, 2], i.e. almost no ratio clipping).

KL-Cov (``kl_cov``): no PPO clip; the top-``max(1, int(kl_cov_ratio * N))`` tokens by cov get an
absolute-log-ratio penalty.
    l = -A r + ppo_kl_coef * |lp - lp_old| * top
Defaults (authors' 7B script): ``kl_cov_ratio=2e-3, ppo_kl_coef=1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import POLICY_LOSS, STABLE, Params, hookimpl
from stablerl.ops import clamped_log_ratio, masked_mean, masked_sum
from stablerl.params import check


@dataclass
class ClipCovParams(Params):
    """Selection fraction and covariance window; PPO bounds ``[1 - clip_ratio_low, 1 + clip_ratio_high]``."""

    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    clip_ratio_low: float = 1.0
    clip_ratio_high: float = 1.0

    def validate(self) -> None:
        check(0 < self.clip_cov_ratio <= 1, f"clip_cov_ratio must be in (0, 1], got {self.clip_cov_ratio}")
        check(
            self.clip_cov_lb < self.clip_cov_ub,
            f"clip_cov_lb ({self.clip_cov_lb}) must be < clip_cov_ub ({self.clip_cov_ub})",
        )
        check(0 <= self.clip_ratio_low, f"clip_ratio_low must be >= 0, got {self.clip_ratio_low}")
        check(0 <= self.clip_ratio_high, f"clip_ratio_high must be >= 0, got {self.clip_ratio_high}")


@dataclass
class KLCovParams(Params):
    """Fraction of tokens penalised and the penalty coefficient."""

    kl_cov_ratio: float = 0.002
    ppo_kl_coef: float = 1.0

    def validate(self) -> None:
        check(0 < self.kl_cov_ratio <= 1, f"kl_cov_ratio must be in (0, 1], got {self.kl_cov_ratio}")
        check(self.ppo_kl_coef >= 0, f"ppo_kl_coef must be >= 0, got {self.ppo_kl_coef}")


def token_covariance(advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(A - mean_m(A)) * (sg(lp) - mean_m(sg(lp)))`` per token (means over this call's valid tokens)."""
    lp = log_prob.detach()
    return (advantages - masked_mean(advantages, mask)) * (lp - masked_mean(lp, mask))


def _randperm(n: int, generator, device) -> torch.Tensor:
    if generator is None:  # the global CPU RNG, as verl's torch.randperm(n)
        return torch.randperm(n).to(device)
    return torch.randperm(n, generator=generator, device=generator.device).to(device)


def clip_cov_loss(b, p: ClipCovParams, ctx):
    mask = b.response_mask
    adv = b.advantages
    log_ratio = clamped_log_ratio(b.log_prob, b.old_log_prob)
    ratio = torch.exp(log_ratio)
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1.0 - p.clip_ratio_low, 1.0 + p.clip_ratio_high)
    valid = mask > 0
    clipped = (pg_losses2 > pg_losses1) & valid

    cov = token_covariance(adv, b.log_prob, mask)
    eligible = valid & ~clipped & (cov > p.clip_cov_lb) & (cov < p.clip_cov_ub)
    n_select = max(int(p.clip_cov_ratio * mask.sum().item()), 1)
    idx = torch.nonzero(eligible)  # row-major, as verl
    corr = torch.ones_like(adv)
    if idx.shape[0] > 0:
        perm = _randperm(idx.shape[0], ctx.generator, idx.device)
        chosen = idx[perm[: min(n_select, idx.shape[0])]]
        corr[chosen[:, 0], chosen[:, 1]] = 0.0
    pg_losses = torch.maximum(pg_losses1, pg_losses2) * corr

    dt = mask.dtype
    metrics = {
        # verl: pg_clipfrac is the covariance-clip fraction
        "pg_clipfrac": masked_mean((corr == 0).to(dt), mask),
        "clip_high": masked_mean(((adv > 0) & (ratio > 1.0 + p.clip_ratio_high)).to(dt), mask),
        "clip_low": masked_mean(((adv < 0) & (ratio < 1.0 - p.clip_ratio_low)).to(dt), mask),
        "ppo_kl": masked_mean(-(b.log_prob.detach() - b.old_log_prob), mask),
    }
    return pg_losses, metrics


def kl_cov_loss(b, p: KLCovParams, ctx):
    mask = b.response_mask
    adv = b.advantages
    diff = b.log_prob - b.old_log_prob
    ratio = torch.exp(clamped_log_ratio(b.log_prob, b.old_log_prob))
    abs_kl = diff.abs()

    flat_valid = torch.nonzero(mask.reshape(-1) > 0).squeeze(-1)
    n_valid = flat_valid.numel()
    # a bool selection: x * True = x and x * False = 0 as with a float 0/1 mask, and autograd keeps
    # 1 byte per token for backward instead of 4
    penalised = torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
    if n_valid > 0:
        adv_v = adv.reshape(-1)[flat_valid]
        lp_v = b.log_prob.detach().reshape(-1)[flat_valid]
        cov = (adv_v - adv_v.mean()) * (lp_v - lp_v.mean())
        k = max(1, int(n_valid * p.kl_cov_ratio))
        top = torch.topk(cov, k, largest=True).indices
        penalised[flat_valid[top]] = True
    penalised = penalised.reshape(mask.shape)
    pg_losses = -adv * ratio + p.ppo_kl_coef * abs_kl * penalised.view(torch.uint8)

    with torch.no_grad():
        count = mask.sum().clamp(min=1)
        metrics = {
            "ppo_kl": masked_sum(abs_kl, mask) / count,  # verl: the ABSOLUTE log-ratio
            "kl_cov/penalized_frac": masked_sum(penalised.view(torch.uint8), mask) / count,
        }
    return pg_losses, metrics


@hookimpl
def register_policy_losses(register):
    register(
        name="clip_cov",
        kind=POLICY_LOSS,
        fn=clip_cov_loss,
        params=ClipCovParams,
        paper="2505.22617",
        title="Clip-Cov: detach a random few high-covariance tokens (entropy mechanism of RL)",
        formula="l = max(-A r, -A clip(r, 1-eps_l, 1+eps_h)) * (1 - sel), sel = random max(int(ratio N),1) of "
        "unclipped tokens with lb < (A-mean A)(lp-mean lp) < ub",
        status=STABLE,
        batch_statistics=True,
        metrics=("pg_clipfrac", "clip_high", "clip_low", "ppo_kl"),
        reference="verl core_algos.compute_policy_loss_clip_cov (loss_mode=clip_cov), equal under the same RNG seed",
        notes=(
            "The random selection uses ctx.generator when given (seeded, reproducible), else the global CPU RNG "
            "exactly as verl's torch.randperm. Covariance means, the selection count and the selection are per "
            "call (micro-batch), as in the reference; the count scales with the micro-batch size. Selected "
            "tokens keep counting in the loss denominator (value and gradient 0). No dual clip (reference). "
            "Defaults are the authors' scripts (clip_ratio_low=clip_ratio_high=1; verl's actor values override "
            "them in verl). pg_clipfrac is the covariance-clip fraction (verl). Log-ratio clamped to +-20 before "
            "exp (verl does not clamp here; differs only for |lp - lp_old| > 20). Honours loss_agg_mode."
        ),
    )
    register(
        name="kl_cov",
        kind=POLICY_LOSS,
        fn=kl_cov_loss,
        params=KLCovParams,
        paper="2505.22617",
        title="KL-Cov: |log-ratio| penalty on the top-k covariance tokens (entropy mechanism of RL)",
        formula="l = -A r + ppo_kl_coef |lp - lp_old| [token in top-max(1,int(kl_cov_ratio N)) of (A-mean A)(lp-mean lp)]",
        status=STABLE,
        batch_statistics=True,
        metrics=("ppo_kl", "kl_cov/penalized_frac"),
        reference="verl core_algos.compute_policy_loss_kl_cov (loss_mode=kl_cov)",
        notes=(
            "No PPO clipping (reference). Covariance means and the top-k count are per call (micro-batch). "
            "ppo_kl is the mean ABSOLUTE log-ratio (verl). Defaults are the authors' 7B script (kl_cov_ratio=2e-3, "
            "ppo_kl_coef=1; 32B: 2e-4; verl's config defaults are 2e-4 / 0.1). Ratio formed from the log-ratio "
            "clamped to +-20 (verl does not clamp; differs only beyond 20); the penalty uses the unclamped "
            "|lp - lp_old|. Honours loss_agg_mode (paper: token-mean)."
        ),
    )
