"""SFPO, Slow-Fast Policy Optimization (Wang et al., arXiv 2510.04072): a trainer hook, not a loss.

Per rollout batch, with the framework's usual loss and ``pi_old = pi_{theta^{s,0}}``:

1. fast trajectory: K optimizer passes over the same batch, ``theta^{s,0} -> theta^{s,K}``;
2. reposition: ``theta_tilde = theta^{s,0} + alpha (theta^{s,K} - theta^{s,0})``;
3. slow correction: one more pass from ``theta_tilde``.

Stop rule (the authors' code): after each batch the mean entropy of its last pass is appended to a
history; once ``len >= w``, ``z = (H_last - mean(H[-w:])) / (std(H[-w:]) + 1e-9)`` (population std);
at the first ``z >= threshold`` SFPO stops for good and every later batch gets one plain pass.
Defaults are the released scripts': K = 3, alpha = 0.8 (0.9 in the Qwen3-4B script), w = 30,
threshold = 1.0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from stablerl import EXPERIMENTAL, ParamsView, Params, TrainerHook, hookimpl
from stablerl.params import StableRLError, check


@dataclass
class SFPOParams(Params):
    """K fast passes, the reposition step alpha and the entropy z-score stop rule (window 0: never stop)."""

    inner_steps: int = 3  # K (sfpo_inner_steps)
    alpha: float = 0.8  # sfpo_step_size
    zscore_window: int = 30  # zscore_w
    zscore_threshold: float = 1.0  # zscore_threshold

    def validate(self) -> None:
        check(isinstance(self.inner_steps, int) and self.inner_steps >= 1,
              f"inner_steps must be an integer >= 1, got {self.inner_steps}")
        check(0.0 <= self.alpha <= 1.0, f"alpha must be in [0, 1], got {self.alpha}")
        check(isinstance(self.zscore_window, int) and self.zscore_window >= 0,
              f"zscore_window must be an integer >= 0 (0: no stop rule), got {self.zscore_window}")
        check(math.isfinite(self.zscore_threshold), f"zscore_threshold must be finite, got {self.zscore_threshold}")


def entropy_zscore(history: list[float], window: int) -> Optional[float]:
    """``(H_last - mean) / (std + 1e-9)`` over the last ``window`` entries (population std), None before
    ``window`` entries exist."""
    if window <= 0 or len(history) < window:
        return None
    recent = torch.tensor(history[-window:], dtype=torch.float64)
    std = float(recent.std(unbiased=False)) + 1e-9
    return (history[-1] - float(recent.mean())) / std


class SFPOHook(TrainerHook):
    """``passes_per_batch() = K + 1`` until the stop rule fires, then 1. ``before_batch`` keeps a copy of
    the parameters (one extra weight copy, this rank's shards); ``after_pass(view, K - 1)`` repositions
    them in place; ``after_pass`` of the batch's last pass records its ``entropy`` and applies the stop rule."""

    def __init__(self, params: SFPOParams):
        super().__init__(params)
        self.entropy_history: list[float] = []
        self.stopped = False
        self.batches = 0
        self._slow: Optional[list[torch.Tensor]] = None
        self._passes = 1
        self.last_fast_drift = self.last_shift = 0.0

    def passes_per_batch(self) -> int:
        return 1 if self.stopped else self.params.inner_steps + 1

    def before_batch(self, view: ParamsView) -> None:
        self._passes = self.passes_per_batch()
        self._slow = None
        if not self.stopped:
            with torch.no_grad():
                self._slow = [p.detach().clone() for p in view.parameters()]

    def reposition(self, view: ParamsView) -> None:
        """``theta <- theta^{s,0} + alpha (theta - theta^{s,0})`` on every parameter, in place."""
        if self._slow is None:
            raise StableRLError("sfpo: reposition without a saved theta^{s,0} (before_batch was not called)")
        params = list(view.parameters())
        if len(params) != len(self._slow):
            raise StableRLError(f"sfpo: the view has {len(params)} parameters, {len(self._slow)} were saved")
        alpha = self.params.alpha
        drift = shift = 0.0
        with torch.no_grad():
            for p, slow in zip(params, self._slow):
                drift += float((p - slow).double().pow(2).sum())
                if alpha != 1.0:  # alpha = 1 keeps theta_K exactly (theta0 + (theta_K - theta0) may round)
                    fast = p.detach().clone()
                    p.copy_(slow + alpha * (p - slow))
                    shift += float((p - fast).double().pow(2).sum())  # measured on the parameter after the copy
        self._slow = None
        self.last_fast_drift, self.last_shift = math.sqrt(drift), math.sqrt(shift)

    def after_pass(self, view: ParamsView, pass_index: int, entropy: Any = None, **unused: Any) -> dict[str, Any]:
        if not 0 <= pass_index < self._passes:
            raise StableRLError(f"sfpo: pass_index {pass_index} outside this batch's {self._passes} passes")
        out: dict[str, Any] = {}
        if self._passes > 1 and pass_index == self.params.inner_steps - 1:
            self.reposition(view)
            out["repositioned"] = True
            out["fast_drift"] = self.last_fast_drift  # ||theta_K - theta0|| over this rank's parameters
            out["reposition_shift"] = self.last_shift  # ||theta~ - theta_K||: (1 - alpha) fast_drift
        if pass_index == self._passes - 1:
            self.batches += 1
            if entropy is not None:
                h = float(entropy.item() if isinstance(entropy, torch.Tensor) else entropy)
                if not math.isfinite(h):
                    raise StableRLError(f"sfpo: entropy must be finite, got {h}")
                self.entropy_history.append(h)
                self.entropy_history = self.entropy_history[-max(self.params.zscore_window, 1):]
                z = entropy_zscore(self.entropy_history, self.params.zscore_window)
                if z is not None:
                    out["zscore"] = z
                    if not self.stopped and z >= self.params.zscore_threshold:
                        self.stopped = True
            out["active"] = not self.stopped
            out["alpha"] = 0.0 if self.stopped else self.params.alpha
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"entropy_history": list(self.entropy_history), "stopped": self.stopped, "batches": self.batches}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.entropy_history = [float(v) for v in state.get("entropy_history", [])]
        self.stopped = bool(state.get("stopped", False))
        self.batches = int(state.get("batches", 0))
        self._slow = None


