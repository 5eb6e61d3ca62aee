"""GTPO: Group-relative Trajectory-based Policy Optimization (Simoni et al., arXiv 2508.03772).

Protects tokens shared by positive and negative completions of a group ("conflict tokens") and
filters high-entropy completions:

    conflict(i,t): the same token id sits at the same position in a positive-A and a negative-A
                   completion of i's group, and t is in the leading run of such tokens (positions
                   from the start) or in the trailing run (positions counted from the end)
    delta        = fwd x bwd, each W_RAW on a conflict token of a positive completion, 0 on one of a
                   negative completion, 1 elsewhere (a positive token in both runs gets W_RAW^2)
    Hbar_i       = token-mean current-policy entropy of completion i
    A'_i         = 0 if Hbar_i > ENT_THRESHOLD else A_i - ENT_SCALE * Hbar_i
    l_i          = (1/L_i) sum_t -(r_t A'_i delta_t) / max(n_conflict_i, 1),   r = exp(lp - sg(lp))
    loss         = mean_i l_i                (the reference sums over completions; see notes)

Defaults (authors' ``config.yaml``): ``ent_threshold=0.7``, ``ent_scale=0.1``, ``w_raw=2.0``.
Positive/negative flags use the advantage before the entropy adjustment. Completions with A = 0
are inactive (delta 1, n_conflict 1). Validity comes from ``response_mask`` (the reference uses a
Llama-specific pad id).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stablerl import EXPERIMENTAL, Params, hookimpl
from stablerl.ops import aggregate, masked_mean, seq_mean
from stablerl.params import StableRLError, check
from stablerl.primitives import entropy_input

CONFLICT_COUNTS = ("union", "max_run")
_ID_BITS = 31  # token ids must be < 2**31 (compared as int32)


@dataclass
class GTPOParams(Params):
    """GTPO constants (reference names ENT_THRESHOLD, ENT_SCALE, W_RAW) and two porting choices."""

    ent_threshold: float = 0.7
    ent_scale: float = 0.1
    w_raw: float = 2.0
    conflict_count: str = "union"
    per_completion_norm: bool = True

    def validate(self) -> None:
        check(self.ent_threshold >= 0, f"ent_threshold must be >= 0 (nats), got {self.ent_threshold}")
        check(self.ent_scale >= 0, f"ent_scale must be >= 0, got {self.ent_scale}")
        check(self.w_raw >= 0, f"w_raw must be >= 0, got {self.w_raw}")
        check(
            self.conflict_count in CONFLICT_COUNTS,
            f"conflict_count must be one of {list(CONFLICT_COUNTS)}, got {self.conflict_count!r}",
        )
        check(isinstance(self.per_completion_norm, bool), f"per_completion_norm must be True or False, got {self.per_completion_norm!r}")


def _members(rows_gid: torch.Tensor, rows: torch.Tensor, n_groups: int, dummy: int) -> torch.Tensor:
    """``[n_groups, max size]``: the selected ``rows`` of each group in row order, ``dummy`` in the empty slots."""
    gid = rows_gid[rows]  # rows ascending, so a stable sort by group keeps row order within each group
    order = torch.argsort(gid, stable=True)
    counts = torch.bincount(gid, minlength=n_groups)
    sorted_gid = gid[order]
    slot = torch.arange(gid.numel(), device=gid.device) - (torch.cumsum(counts, 0) - counts)[sorted_gid]
    member = torch.full((n_groups, int(counts.max()) if gid.numel() else 0), dummy, dtype=torch.long, device=gid.device)
    member[sorted_gid, slot] = rows[order]
    return member


def _slot_hits(x: torch.Tensor, rows_gid: torch.Tensor, pos_rows: torch.Tensor, neg_rows: torch.Tensor,
               n_groups: int) -> torch.Tensor:
    """``[R, T]`` bool: a completion of the opposite sign in the same group holds the same value ``x`` (>= 0)
    at the same position. A row always shares its own keys, so this is "in a positive and in a negative
    completion" for the active rows. One pass per slot of the largest opposite side: O(G R T), no sort."""
    R, T = x.shape
    pos_members = _members(rows_gid, pos_rows.nonzero().squeeze(-1), n_groups, R)
    neg_members = _members(rows_gid, neg_rows.nonzero().squeeze(-1), n_groups, R)
    slots = max(pos_members.shape[1], neg_members.shape[1])
    pad = lambda m: torch.nn.functional.pad(m, (0, slots - m.shape[1]), value=R)  # noqa: E731
    # opposite[r, j]: the j-th completion of the other sign in r's group (the dummy row R for inactive rows)
    opposite = torch.where(pos_rows.unsqueeze(-1), pad(neg_members)[rows_gid], pad(pos_members)[rows_gid])
    opposite = torch.where((pos_rows | neg_rows).unsqueeze(-1), opposite, R)
    x = torch.cat([x, torch.full((1, T), -2, dtype=x.dtype, device=x.device)])  # the dummy matches nothing
    hit = torch.zeros(R, T, dtype=torch.bool, device=x.device)
    for j in range(slots):
        hit |= x[:R] == x.index_select(0, opposite[:, j])
    return hit


