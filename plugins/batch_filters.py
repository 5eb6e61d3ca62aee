"""Batch filters and samplers: run after the advantage estimator, select rows and mask tokens.

* ``dynamic_sampling`` — DAPO (Yu et al., arXiv 2503.14476): drop groups whose rewards are all
  equal (keep ``0 < #correct < G``); a group of one is kept (verl's ``std > 0 or len == 1``).
* ``simpletir`` — SimpleTIR (Xue et al., arXiv 2509.02479): zero ``response_mask`` of trajectories with
  a void turn; they stay in the group statistics because this runs after the estimator.
* ``gtpo_entropy_filter`` — GTPO (Simoni et al., arXiv 2508.03772): ``H_i > 0.7 -> A_i = 0``, else
  ``A_i -= 0.1 * H_i`` (H_i = token-mean entropy of completion i).
* ``d3s`` — D³S (Wang et al., arXiv 2509.22115): per group keep the ``N`` responses of maximum advantage
  variance (top-j most positive + bottom-(N-j) most negative), then the top ``K`` fraction of tokens by
  ``|A| * H``; ``[N, K](p) = (1-p)[N_init, K_init] + p[N_final, K_final]``, ``p = step / total_steps``.
* ``shuffle_r1`` — Shuffle-R1 (Zhu et al., arXiv 2508.05612): pairwise trajectory sampling (pair the
  max with the min advantage, keep the ``alpha * N`` largest-contrast pairs, alpha = 0.5) and
  advantage-based batch shuffle (``S = 8`` sub-batches drawn with probability proportional to
  ``|A_1| + |A_2|``, without replacement within and with replacement across sub-batches).

Filters run on the whole (gathered) batch in the trainer's driver, so they take no ctx reductions.
A row's advantage is the token mean of ``advantages`` over its valid tokens (outcome estimators
broadcast one value per response).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from stablerl import EXPERIMENTAL, STABLE, FilterResult, Params, hookimpl
from stablerl.ops import masked_var, seq_mean
from stablerl.params import StableRLError, check
from stablerl.primitives import draw_uniform, per_response, refuse_param_typos


def _scalar(v, device) -> torch.Tensor:
    return torch.as_tensor(float(v), dtype=torch.float32, device=device)


def _frac(num, den, device) -> torch.Tensor:
    return _scalar(float(num) / float(den) if float(den) > 0 else 0.0, device)


def _valid_values(name: str, t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``t`` with padding zeroed; non-finite values on valid tokens raise (padding may hold garbage)."""
    valid = mask.bool()
    if not bool(torch.isfinite(t[valid]).all()):
        raise StableRLError(f"{name} has non-finite values (NaN or inf) on tokens where response_mask is 1")
    return torch.where(valid, t, torch.zeros((), dtype=t.dtype, device=t.device))


