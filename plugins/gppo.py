"""GPPO and CE-GPPO: gradient-preserving clipping (Kuaishou Klear).

GPPO: Su et al., arXiv 2508.07629 (Klear-Reasoner). CE-GPPO: Su et al., arXiv 2509.20712.

    r = exp(clamp(lp - lp_old, -20, 20)),  rs = r / sg(r)        (value 1, d rs = rs d lp)
    low  = (A < 0) & (r < 1 - eps_l);  high = (A > 0) & (r > 1 + eps_h)
    l = -beta1 (1 - eps_l) rs A  on low,  -beta2 (1 + eps_h) rs A  on high,  -r A  otherwise
    l = where(A < 0, min(l, -A c), l)                              (dual clip)

GPPO is beta1 = beta2 = 1: its value equals PPO-clip's, but a clipped token keeps the bounded
gradient ``-A (1 + eps_h) grad lp`` (upper side) or ``-A (1 - eps_l) grad lp`` (lower side)
where PPO's is 0. CE-GPPO scales those out-of-band gradients by beta1 (negative-advantage,
low-probability side) and beta2 (positive-advantage side) to steer entropy.

Defaults: GPPO (Klear scripts) ``clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10``;
CE-GPPO (7B scripts) ``beta1=0.75, beta2=1.0, clip_ratio_low=clip_ratio_high=0.2, clip_ratio_c=10``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from stablerl import POLICY_LOSS, STABLE, hookimpl
from stablerl.ops import clamped_log_ratio
from stablerl.params import check
from stablerl.primitives import ClipParams, gradient_preserving_terms


@dataclass
class GPPOParams(ClipParams):
    """PPO bounds ``[1 - clip_ratio_low, 1 + clip_ratio_high]``, dual clip ``clip_ratio_c`` (None: off)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: Optional[float] = 10.0


@dataclass
class CEGPPOParams(ClipParams):
    """GPPO bounds plus ``beta1`` (gradient scale on A<0, r<1-eps_l) and ``beta2`` (A>0, r>1+eps_h)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: Optional[float] = 10.0
    beta1: float = 0.75
    beta2: float = 1.0

    def validate(self) -> None:
        super().validate()
        check(self.beta1 >= 0, f"beta1 must be >= 0, got {self.beta1}")
        check(self.beta2 >= 0, f"beta2 must be >= 0, got {self.beta2}")


def gppo_loss(b, p: GPPOParams, ctx):
    log_ratio = clamped_log_ratio(b.log_prob, b.old_log_prob)
    return gradient_preserving_terms(
        log_ratio, b.advantages, b.response_mask, p.clip_ratio_low, p.clip_ratio_high, p.clip_ratio_c
    )


def ce_gppo_loss(b, p: CEGPPOParams, ctx):
    log_ratio = clamped_log_ratio(b.log_prob, b.old_log_prob)
    return gradient_preserving_terms(
        log_ratio, b.advantages, b.response_mask, p.clip_ratio_low, p.clip_ratio_high, p.clip_ratio_c,
        beta_low=p.beta1, beta_high=p.beta2,
    )


_METRICS = ("pg_clipfrac", "pg_clipfrac_lower", "clip_high", "clip_low", "ppo_kl")


@hookimpl
def register_policy_losses(register):
    register(
        name="gppo",
        kind=POLICY_LOSS,
        fn=gppo_loss,
        params=GPPOParams,
        paper="2508.07629",
        title="GPPO (Klear-Reasoner): PPO clip whose clipped tokens keep a bounded gradient",
        formula="l = -A (1+eps_h) r/sg(r) if A>0,r>1+eps_h; -A (1-eps_l) r/sg(r) if A<0,r<1-eps_l; else -A r; dual clip c",
        status=STABLE,
        metrics=_METRICS,
        reference="Kwai-Klear/KlearReasoner core_algos.compute_gppo_loss (verified via the catalogue; its "
        "'only_higher' NameError not reproduced)",
        notes=(
            "Forward value equals PPO-clip (vanilla) with the same bounds; only the gradient of out-of-band "
            "tokens differs. Defaults are the Klear scripts' (0.2/0.28, dual clip c=10; verl's own default c is "
            "3). Log-ratio clamped to +-20. Honours loss_agg_mode (paper: token-mean). The 'only_high' variant "
            "of the reference is not provided."
        ),
    )
    register(
        name="ce_gppo",
        kind=POLICY_LOSS,
        fn=ce_gppo_loss,
        params=CEGPPOParams,
        paper="2509.20712",
        title="CE-GPPO: gradient-preserving clipping with separate scales beta1/beta2 to control entropy",
        formula="l = -beta1 (1-eps_l) r/sg(r) A if A<0,r<1-eps_l; -beta2 (1+eps_h) r/sg(r) A if A>0,r>1+eps_h; else -r A; dual clip c",
        status=STABLE,
        metrics=_METRICS,
        reference="Kwai-Klear/CE-GPPO core_algos.compute_gppo_loss_general_beta (verified via the catalogue)",
        notes=(
            "beta1 scales the negative-advantage low-ratio side, beta2 the positive-advantage high-ratio side "
            "(raise beta2 or lower beta1 to raise entropy). beta1=beta2=1 equals gppo. Defaults: CE-GPPO 7B "
            "scripts (beta1=0.75, beta2=1, 0.2/0.2, c=10); 1.5B scripts use beta1=0.5. Unlike GPPO the forward "
            "value differs from PPO when a beta != 1. Log-ratio clamped to +-20; honours loss_agg_mode."
        ),
    )
