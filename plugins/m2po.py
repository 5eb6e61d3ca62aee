"""M2PO: Second-Moment Trust Policy Optimization (Zheng, Zhao, Chen, arXiv 2510.01161, Sec. 5, Alg. 1, Eq. 5).

Paper (``variant="mask"``, default)::

    d = lp - lp_old (lp_old: the behaviour / stale policy),  M2 = d^2
    T = valid & ((A > 0 & d > 0) | (A < 0 & d < 0))                  (trust-region tokens)
    M = 1;  while mean_{T} M2 > tau:  drop argmax_{T} M2 from T, M[it] = 0
    l = -M * A * exp(clamp(d, -20, 20))       aggregated over ALL valid tokens (masked ones still count)

The greedy loop is computed exactly by sorting: prefix means of the ascending M2 values are
non-decreasing, so the kept set is the longest prefix whose mean is <= tau. The M2 values of the
trust region are gathered over all data-parallel ranks (``ctx.all_gather``), so the cut is the same
on every rank and 2 ranks equal 1 rank with the whole batch. Default ``m2_threshold = 0.04``.

Authors' release (``variant="clip_bounds"``, Infini-AI-Lab/M2PO ``compute_m2po_policy_loss``): no
mask; a single threshold tau with ``sum_T min(M2, tau^2) ~= m2_threshold * |T|`` (tau^2 is the
largest sorted M2 breakpoint below the crossing; 0 if the first breakpoint already crosses) is mapped
to PPO bounds ``eps_low = 1 - e^-tau``, ``eps_high = e^tau - 1`` (``(0, 1e5)`` in ratio space when M2
is within budget) and the standard PPO clip without dual clip is applied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from stablerl import STABLE, Params, hookimpl
from stablerl.ops import clamped_log_ratio, masked_mean
from stablerl.params import check
from stablerl.primitives import ppo_clip_terms

VARIANTS = ("mask", "clip_bounds")
# the authors' "no clipping" bounds: ratio in (1 - 1, 1 + (1e5 - 1)) = (0, 1e5)
_NO_CLIP = (1.0, 1e5 - 1.0)
_AUTHORS_TOL = 1e-12


@dataclass
class M2POParams(Params):
    m2_threshold: float = 0.04  # tau_M2 (authors' code: M2_budget)
    variant: str = "mask"  # "mask" (paper, Trinity-RFT) | "clip_bounds" (authors' release)
    miniclip_low: Optional[float] = None  # clip_bounds only: floor on eps_low (authors' option, off in their runs)
    miniclip_high: Optional[float] = None  # clip_bounds only: floor on eps_high

    def validate(self) -> None:
        check(self.m2_threshold > 0, f"m2_threshold must be > 0, got {self.m2_threshold}")
        check(self.variant in VARIANTS, f"variant must be one of {VARIANTS}, got {self.variant!r}")
        for name in ("miniclip_low", "miniclip_high"):
            v = getattr(self, name)
            check(v is None or v >= 0, f"{name} must be >= 0 or None, got {v}")


def _trust_region(b):
    """Per-token M2 (float64, detached) and the trust-region mask T."""
    d = (b.log_prob.detach() - b.old_log_prob).to(torch.float64)
    adv = b.advantages
    valid = b.response_mask > 0
    tr = valid & (((adv > 0) & (d > 0)) | ((adv < 0) & (d < 0)))
    return d * d, tr


def _global_counts(ctx, *counts: torch.Tensor) -> list[torch.Tensor]:
    summed = ctx.all_reduce(torch.stack([c.to(torch.float64) for c in counts]), "sum")
    return list(summed.unbind())


def _sorted_gathered(ctx, m2: torch.Tensor, tr: torch.Tensor):
    """The trust-region M2 values of every DP rank, sorted, with prefix sums and their mean.

    Statistics are taken on the sorted values, so they do not depend on the order of rows or ranks.
    """
    values, _ = torch.sort(ctx.all_gather(m2[tr]))  # every rank holds the same multiset
    csum = torch.cumsum(values, 0)
    n = values.numel()
    m2_before = csum[-1] / n if n else values.new_zeros(())
    return values, csum, m2_before


def _mask_variant(b, p: M2POParams, ctx, m2: torch.Tensor, tr: torch.Tensor):
    sorted_vals, csum, m2_before = _sorted_gathered(ctx, m2, tr)
    n = sorted_vals.numel()
    drop = torch.zeros_like(tr)
    m2_after = m2_before
    if n > 0 and float(m2_before) > p.m2_threshold:
        counts = torch.arange(1, n + 1, dtype=sorted_vals.dtype, device=sorted_vals.device)
        keep = int((csum / counts <= p.m2_threshold).sum())  # prefix means are non-decreasing; keep < n
        cut = sorted_vals[keep]
        # ties at the cut are all dropped (order-independent; the loop would drop an arbitrary subset)
        drop = tr & (m2 >= cut)
        kept = int(torch.searchsorted(sorted_vals, cut, right=False))  # values < cut: a prefix
        m2_after = csum[kept - 1] / kept if kept else sorted_vals.new_zeros(())
    keep_mask = (~drop).to(b.log_prob.dtype)
    ratio = torch.exp(clamped_log_ratio(b.log_prob, b.old_log_prob))
    pg_losses = -b.advantages * ratio * keep_mask
    return pg_losses, drop, m2_before, m2_after, {}


def _authors_tau(sorted_vals: torch.Tensor, csum: torch.Tensor, budget: float) -> tuple[float, float]:
    """(tau, M2 after capping at tau^2): the authors' search over the sorted M2 breakpoints."""
    n = sorted_vals.numel()
    target = budget * n
    if target <= _AUTHORS_TOL:
        tau = 0.0
    else:
        rest = torch.arange(n - 1, -1, -1, dtype=sorted_vals.dtype, device=sorted_vals.device)  # n-k-1
        crosses = (sorted_vals - _AUTHORS_TOL) * rest + csum >= target - _AUTHORS_TOL
        k = int(torch.nonzero(crosses)[0])  # exists: at k = n-1 the left side is the total > target
        tau = 0.0 if k == 0 else math.sqrt(max(float(sorted_vals[k - 1]) - _AUTHORS_TOL, 0.0))
    m2_after = float(torch.clamp(sorted_vals, max=tau * tau).sum()) / n
    return tau, m2_after