def _adv_and_mask(b) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages (padding zeroed, checked finite) and mask, half precision upcast to fp32 (a bf16
    mask cannot count more than 256 tokens exactly)."""
    adv = b.advantages.float() if b.advantages.dtype in (torch.float16, torch.bfloat16) else b.advantages
    mask = b.response_mask.to(adv.dtype)
    return _valid_values("advantages", adv, mask), mask


def _groups(gid: torch.Tensor) -> list[torch.Tensor]:
    """Row indices of each group, in group-id order (ids are 0..n_groups-1)."""
    if gid.numel() == 0:
        return []
    order = torch.sort(gid, stable=True).indices
    counts = torch.bincount(gid).tolist()
    return list(torch.split(order, counts))


# ----------------------------------------------------------------------------- dynamic sampling (DAPO)


@dataclass
class DynamicSamplingParams(Params):
    """Keep groups of one (verl keeps them: their std is undefined)."""

    keep_singletons: bool = True


def dynamic_sampling(b, p: DynamicSamplingParams, ctx):
    refuse_param_typos(b.extras, DynamicSamplingParams, "dynamic_sampling")
    device = b.advantages.device
    scores = per_response({"scores": b.scores}, "scores", b.index.shape[0], device)
    keep = torch.zeros_like(b.index, dtype=torch.bool)
    groups = _groups(b.index)
    kept_groups = 0
    for rows in groups:
        s = scores[rows]
        varied = bool(s.max() != s.min())
        if varied or (rows.numel() == 1 and p.keep_singletons):
            keep[rows] = True
            kept_groups += 1
    rows = torch.nonzero(keep).reshape(-1)
    metrics = {
        "dynamic_sampling/kept_group_frac": _frac(kept_groups, len(groups), device),
        "dynamic_sampling/kept_frac": _frac(rows.numel(), keep.numel(), device),
        "dynamic_sampling/num_kept_groups": _scalar(kept_groups, device),
    }
    return FilterResult(rows=rows, response_mask=b.response_mask[rows], metrics=metrics)


# ----------------------------------------------------------------------------- SimpleTIR


@dataclass
class SimpleTIRParams(Params):
    """``min_n`` > 0 also masks every response of a group with fewer than ``min_n`` unmasked responses."""

    min_n: int = 0

    def validate(self) -> None:
        check(isinstance(self.min_n, int) and self.min_n >= 0, f"min_n must be an integer >= 0, got {self.min_n}")


def simpletir(b, p: SimpleTIRParams, ctx):
    refuse_param_typos(b.extras, SimpleTIRParams, "simpletir")
    B = b.index.shape[0]
    device = b.advantages.device
    void = per_response(b.extras, "void_turn", B, device, kind="bool")
    keep = ~void
    groups = _groups(b.index)
    small_groups = 0
    if p.min_n > 0:
        for rows in groups:
            if int(keep[rows].sum()) < p.min_n:
                keep[rows] = False
                small_groups += 1
    mask = b.response_mask * keep.to(b.response_mask.dtype).unsqueeze(-1)
    metrics = {
        "simpletir/void_frac": _frac(int(void.sum()), B, device),
        "simpletir/masked_frac": _frac(int((~keep).sum()), B, device),
        "simpletir/masked_group_frac": _frac(small_groups, len(groups), device),
    }
    return FilterResult(rows=torch.arange(B, device=b.index.device), response_mask=mask, metrics=metrics)


# ----------------------------------------------------------------------------- GTPO entropy filter


@dataclass
class GTPOFilterParams(Params):
    """``ENT_THRESHOLD`` and ``ENT_SCALE`` of the reference code."""

    ent_threshold: float = 0.7
    ent_scale: float = 0.1

    def validate(self) -> None:
        check(math.isfinite(self.ent_threshold) and self.ent_threshold >= 0,
              f"ent_threshold must be finite and >= 0, got {self.ent_threshold}")
        check(math.isfinite(self.ent_scale) and self.ent_scale >= 0, f"ent_scale must be finite and >= 0, got {self.ent_scale}")


def gtpo_entropy_filter(b, p: GTPOFilterParams, ctx):
    refuse_param_typos(b.extras, GTPOFilterParams, "gtpo_entropy_filter")
    adv, mask = _adv_and_mask(b)
    H = _valid_values("entropy", b.entropy.to(adv.dtype), mask)
    H_seq = seq_mean(H, mask)  # [B]
    row_valid = mask.sum(-1) > 0
    drop = (H_seq > p.ent_threshold) & row_valid
    new_adv = torch.where(drop.unsqueeze(-1), torch.zeros_like(adv), adv - p.ent_scale * H_seq.unsqueeze(-1)) * mask
    B = mask.shape[0]
    n_valid = int(row_valid.sum())
    metrics = {
        "gtpo_filter/dropped_frac": _frac(int(drop.sum()), n_valid, mask.device),
        "gtpo_filter/entropy_mean": (H_seq[row_valid].mean().float() if n_valid else _scalar(0.0, mask.device)),
    }
    return FilterResult(rows=torch.arange(B, device=b.index.device), response_mask=mask, advantages=new_adv, metrics=metrics)


# ----------------------------------------------------------------------------- D3S

D3S_SCOPES = ("group", "batch")


@dataclass
class D3SParams(Params):
    """Sample fraction N and token fraction K at the start (init) and end (final) of training.

    The paper publishes no defaults: these are ASSUMED (aggressive at first, relaxed later; the
    abstract reports "<20% tokens").
    """

    n_init: float = 0.5
    n_final: float = 1.0
    k_init: float = 0.2
    k_final: float = 0.5
    scope: str = "group"  # "batch": the paper's cross-group variant (selection over the whole batch)

    def validate(self) -> None:
        for name in ("n_init", "n_final", "k_init", "k_final"):
            v = getattr(self, name)
            check(0.0 < v <= 1.0, f"{name} must be in (0, 1], got {v}")
        check(self.scope in D3S_SCOPES, f"scope must be one of {list(D3S_SCOPES)}, got {self.scope!r}")


def max_variance_subset(values: torch.Tensor, n: int) -> torch.Tensor:
    """Indices (into ``values``) of the size-``n`` subset of maximum variance.

    The optimum consists of extremes: the j largest plus the n - j smallest for some j; every j
    is scanned (ties: the j closest to n/2, then the smaller j).
    """
    m = values.numel()
    if n >= m:
        return torch.arange(m, device=values.device)
    order = torch.sort(values.to(torch.float64), descending=True, stable=True).indices
    v = values.to(torch.float64)[order]
    prefix = torch.cat([v.new_zeros(1), torch.cumsum(v, 0)])
    prefix_sq = torch.cat([v.new_zeros(1), torch.cumsum(v * v, 0)])
    best, best_key = None, None
    for j in range(n + 1):
        s = prefix[j] + (prefix[m] - prefix[m - (n - j)])
        sq = prefix_sq[j] + (prefix_sq[m] - prefix_sq[m - (n - j)])
        var = float(sq / n - (s / n) ** 2)
        key = (round(var, 12), -abs(j - n / 2), -j)
        if best_key is None or key > best_key:
            best, best_key = j, key
    return torch.cat([order[:best], order[m - (n - best):]])


def _progress(ctx, p: D3SParams) -> float:
    if p.n_init == p.n_final and p.k_init == p.k_final:
        return 0.0
    if ctx.step is None or not ctx.total_steps:
        raise StableRLError(
            "d3s schedules N and K linearly in training progress: pass ctx.step and ctx.total_steps "
            "(or set n_init == n_final and k_init == k_final)"
        )
    return min(max(float(ctx.step) / float(ctx.total_steps), 0.0), 1.0)


def d3s(b, p: D3SParams, ctx):
    refuse_param_typos(b.extras, D3SParams, "d3s")
    adv, mask = _adv_and_mask(b)
    device = mask.device
    valid = mask.bool()
    progress = _progress(ctx, p)
    n_frac = (1 - progress) * p.n_init + progress * p.n_final
    k_frac = (1 - progress) * p.k_init + progress * p.k_final
    seq_adv = seq_mean(adv, mask)
    row_valid = mask.sum(-1) > 0
    candidate = row_valid & (seq_adv != 0)  # zero-advantage responses add nothing to the variance

    keep = torch.zeros_like(row_valid)
    pools = _groups(b.index) if p.scope == "group" else [torch.arange(mask.shape[0], device=b.index.device)]
    for rows in pools:
        size = int(row_valid[rows].sum())
        if size == 0:
            continue
        n = max(1, math.ceil(n_frac * size - 1e-9))
        cand = rows[candidate[rows]]
        if cand.numel() == 0:
            continue
        chosen = cand[max_variance_subset(seq_adv[cand], n)]
        keep[chosen] = True

    # token level: top ceil(K * tokens) of |A| * H over the valid tokens of the kept responses
    token_pool = valid & keep.unsqueeze(-1)
    n_pool = int(token_pool.sum())
    token_keep = torch.zeros_like(valid)
    if n_pool:
        H = _valid_values("entropy", b.entropy.to(adv.dtype), mask)
        score = (adv.abs() * H).reshape(-1)
        flat_pool = token_pool.reshape(-1)
        pool_idx = torch.nonzero(flat_pool).reshape(-1)
        k = max(1, math.ceil(k_frac * n_pool - 1e-9))
        top = pool_idx[torch.sort(score[pool_idx], descending=True, stable=True).indices[:k]]
        flat_keep = torch.zeros_like(flat_pool)
        flat_keep[top] = True
        token_keep = flat_keep.reshape(valid.shape)

    rows = torch.nonzero(keep).reshape(-1)
    new_mask = (mask * token_keep.to(mask.dtype))[rows]
    ones_valid = row_valid.to(seq_adv.dtype)
    metrics = {
        "d3s/progress": _scalar(progress, device),
        "d3s/n_frac": _scalar(n_frac, device),
        "d3s/k_frac": _scalar(k_frac, device),
        "d3s/kept_sample_frac": _frac(rows.numel(), int(row_valid.sum()), device),
        "d3s/kept_token_frac": _frac(int(token_keep.sum()), int(valid.sum()), device),
        "d3s/adv_var_before": masked_var(seq_adv, ones_valid, unbiased=False).float(),
        "d3s/adv_var_after": masked_var(seq_adv, keep.to(seq_adv.dtype), unbiased=False).float(),
    }
    return FilterResult(rows=rows, response_mask=new_mask, metrics=metrics)


# ----------------------------------------------------------------------------- Shuffle-R1


@dataclass
class ShuffleR1Params(Params):
    """PTS keeps ``alpha`` of each group's pairs; ABS draws ``num_sub_batches`` (S) weighted sub-batches."""

    alpha: float = 0.5
    num_sub_batches: int = 8
    shuffle: bool = True  # False: PTS only (kept pairs in order, no resampling)

    def validate(self) -> None:
        check(0.0 < self.alpha <= 1.0, f"alpha must be in (0, 1], got {self.alpha}")
        check(isinstance(self.num_sub_batches, int) and self.num_sub_batches >= 1,
              f"num_sub_batches must be an integer >= 1, got {self.num_sub_batches}")


