"""Framework batches meeting stablerl algorithms: machinery every adapter shares.

* :func:`apply_filter_result`: verl, TRL and OpenRLHF have split the batch over workers / micro-batches by
  the time a filter runs, so rows cannot be removed or duplicated there: a dropped row or token keeps its
  place with loss mask 0 and advantage 0. The adapter only reads its batch into ``[N, T]`` tensors and
  writes the result back.
* :class:`GroupBatchSampler` / :func:`check_whole_groups`: a loss that takes prompt groups (``index``) needs whole
  groups in every loss call, where a framework's data loader shuffles single rows.
* :func:`balanced_group_partitions`: a framework that balances its batch over data-parallel ranks by token count
  (verl's ``trainer.balance_batch``) moves single rows; for such a loss it balances whole groups instead.
* :func:`loss_inputs` / :func:`pending_loss_inputs`: a framework calls its loss with its own arguments
  only; the inputs a stablerl loss declares beyond them (entropy, token ids, group ids...) are gathered
  at the call site and handed to the loss through this scoped channel.
* :func:`advantages_from_scores`: a stablerl estimator on one score per response (TRL and OpenRLHF score whole
  responses; verl's token-level rewards already have this layout).
* :func:`declared_inputs`: the inputs an algorithm requires, each from where the framework keeps it, or an
  error saying how to provide it.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch

from .contracts import OPTIONAL_INPUTS, AlgorithmSpec, FilterResult
from .params import MissingInputError, StableRLError


@dataclass(frozen=True)
class FilteredBatch:
    """The fixed-size batch after a filter: ``response_mask`` [N, T] (input dtype) is 1 only on tokens the
    filter kept, ``advantages`` [N, T] (input dtype) is 0 outside it, ``dropped`` [N] marks rows left without
    a token, ``metrics`` are the filter's own plus ``filter/kept_row_frac`` and ``filter/kept_token_frac``."""

    response_mask: torch.Tensor
    advantages: torch.Tensor
    dropped: torch.Tensor
    metrics: dict


def apply_filter_result(result: FilterResult, response_mask: torch.Tensor, advantages: torch.Tensor, *,
                        selected_by: str, why_no_resampling: str) -> FilteredBatch:
    """Apply ``result`` (rows into the batch, their masks, optionally new advantages) to the ``[N, T]`` batch.

    Kept rows go back to their own places (a filter may return them in any order); a row returned twice is
    refused, naming ``selected_by`` (the config key that chose the filter) and ``why_no_resampling`` (why this
    framework cannot duplicate rows). A filter only removes tokens: the new mask is the filter's mask AND the
    old one. Advantages are the filter's where it gave some, else the old ones, and 0 on every removed token.
    """
    mask, adv = response_mask, advantages
    kept = result.rows.to(mask.device).long().reshape(-1)
    if kept.numel() != torch.unique(kept).numel():
        raise StableRLError(f"{selected_by} returned repeated rows (a resampling sampler); {why_no_resampling}")
    new_mask = torch.zeros_like(mask)
    new_mask[kept] = result.response_mask.to(mask.device, mask.dtype)
    new_mask = ((new_mask * mask) > 0).to(mask.dtype)  # a filter only removes tokens
    new_adv = torch.zeros_like(adv)
    new_adv[kept] = adv[kept] if result.advantages is None else result.advantages.to(adv.device, adv.dtype)
    new_adv = new_adv * new_mask.to(adv.dtype)
    row_kept = new_mask.sum(-1) > 0  # rows left without a token (e.g. simpletir's void rows) count as dropped
    had = mask.sum(-1) > 0
    metrics = dict(result.metrics)
    metrics["filter/kept_row_frac"] = float((row_kept & had).sum() / had.sum().clamp(min=1))
    metrics["filter/kept_token_frac"] = float(new_mask.sum() / mask.sum().clamp(min=1))
    return FilteredBatch(response_mask=new_mask, advantages=new_adv, dropped=~row_kept, metrics=metrics)