def _sort_hits(x: torch.Tensor, rows_gid: torch.Tensor, neg_rows: torch.Tensor, id_bits: int) -> torch.Tensor:
    """Same as :func:`_slot_hits` with one sort of (group, position, value, negative) keys: O(N log N).
    Only active rows may hold ``x >= 0``."""
    R, T = x.shape
    device = x.device
    rows, cols = (x >= 0).nonzero(as_tuple=True)
    hit = torch.zeros(R, T, dtype=torch.bool, device=device)
    if rows.numel() == 0:
        return hit
    negative = neg_rows[rows].long()
    key = ((((rows_gid[rows] * T + cols) << id_bits) | x[rows, cols].long()) << 1) | negative
    keys, perm = torch.sort(key)
    # a key sits in both a positive and a negative row iff its sorted run holds an even entry followed by its odd twin
    mixed_pair = (keys[1:] - keys[:-1] == 1) & ((keys[:-1] & 1) == 0)
    run = torch.cat([keys.new_zeros(1), ((keys[1:] >> 1) != (keys[:-1] >> 1)).long()]).cumsum(0)
    mixed = torch.zeros(int(run[-1]) + 1, dtype=torch.bool, device=device)
    mixed[run[1:][mixed_pair]] = True
    flag = torch.empty(keys.numel(), dtype=torch.bool, device=device)
    flag[perm] = mixed[run]
    hit[rows, cols] = flag
    return hit


#: most positive (or negative) completions in a group for the per-slot comparison; above it one sort is cheaper
SLOT_LOOP_MAX_SIDE = 32


def conflict_runs(token_ids, mask, gid, pos_rows, neg_rows):
    """Forward (leading) and backward (trailing) conflict runs, both ``[B, T]`` bool in forward order.

    A masked-out position ends a run. The backward pass aligns each completion on its last valid
    token (positions counted from the end), as the reference does for right-padded completions.
    ``gid`` holds group ids ``0..n_groups-1`` (core's normalised ``index``).
    """
    B, T = mask.shape
    device = mask.device
    valid = mask.bool()
    if B == 0 or T == 0:
        return valid, valid
    ok = valid & (pos_rows | neg_rows).unsqueeze(-1)
    t = torch.arange(T, device=device)
    end = torch.where(valid, t + 1, 0).amax(dim=1, keepdim=True)
    from_end = end - 1 - t  # position counted from the last valid token; < 0 after it
    inside = from_end >= 0
    idx = from_end.clamp(min=0)  # reversed coordinates: s -> t = end - 1 - s (an involution on [0, end))
    # x: the token id where it can conflict, -1 elsewhere; forward rows, then the same rows read from their end
    # (a second set of groups), so one pass finds both raw conflict masks
    x = torch.where(ok, token_ids.to(torch.int32), -1)
    x = torch.cat([x, torch.where(inside, x.gather(1, idx), -1)])
    n_groups = int(gid.max()) + 1
    rows_gid = torch.cat([gid, gid + n_groups])
    pos2, neg2 = pos_rows.repeat(2), neg_rows.repeat(2)
    id_bits = int(x.max()).bit_length()
    fits = (2 * n_groups * T) << (id_bits + 1) < 2**63  # the sort's packed key
    side = max(int(torch.bincount(gid[rows], minlength=1).max()) for rows in (pos_rows, neg_rows))
    if not fits or side <= SLOT_LOOP_MAX_SIDE:
        hit = _slot_hits(x, rows_gid, pos2, neg2, 2 * n_groups)
    else:
        hit = _sort_hits(x, rows_gid, neg2, id_bits)
    # a run ends at the first non-conflict position (row-wise first argmax of ~raw; T when there is none)
    stop = ~((x >= 0) & hit)
    run_len = torch.where(stop.any(dim=1), stop.to(torch.uint8).argmax(dim=1), T).unsqueeze(-1)
    fwd = (t < run_len[:B]) & valid
    bwd = inside & (from_end < run_len[B:]) & valid
    return fwd, bwd