def _weighted_order(weights: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """A random order of the items: sampling without replacement with probability proportional to
    ``weights`` (Gumbel top-k); zero-weight items come last, in uniformly random order."""
    m = weights.numel()
    u = draw_uniform(m, generator, weights.device).clamp(min=1e-300, max=1 - 1e-16)
    gumbel = -torch.log(-torch.log(u))
    positive = weights > 0
    key = torch.where(positive, torch.log(weights.clamp(min=1e-300)) + gumbel, gumbel)
    pos = torch.nonzero(positive).reshape(-1)
    zero = torch.nonzero(~positive).reshape(-1)
    return torch.cat([pos[torch.sort(key[pos], descending=True).indices], zero[torch.sort(key[zero], descending=True).indices]])


def shuffle_r1(b, p: ShuffleR1Params, ctx):
    refuse_param_typos(b.extras, ShuffleR1Params, "shuffle_r1")
    adv, mask = _adv_and_mask(b)
    device = mask.device
    seq_adv = seq_mean(adv, mask).to(torch.float64)
    # Pairwise Trajectory Sampling: within a group sort by A, pair i-th largest with i-th smallest
    pairs: list[tuple[int, int]] = []
    possible = 0
    for rows in _groups(b.index):
        n_pairs = rows.numel() // 2
        if n_pairs == 0:
            continue
        possible += n_pairs
        order = rows[torch.sort(seq_adv[rows], descending=True, stable=True).indices]
        keep = max(1, int(math.floor(p.alpha * n_pairs + 1e-9)))
        pairs.extend((int(order[i]), int(order[rows.numel() - 1 - i])) for i in range(keep))
    m = len(pairs)
    pair_t = torch.tensor(pairs, dtype=torch.long, device=b.index.device).reshape(m, 2)
    weights = (seq_adv[pair_t[:, 0]].abs() + seq_adv[pair_t[:, 1]].abs()) if m else seq_adv.new_zeros(0)
    if p.shuffle and m:
        # Advantage-based Batch Shuffle: S sub-batches of ceil(m/S) pairs, each drawn without replacement
        # with probability W/sum(W), independently of the others; truncated to m pairs in total
        sub = math.ceil(m / p.num_sub_batches)
        draws = [_weighted_order(weights, ctx.generator)[: min(sub, m)] for _ in range(p.num_sub_batches)]
        chosen = torch.cat(draws)[:m]
    else:
        chosen = torch.arange(m, device=b.index.device)
    rows = pair_t[chosen].reshape(-1)
    n_unique = int(torch.unique(rows).numel()) if rows.numel() else 0
    metrics = {
        "shuffle_r1/kept_pair_frac": _frac(m, possible, device),
        "shuffle_r1/unique_row_frac": _frac(n_unique, rows.numel(), device),
        "shuffle_r1/pair_weight_mean": (weights.mean().float() if m else _scalar(0.0, device)),
    }
    return FilterResult(rows=rows, response_mask=mask[rows], metrics=metrics)


@hookimpl
def register_batch_filters(register):
    register(
        name="dynamic_sampling",
        fn=dynamic_sampling,
        params=DynamicSamplingParams,
        paper="2503.14476",
        title="DAPO dynamic sampling: drop groups whose rewards are all equal",
        formula="keep group g iff max_i r_i != min_i r_i (0 < #correct < G), or |g| = 1",
        status=STABLE,
        requires=("scores",),
        metrics=("dynamic_sampling/kept_group_frac", "dynamic_sampling/kept_frac", "dynamic_sampling/num_kept_groups"),
        reference="verl-recipe dapo ray_trainer filter_groups (kept: np.std(metric) > 0 or len == 1)",
        notes=(
            "scores are the per-response values of verl's algorithm.filter_groups.metric (acc or score). "
            "Equality is exact (max == min), which is verl's std > 0 without floating-point round-off. The "
            "refill loop (generate more batches until train_batch_size groups are kept, up to "
            "max_num_gen_batches) is the trainer's: this filter only selects and reports kept fractions."
        ),
    )
    register(
        name="simpletir",
        fn=simpletir,
        params=SimpleTIRParams,
        paper="2509.02479",
        title="SimpleTIR: mask trajectories with void turns out of the loss",
        formula="loss_mask = response_mask * (1 - void_turn_i); group statistics unchanged",
        status=STABLE,
        requires=("void_turn",),
        metrics=("simpletir/void_frac", "simpletir/masked_frac", "simpletir/masked_group_frac"),
        reference="ltzheng/SimpleTIR simpletir_ray_trainer.py (loss_mask *= void_turn_mask) + agent_utils.py",
        notes=(
            "void_turn [B] bool (True: the trajectory has a turn with neither a complete code block nor "
            "\\boxed{}) comes from the agent loop. Run after the advantage estimator: masked trajectories keep "
            "their place in the group baseline (the reference's choice) and every row is returned, only "
            "response_mask changes (a masked row adds nothing to token-mean denominators). min_n (default 0: "
            "off) also masks whole groups with fewer than min_n unmasked responses; the reference's min_n = 4 "
            "is a different, pre-estimator rule (remove_clip: drop prompts with fewer than min_n non-truncated "
            "responses from the batch). The arXiv id 2509.02479 is not verified."
        ),
    )
    register(
        name="gtpo_entropy_filter",
        fn=gtpo_entropy_filter,
        params=GTPOFilterParams,
        paper="2508.03772",
        title="GTPO entropy filter: zero the advantage of high-entropy completions, penalise the rest",
        formula="H_i = mean_t H_it; A_i = 0 if H_i > 0.7 else A_i - 0.1 H_i",
        status=STABLE,
        requires=("entropy",),
        metrics=("gtpo_filter/dropped_frac", "gtpo_filter/entropy_mean"),
        reference="winstonsmith1897/GTPO gtpo/gtpo_training.py (ENT_THRESHOLD = 0.7, ENT_SCALE = 0.1)",
        notes=(
            "entropy must be the current policy's full-vocabulary entropy (the reference uses the current "
            "logits); at the start of an on-policy step the old-log-prob pass's entropy is the same. H_i is "
            "the token mean over the completion's valid tokens. A dropped completion keeps its tokens in the "
            "mask (advantage 0: no gradient, but it counts in token-mean denominators). Returns new advantages "
            "for every row. The paper-vs-code constants (0.7 ~ ln 2) are not verified; defaults are the code's."
        ),
    )
    register(
        name="d3s",
        fn=d3s,
        params=D3SParams,
        paper="2509.22115",
        title="D³S: dynamic dual-level down-sampling (max-variance samples, top-|A|H tokens)",
        formula="keep argmax_{|S|=N} Var(A_S) per group, then top-K of |A| H tokens; [N,K](p) = (1-p)[N,K]_init + p[N,K]_final",
        status=EXPERIMENTAL,
        requires=("entropy",),
        metrics=("d3s/progress", "d3s/n_frac", "d3s/k_frac", "d3s/kept_sample_frac", "d3s/kept_token_frac",
                 "d3s/adv_var_before", "d3s/adv_var_after"),
        reference="none (supplementary material only); catalogue §4.1 from the paper",
        notes=(
            "Experimental: no public code and no published defaults. n_* and k_* are FRACTIONS (of the group's "
            "responses and of the kept responses' valid tokens); the defaults n 0.5 -> 1.0, k 0.2 -> 0.5 are "
            "ASSUMED. N = ceil(n_frac * valid responses of the group) (>= 1); responses with zero advantage are "
            "never selected (they add nothing to the variance), so a group with fewer non-zero responses than N "
            "keeps all of them and an all-zero group is dropped. The max-variance subset is found exactly by "
            "scanning top-j + bottom-(N-j). scope='batch' selects over the whole batch (cross-group variant, "
            "no re-normalisation). The token top-K is taken over all kept responses together (ties: earlier "
            "tokens first). entropy is the old-log-prob pass's. p = ctx.step / ctx.total_steps, required unless "
            "the schedule is constant. Row advantage = token mean of A."
        ),
    )
    register(
        name="shuffle_r1",
        fn=shuffle_r1,
        params=ShuffleR1Params,
        paper="2508.05612",
        title="Shuffle-R1: pairwise trajectory sampling + advantage-based batch shuffle",
        formula="pairs (o_(i), o_(2N-i+1)), keep alpha N; S sub-batches drawn with P(pair) = (|A_1|+|A_2|)/sum W",
        status=EXPERIMENTAL,
        metrics=("shuffle_r1/kept_pair_frac", "shuffle_r1/unique_row_frac", "shuffle_r1/pair_weight_mean"),
        reference="none (the repository held only a README); catalogue §4.2 from a secondary paper note",
        notes=(
            "Experimental (alpha = 0.5 and S = 8 from a paper note, no code). Per group of 2N responses sorted "
            "by advantage, pair i-th largest with i-th smallest (an odd group's median is unpaired) and keep "
            "max(1, floor(alpha N)) pairs. ABS: S sub-batches of ceil(M/S) pairs (M = kept pairs), each drawn "
            "without replacement with probability W/sum(W) (uniform among zero-weight pairs once positive ones "
            "are exhausted), independently across sub-batches, truncated to M pairs; rows come out pair by pair, "
            "sub-batch by sub-batch (split them into S consecutive mini-batches). RNG: ctx.generator. Rows may "
            "REPEAT: a duplicated response is trained on once per copy and its tokens count once per copy in "
            "token-mean denominators (token_count must be taken from the returned response_mask), so "
            "high-contrast pairs are up-weighted. The estimator's statistics (group or batch mean-std) are "
            "whatever ran before; shuffle=False gives PTS only."
        ),
    )