def _clip_bounds_variant(b, p: M2POParams, ctx, m2: torch.Tensor, tr: torch.Tensor):
    sorted_vals, csum, m2_before = _sorted_gathered(ctx, m2, tr)
    n = sorted_vals.numel()
    if n == 0 or float(m2_before) <= p.m2_threshold + _AUTHORS_TOL:
        eps_low, eps_high = _NO_CLIP
        m2_after = m2_before
    else:
        tau, m2_after_f = _authors_tau(sorted_vals, csum, p.m2_threshold)
        # fp32 exp as in the authors' code: it decides whether the breakpoint token itself is clipped
        eps_low = 1.0 - float(torch.exp(torch.tensor(-tau, dtype=torch.float32)))
        eps_high = float(torch.exp(torch.tensor(tau, dtype=torch.float32))) - 1.0
        m2_after = m2_before.new_tensor(m2_after_f)
    if p.miniclip_low is not None and eps_low < p.miniclip_low:
        eps_low = p.miniclip_low
    if p.miniclip_high is not None and eps_high < p.miniclip_high:
        eps_high = p.miniclip_high
    ratio = torch.exp(clamped_log_ratio(b.log_prob, b.old_log_prob))
    pg_losses, clip_metrics = ppo_clip_terms(ratio, b.advantages, b.response_mask, eps_low, eps_high, None)
    extra = {
        "m2po/clip_low": float(eps_low),
        "m2po/clip_high": float(eps_high),
        **clip_metrics,
    }
    return pg_losses, torch.zeros_like(tr), m2_before, m2_after, extra