def gtpo_terms(b, p: GTPOParams):
    """Per-completion advantage A', token weights delta, conflict counts and the conflict mask."""
    mask = b.response_mask
    token_ids = b.token_ids
    if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
        raise StableRLError(f"token_ids must be an integer tensor, got dtype {token_ids.dtype}")
    valid = b.bool_mask
    if bool((((token_ids < 0) | (token_ids >= 2**_ID_BITS)) & valid).any()):
        raise StableRLError(f"token_ids must be in [0, 2**{_ID_BITS}) on tokens where response_mask is 1")
    has_tokens = valid.any(dim=-1)
    adv_seq = seq_mean(b.advantages, mask)  # outcome advantage per completion (the broadcast value)
    pos_rows = (adv_seq > 0) & has_tokens
    neg_rows = (adv_seq < 0) & has_tokens
    fwd, bwd = conflict_runs(token_ids, mask, b.index, pos_rows, neg_rows)

    one = torch.ones((), dtype=adv_seq.dtype, device=mask.device)
    zero = torch.zeros((), dtype=adv_seq.dtype, device=mask.device)
    conflict_w = torch.where(pos_rows, p.w_raw * one, zero).unsqueeze(-1)  # W_RAW (positive) or 0 (negative)
    delta = torch.where(fwd, conflict_w, one) * torch.where(bwd, conflict_w, one)

    conflict = fwd | bwd
    if p.conflict_count == "union":
        n_conflict = conflict.sum(-1)
    else:  # the reference's count: max(leading run, trailing run)
        n_conflict = torch.maximum(fwd.sum(-1), bwd.sum(-1))
    n_conflict = n_conflict.clamp(min=1).to(adv_seq.dtype)

    H = entropy_input(b.entropy, mask, "entropy").to(adv_seq.dtype)
    h_bar = seq_mean(H, mask)
    filtered = h_bar > p.ent_threshold
    adv_mod = torch.where(filtered, zero, adv_seq - p.ent_scale * h_bar)
    return adv_mod, delta, n_conflict, conflict, filtered & has_tokens, has_tokens, H


def gtpo_loss(b, p: GTPOParams, ctx):
    mask = b.response_mask
    adv_mod, delta, n_conflict, conflict, filtered, has_tokens, H = gtpo_terms(b, p)
    lp = b.log_prob
    ratio = torch.exp(lp - lp.detach())  # value 1, gradient d lp (single-step on-policy, as the reference)
    per_token = -(ratio * adv_mod.unsqueeze(-1) * delta) / n_conflict.unsqueeze(-1)
    if b.is_weights is not None:
        per_token = per_token * b.is_weights
    if p.per_completion_norm:
        loss = aggregate(per_token, mask, "seq-mean-token-mean", ctx)
    else:
        loss = aggregate(per_token, mask, b.loss_agg_mode, ctx, params=b.loss_agg_params)
    dt = mask.dtype
    metrics = {
        "gtpo/conflict_tokens": (conflict & b.bool_mask).sum().to(dt),
        "gtpo/conflict_fraction": masked_mean(conflict.to(dt), mask),
        "gtpo/entropy_filtered_fraction": masked_mean(filtered.to(dt), has_tokens.to(dt)),
        "entropy": masked_mean(H, mask),
        "ppo_kl": masked_mean(b.old_log_prob - lp.detach(), mask),
    }
    return loss, metrics


@hookimpl
def register_policy_losses(register):
    register(
        name="gtpo",
        aggregation=lambda p: "seq-mean-token-mean" if p is None or p.per_completion_norm else "",
        fn=gtpo_loss,
        params=GTPOParams,
        paper="2508.03772",
        title="GTPO: conflict-token protection and entropy filtering of completions within each group",
        formula="l = mean_i (1/L_i) sum_t -(r_t A'_i delta_t)/n_conflict_i; A'_i = 0 if Hbar_i > 0.7 else A_i - 0.1 Hbar_i",
        status=EXPERIMENTAL,
        requires=("token_ids", "index", "entropy"),
        metrics=(
            "gtpo/conflict_tokens", "gtpo/conflict_fraction", "gtpo/entropy_filtered_fraction", "entropy", "ppo_kl",
        ),
        reference="winstonsmith1897/GTPO gtpo/gtpo_training.py::{build_conflict_mask, gtpo_compute_loss, "
        "UnslothEfficientGTPO} (catalogue-verified delta and n_conflict)",
        notes=(
            "Experimental: paper-vs-code constants (ENT_THRESHOLD possibly relative to ln|V|, the division by "
            "n_conflict) are unverified against paper v5. Porting choices: (1) MEAN over completions, where "
            "the reference SUMS the per-completion losses (its step grows with the number of completions; "
            "multiply the learning rate by the completions per step to reproduce it); with "
            "per_completion_norm=True (default) the loss is aggregated as seq-mean-token-mean with the global "
            "ctx.seq_count whatever loss_agg_mode says; per_completion_norm=False uses loss_agg_mode. "
            "(2) n_conflict = size of the union of the leading and trailing conflict runs (conflict_count="
            "'union'); 'max_run' reproduces the reference's count, max(leading, trailing), which comes from "
            "OR-ing masks in opposite orientations. (3) Validity from response_mask, not a pad id; a masked "
            "position ends a run. (4) The ratio is exp(lp - sg(lp)) (value 1) as in the reference, so "
            "old_log_prob only feeds ppo_kl: GTPO is a single-update on-policy method. (5) A_i is the mean of "
            "advantages over the completion's valid tokens. Groups (index) must be whole inside each call; the "
            "entropy is the current-policy full-vocabulary entropy in nats. IS weights multiply per token."
        ),
        output="scalar",
    )
