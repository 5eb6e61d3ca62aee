"""Entropy controllers with state across training steps (checkpointable with state_dict).

* ``aepo`` — AEPO, Arbitrary Entropy Policy Optimization (Wang et al., arXiv 2510.08141): from the
  previous step's mean entropy H, choose the temperature of the control samples
  (``T = 1.2`` if ``H <= entropy_base = 0.5`` else ``0.8``) and how many of the main batch's rows they
  replace (``min(60, #kept)``, half of it above target); kept = control samples with A > 0.05, whose
  advantage is set to 1.0. Sampling, scoring and batch surgery are the trainer's.
* ``epo`` — EPO (Xu et al., arXiv 2509.22576): per-turn entropy history across epochs and a smoothing
  penalty ``P = 0 if k_l H_hist[s] < H < k_h H_hist[s] else out_range_penalty`` on samples at turn
  ``s >= max_steps / 2``, weighted by the phase schedule (E = 150)
  ``w = 1 - 0.2 (1 - exp(-2e/(E/2)))`` for ``e <= E/2``, else ``0.8 exp(-3 (e - E/2)/(E/2))``;
  loss term ``c_ent * c_smooth * w * agg(P)``.

* ``adaptive_entropy`` — Skywork-OR1's adaptive entropy control (He et al., arXiv 2505.22312), as TRL 1.16
  ships it (``use_adaptive_entropy``): after each step ``c <- min(c + delta, c_max)`` if the step's entropy
  ``H <= target`` else ``max(c - delta, c_min)``; the loss term is ``-c agg(H)`` while the last step's
  ``H <= target``, else 0.

Controllers never reduce anything themselves: every rank must feed them the same, already
all-reduced statistics, so their state stays identical across ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from stablerl import EXPERIMENTAL, Controller, Params, hookimpl
from stablerl.ops import aggregate, masked_mean
from stablerl.params import StableRLError, check


def _finite_float(name: str, v: Any) -> float:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise StableRLError(f"{name} must be a scalar, got shape {tuple(v.shape)}")
        v = v.item()
    v = float(v)
    if not math.isfinite(v):
        raise StableRLError(f"{name} must be finite, got {v}")
    return v


# ----------------------------------------------------------------------------- AEPO


@dataclass
class AEPOParams(Params):
    """Entropy target, the two temperatures, the replacement budget and the kept-advantage threshold."""

    entropy_base: float = 0.5
    temperature_high: float = 1.2
    temperature_low: float = 0.8
    reinforce_sample_num: int = 60
    adv_threshold: float = 0.05
    control_prompt_fraction: float = 0.25

    def validate(self) -> None:
        check(math.isfinite(self.entropy_base) and self.entropy_base >= 0, f"entropy_base must be >= 0, got {self.entropy_base}")
        check(self.temperature_high > 0, f"temperature_high must be > 0, got {self.temperature_high}")
        check(self.temperature_low > 0, f"temperature_low must be > 0, got {self.temperature_low}")
        check(isinstance(self.reinforce_sample_num, int) and self.reinforce_sample_num >= 0,
              f"reinforce_sample_num must be an integer >= 0, got {self.reinforce_sample_num}")
        check(math.isfinite(self.adv_threshold), f"adv_threshold must be finite, got {self.adv_threshold}")
        check(0 < self.control_prompt_fraction <= 1,
              f"control_prompt_fraction must be in (0, 1], got {self.control_prompt_fraction}")


class AEPOController(Controller):
    """``step(entropy=H_prev, num_kept=None) -> {temperature, num_samples, below_target, active}``.

    ``entropy`` is the previous update's mean token entropy (verl: ``actor/entropy``), all-reduced.
    ``num_samples`` is ``min(reinforce_sample_num, num_kept)``, halved (integer) above target, where
    ``num_kept`` counts the control samples with A > adv_threshold; without ``num_kept`` it is the
    upper bound ``reinforce_sample_num`` (halved above target) and :meth:`select` gives the exact count.
    Before any entropy was measured (``entropy=None`` on the first step) the controller is
    inactive: ``num_samples = 0`` and ``temperature = None`` (train on the normal batch only).
    :meth:`select` applies the kept rule to the control samples' advantages.
    """

    def __init__(self, params: AEPOParams):
        super().__init__(params)
        self.last_entropy: Optional[float] = None
        self.temperature: Optional[float] = None
        self.num_samples = 0
        self.steps = 0

    def step(self, entropy: Any = None, num_kept: Optional[int] = None, **unused: Any) -> dict[str, Any]:
        if unused:
            raise StableRLError(f"aepo controller step() got unexpected statistics {sorted(unused)}; it takes entropy, num_kept")
        p = self.params
        if entropy is not None:
            self.last_entropy = _finite_float("entropy", entropy)
        self.steps += 1
        if self.last_entropy is None:
            self.temperature, self.num_samples = None, 0
            return {"temperature": None, "num_samples": 0, "below_target": None, "active": False}
        below = self.last_entropy <= p.entropy_base
        self.temperature = p.temperature_high if below else p.temperature_low
        budget = p.reinforce_sample_num
        if num_kept is not None:
            if int(num_kept) < 0:
                raise StableRLError(f"num_kept must be >= 0, got {num_kept}")
            budget = min(budget, int(num_kept))
        self.num_samples = budget if below else budget // 2
        return {"temperature": self.temperature, "num_samples": self.num_samples, "below_target": below, "active": True}

    def select(self, advantages: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Control samples to use after :meth:`step`: those with advantage > adv_threshold, the first
        ``min(reinforce_sample_num, #kept)`` of them (halved above target), with advantage 1.0 each.
        Updates ``num_samples`` to that count (the number of main-batch rows to replace)."""
        a = torch.as_tensor(advantages).detach()
        if a.dim() != 1:
            raise StableRLError(f"select() takes one advantage per control sample, [N], got shape {tuple(a.shape)}")
        if self.last_entropy is None:
            self.num_samples = 0
        else:
            kept = torch.nonzero(a > self.params.adv_threshold).reshape(-1)
            budget = min(self.params.reinforce_sample_num, kept.numel())
            self.num_samples = budget if self.last_entropy <= self.params.entropy_base else budget // 2
        chosen = torch.nonzero(a > self.params.adv_threshold).reshape(-1)[: self.num_samples]
        dtype = a.dtype if a.is_floating_point() else torch.float32
        return chosen, torch.ones(chosen.numel(), dtype=dtype, device=a.device)

    def state_dict(self) -> dict[str, Any]:
        return {"last_entropy": self.last_entropy, "temperature": self.temperature,
                "num_samples": self.num_samples, "steps": self.steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        le = state.get("last_entropy")
        self.last_entropy = None if le is None else float(le)
        t = state.get("temperature")
        self.temperature = None if t is None else float(t)
        self.num_samples = int(state.get("num_samples", 0))
        self.steps = int(state.get("steps", 0))


# ----------------------------------------------------------------------------- EPO

EPO_MODES = ("released", "differentiable")


@dataclass
class EPOParams(Params):
    """Smoothing range [k_l, k_h] x H_hist, the out-of-range penalty, weights and the phase schedule."""

    entropy_smooth_min_ratio: float = 0.0  # k_l (README commands)
    entropy_smooth_max_ratio: float = 2.0  # k_h
    out_range_penalty: float = 0.1
    entropy_smooth_coeff: float = 1.0  # c_smooth
    entropy_coeff: float = 0.001  # c_ent
    max_steps: int = 50  # turns per episode (environment's max_steps)
    total_epochs: int = 150  # E (hard-coded in the reference)
    enable_smooth_weights: bool = True
    mode: str = "released"  # "differentiable": w (relu(H - k_h Hh) + relu(k_l Hh - H))
    include_entropy_bonus: bool = False  # add -c_ent * agg(H) (off: the framework's entropy_coeff does it)

    def validate(self) -> None:
        check(0 <= self.entropy_smooth_min_ratio <= self.entropy_smooth_max_ratio,
              "need 0 <= entropy_smooth_min_ratio <= entropy_smooth_max_ratio, got "
              f"{self.entropy_smooth_min_ratio}, {self.entropy_smooth_max_ratio}")
        check(math.isfinite(self.entropy_smooth_max_ratio), "entropy_smooth_max_ratio must be finite")
        check(self.out_range_penalty >= 0, f"out_range_penalty must be >= 0, got {self.out_range_penalty}")
        check(self.entropy_smooth_coeff >= 0, f"entropy_smooth_coeff must be >= 0, got {self.entropy_smooth_coeff}")
        check(self.entropy_coeff >= 0, f"entropy_coeff must be >= 0, got {self.entropy_coeff}")
        check(isinstance(self.max_steps, int) and self.max_steps >= 1, f"max_steps must be an integer >= 1, got {self.max_steps}")
        check(isinstance(self.total_epochs, int) and self.total_epochs >= 2,
              f"total_epochs must be an integer >= 2, got {self.total_epochs}")
        check(self.mode in EPO_MODES, f"mode must be one of {list(EPO_MODES)}, got {self.mode!r}")


def epo_phase_weight(epoch: float, total_epochs: int = 150) -> float:
    """EPO's phase weight: ``1 - 0.2(1 - exp(-2e/(E/2)))`` up to E/2, then ``0.8 exp(-3(e - E/2)/(E/2))``."""
    half = total_epochs / 2.0
    if epoch <= half:
        return 1.0 - 0.2 * (1.0 - math.exp(-2.0 * epoch / half))
    return 0.8 * math.exp(-3.0 * (epoch - half) / half)


class EPOController(Controller):
    """Per-turn entropy history across epochs and EPO's smoothing penalty.

    ``step(epoch=e, turn_entropy=[H_0, H_1, ...])`` records epoch ``e``'s mean entropy per turn
    (all-reduced; NaN for a turn that did not occur) and moves the phase schedule to ``e + 1``.
    ``penalty(entropy, turn_index, response_mask)`` returns the loss term to add to the policy loss,
    computed against the history of the epochs recorded so far.
    """

    def __init__(self, params: EPOParams):
        super().__init__(params)
        self.sums = [0.0] * params.max_steps
        self.counts = [0] * params.max_steps
        self.epoch = 0

    def history(self) -> torch.Tensor:
        """``[max_steps]`` mean entropy per turn over the recorded epochs (NaN where never seen)."""
        return torch.tensor([s / c if c else float("nan") for s, c in zip(self.sums, self.counts)], dtype=torch.float64)

    def phase_weight(self, epoch: Optional[float] = None) -> float:
        if not self.params.enable_smooth_weights:
            return 1.0
        return epo_phase_weight(self.epoch if epoch is None else epoch, self.params.total_epochs)

    def step(self, epoch: Optional[int] = None, turn_entropy: Any = None, **unused: Any) -> dict[str, Any]:
        if unused:
            raise StableRLError(f"epo controller step() got unexpected statistics {sorted(unused)}; it takes epoch, turn_entropy")
        if turn_entropy is None:
            raise StableRLError("epo controller step() needs turn_entropy: the all-reduced mean entropy of each turn")
        values = torch.as_tensor(turn_entropy, dtype=torch.float64).detach().cpu().reshape(-1)
        if values.numel() > self.params.max_steps:
            raise StableRLError(f"turn_entropy has {values.numel()} turns, more than max_steps={self.params.max_steps}")
        if bool(torch.isinf(values).any()):
            raise StableRLError("turn_entropy has infinite values (use NaN for turns that did not occur)")
        for s, v in enumerate(values.tolist()):
            if not math.isnan(v):
                self.sums[s] += v
                self.counts[s] += 1
        self.epoch = (int(epoch) if epoch is not None else self.epoch) + 1
        return {"epoch": self.epoch, "phase_weight": self.phase_weight(), "turns_seen": sum(c > 0 for c in self.counts)}

    def penalty(
        self,
        entropy: torch.Tensor,
        turn_index: Any,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        ctx=None,
        epoch: Optional[float] = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """EPO's loss term ``c_ent * c_smooth * w * agg(P)`` (plus ``-c_ent * agg(H)`` with
        ``include_entropy_bonus``) for a ``[B, T]`` entropy of the current policy and the turn index of
        each sample ``[B]``. ``mode="released"``: P is the constant ``out_range_penalty`` outside the range
        (no gradient, as released); ``"differentiable"``: P = relu(H - k_h Hh) + relu(k_l Hh - H)."""
        p = self.params
        if entropy.dim() != 2 or tuple(response_mask.shape) != tuple(entropy.shape):
            raise StableRLError(f"entropy and response_mask must be [B, T] of the same shape, got "
                                f"{tuple(entropy.shape)} and {tuple(response_mask.shape)}")
        B = entropy.shape[0]
        turn = torch.as_tensor(turn_index, device=entropy.device).reshape(-1).long()
        if turn.numel() != B:
            raise StableRLError(f"turn_index must have one entry per sample, shape ({B},), got {tuple(turn.shape)}")
        if B and (int(turn.min()) < 0 or int(turn.max()) >= p.max_steps):
            raise StableRLError(f"turn_index must be in [0, max_steps={p.max_steps})")
        mask = response_mask.to(entropy.dtype if entropy.is_floating_point() else torch.float32)
        valid = mask.bool()
        H = torch.where(valid, entropy, torch.zeros((), dtype=entropy.dtype, device=entropy.device))
        hist = self.history().to(device=entropy.device, dtype=H.dtype)[turn]  # [B]
        active = (turn >= p.max_steps / 2.0) & ~torch.isnan(hist)  # later half of the episode, with history
        hist = torch.where(active, hist, torch.zeros_like(hist)).unsqueeze(-1)
        lo, hi = p.entropy_smooth_min_ratio * hist, p.entropy_smooth_max_ratio * hist
        if p.mode == "released":
            within = (H > lo) & (H < hi)
            P = torch.where(within, torch.zeros_like(H), torch.full_like(H, p.out_range_penalty)).detach()
        else:
            P = torch.relu(H - hi) + torch.relu(lo - H)
        P = torch.where(active.unsqueeze(-1) & valid, P, torch.zeros_like(P))
        w = self.phase_weight(epoch)
        term = p.entropy_coeff * p.entropy_smooth_coeff * w * aggregate(P, mask, loss_agg_mode, ctx)
        if p.include_entropy_bonus:
            term = term - p.entropy_coeff * aggregate(H, mask, loss_agg_mode, ctx)
        out_of_range = ((P > 0) & valid).to(torch.float32)
        metrics = {
            "epo/phase_weight": float(w),
            "epo/out_of_range_frac": float(masked_mean(out_of_range, mask.float())),
            "epo/active_sample_frac": float(active.float().mean()) if B else 0.0,
            "epo/smooth_penalty": float(aggregate(P.detach(), mask, loss_agg_mode, ctx)),
        }
        return term, metrics

    def state_dict(self) -> dict[str, Any]:
        return {"sums": list(self.sums), "counts": list(self.counts), "epoch": self.epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        sums, counts = list(state["sums"]), list(state["counts"])
        if len(sums) != self.params.max_steps or len(counts) != self.params.max_steps:
            raise StableRLError(f"epo state has {len(sums)} turns but max_steps={self.params.max_steps}")
        self.sums = [float(v) for v in sums]
        self.counts = [int(v) for v in counts]
        self.epoch = int(state.get("epoch", 0))


# ----------------------------------------------------------------------------- adaptive entropy (Skywork-OR1)


@dataclass
class AdaptiveEntropyParams(Params):
    """TRL 1.16's GRPOConfig defaults: initial coefficient, target entropy (nats), step and bounds."""

    entropy_coef: float = 0.0  # initial c
    entropy_target: float = 0.2
    entropy_coef_delta: float = 0.005
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0

    def validate(self) -> None:
        # an entropy is >= 0: a negative target would leave the bonus off for ever without a word
        check(math.isfinite(self.entropy_target) and self.entropy_target >= 0,
              f"entropy_target must be a finite entropy >= 0 (nats), got {self.entropy_target}")
        check(self.entropy_coef_delta >= 0, f"entropy_coef_delta must be >= 0, got {self.entropy_coef_delta}")
        check(0 <= self.entropy_coef_min <= self.entropy_coef_max,
              f"need 0 <= entropy_coef_min <= entropy_coef_max, got {self.entropy_coef_min}, {self.entropy_coef_max}")
        check(math.isfinite(self.entropy_coef) and self.entropy_coef >= 0,
              f"entropy_coef must be finite and >= 0, got {self.entropy_coef}")


class AdaptiveEntropyController(Controller):
    """``step(entropy=H)`` once per optimizer step with the step's all-reduced mean token entropy:
    ``c <- min(c + delta, c_max)`` if ``H <= target`` else ``max(c - delta, c_min)``; remembers H.
    ``penalty(entropy, response_mask)`` is the loss term ``-c agg(H)`` when the last recorded
    ``H <= target`` (none recorded yet: inactive), else 0 — the coefficient of the previous step's end
    for every micro-batch of the step, as TRL."""

    def __init__(self, params: AdaptiveEntropyParams):
        super().__init__(params)
        self.coef = float(params.entropy_coef)
        self.last_entropy = math.inf

    @property
    def applied_coef(self) -> float:
        return self.coef if self.last_entropy <= self.params.entropy_target else 0.0

    def step(self, entropy: Any = None, **unused: Any) -> dict[str, Any]:
        if unused:
            raise StableRLError(f"adaptive_entropy controller step() got unexpected statistics {sorted(unused)}; it takes entropy")
        p = self.params
        if entropy is not None:
            h = _finite_float("entropy", entropy)
            if h <= p.entropy_target:
                self.coef = min(self.coef + p.entropy_coef_delta, p.entropy_coef_max)
            else:
                self.coef = max(self.coef - p.entropy_coef_delta, p.entropy_coef_min)
            self.last_entropy = h
        return {"entropy_coef": self.coef, "active": self.last_entropy <= p.entropy_target}

    def penalty(self, entropy: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean",
                ctx=None) -> tuple[torch.Tensor, dict[str, float]]:
        """``-c agg(H)`` (gradient through the entropy) with the coefficient in force this step."""
        if entropy.dim() != 2 or tuple(response_mask.shape) != tuple(entropy.shape):
            raise StableRLError(f"entropy and response_mask must be [B, T] of the same shape, got "
                                f"{tuple(entropy.shape)} and {tuple(response_mask.shape)}")
        c = self.applied_coef
        mask = response_mask.to(entropy.dtype if entropy.is_floating_point() else torch.float32)
        zero = torch.zeros((), dtype=entropy.dtype, device=entropy.device)
        H = torch.where(mask.bool(), entropy, zero)
        mean_H = aggregate(H, mask, loss_agg_mode, ctx)
        return -c * mean_H, {"adaptive_entropy/applied_coef": c}

    def state_dict(self) -> dict[str, Any]:
        return {"entropy_coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.coef = float(state["entropy_coef"])
        self.last_entropy = float(state.get("last_entropy", math.inf))


@hookimpl
def register_controllers(register):
    register(
        name="aepo",
        fn=AEPOController,
        params=AEPOParams,
        paper="2510.08141",
        title="AEPO (Arbitrary Entropy Policy Optimization): temperature-adjusted REINFORCE samples",
        formula="T = T_high (1.2) if H_prev <= H_target (0.5) else T_low (0.8); replace min(60, #kept) rows (half above target)",
        status=EXPERIMENTAL,
        requires=("rollout_temperature",),  # the trainer samples the control batch at the returned temperature
        metrics=("temperature", "num_samples", "below_target", "active"),
        reference="597358816/AEPO verl/trainer/ray_trainer.py::fit (alg == 'AEPO'), read via the catalogue",
        notes=(
            "Experimental: the trainer-loop procedure was read from code but not executed against it. Each step "
            "the trainer re-samples the first control_prompt_fraction (1/4) of prompts at the returned "
            "temperature, scores them, computes GRPO advantages, keeps A > adv_threshold (0.05) with advantage "
            "set to 1.0 (select()), and replaces the first num_samples rows of the main batch (the replaced "
            "samples are dropped); old log-probs are then computed at the training temperature (T = 1), not T. "
            "'Half of that' above target is integer halving of min(reinforce_sample_num, #kept). The first step "
            "(no measured entropy yet) is inactive (num_samples 0) — the reference's start-up value was not "
            "read. The entropy fed to step() must be the all-reduced mean of the previous update. The paper's "
            "README reports entropy_base = 0.75 as best; 0.5 is the code default."
        ),
    )
    register(
        name="epo",
        fn=EPOController,
        params=EPOParams,
        paper="2509.22576",
        title="EPO: per-turn entropy history, smoothing penalty and phase schedule (multi-turn agents)",
        formula="L += c_ent c_smooth w(e) agg(P), P = 0 if k_l Hh[s] < H < k_h Hh[s] else pen (s >= S/2); w: E = 150 phase weight",
        status=EXPERIMENTAL,
        requires=("loss_term",),
        metrics=("epo/phase_weight", "epo/out_of_range_frac", "epo/active_sample_frac", "epo/smooth_penalty"),
        reference="WujiangXu/EPO dp_actor.py::{generate_entropy_penalty, _calculate_epoch_based_entropy_weight}, "
        "ray_trainer.py::entropy_history (read via the catalogue)",
        notes=(
            "mode='released' (default) reproduces the released code: P is the constant out_range_penalty "
            "outside the range, with NO gradient path (it shifts the loss value only; only the entropy bonus "
            "acts). mode='differentiable' is our option with the paper's stated effect: "
            "P = relu(H - k_h Hh) + relu(k_l Hh - H) (gradient through the entropy). Defaults: the README "
            "commands' k_l = 0, k_h = 2.0, c_smooth = 1, c_ent = 0.001, out_range_penalty 0.1 (README range "
            "0.05-0.1; launcher 0.5/1.5/0.1), E = 150. Deviations/assumptions: the history is the mean over the "
            "recorded epochs in which turn s occurred (the reference left-pads each epoch's vector with zeros "
            "to max_steps); turns without history get no penalty; tokens of samples at turn < max_steps/2 get "
            "P = 0 but stay in the aggregation denominator; max_steps = 50 is a placeholder for the "
            "environment's turn limit. The plain entropy bonus -c_ent agg(H) is the framework's entropy_coeff "
            "(include_entropy_bonus adds it here instead). turn_entropy fed to step() must be all-reduced."
        ),
    )
    register(
        name="adaptive_entropy",
        fn=AdaptiveEntropyController,
        params=AdaptiveEntropyParams,
        paper="2505.22312",
        title="Adaptive entropy control (Skywork-OR1): entropy bonus coefficient steered to a target entropy",
        formula="c <- clip(c + delta sign(target - H), c_min, c_max) per step (H = target: +delta); L -= c agg(H) "
        "while H_prev <= target; c0 = 0, target 0.2, delta 0.005, [0, 1]",
        status=EXPERIMENTAL,
        requires=("entropy_bonus",),
        metrics=("entropy_coef", "active", "adaptive_entropy/applied_coef"),
        reference="TRL 1.16 GRPOTrainer use_adaptive_entropy (_compute_loss; its parity test runs both trainers)",
        notes=(
            "Experimental: equal to TRL 1.16's use_adaptive_entropy (checked in the trl session: same coefficients "
            "and weights over 3 steps); Skywork-OR1's own code was not read. The step's entropy is the mean of the "
            "framework's per-micro-batch entropy means (TRL's controller uses the token-weighted mean over the "
            "accumulation window: equal with gradient_accumulation_steps=1 or equal token counts). The loss term "
            "is aggregated with the adapter's token-mean over the accumulation window (TRL: per-micro-batch mean / "
            "GA). verl: the adapter sets actor.entropy_coeff to c before each update (verl's ppo_loss subtracts "
            "entropy_coeff agg(H), the same term) and steps c once per update_actor call."
        ),
    )
