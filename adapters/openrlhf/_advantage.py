"""The advantage step in OpenRLHF's ``RemoteExperienceMaker.compute_advantages_and_returns`` (imported only in
OpenRLHF's trainer worker, or by tests), on the whole rollout batch, in OpenRLHF's order:

1. rewards promoted to >= fp32, OpenRLHF's ``apply_length_penalties``; a **reward shaper** then replaces
   ``experience.rewards`` (the estimator runs with the length penalties off: they ran once already);
2. the estimator: OpenRLHF's method for its own names; for a stablerl one (:func:`stable_advantages_and_returns`)
   ``stablerl.compute_advantage`` once, rewards on each row's last valid token, OpenRLHF's prompt groups, then
   OpenRLHF's own KL reward after the baseline: ``A = clamp(A_stablerl) + cumsum_reversed(-kl_coef * kl)``
   (the clamp only when ``--reward.clip_range`` was given), ``info["return"]``, no global whitening;
3. a **batch filter** on the ``[N, T]`` advantages: the batch is already split into the DP ranks' micro-batches,
   so a dropped row or token gets ``action_mask`` 0 (core's ``apply_filter_result``); resamplers are refused.

Shapers and filters read ``index``, ``scores``, ``lengths``, the old-log-prob pass's ``entropy`` and the reward
function's per-response ``extra_logs`` (OpenRLHF copies them into ``experience.info``); estimators also the old
pass's log-probs (``experience.action_log_probs``) as ``old_log_prob`` and its ``sum_pi_squared``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import torch

import stablerl
from openrlhf.models.utils import compute_reward
from openrlhf.trainer.ppo_utils.length_penalty import apply_length_penalties
from stablerl import BATCH_FILTER, REWARD_SHAPER, Context, MissingInputError, StableRLError
from stablerl.contracts import OPTIONAL_INPUTS
from stablerl.frameworks import apply_filter_result, as_params, log_effective_settings
from stablerl.ops import group_ids, group_stats, scores_on_last_token
from stablerl.state import StateStore

from ._groups import group_index, tag_groups
from ._inputs import drop_old_pass_stats, padded, padded_old_pass_stat
from ._selection import Selection, selection_from_args
from ._spec import OPENRLHF, REWARD_FUNCTION_INPUTS

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


def from_info(what: str, experiences, kind: str, name: str) -> torch.Tensor:
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


def _inputs(kind: str, name: str, experiences) -> dict[str, torch.Tensor]:
    """The declared inputs (and the reward function's optional per-response values that are present)."""
    spec = stablerl.get_spec(kind, name)
    out: dict[str, torch.Tensor] = {}
    for what in spec.requires:
        if what in ("index", "scores"):
            continue
        if what == "lengths":
            out[what] = torch.cat([e.action_mask.sum(-1) for e in experiences]).float()
        elif what == "entropy":  # the old-log-prob pass's, [N, T_max] (._inputs)
            out[what] = padded_old_pass_stat(experiences, max(int(e.action_mask.shape[1]) for e in experiences))
        else:  # resolve() refused everything that is neither here nor a reward-function value
            out[what] = from_info(what, experiences, kind, name)
    for what in REWARD_FUNCTION_INPUTS:
        if what not in out and all(what in (e.info or {}) for e in experiences):
            out[what] = from_info(what, experiences, kind, name)
    return out


def _penalised_rewards(experiences, args) -> torch.Tensor:
    """As OpenRLHF's method starts: rewards promoted to >= fp32, then its length penalties; all rows' rewards."""
    for e in experiences:
        e.rewards = e.rewards.to(torch.promote_types(e.rewards.dtype, torch.float32))
    apply_length_penalties(experiences, args)
    return torch.cat([e.rewards.reshape(-1) for e in experiences])


def shape(maker, experiences, name: str, params: dict) -> tuple[dict[str, float], torch.Tensor]:
    """Replace ``experience.rewards`` by the shaped rewards (after OpenRLHF's fp32 promotion and length penalties);
    returns the metrics and the rewards before shaping."""
    args = maker.strategy.args
    scores = _penalised_rewards(experiences, args)
    shaped, metrics = stablerl.shape_rewards(
        name, scores=scores, index=group_index(experiences, int(args.rollout.n_samples_per_prompt)),
        ctx=_context(args, REWARD_SHAPER, name), **_inputs(REWARD_SHAPER, name, experiences), **params,
    )
    for e, r in zip(experiences, shaped.split([len(e.index) for e in experiences])):
        e.rewards = r.to(e.rewards.dtype)
    return metrics, scores


def filter_rows(maker, experiences, name: str, params: dict, scores: Optional[torch.Tensor]) -> dict[str, float]:
    """Zero ``action_mask``, ``advantages`` and ``returns`` of the rows / tokens the filter drops."""
    args = maker.strategy.args
    width = max(int(e.action_mask.shape[1]) for e in experiences)
    adv_dtype = torch.promote_types(experiences[0].advantages.dtype, torch.float32)
    mask = padded([e.action_mask for e in experiences], width, adv_dtype)
    adv = padded([e.advantages for e in experiences], width, adv_dtype) * mask
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
        m, a = m[:, :e.action_mask.shape[1]], a[:, :e.action_mask.shape[1]]
        e.action_mask, e.advantages = m.to(e.action_mask.dtype), a.to(e.advantages.dtype)
        if e.returns is not None:
            e.returns = e.returns * m.to(e.returns.dtype)
    return filtered.metrics


def advantages_and_returns(maker, experiences, openrlhf_method: Callable):
    """``compute_advantages_and_returns``: shaper, estimator (``openrlhf_method`` for OpenRLHF's names), filter;
    then what the loss reads later: the old-pass entropy (dropped if no loss reads it) and the prompt groups."""
    sel = selection_from_args(maker.strategy.args)
    estimate = (openrlhf_method if sel.advantage_estimator is None
                else functools.partial(stable_advantages_and_returns, maker, selection=sel))
    experiences = (advantages_with_extensions(maker, experiences, sel, estimate) if sel.has_extensions
                   else estimate(experiences))
    # used by the advantage step only: not sent on (sum_pi_squared never; the entropy unless the loss reads it)
    drop_old_pass_stats(experiences, ("sum_pi_squared",) if sel.requires(stablerl.POLICY_LOSS, "old_entropy")
                        else ("entropy", "sum_pi_squared"))
    if sel.requires(stablerl.POLICY_LOSS, "index"):  # the loss's prompt groups, through the replay buffer
        tag_groups(experiences, int(maker.strategy.args.rollout.n_samples_per_prompt))
    return experiences


@torch.no_grad()
def advantages_with_extensions(maker, experiences, selection: Selection, estimate: Callable):
    """Shaper, then ``estimate(experiences)`` (OpenRLHF's method or the stablerl estimator), then filter."""
    args = maker.strategy.args
    metrics, scores = {}, None
    if selection.reward_shaper is not None:
        metrics, scores = shape(maker, experiences, selection.reward_shaper, selection.reward_shaper_params)
    with _length_penalties_off(args) if scores is not None else contextlib.nullcontext():
        experiences = estimate(experiences)
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


@torch.no_grad()
def stable_advantages_and_returns(maker, experiences, selection: Selection):
    args = maker.strategy.args
    n = int(args.rollout.n_samples_per_prompt)
    rewards = _penalised_rewards(experiences, args)
    sizes = [len(experience.index) for experience in experiences]
    index = group_index(experiences, n)
    if n > 1:  # OpenRLHF's info["group_reward_std"] (logging only): the per-prompt std, per row
        std = group_stats(rewards, group_ids(index))[1].to(rewards.dtype)
        for experience, row_std in zip(experiences, std.split(sizes)):
            experience.info["group_reward_std"] = row_std

    width = max(int(e.action_mask.shape[1]) for e in experiences)
    mask = padded([e.action_mask for e in experiences], width, rewards.dtype)
    settings = selection.advantage_settings()  # one precedence rule; printed once per process
    spec = stablerl.get_spec(stablerl.ADVANTAGE_ESTIMATOR, selection.advantage_estimator)
    log_effective_settings(OPENRLHF, spec, settings)
    extra = {stat: padded_old_pass_stat(experiences, width, stat) for stat in ("entropy", "sum_pi_squared")
             if stat in spec.requires}
    if "old_log_prob" in spec.requires:  # the old-log-prob pass's log-probs (0 outside the action mask)
        if any(e.action_log_probs is None for e in experiences):
            raise MissingInputError(f"advantage estimator {selection.advantage_estimator!r} needs old_log_prob, but an "
                                    "experience has no action_log_probs (OpenRLHF's old-log-prob pass)")
        extra["old_log_prob"] = padded([e.action_log_probs for e in experiences], width, torch.float32) * mask
    if selection.reward_components:  # the reward function's extra_logs named on the command line (GDPO)
        extra["extras"] = {"reward_components": {
            key: from_info(key, experiences, stablerl.ADVANTAGE_ESTIMATOR, selection.advantage_estimator)
            for key in selection.reward_components}}
        if selection.reward_weights:
            extra["extras"]["reward_weights"] = list(selection.reward_weights)
    advantages, returns = stablerl.compute_advantage(
        selection.advantage_estimator, token_level_rewards=scores_on_last_token(rewards, mask) * mask,
        response_mask=mask, index=index, ctx=stablerl.Context(), **extra, **as_params(settings))

    clip_range = selection.reward_clip_range
    for experience, adv, ret in zip(experiences, advantages.split(sizes), returns.split(sizes)):
        mask = experience.action_mask
        adv, ret = adv[:, :mask.shape[1]], ret[:, :mask.shape[1]]
        if clip_range:  # OpenRLHF clamps the baseline-shaped reward to --reward.clip_range before adding KL
            adv, ret = adv.clamp(*clip_range), ret.clamp(*clip_range)
        # the KL reward after the baseline, by OpenRLHF's own code (zero shaped reward: the KL part only)
        kl = experience.kl if experience.kl is not None else torch.zeros_like(adv)
        kl_reward = compute_reward(torch.zeros(mask.shape[0], dtype=adv.dtype, device=adv.device),
                                   maker.kl_ctl.value, kl, action_mask=mask, reward_clip_range=None)
        kl_returns = maker.get_cumulative_returns(kl_reward, mask, 1.0)
        valid = mask.to(adv.dtype)
        experience.advantages = (adv + kl_returns) * valid
        experience.returns = (ret + kl_returns) * valid
        first = mask.long().argmax(dim=1, keepdim=True)  # the return seen from the first response token
        experience.info["return"] = experience.returns.gather(1, first).squeeze(1)
        experience.kl = None
    return experiences


__all__ = ["advantages_and_returns", "stable_advantages_and_returns", "advantages_with_extensions", "shape",
           "filter_rows", "from_info", "LAST_METRICS", "STATE"]
