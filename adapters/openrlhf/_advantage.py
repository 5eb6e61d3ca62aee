"""The advantage step's call site: OpenRLHF's ``RemoteExperienceMaker.compute_advantages_and_returns`` (imported
only in OpenRLHF's trainer worker, or by tests). The order, the refusals and the metrics are core's
:class:`~stablerl.steps.AdvantageStep` (shaper -> estimator -> batch filter -> state); this module translates the
rollout batch into one :class:`~stablerl.steps.BatchRecord` and the result back:

1. OpenRLHF's first step, once: rewards promoted to >= fp32, its ``apply_length_penalties``; the record holds one
   reward per response (``scores``), OpenRLHF's prompt groups (``index``) and the experiences (``host``, read by
   the adapter's providers); a **reward shaper** replaces ``experience.rewards``;
2. the estimator: OpenRLHF's own method for its names (``estimate=``, its length penalties off: they ran once);
   a stablerl one on the rewards placed on each row's last valid token, then OpenRLHF's own reward assembly:
   ``A = clamp(A_stablerl) + cumsum_reversed(-kl_coef * kl)`` (the clamp only when ``--reward.clip_range`` was
   given; the KL reward after the baseline, never normalised), ``info["return"]``, no global whitening;
3. a **batch filter** on the ``[N, T]`` advantages, with the reward function's ``scores`` when every row has them
   (what OpenRLHF's own dynamic filtering reads), else the rewards before shaping: the batch is already split into
   the DP ranks' micro-batches, so a dropped row or token gets ``action_mask`` 0; resamplers are refused.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from openrlhf.models.utils import compute_reward
from openrlhf.trainer.ppo_utils.length_penalty import apply_length_penalties
from stablerl import ADVANTAGE_ESTIMATOR, POLICY_LOSS, Context, get_spec
from stablerl.frameworks import as_params, log_effective_settings
from stablerl.ops import group_ids, group_stats, scores_on_last_token
from stablerl.steps import AdvantageSelection, AdvantageStep, BatchRecord

from ._flags import ARGS_KEY, FILTER_FLAG, NAME
from ._groups import group_index, tag_groups
from ._inputs import drop_old_pass_stats, from_info, padded
from ._selection import selection_from_args

WHY_NO_RESAMPLING = ("for shuffle_r1 set shuffle=false: OpenRLHF's batch is already split into the DP ranks' "
                     "micro-batches at compute_advantages_and_returns, so rows can be dropped (action_mask 0) but not "
                     "duplicated")


@contextlib.contextmanager
def _length_penalties_off(args):
    """OpenRLHF's estimator code applies the length penalties itself; they ran before the step."""
    keys = ("overlong_buffer_len", "stop_properly_penalty_coef")
    saved = {k: getattr(args.reward, k) for k in keys if hasattr(args.reward, k)}
    for k in saved:
        setattr(args.reward, k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(args.reward, k, v)


def _penalised_rewards(experiences, args) -> torch.Tensor:
    """As OpenRLHF's method starts: rewards promoted to >= fp32, then its length penalties; all rows' rewards."""
    for e in experiences:
        e.rewards = e.rewards.to(torch.promote_types(e.rewards.dtype, torch.float32))
    apply_length_penalties(experiences, args)
    return torch.cat([e.rewards.reshape(-1) for e in experiences])


def _batch_advantages(experiences, width: int) -> torch.Tensor:
    """The experiences' advantages as one ``[N, width]`` batch (>= fp32, 0 outside the action mask)."""
    dtype = torch.promote_types(experiences[0].advantages.dtype, torch.float32)
    return padded([e.advantages for e in experiences], width, dtype) * padded([e.action_mask for e in experiences],
                                                                                width, dtype)


def _sizes(experiences) -> list[int]:
    return [len(e.index) for e in experiences]


class OpenRLHFAdvantageStep(AdvantageStep):
    """Core's advantage step with OpenRLHF's reward assembly around a stablerl estimator and OpenRLHF's ``scores``
    for the batch filter (the module docstring, 2 and 3)."""

    def __init__(self, selection: AdvantageSelection, maker, filter_scores: torch.Tensor, clip_range, **kwargs):
        super().__init__(selection, **kwargs)
        self.maker, self.filter_scores, self.clip_range = maker, filter_scores, clip_range

    def shape(self, record: BatchRecord) -> dict:
        metrics = super().shape(record)
        for e, r in zip(record.host, record.scores.split(_sizes(record.host))):
            e.rewards = r.to(e.rewards.dtype)  # the shaped rewards: what the estimator and the loss's scores read
        return metrics

    def estimate(self, record: BatchRecord, extras=None):
        experiences, mask = record.host, record.response_mask
        rewards, sizes = record.scores, _sizes(record.host)
        n = int(self.maker.strategy.args.rollout.n_samples_per_prompt)
        if n > 1:  # OpenRLHF's info["group_reward_std"] (logging only): the per-prompt std, per row
            std = group_stats(rewards, group_ids(record.index))[1].to(rewards.dtype)
            for experience, row_std in zip(experiences, std.split(sizes)):
                experience.info["group_reward_std"] = row_std
        record.token_level_rewards = scores_on_last_token(rewards, mask) * mask
        try:
            advantages, returns, metrics = super().estimate(record, extras)
        finally:
            record.token_level_rewards = None
        for experience, adv, ret in zip(experiences, advantages.split(sizes), returns.split(sizes)):
            mask = experience.action_mask
            adv, ret = adv[:, :mask.shape[1]], ret[:, :mask.shape[1]]
            if self.clip_range:  # OpenRLHF clamps the baseline-shaped reward to --reward.clip_range before adding KL
                adv, ret = adv.clamp(*self.clip_range), ret.clamp(*self.clip_range)
            # the KL reward after the baseline, by OpenRLHF's own code (zero shaped reward: the KL part only)
            kl = experience.kl if experience.kl is not None else torch.zeros_like(adv)
            if self.selection.reads("teacher_log_prob"):  # the reference is the teacher: its KL is the estimator's
                kl = torch.zeros_like(adv)
            kl_reward = compute_reward(torch.zeros(mask.shape[0], dtype=adv.dtype, device=adv.device),
                                       self.maker.kl_ctl.value, kl, action_mask=mask, reward_clip_range=None)
            kl_returns = self.maker.get_cumulative_returns(kl_reward, mask, 1.0)
            valid = mask.to(adv.dtype)
            experience.advantages = (adv + kl_returns) * valid
            experience.returns = (ret + kl_returns) * valid
            first = mask.long().argmax(dim=1, keepdim=True)  # the return seen from the first response token
            experience.info["return"] = experience.returns.gather(1, first).squeeze(1)
            experience.kl = None
        return _batch_advantages(experiences, record.response_mask.shape[1]), None, metrics

    def filter(self, record: BatchRecord, advantages: torch.Tensor):
        shaped, record.scores = record.scores, self.filter_scores
        try:
            return super().filter(record, advantages)
        finally:
            record.scores = shaped


def advantages_and_returns(adapter, maker, experiences, openrlhf_method: Callable):
    """``compute_advantages_and_returns``: the advantage step (OpenRLHF's method alone when nothing stablerl is
    selected); then what the loss reads later: the old-pass entropy (dropped if no loss reads it) and the groups."""
    sel = selection_from_args(maker.strategy.args)
    if sel.advantage_estimator is None and not sel.has_extensions:
        experiences = openrlhf_method(experiences)
    else:
        experiences = _advantage_step(adapter, maker, experiences, sel, openrlhf_method)
    # used by the advantage step only: not sent on (sum_pi_squared never; the entropy unless the loss reads it)
    drop_old_pass_stats(experiences, ("sum_pi_squared",) if sel.requires(POLICY_LOSS, "old_entropy")
                        else ("entropy", "sum_pi_squared"))
    if sel.requires(POLICY_LOSS, "index"):  # the loss's prompt groups, through the replay buffer
        tag_groups(experiences, int(maker.strategy.args.rollout.n_samples_per_prompt))
    return experiences


@torch.no_grad()
def _advantage_step(adapter, maker, experiences, sel, openrlhf_method: Callable):
    args = maker.strategy.args
    rewards = _penalised_rewards(experiences, args)
    width = max(int(e.action_mask.shape[1]) for e in experiences)
    record = BatchRecord(adapter, response_mask=padded([e.action_mask for e in experiences], width, rewards.dtype),
                         index=group_index(experiences, int(args.rollout.n_samples_per_prompt)), scores=rewards,
                         host=experiences)
    record.produced[ARGS_KEY] = args  # the teacher provider reads --algo.kl.estimator
    filter_scores = (torch.cat([e.scores.reshape(-1) for e in experiences]).to(rewards.dtype)
                     if all(e.scores is not None for e in experiences) else rewards)
    params, extras = {}, None
    if sel.advantage_estimator is not None:
        settings = sel.advantage_settings()  # one precedence rule; printed once per process
        log_effective_settings(NAME, get_spec(ADVANTAGE_ESTIMATOR, sel.advantage_estimator), settings)
        params = as_params(settings)
        if sel.reward_components:  # the reward function's extra_logs named on the command line (GDPO)
            extras = {"reward_components": {key: from_info(key, experiences) for key in sel.reward_components}}
            if sel.reward_weights:
                extras["reward_weights"] = list(sel.reward_weights)
    seed = int(getattr(getattr(args, "train", None), "seed", 0) or 0)

    def ctx(kind: str, name: str) -> Context:  # a stablerl estimator keeps no state here: a fresh context per call
        return Context() if kind == ADVANTAGE_ESTIMATOR else adapter.driver_state.context(kind, name, seed=seed)

    def openrlhf_estimate(record: BatchRecord) -> torch.Tensor:
        with _length_penalties_off(args):
            record.host = openrlhf_method(record.host)
        return _batch_advantages(record.host, width)

    step = OpenRLHFAdvantageStep(
        sel.advantage_selection(params), maker, filter_scores, sel.reward_clip_range, ctx=ctx,
        state=adapter.driver_state, filter_key=FILTER_FLAG,
        why_no_resampling=WHY_NO_RESAMPLING)
    result = step.run(record, estimate=None if sel.advantage_estimator else openrlhf_estimate, extras=extras)
    experiences = record.host
    if result.dropped is not None:  # the filter's mask: dropped rows / tokens get action_mask 0
        sizes = _sizes(experiences)
        for e, m, a in zip(experiences, result.response_mask.split(sizes), result.advantages.split(sizes)):
            m, a = m[:, :e.action_mask.shape[1]], a[:, :e.action_mask.shape[1]]
            e.action_mask, e.advantages = m.to(e.action_mask.dtype), a.to(e.advantages.dtype)
            if e.returns is not None:
                e.returns = e.returns * m.to(e.returns.dtype)
    adapter.last_metrics = {f"stablerl/{k}": float(v) for k, v in result.metrics.items()}
    for e in experiences:  # OpenRLHF logs info entries per sample
        for k, v in adapter.last_metrics.items():
            e.info[k] = torch.full((len(e.index),), v)
    return experiences


__all__ = ["advantages_and_returns", "OpenRLHFAdvantageStep", "WHY_NO_RESAMPLING"]
