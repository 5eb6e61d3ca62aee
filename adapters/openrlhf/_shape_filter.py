"""stablerl reward shapers and batch filters inside OpenRLHF's ``RemoteExperienceMaker.compute_advantages_and_returns``.

Imported only in OpenRLHF's trainer worker (or by tests). Around the advantage step (OpenRLHF's own
estimator or a stablerl one, see ``_advantage``), on the whole rollout batch:

1. **reward shaper** (``--algo.advantage.stablerl_reward_shaper``): the per-response rewards
   ``experience.rewards`` are promoted to >= fp32 and OpenRLHF's ``apply_length_penalties`` runs
   (DAPO overlong / ProRL stop-properly), exactly as OpenRLHF's method starts; then
   ``stablerl.shape_rewards`` replaces them, with groups ``experience.index // n_samples_per_prompt``;
   then the estimator runs with the length penalties switched off for that call (they were applied
   once already). So the shaper sees the rewards OpenRLHF's baseline would have seen, and the
   estimator (and a loss that reads ``scores``) sees the shaped ones.
2. **batch filter** (``--algo.advantage.stablerl_batch_filter``): runs after the estimator on the
   ``[N, T]`` advantages. OpenRLHF's batch is already split into the DP ranks' micro-batches here,
   so rows are not removed: a dropped row (or token) gets ``action_mask = 0``, ``advantages = 0`` and
   ``returns = 0``. OpenRLHF's loss normalisers count only mask tokens and sequences with a non-empty
   mask (``utils/loss_utils.py``, the dynamic-batch replay buffer, ``aggregate_loss``), so a dropped
   row adds nothing to the loss, its gradient or its denominators. Filters that repeat rows (a
   resampler) are refused; OpenRLHF's replay buffer shuffles rows, so a filter's row order is not kept.

Inputs (``AlgorithmSpec.requires``): ``index`` (prompt groups), ``scores``, ``lengths``
(``action_mask.sum(-1)``) and per-response values of the user's reward function: OpenRLHF copies the
``extra_logs`` dict a ``--reward.remote_url`` function / agent returns into ``experience.info``, one
value per response (``correct``, ``flawed``, ``void_turn``), and ``entropy`` ``[N, T]``: the old-log-prob
pass's per-token entropy, which the adapter has that pass return when a selected algorithm declares it
(``._inputs``; the current policy's at the start of the step, as the filters' papers use it). Other
per-token inputs are refused before Ray starts (``stablerl.adapters.openrlhf.resolve_extension``).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Callable, Optional

import torch

import stablerl
from stablerl import BATCH_FILTER, REWARD_SHAPER, Context, MissingInputError, StableRLError
from stablerl.contracts import OPTIONAL_INPUTS
from stablerl.frameworks import apply_filter_result
from stablerl.state import StateStore
from openrlhf.trainer.ppo_utils.length_penalty import apply_length_penalties

from ._inputs import padded_old_entropy
from ._selection import Selection
from ._spec import REWARD_FUNCTION_INPUTS

#: per-process state: one generator per (slot, seed) and the call counter (ctx.step)
STATE = StateStore(holds="driver")
#: metrics of the last call (``stablerl/<name>/...``); also written into every experience's ``info``
LAST_METRICS: dict[str, float] = {}


def _context(args, kind: str, name: str) -> Context:
    return STATE.context(kind, name, seed=int(getattr(getattr(args, "train", None), "seed", 0) or 0))


@contextlib.contextmanager
def _length_penalties_off(args):
    """OpenRLHF's estimator code applies the length penalties itself; they ran before the shaper."""
    keys = ("overlong_buffer_len", "stop_properly_penalty_coef")
    saved = {k: getattr(args.reward, k) for k in keys if hasattr(args.reward, k)}
    for k in saved:
        setattr(args.reward, k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(args.reward, k, v)


def group_index(experiences, n: int) -> torch.Tensor:
    """OpenRLHF's prompt groups in rollout order: position in prompt order // n_samples_per_prompt."""
    indices = torch.tensor(list(itertools.chain.from_iterable(e.index for e in experiences)), dtype=torch.long)
    return torch.div(indices, n, rounding_mode="floor")


def _from_info(what: str, experiences, kind: str, name: str) -> torch.Tensor:
    values = []
    for e in experiences:
        v = (e.info or {}).get(what)
        if v is None:
            raise MissingInputError(
                f"stablerl {kind.replace('_', ' ')} {name!r} needs {what!r} ({OPTIONAL_INPUTS.get(what, '')}) "
                f"per response, but OpenRLHF's experience.info has no {what!r}: return "
                f"{{'rewards': ..., 'scores': ..., 'extra_logs': {{'{what}': ...}}}} from your --reward.remote_url "
                "reward function or agent (OpenRLHF copies extra_logs into experience.info, one value per response)"
            )
        v = torch.as_tensor(v).reshape(-1)
        if v.numel() != len(e.index):
            raise StableRLError(f"experience.info[{what!r}] has {v.numel()} values for {len(e.index)} responses")
        values.append(v)
    return torch.cat(values)


def _inputs(kind: str, name: str, experiences, skip=()) -> dict[str, torch.Tensor]:
    """The declared inputs (and the reward function's optional per-response values that are present)."""
    spec = stablerl.get_spec(kind, name)
    out: dict[str, torch.Tensor] = {}
    for what in spec.requires:
        if what in skip or what in ("index", "scores"):
            continue
        if what == "lengths":
            out[what] = torch.cat([e.action_mask.sum(-1) for e in experiences]).float()
        elif what == "entropy":  # the old-log-prob pass's, [N, T_max] (._inputs)
            out[what] = padded_old_entropy(experiences, max(int(e.action_mask.shape[1]) for e in experiences))
        else:  # resolve_extension refused everything that is neither here nor a reward-function value
            out[what] = _from_info(what, experiences, kind, name)
    for what in REWARD_FUNCTION_INPUTS:
        if what not in out and all(what in (e.info or {}) for e in experiences):
            out[what] = _from_info(what, experiences, kind, name)
    return out


def shape(maker, experiences, name: str, params: dict) -> tuple[dict[str, float], torch.Tensor]:
    """Replace ``experience.rewards`` by the shaped rewards (after OpenRLHF's fp32 promotion and length penalties);
    returns the metrics and the rewards before shaping."""
    args = maker.strategy.args
    for e in experiences:
        e.rewards = e.rewards.to(torch.promote_types(e.rewards.dtype, torch.float32))
    apply_length_penalties(experiences, args)
    scores = torch.cat([e.rewards.reshape(-1) for e in experiences])
    shaped, metrics = stablerl.shape_rewards(
        name, scores=scores, index=group_index(experiences, int(args.rollout.n_samples_per_prompt)),
        ctx=_context(args, REWARD_SHAPER, name), **_inputs(REWARD_SHAPER, name, experiences), **params,
    )
    for e, r in zip(experiences, shaped.split([len(e.index) for e in experiences])):
        e.rewards = r.to(e.rewards.dtype)
    return metrics, scores


def _padded(tensors, width: int, dtype) -> torch.Tensor:
    return torch.cat([torch.nn.functional.pad(t.to(dtype), (0, width - t.shape[1])) for t in tensors])


def filter_rows(maker, experiences, name: str, params: dict, scores: Optional[torch.Tensor]) -> dict[str, float]:
    """Zero ``action_mask``, ``advantages`` and ``returns`` of the rows / tokens the filter drops."""
    args = maker.strategy.args
    width = max(int(e.action_mask.shape[1]) for e in experiences)
    adv_dtype = torch.promote_types(experiences[0].advantages.dtype, torch.float32)
    mask = _padded([e.action_mask for e in experiences], width, adv_dtype)
    adv = _padded([e.advantages for e in experiences], width, adv_dtype) * mask
    # the reward function's "scores" (what OpenRLHF's own dynamic filtering reads) when every row has them
    if all(e.scores is not None for e in experiences):
        scores = torch.cat([e.scores.reshape(-1) for e in experiences]).to(adv_dtype)
    result = stablerl.filter_batch(
        name, advantages=adv, response_mask=mask,
        index=group_index(experiences, int(args.rollout.n_samples_per_prompt)),
        scores=scores, ctx=_context(args, BATCH_FILTER, name), **_inputs(BATCH_FILTER, name, experiences), **params,
    )
    filtered = apply_filter_result(
        result, mask, adv, selected_by=f"--algo.advantage.stablerl_batch_filter {name!r}",
        why_no_resampling="for shuffle_r1 set shuffle=false: OpenRLHF's batch is already split into the DP ranks' "
        "micro-batches at compute_advantages_and_returns, so rows can be dropped (action_mask 0) but not duplicated")
    sizes = [len(e.index) for e in experiences]
    for e, m, a in zip(experiences, filtered.response_mask.split(sizes), filtered.advantages.split(sizes)):
        t = e.action_mask.shape[1]
        m, a = m[:, :t], a[:, :t]
        e.action_mask = m.to(e.action_mask.dtype)
        e.advantages = a.to(e.advantages.dtype)
        if e.returns is not None:
            e.returns = e.returns * m.to(e.returns.dtype)
    return filtered.metrics


@torch.no_grad()
def advantages_with_extensions(maker, experiences, selection: Selection, estimate: Callable):
    """Shaper, then ``estimate(experiences)`` (OpenRLHF's method or the stablerl estimator), then filter."""
    args = maker.strategy.args
    metrics: dict[str, float] = {}
    if selection.reward_shaper is not None:
        shaper_metrics, scores = shape(maker, experiences, selection.reward_shaper, selection.reward_shaper_params)
        metrics.update(shaper_metrics)
        with _length_penalties_off(args):
            experiences = estimate(experiences)
    else:
        experiences = estimate(experiences)
        scores = None
    if selection.batch_filter is not None:
        if scores is None:  # the rewards after OpenRLHF's length penalties (before any shaper)
            scores = torch.cat([e.rewards.reshape(-1) for e in experiences]).float()
        metrics.update(filter_rows(maker, experiences, selection.batch_filter, selection.batch_filter_params, scores))
    STATE.advance()
    LAST_METRICS.clear()
    LAST_METRICS.update({f"stablerl/{k}": float(v) for k, v in metrics.items()})
    for e in experiences:  # OpenRLHF logs info entries per sample
        for k, v in LAST_METRICS.items():
            e.info[k] = torch.full((len(e.index),), v)
    return experiences


__all__ = ["advantages_with_extensions", "shape", "filter_rows", "group_index", "LAST_METRICS", "STATE"]