@hookimpl
def register_trainer_hooks(register):
    register(
        name="sfpo",
        fn=SFPOHook,
        params=SFPOParams,
        paper="2510.04072",
        title="SFPO: Slow-Fast Policy Optimization (K fast passes, reposition, slow correction)",
        formula="theta~ = theta0 + alpha (theta_K - theta0) after K fast passes on the batch, then one slow pass "
        "from theta~; stop for good at z = (H - mean_w H)/(std_w H + 1e-9) >= 1.0 (w = 30); K = 3, alpha = 0.8",
        status=EXPERIMENTAL,
        requires=("params_view",),
        metrics=("repositioned", "fast_drift", "reposition_shift", "zscore", "active", "alpha"),
        reference="Urheen/SFPO (authors' verl fork, read, not run): Demo/fsdp_workers.py::sfpo_update_actor, "
        "Code/SFPO/verl/trainer/ppo/ray_trainer.py (entropy_container z-score), train-scripts/*_sfpo.sh",
        notes=(
            "Experimental: the schedule matches the authors' verl fork as read (K update_policy passes, "
            "slow + step_size (fast - slow) on every trainable parameter, one more pass; the optimizer state carries "
            "on through the reposition, nothing is reset or interpolated; the stop rule is one-sided z >= threshold "
            "on the window of the last w slow-pass entropies, population std + 1e-9, latched), but it was not run "
            "against that code. Differences by framework design: the reference steps the LR scheduler once per "
            "batch; the adapters step it once per pass (TRL: per optimizer step; verl: per update_actor call), K+1 "
            "times per batch (the same result with a constant LR). The paper's main setting is alpha = 0.8 (Qwen3-4B script: 0.9); K = 7 needs "
            "alpha ~ 0.2."
        ),
    )
