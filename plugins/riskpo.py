"""RiskPO: mixed value-at-risk advantage with question bundling (Ren, Jiang et al., arXiv 2510.00911).

Consecutive prompts are grouped into bundles (``extras["bundle_index"]``, one id per response).
Within a bundle of questions q_1..q_M, "paper" j (j = 1..min_q n_q) is the j-th response of every
question in rollout (row) order and scores S_j = sum_q r_{q,j}. With a = Q_alpha({S_j}) and
b = Q_beta({S_j}) the bundle's linear-interpolation quantiles (torch.quantile):

    g_j = [(S_j - a)^+ - (S_j - b)^+ + (a - b)] / (beta - alpha + eps)          (RVaR part, <= 0)
    c_j = -(a - S_j)^+ / (alpha + eps)                                          (CVaR part, <= 0)
    A_j = (w_mix c_j + g_j) / (w_mix + 1);   A_j /= (std_j(S) + eps)   if norm_adv_by_std_in_grpo

and A_j is credited to the responses of paper j (``credit_assign_mode``):
``uniform`` A_j; ``std`` A_j / (std_q + eps), std_q the unbiased std of question q's rewards (1 where
<= 1e-3 or q has one response); ``score`` 0.5 A_j if r > 0 else 1.5 A_j; ``sum-mean``
A_j (r - mean_q) / sum_{paper}(r - mean_q) (A_j / M where that sum is <= 1e-6 in magnitude).

Defaults (scripts/run_qwen2.5_1.5b_MVaR_math.sh): ``quantile_down=0.2`` (alpha), ``quantile_up=0.9``
(beta), ``w_mix=1.5``, ``use_mixing_risk_measure=True``, ``credit_assign_mode="std"``,
``norm_adv_by_std_in_grpo=True``, ``epsilon=1e-6``. Without ``bundle_index`` every question is its
own bundle (bundle_size 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import EXPERIMENTAL, Params, hookimpl
from stablerl.ops import group_ids
from stablerl.params import StableRLError, check
from stablerl.primitives import position_in_group

CREDIT_MODES = ("uniform", "std", "score", "sum-mean")
# the reference's floor under which a question's reward std is replaced by 1
_QUESTION_STD_FLOOR = 1e-3
# the reference's threshold under which the sum-mean ratios fall back to an equal share
_SUM_FLOOR = 1e-6


@dataclass
class RiskPOParams(Params):
    """Quantile levels alpha < beta, the CVaR mixing weight, and the credit assignment."""

    quantile_down: float = 0.2
    quantile_up: float = 0.9
    w_mix: float = 1.5
    use_mixing_risk_measure: bool = True
    credit_assign_mode: str = "std"
    norm_adv_by_std_in_grpo: bool = True
    epsilon: float = 1e-6

    def validate(self) -> None:
        check(
            0.0 < self.quantile_down < self.quantile_up < 1.0,
            f"need 0 < quantile_down < quantile_up < 1, got quantile_down={self.quantile_down}, "
            f"quantile_up={self.quantile_up}",
        )
        check(self.w_mix >= 0, f"w_mix must be >= 0, got {self.w_mix}")
        check(self.credit_assign_mode in CREDIT_MODES,
              f"credit_assign_mode must be one of {list(CREDIT_MODES)}, got {self.credit_assign_mode!r}")
        check(self.epsilon >= 0, f"epsilon must be >= 0, got {self.epsilon}")


def _bundles(b, gid: torch.Tensor) -> torch.Tensor:
    raw = b.extras.get("bundle_index")
    if raw is None:
        return gid
    bid = group_ids(raw, n=gid.numel(), device=gid.device)
    if gid.numel():
        n_groups = int(gid.max().item()) + 1
        hi = torch.full((n_groups,), -1, dtype=torch.long, device=gid.device).scatter_reduce(0, gid, bid, "amax")
        lo = torch.full((n_groups,), bid.numel(), dtype=torch.long, device=gid.device).scatter_reduce(0, gid, bid, "amin")
        if bool((hi != lo).any()):
            raise StableRLError("riskpo: a question's responses carry different bundle_index values")
    return bid


def paper_advantage(S: torch.Tensor, p: RiskPOParams) -> torch.Tensor:
    """Mixed-VaR advantage of the papers ``S`` [n] of one bundle (float64)."""
    if S.numel() == 1:
        a = bq = S[0]
        std = S.new_ones(())
    else:
        a = torch.quantile(S, p.quantile_down)
        bq = torch.quantile(S, p.quantile_up)
        std = S.std()
    eps = p.epsilon
    g = ((S - a).clamp(min=0) - (S - bq).clamp(min=0) + (a - bq)) / (p.quantile_up - p.quantile_down + eps)
    if p.use_mixing_risk_measure:
        c = -(a - S).clamp(min=0) / (p.quantile_down + eps)
        g = (p.w_mix * c + g) / (p.w_mix + 1)
    if p.norm_adv_by_std_in_grpo:
        g = g / (std + eps)
    return g


def riskpo_advantage(b, p: RiskPOParams, ctx):
    scores = b.scores
    gid = b.index
    out = torch.zeros_like(scores)
    if scores.numel():
        s = scores.to(torch.float64)
        bid = _bundles(b, gid)
        pos = position_in_group(gid)
        n_q = int(gid.max().item()) + 1
        count = torch.bincount(gid, minlength=n_q).to(torch.float64)
        q_sum = s.new_zeros(n_q).index_add_(0, gid, s)
        q_mean = q_sum / count
        q_sq = s.new_zeros(n_q).index_add_(0, gid, (s - q_mean[gid]) ** 2)
        q_std = torch.sqrt(q_sq / (count - 1).clamp(min=1))
        q_std = torch.where((count < 2) | (q_std <= _QUESTION_STD_FLOOR), torch.ones_like(q_std), q_std)
        adv = torch.zeros_like(s)
        for bundle in range(int(bid.max().item()) + 1):
            rows = torch.nonzero(bid == bundle).squeeze(-1)
            questions = torch.unique(gid[rows])
            n_papers = int(count[questions].min().item())
            rows = rows[pos[rows] < n_papers]  # responses beyond the shortest question's count get 0
            paper = pos[rows]
            S = s.new_zeros(n_papers).index_add_(0, paper, s[rows])
            A = paper_advantage(S, p)[paper]
            r, q = s[rows], gid[rows]
            mode = p.credit_assign_mode
            if mode == "uniform":
                adv[rows] = A
            elif mode == "std":
                adv[rows] = A / (q_std[q] + p.epsilon)
            elif mode == "score":
                adv[rows] = torch.where(r > 0, 0.5 * A, 1.5 * A)
            else:  # sum-mean
                ratio = r - q_mean[q]
                total = s.new_zeros(n_papers).index_add_(0, paper, ratio)[paper]
                share = A / float(questions.numel())
                safe = total.abs() > _SUM_FLOOR
                adv[rows] = torch.where(safe, A * ratio / torch.where(safe, total, torch.ones_like(total)), share)
        out = adv.to(scores.dtype)
    out = b.on_response_tokens(out)
    return out, out


@hookimpl
def register_advantage_estimators(register):
    register(
        name="riskpo",
        fn=riskpo_advantage,
        params=RiskPOParams,
        paper="2510.00911",
        title="RiskPO: mixed value-at-risk advantage with question bundling",
        formula="paper j of a bundle: S_j = sum_q r_{q,j}; a, b = Q_alpha, Q_beta({S_j}); A_j = (w_mix c_j + g_j)/(w_mix + 1) "
        "/ (std(S) + eps), g_j = [(S_j-a)^+ - (S_j-b)^+ + a - b]/(beta - alpha), c_j = -(a - S_j)^+/alpha; "
        "credited to each response of the paper by credit_assign_mode",
        status=EXPERIMENTAL,
        reference="authors' verl fork RTkenny/RiskPO 65ec40c, core_algos."
        "compute_grpo_bundle_rvar_outcome_advantage_quantile_tracking (released flags: natural_baseline_adv=True, "
        "use_mean_as_baseline=False, use_mixing_risk_measure=True)",
        notes="Bundles come from extras['bundle_index'] ([B] ids, every response of a question in one bundle; "
        "without it each question is its own bundle). Paper j = the j-th response of each question of the bundle in "
        "row (rollout) order, so the result depends on the order of a question's responses; questions with more "
        "responses than the bundle's smallest get A = 0 on the extra ones. Ships the per-bundle batch quantiles "
        "(torch.quantile, linear interpolation), which is the code path the released run actually uses: its "
        "tracked quantiles (19-level pinball-loss SGD tracker, lr_q=0.1) are written to the batch after the "
        "advantage and never read back, so no cross-step state is kept here. quantile_up defaults to the script's "
        "0.9 (a summary of the paper reports 0.8). With the released flags every advantage is <= 0 (the update "
        "only pushes down low-scoring papers). One paper in a bundle: a = b = S, std 1 (A = 0). Not provided: "
        "use_mean_as_baseline, risk_seeking_upper_tail, natural_baseline_adv=False, the deprecated value-unit "
        "denominators. S = sum of token rewards over response_mask. returns == advantages.",
    )