def m2po_loss(b, p: M2POParams, ctx):
    mask = b.response_mask
    m2, tr = _trust_region(b)
    variant = _mask_variant if p.variant == "mask" else _clip_bounds_variant
    pg_losses, drop, m2_before, m2_after, extra = variant(b, p, ctx, m2, tr)
    n_valid, n_tr, n_drop = _global_counts(ctx, mask.sum(), tr.sum(), drop.sum())
    metrics = {
        "m2po/m2_before": m2_before,
        "m2po/m2_after": m2_after,
        "m2po/masked_fraction": n_drop / n_valid.clamp(min=1),
        "m2po/trust_region_fraction": n_tr / n_valid.clamp(min=1),
    }
    if p.variant == "mask":
        adv = b.advantages
        metrics.update(
            {  # masked tokens are this variant's "clipped" tokens (this call's batch)
                "pg_clipfrac": masked_mean(drop.to(mask.dtype), mask),
                "pg_clipfrac_lower": torch.zeros((), dtype=mask.dtype, device=mask.device),
                "clip_high": masked_mean((drop & (adv > 0)).to(mask.dtype), mask),
                "clip_low": masked_mean((drop & (adv < 0)).to(mask.dtype), mask),
            }
        )
    metrics.update(extra)
    metrics["ppo_kl"] = masked_mean(-(b.log_prob.detach() - b.old_log_prob), mask)
    return pg_losses, metrics


@hookimpl
def register_policy_losses(register):
    register(
        name="m2po",
        fn=m2po_loss,
        params=M2POParams,
        paper="2510.01161",
        title="M2PO: second-moment trust region (mask the largest-M2 trust-region tokens until mean M2 <= tau)",
        formula="l = -M A r, r = exp(lp - lp_old); M drops the largest (log r)^2 of T={(A>0,r>1)|(A<0,r<1)} "
        "until mean_T (log r)^2 <= tau; token-mean over all valid tokens",
        status=STABLE,
        batch_statistics=True,
        metrics=("m2po/m2_before", "m2po/m2_after", "m2po/masked_fraction", "m2po/trust_region_fraction",
                 "pg_clipfrac", "pg_clipfrac_lower", "clip_high", "clip_low", "ppo_kl",
                 "m2po/clip_low", "m2po/clip_high"),
        reference="paper Alg. 1 (greedy loop; sorted-prefix equivalent as in Trinity-RFT M2POPolicyLossFn); "
        "variant='clip_bounds': Infini-AI-Lab/M2PO core_algos.compute_m2po_policy_loss",
        notes=(
            "old_log_prob is the behaviour (stale, generation-time) policy's log-prob, as in the paper and the "
            "authors' code; the mask is recomputed every call from the current lp and carries no gradient. "
            "The M2 statistic is global over DP ranks (gathered with ctx.all_gather) but per call: with gradient "
            "accumulation it is per micro-batch (x DP), whereas the paper specifies the batch. variant='mask' "
            "(default): masked tokens are removed from the numerator, the denominator counts every valid token "
            "(paper footnote 2; token-mean), no epsilon clip; ties at the cut value are all masked (the greedy "
            "loop would drop an arbitrary subset of them). variant='clip_bounds': authors' release (discrete "
            "breakpoint tau, (0, 1e5) bounds within budget, no dual clip, optional miniclip floors off by "
            "default); it logs m2po/clip_low and m2po/clip_high (eps values), and its m2po/masked_fraction is 0. "
            "Both variants take the quadrant per token (the authors use advantages[:, 0], identical for "
            "sequence-level advantages) with strict inequalities (the authors' tolerance is 1e-12). "
            "Log-ratios are clamped to +-20 before exp."
        ),
    )