class GroupBatchSampler:
    """A ``batch_sampler`` whose batches of ``batch_size`` positions are made of whole prompt groups: each group
    contiguous, groups in random order (``shuffle``: torch's default generator, as the ``RandomSampler`` it
    replaces) or first-seen order, a fresh order every epoch.

    ``group_ids[i]`` / ``group_sizes[i]``: the group of position i and that group's full size. At iteration a group
    with fewer positions than its size (``incomplete_hint`` says why that happens and what to set) or a
    ``batch_size`` that is not a multiple of a group's size raises, in the framework's words (``batch_size_key``,
    ``group_size_key``)."""

    def __init__(self, group_ids: Sequence[int], group_sizes: Sequence[int], batch_size: int, shuffle: bool,
                 drop_last: bool, *, incomplete_hint: str = "", batch_size_key: str = "batch_size",
                 group_size_key: str = "group size") -> None:
        self.group_ids, self.group_sizes = [int(g) for g in group_ids], [int(n) for n in group_sizes]
        self.batch_size, self.shuffle, self.drop_last = int(batch_size), bool(shuffle), bool(drop_last)
        self.incomplete_hint, self.batch_size_key, self.group_size_key = incomplete_hint, batch_size_key, group_size_key

    def _order(self) -> list[int]:
        groups: dict[int, list[int]] = {}
        sizes: dict[int, int] = {}
        for position, (gid, size) in enumerate(zip(self.group_ids, self.group_sizes)):
            groups.setdefault(gid, []).append(position)
            sizes[gid] = size
        for gid, rows in groups.items():
            if len(rows) != sizes[gid]:
                raise StableRLError(f"prompt group {gid} has {len(rows)} of its {sizes[gid]} responses here"
                                    + (f": {self.incomplete_hint}" if self.incomplete_hint else ""))
            if self.batch_size % sizes[gid]:
                raise StableRLError(
                    f"{self.batch_size_key}={self.batch_size} is not a multiple of {self.group_size_key}={sizes[gid]}: "
                    "the selected stablerl policy loss takes prompt groups (index) and needs whole groups in every "
                    "micro-batch")
        keys = list(groups)
        if self.shuffle:
            keys = [keys[i] for i in torch.randperm(len(keys)).tolist()]
        return [position for key in keys for position in groups[key]]

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            if len(batch) == self.batch_size or not self.drop_last:
                yield batch

    def __len__(self) -> int:
        full, rest = divmod(len(self.group_ids), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)


def check_whole_groups(group_ids: torch.Tensor, group_sizes: torch.Tensor, why: str = "") -> None:
    """Raise unless every group in ``group_ids`` [N] appears exactly ``group_sizes`` [N] (its size) times: a loss
    call that takes prompt groups sees whole groups only (``why``: how a group could have been split)."""
    unique, counts = torch.unique(group_ids, return_counts=True)
    want = torch.stack([group_sizes[group_ids == g][0] for g in unique])
    partial = unique[counts != want].tolist()
    if partial:
        raise StableRLError(f"prompt groups {partial} are split across micro-batches: the selected stablerl policy "
                            f"loss needs whole groups per loss call" + (f" ({why})" if why else ""))


def balanced_group_partitions(group_ids: Sequence[Any], workloads: Sequence[float], k: int, *,
                              balance_key: str = "", group_size_key: str = "group size") -> list[list[int]]:
    """``k`` partitions of the row positions 0..N-1, each made of whole prompt groups (``group_ids[i]``: row i's
    group, any hashable) and each with the same number of rows, balancing the summed ``workloads`` (one per row,
    e.g. token counts): greedy longest-processing-time over the groups, heaviest first, each to the lightest
    partition that still has room.

    Within a partition the groups stay contiguous (each in its rows' original order), lighter groups at both ends
    (verl's order for pipeline bubbles). Raises, naming ``balance_key`` (the setting that asked for balancing) and
    ``group_size_key``, when the groups cannot be dealt out as whole groups in equal shares: a group count that is
    not a multiple of ``k``, or groups of unequal sizes that do not add up to equal shares."""
    if k < 1:
        raise StableRLError(f"cannot partition a batch over {k} ranks")
    if len(group_ids) != len(workloads):
        raise StableRLError(f"{len(group_ids)} group ids but {len(workloads)} workloads")
    rows: dict[Any, list[int]] = {}
    for position, gid in enumerate(group_ids):
        rows.setdefault(gid, []).append(position)
    groups = list(rows)
    first = {g: n for n, g in enumerate(groups)}
    where = f" ({balance_key})" if balance_key else ""
    if len(groups) % k:
        raise StableRLError(
            f"{len(groups)} prompt groups cannot be dealt out whole, in equal shares, over {k} data-parallel ranks"
            f"{where}: the selected stablerl policy loss takes prompt groups (index) and needs whole groups on every "
            f"rank; make the number of prompts per batch a multiple of {k}")
    per_part, rows_per_part = len(groups) // k, len(group_ids) // k
    load = {g: float(sum(float(workloads[i]) for i in rows[g])) for g in groups}
    parts: list[list[Any]] = [[] for _ in range(k)]
    sums, sizes = [0.0] * k, [0] * k
    for g in sorted(groups, key=lambda g: (-load[g], first[g])):
        room = [p for p in range(k) if len(parts[p]) < per_part]
        best = min(room, key=lambda p: (sums[p], p))
        parts[best].append(g)
        sums[best] += load[g]
        sizes[best] += len(rows[g])
    if len(set(sizes)) > 1 or sizes[0] != rows_per_part:
        raise StableRLError(
            f"prompt groups of sizes {sorted({len(r) for r in rows.values()})} cannot be dealt out whole in equal "
            f"shares of {rows_per_part} rows over {k} data-parallel ranks{where}: every group needs "
            f"{group_size_key} responses")
    out = []
    for part in parts:
        part.sort(key=lambda g: (load[g], first[g]))
        ordered = part[::2] + part[1::2][::-1]
        out.append([i for g in ordered for i in rows[g]])
    return out


