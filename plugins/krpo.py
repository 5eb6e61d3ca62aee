"""KRPO: Kalman-filter group baseline (Wang, Ma, Reid, Yaqub, arXiv 2505.07527).

"Kalman Filter Enhanced GRPO". A 1-D Kalman filter is re-initialised for every group
(x_0 = 0, P_0 = 1) and run over the group's responses in rollout order (row order):

    P- = P + Q,   K = P- / (P- + R),   x <- x + K (S_i - x),   P <- (1 - K) P-
    A_i = (S_i - x_i) / (sqrt(P_i) + epsilon)          (x_i, P_i a-posteriori: they include S_i)

Defaults: ``process_var=1e-5`` (Q), ``meas_var=1e-2`` (R), ``epsilon=1e-8``. The result depends
on the order of the responses within a group. sqrt(P_i) is the posterior std of the mean
estimate, not a reward std, so advantages are ~10x GRPO's for the first response and grow
along the group; an all-equal group does not give 0 (all S = 1: A_1 ~ 0.0995).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import STABLE, Params, hookimpl
from stablerl.params import check
from stablerl.primitives import position_in_group


@dataclass
class KRPOParams(Params):
    """Process noise Q, measurement noise R, and the stabiliser added to sqrt(P)."""

    process_var: float = 1e-5
    meas_var: float = 1e-2
    epsilon: float = 1e-8

    def validate(self) -> None:
        check(self.process_var >= 0, f"process_var must be >= 0, got {self.process_var}")
        check(self.meas_var > 0, f"meas_var must be > 0, got {self.meas_var}")
        check(self.epsilon >= 0, f"epsilon must be >= 0, got {self.epsilon}")


def krpo_advantage(b, p: KRPOParams, ctx):
    scores = b.scores
    gid = b.index
    adv = torch.zeros_like(scores)
    if scores.numel():
        pos = position_in_group(gid)
        n_groups = int(gid.max().item()) + 1
        x = torch.zeros(n_groups, dtype=torch.float64, device=scores.device)
        var = 1.0  # P: the same for every group at a given position, so a python float
        s64 = scores.to(torch.float64)
        for i in range(int(pos.max().item()) + 1):
            rows = torch.nonzero(pos == i).squeeze(-1)
            var_pred = var + p.process_var
            gain = var_pred / (var_pred + p.meas_var)
            g = gid[rows]
            x[g] = x[g] + gain * (s64[rows] - x[g])
            var = (1 - gain) * var_pred
            adv[rows] = ((s64[rows] - x[g]) / (var ** 0.5 + p.epsilon)).to(scores.dtype)
    adv = b.on_response_tokens(adv)
    return adv, adv


@hookimpl
def register_advantage_estimators(register):
    register(
        name="krpo",
        fn=krpo_advantage,
        params=KRPOParams,
        paper="2505.07527",
        title="KRPO: Kalman-filter group baseline",
        formula="per group in rollout order: P- = P + Q, K = P-/(P- + R), x += K(S_i - x), P = (1-K)P-; "
        "A_i = (S_i - x_i)/(sqrt(P_i) + epsilon), x_0 = 0, P_0 = 1",
        status=STABLE,
        reference="authors' code billhhh/KRPO_LLMs_RL df1ae2b, train.py::KalmanFilter and group_advantages",
        notes="Order-dependent: the filter runs over each group's responses in row (rollout) order, so the rows "
        "of a group must arrive in generation order (shuffling within a group changes the result; keep the "
        "order deterministic under DP). A fresh filter per group and per call (no state across steps, as the "
        "released code). x_i and P_i are the a-posteriori values that already include S_i. All-equal group: "
        "A != 0 (all S = 1: A_1 = 0.0995). Group of one: A = (S - x_1)/(sqrt(P_1) + epsilon) = 0.0995 S. "
        "Advantages are large (sqrt(P) shrinks like sqrt(R/i)): retune learning rate / clipping. "
        "S = sum of token rewards over response_mask. returns == advantages.",
    )
