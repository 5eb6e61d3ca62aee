"""EntroPIC: entropy stabilisation with proportional-integral control (Yang et al., arXiv 2511.15248).

A PI controller turns the gap between the measured policy entropy and a target into a
coefficient alpha, which scales an extra, unclipped term on high-probability tokens:

    H      = token-mean current-policy entropy of this micro-batch (all-reduced over DP ranks)
    alpha  = clip(K_p (H - H_target) + K_i I, -1, 1)          I = integral BEFORE this update
    I     += (H - H_target) * (sequences in this micro-batch / sequences in the mini-batch)
    hp     = m * (lp > log(high_prob_thresh))                  (current policy, detached mask)
    loss   = agg(l_PPO_dualclip, m) + alpha * agg(-r |A|, hp)  r = exp(clamp(lp - lp_old, +-20))

alpha > 0 (entropy above target) reinforces high-probability tokens of positive samples and
weakens them in negative ones, which lowers the entropy; alpha < 0 does the opposite.

Defaults (authors' ``run_entropic.sh``): ``target_entropy=0.1`` (negative disables the controller:
alpha = 0, plain PPO), ``entropy_control_p=1`` (K_p), ``entropy_control_i=0.01`` (K_i),
``high_prob_thresh=0.95``; the PPO part uses verl's defaults (``clip_ratio_low=clip_ratio_high=0.2``,
``clip_ratio_c=3``), which the script does not override.

The controller state (the integral) persists across steps in ``ctx.state["entropic"]`` (a dict of
plain floats the adapter keeps and checkpoints); :class:`EntroPICController` is the controller.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from stablerl import EXPERIMENTAL, hookimpl
from stablerl.ops import aggregate, clamped_log_ratio, masked_mean
from stablerl.params import check
from stablerl.primitives import ClipParams, entropy_input, ppo_clip_terms

STATE_KEY = "entropic"


class EntroPICController:
    """The EntroPIC PI controller: ``update(entropy_mean) -> alpha``; state is the error integral.

    ``alpha = clip(k_p * e + k_i * I, -alpha_max, alpha_max)`` with ``e = entropy_mean - target``
    and ``I`` the weighted sum of the previous errors; then ``I += e * weight``. With a negative
    ``target_entropy`` the controller is off: alpha is 0 and the state does not change.
    """

    def __init__(
        self,
        target_entropy: float = 0.1,
        k_p: float = 1.0,
        k_i: float = 0.01,
        alpha_max: float = 1.0,
    ) -> None:
        self.target_entropy = float(target_entropy)
        self.k_p = float(k_p)
        self.k_i = float(k_i)
        self.alpha_max = float(alpha_max)
        self.integral = 0.0
        self.alpha = 0.0
        self.updates = 0

    @property
    def enabled(self) -> bool:
        return self.target_entropy >= 0

    def update(self, entropy_mean: float, weight: float = 1.0) -> float:
        """Feed one measured entropy; returns the alpha to use for this micro-batch."""
        if not self.enabled:
            self.alpha = 0.0
            return 0.0
        error = float(entropy_mean) - self.target_entropy
        raw = self.k_p * error + self.k_i * self.integral
        self.alpha = min(max(raw, -self.alpha_max), self.alpha_max)
        self.integral += error * float(weight)
        self.updates += 1
        return self.alpha

    def state_dict(self) -> dict[str, Any]:
        return {"integral": self.integral, "alpha": self.alpha, "updates": self.updates}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.integral = float(state.get("integral", 0.0))
        self.alpha = float(state.get("alpha", 0.0))
        self.updates = int(state.get("updates", 0))


@dataclass
class EntroPICParams(ClipParams):
    """PPO dual-clip bounds, the entropy target and the PI gains."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: Optional[float] = 3.0
    target_entropy: float = 0.1
    entropy_control_p: float = 1.0
    entropy_control_i: float = 0.01
    high_prob_thresh: float = 0.95

    def validate(self) -> None:
        super().validate()  # the clip bounds (ClipParams)
        check(math.isfinite(self.target_entropy), f"target_entropy must be finite (negative disables), got {self.target_entropy}")
        check(self.entropy_control_p >= 0, f"entropy_control_p (K_p) must be >= 0, got {self.entropy_control_p}")
        check(self.entropy_control_i >= 0, f"entropy_control_i (K_i) must be >= 0, got {self.entropy_control_i}")
        check(0 < self.high_prob_thresh <= 1.0, f"high_prob_thresh must be in (0, 1], got {self.high_prob_thresh}")