# (loss name, inputs) of the innermost active loss_inputs block
_PENDING: contextvars.ContextVar[Optional[tuple]] = contextvars.ContextVar("stablerl_loss_inputs", default=None)


@contextlib.contextmanager
def loss_inputs(name: str, inputs: dict) -> Iterator[dict]:
    """Hand ``inputs`` to the calls of stablerl loss ``name`` made inside the block (the adapter wraps the
    framework's call site in it; the loss reads :func:`pending_loss_inputs`).

    Reset when the block exits or raises, so nothing leaks into the next call; nested blocks (a loss called
    inside another's call) each see their own. ``inputs`` is shared, not copied: code inside the block may
    still add to it (a forward pass that computes the entropy the loss asked for)."""
    token = _PENDING.set((name, inputs))
    try:
        yield inputs
    finally:
        _PENDING.reset(token)


def pending_loss_inputs(name: Optional[str] = None) -> Optional[dict]:
    """The inputs of the innermost active :func:`loss_inputs` block if it is loss ``name``'s (any loss's when
    ``name`` is None); None outside one."""
    got = _PENDING.get()
    if got is None or (name is not None and got[0] != name):
        return None
    return got[1]


def advantages_from_scores(name: str, scores: torch.Tensor, response_mask: torch.Tensor, index: torch.Tensor, *,
                           unscorable: Optional[torch.Tensor] = None, ctx: Any = None, extras: Optional[dict] = None,
                           **params: Any) -> tuple[torch.Tensor, dict]:
    """Advantages ``[N, T]`` (float32) of estimator ``name`` from one score per response, and the per-response
    advantage's ``advantages/mean``, ``/std`` and ``/frac_zero``.

    The score sits on the last response token (verl's convention: a response's return is the sum of its token
    rewards). A row with an empty mask keeps its score on position 0, so it still counts in its group's
    statistics (it is not trained on). ``unscorable`` rows (no reward at all) each form a group of their own,
    out of the others' statistics, and get advantage 0 (TRL's rule)."""
    from .api import compute_advantage
    from .ops import last_valid_index, scores_on_last_token

    mask = response_mask.float().clone()
    mask[mask.sum(-1) == 0, 0] = 1.0
    last = last_valid_index(mask)
    if unscorable is not None and bool(unscorable.any()):
        index = index.clone()
        index[unscorable] = int(index.max()) + 1 + torch.arange(int(unscorable.sum()), device=index.device)
    adv, _ = compute_advantage(name, token_level_rewards=scores_on_last_token(scores.to(mask.dtype), mask),
                               response_mask=mask, index=index, ctx=ctx, **({"extras": extras} if extras else {}),
                               **params)
    if unscorable is not None:
        adv = torch.where(unscorable.unsqueeze(-1), torch.zeros_like(adv), adv)
    per_response = adv.gather(1, last.unsqueeze(-1)).squeeze(-1)
    metrics = {"advantages/mean": per_response.mean().item(),
               "advantages/std": per_response.std().item() if per_response.numel() > 1 else 0.0,
               "advantages/frac_zero": (per_response == 0).float().mean().item()}
    return adv.to(torch.float32), metrics


def declared_inputs(spec: AlgorithmSpec, find: Callable[[str], Any], how_to_provide: Callable[[str], str], *,
                    skip: Iterable[str] = ()) -> dict[str, Any]:
    """Each input ``spec`` requires (less ``skip``: those the adapter passes itself) as ``find(name)`` returns it;
    an input ``find`` has not (None) raises :class:`MissingInputError` with ``how_to_provide(name)``."""
    out: dict[str, Any] = {}
    for name in spec.requires:
        if name in skip:
            continue
        value = find(name)
        if value is None:
            raise MissingInputError(f"{spec.kind.replace('_', ' ')} {spec.name!r} needs input {name!r} "
                                    f"({OPTIONAL_INPUTS.get(name, '')}): {how_to_provide(name)}")
        out[name] = value
    return out


def check_supplied_inputs(spec: AlgorithmSpec, declared: Iterable[str], supplied: dict, *, declared_in: str,
                          supplied_by: str) -> dict:
    """``supplied``: the inputs a user's code returned for ``spec`` (``supplied_by``), checked against those it
    declared (``declared``, in ``declared_in``): an undeclared one raises, and so does a declared input ``spec``
    requires that was not returned."""
    declared = set(declared)
    undeclared = sorted(set(supplied) - declared)
    if undeclared:
        raise StableRLError(f"{supplied_by} returned {undeclared}, which {declared_in} does not list ({sorted(declared)})")
    needed = (set(spec.requires) & declared) - set(supplied)
    if needed:
        raise MissingInputError(f"{spec.kind.replace('_', ' ')} {spec.name!r} needs {sorted(needed)}, declared in "
                                f"{declared_in}, but {supplied_by} did not return them")
    return supplied


__all__ = ["FilteredBatch", "GroupBatchSampler", "advantages_from_scores", "apply_filter_result",
           "balanced_group_partitions",
           "check_supplied_inputs", "check_whole_groups", "declared_inputs", "loss_inputs", "pending_loss_inputs"]
