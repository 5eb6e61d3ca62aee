"""EMPG: Entropy-Modulated Policy Gradients (Liu, Fu, Li, Wang et al., arXiv 2509.09265).

An advantage transform for multi-turn agents. A step j is one assistant turn (``turn_ids``, or else a
contiguous run of trained tokens);
H_j is the mean old-policy token entropy over the step's trained tokens. Over ALL steps of the
batch (every DP rank):

    H^_j  = (H_j - min H) / (max H - min H + 1e-8)
    g_j   = exp(-k H^_j) / mean_steps(exp(-k H^))            (batch mean of g is 1)
    f_j   = exp(-k_f H^_j)
    A_mod = g_j A_i + zeta f_{j+1}    (f_{j+1}: the next step of the same trajectory; 0 for its last step)
    A     = A_mod - mean_steps(A_mod)                        (zero-mean shift only, no std division)

A_i is the trajectory's GRPO advantage (``epsilon``, ``norm_adv_by_std_in_grpo`` as verl's GRPO);
the step value is broadcast to the step's tokens. Defaults (project-page pseudocode): ``k=1.0``,
``k_f=1.0``, ``zeta=0.1``; ``epsilon=1e-6``, ``norm_adv_by_std_in_grpo=True``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stablerl import EXPERIMENTAL, Params, hookimpl
from stablerl.ops import group_stats, mask_runs
from stablerl.params import StableRLError, check
from stablerl.primitives import singleton_convention

# the pseudocode's stabiliser of the min-max normalisation
MINMAX_EPS = 1e-8


@dataclass
class EMPGParams(Params):
    """Self-calibrating scale ``k``, future-clarity scale ``k_f`` and weight ``zeta``; GRPO's base options."""

    k: float = 1.0
    k_f: float = 1.0
    zeta: float = 0.1
    epsilon: float = 1e-6
    norm_adv_by_std_in_grpo: bool = True

    def validate(self) -> None:
        for name in ("k", "k_f", "zeta", "epsilon"):
            value = getattr(self, name)
            check(math.isfinite(value) and value >= 0, f"{name} must be a finite number >= 0, got {value}")


def _steps(b):
    """Per-token step index ``[B, T]`` (-1 off steps), each step's row, and the number of steps."""
    turn = b.extras.get("turn_ids")
    if turn is None:  # a step is a contiguous run of trained tokens (tool/environment tokens are masked)
        return _steps_of(mask_runs(b.response_mask), b.response_mask.bool())
    turn = torch.as_tensor(turn, device=b.response_mask.device)
    if tuple(turn.shape) != tuple(b.response_mask.shape):
        raise StableRLError(f"empg: turn_ids has shape {tuple(turn.shape)}, expected {tuple(b.response_mask.shape)}")
    if turn.dtype.is_floating_point or turn.dtype == torch.bool:
        raise StableRLError(f"empg: turn_ids must hold integer step ids, got dtype {turn.dtype}")
    valid = b.response_mask.bool()
    turn = turn.long()
    if bool((turn[valid] < 0).any()):
        raise StableRLError("empg: turn_ids < 0 on a token where response_mask is 1 (every trained token needs a step)")
    return _steps_of(turn, valid)


def _steps_of(turn: torch.Tensor, valid: torch.Tensor):
    B, T = turn.shape
    # a step is a (row, turn id) pair; keys sort rows first, then turn ids
    span = int(turn[valid].max().item()) + 1 if bool(valid.any()) else 1
    rows = torch.arange(B, device=turn.device).unsqueeze(-1).expand(B, T)
    keys = rows[valid] * span + turn[valid]
    uniq, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    step = torch.full((B, T), -1, dtype=torch.long, device=turn.device)
    step[valid] = inverse
    return step, torch.div(uniq, span, rounding_mode="floor"), uniq.numel()