def entropic_loss(b, p: EntroPICParams, ctx):
    mask = b.response_mask
    dt = b.log_prob.dtype
    adv = b.advantages
    H = entropy_input(b.entropy, mask, "entropy").to(dt)
    lp = b.log_prob.detach()
    hp = mask * (lp > math.log(p.high_prob_thresh)).to(mask.dtype)

    # one collective: entropy sum, valid tokens, high-prob tokens, sequences (all over DP ranks)
    local = torch.stack([
        (H * mask.to(dt)).sum(),
        mask.sum().to(dt),
        hp.sum().to(dt),
        torch.tensor(float(mask.shape[0]), dtype=dt, device=mask.device),
    ])
    h_sum, n_tok, n_hp, n_seq = ctx.all_reduce(local, "sum").tolist()

    state = ctx.state.setdefault(STATE_KEY, {"integral": 0.0, "alpha": 0.0, "updates": 0})
    controller = EntroPICController(p.target_entropy, p.entropy_control_p, p.entropy_control_i)
    controller.load_state_dict(state)
    entropy_mean = h_sum / max(n_tok, 1.0)
    if n_tok > 0:
        rows = ctx.row_count if ctx.row_count is not None else ctx.seq_count
        weight = n_seq / float(rows) if rows else 1.0
        alpha = controller.update(entropy_mean, weight)
    else:  # nothing to measure: no update, no adjustment (the loss is 0 anyway)
        alpha = 0.0
    state.update(controller.state_dict())

    log_ratio = clamped_log_ratio(b.log_prob, b.old_log_prob)
    ratio = torch.exp(log_ratio)
    pg_losses, metrics = ppo_clip_terms(ratio, adv, mask, p.clip_ratio_low, p.clip_ratio_high, p.clip_ratio_c)
    if b.is_weights is not None:
        pg_losses = pg_losses * b.is_weights
    loss = aggregate(pg_losses, mask, b.loss_agg_mode, ctx, params=b.loss_agg_params)

    adjust = -ratio * adv.abs()
    hp_ctx = ctx
    if b.loss_agg_mode == "token-mean" and ctx.token_count is not None:
        # token-mean over the high-prob tokens of the whole mini-batch: the global valid-token count
        # times the (all-reduced) high-prob fraction of this micro-batch
        hp_ctx = dataclasses.replace(ctx, token_count=float(ctx.token_count) * n_hp / max(n_tok, 1.0))
    loss = loss + alpha * aggregate(adjust, hp, b.loss_agg_mode, hp_ctx, params=b.loss_agg_params)

    metrics["ppo_kl"] = masked_mean(-log_ratio.detach(), mask)
    scalar = lambda v: torch.tensor(float(v), dtype=torch.float32, device=mask.device)  # noqa: E731
    metrics["entropy"] = scalar(entropy_mean)
    metrics["entropic/alpha"] = scalar(alpha)
    metrics["entropic/integral"] = scalar(controller.integral)
    metrics["entropic/high_prob_fraction"] = scalar(n_hp / max(n_tok, 1.0))
    return loss, metrics


@hookimpl
def register_policy_losses(register):
    register(
        name="entropic",
        fn=entropic_loss,
        params=EntroPICParams,
        paper="2511.15248",
        title="EntroPIC: PI-controlled reweighting of high-probability tokens to hold entropy at a target",
        formula="loss = agg(l_PPO, m) + alpha * agg(-r|A|, m & p>0.95); alpha = clip(K_p e + K_i sum e, -1, 1), e = H - H_target",
        status=EXPERIMENTAL,
        requires=("entropy",),
        metrics=(
            "pg_clipfrac", "pg_clipfrac_lower", "clip_high", "clip_low", "ppo_kl",
            "entropy", "entropic/alpha", "entropic/integral", "entropic/high_prob_fraction",
        ),
        reference="yk7333/EntroPIC core_algos.py::compute_policy_loss_entropic + dp_actor.py (PI controller), "
        "transcribed in the catalogue",
        notes=(
            "Experimental: LOSSES.md E6 transcribed the authors' code (✓), but ADVANTAGES_AND_MOE.md §5.4 marks "
            "the paper's coefficient application, thresholds and gains uncertain, and the transcription was "
            "file-level only. Controller state lives in ctx.state['entropic'] ({integral, alpha, updates}); "
            "the adapter must persist and checkpoint it, or a resume resets the integral. The entropy "
            "(token-mean, current policy, same forward pass as log_prob) is all-reduced over DP ranks so every "
            "rank holds the same alpha; the reference integrates per rank. The controller updates once per "
            "call (micro-batch), the error weighted by sequences-in-call / ctx.seq_count (the reference's "
            "micro_bsz / ppo_mini_batch_size; 1 when seq_count is unknown), rows counted whether masked or not on "
            "both sides (ctx.row_count where the framework's seq_count counts only non-empty rows), so the "
            "weights of one optimizer step sum to 1. The high-prob term uses the "
            "current-policy probability, is unclipped, and is aggregated over high-prob tokens only; under "
            "token-mean with a global token_count its denominator is token_count x the all-reduced high-prob "
            "fraction of this micro-batch. IS weights multiply the PPO part only (as in the reference). "
            "Output is the aggregated scalar."
        ),
        output="scalar",
        batch_statistics=True,
    )