def empg_advantage(b, p: EMPGParams, ctx):
    mask = b.response_mask
    dtype = b.token_level_rewards.dtype
    if tuple(b.entropy.shape) != tuple(mask.shape):
        raise StableRLError(f"empg: entropy has shape {tuple(b.entropy.shape)}, expected {tuple(mask.shape)}")
    entropy = b.entropy.to(torch.float64)
    valid = mask.bool()
    step, step_row, n = _steps(b)

    # base: GRPO per trajectory
    scores = b.scores.to(torch.float64)
    mean, std, count = group_stats(scores, b.index)
    mean, std = singleton_convention(mean, std, count)
    base = scores - mean
    if p.norm_adv_by_std_in_grpo:
        base = base / (std + p.epsilon)

    # step entropies (mean over the step's trained tokens)
    idx = step[valid]
    ent = torch.where(torch.isfinite(entropy[valid]), entropy[valid], torch.zeros_like(entropy[valid]))
    tokens = torch.zeros(n, dtype=torch.float64, device=mask.device).index_add_(0, idx, torch.ones_like(ent))
    H = torch.zeros(n, dtype=torch.float64, device=mask.device).index_add_(0, idx, ent) / tokens.clamp(min=1)

    # one max-reduction for max H, -min H and the input check (every rank raises together)
    bad = (~torch.isfinite(entropy[valid])).any().to(torch.float64)
    local = torch.stack([
        H.max() if n else torch.tensor(-math.inf, dtype=torch.float64, device=mask.device),
        (-H).max() if n else torch.tensor(-math.inf, dtype=torch.float64, device=mask.device),
        bad,
    ])
    h_max, neg_min, any_bad = ctx.all_reduce(local, "max").unbind()
    if bool(any_bad > 0):
        raise StableRLError("empg: entropy has non-finite values (NaN or inf) on tokens where response_mask is 1"
                            + ("" if bool(bad > 0) else " on another rank"))
    if n:
        h_norm = (H - (-neg_min)) / (h_max - (-neg_min) + MINMAX_EPS)
    else:
        h_norm = H
    e = torch.exp(-p.k * h_norm)
    f = torch.exp(-p.k_f * h_norm)
    # bonus from the next step of the same trajectory (steps are sorted by row, then turn id)
    has_next = torch.zeros(n, dtype=torch.bool, device=mask.device)
    if n > 1:
        has_next[:-1] = step_row[1:] == step_row[:-1]
    f_next = torch.zeros_like(f)
    if n > 1:
        f_next[:-1] = torch.where(has_next[:-1], f[1:], torch.zeros_like(f[1:]))
    a_step = base[step_row]
    # one sum-reduction: sum exp, step count, sum exp*A, sum of the bonuses -> mean g and mean A_mod
    sums = ctx.all_reduce(torch.stack([e.sum(), e.new_tensor(float(n)), (e * a_step).sum(), f_next.sum()]), "sum")
    e_sum, n_all, ea_sum, f_sum = sums.unbind()
    if bool(n_all > 0):
        e_mean = e_sum / n_all
        g = e / e_mean
        a_mod = g * a_step + p.zeta * f_next
        mean_mod = (ea_sum / e_mean + p.zeta * f_sum) / n_all
        a_step_final = a_mod - mean_mod
    else:
        a_step_final = a_step
    adv = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    adv[valid] = a_step_final[idx]
    adv = adv.to(dtype)
    return adv, adv


@hookimpl
def register_advantage_estimators(register):
    register(
        name="empg",
        fn=empg_advantage,
        params=EMPGParams,
        paper="2509.09265",
        title="EMPG: Entropy-Modulated Policy Gradients (step-level advantage recalibration)",
        formula="A = g(H_j) A_i + zeta f(H_{j+1}) - mean_steps(...), g = exp(-k H^)/mean(exp(-k H^)), "
        "f = exp(-k_f H^), H^ = batch min-max normalised step entropy",
        status=EXPERIMENTAL,
        requires=("entropy",),
        optional_inputs=("turn_ids",),
        batch_statistics=True,
        reference="project-page pseudocode (empgseed-seed.github.io, Eq. 7, 10-12); no authors' repository",
        notes="entropy: per-token entropy of the policy that generated the batch (verl: the old-log-prob pass's "
        "entropys). turn_ids (optional): [B, T] integer step id per token (< 0 allowed only where response_mask is 0; a "
        "trained token with a negative id raises); without it a step is a contiguous run of trained tokens "
        "(ops.mask_runs: the frameworks' loss masks leave out tool/environment tokens); a step is a (response, turn id) pair and its entropy the mean "
        "over its trained tokens; the 'next' step is the next larger turn id of the same response. min/max, the "
        "mean of exp(-k H^) and the final mean are over all steps of the batch (each step counts once, not per "
        "token), reduced over DP ranks with ctx.all_reduce (max, sum), so 2 ranks equal 1. Unverified assumptions: "
        "the last step of a trajectory gets bonus 0; the final normalisation is a zero-mean shift only (no std "
        "division). Base advantage: GRPO (verl conventions: std unbiased + epsilon, group of one: baseline 0, std 1). "
        "returns == advantages.",
    )
