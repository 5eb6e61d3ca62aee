"""A stablerl advantage estimator inside OpenRLHF's ``RemoteExperienceMaker.compute_advantages_and_returns``.

Imported only in OpenRLHF's trainer worker (or by tests). OpenRLHF's order is kept:

1. rewards promoted to >= fp32, then OpenRLHF's ``apply_length_penalties``;
2. the baseline step: the stablerl estimator replaces OpenRLHF's ``rloo``/``group_norm``/...
   branch. Scalar rewards are grouped as OpenRLHF groups them (prompt position
   ``experience.index // n_samples_per_prompt``), placed on the last valid token, and
   ``stablerl.compute_advantage`` runs once over the whole rollout batch;
3. OpenRLHF's ``compute_reward`` then adds ``-kl_coef * kl`` per token after the baseline (never
   normalised) and ``--reward.clip_range``, when given on the command line, clamps the baseline-shaped
   value (its default is not applied to a stablerl estimator: one behaviour in every framework), and OpenRLHF's
   ``get_cumulative_returns`` (gamma 1, as for every group estimator) turns the per-token KL
   reward into returns: ``A = clamp(A_stablerl) + cumsum_reversed(-kl_coef * kl)``;
4. ``info["return"]`` is set and ``experience.kl`` cleared, as OpenRLHF does; no global whitening
   (OpenRLHF whitens only ``gae``/``reinforce``/``reinforce_baseline``).

For an outcome estimator (one advantage per response) this is exactly OpenRLHF's computation with
the stablerl baseline in place of its own.
"""

from __future__ import annotations

import itertools

import torch

import stablerl
from stablerl.ops import scores_on_last_token
from openrlhf.models.utils import compute_reward
from openrlhf.trainer.ppo_utils.length_penalty import apply_length_penalties

from stablerl.frameworks import as_params, log_effective_settings

from ._inputs import padded_old_entropy
from ._names import advantage_settings
from ._selection import Selection
from ._spec import OPENRLHF


def _group_reward_std(rewards: torch.Tensor, n: int, indices: torch.Tensor, exp_len: list[int]):
    """OpenRLHF's ``info["group_reward_std"]`` (logging only): per-prompt std in rollout order."""
    grouped = torch.empty_like(rewards)
    grouped[indices] = rewards
    grouped = grouped.reshape(-1, n)
    return grouped.std(-1, keepdim=True).repeat(1, n).reshape(-1)[indices].split(exp_len)


@torch.no_grad()
def stable_advantages_and_returns(maker, experiences, selection: Selection):
    args = maker.strategy.args
    n = int(args.rollout.n_samples_per_prompt)

    for experience in experiences:
        experience.rewards = experience.rewards.to(torch.promote_types(experience.rewards.dtype, torch.float32))
    apply_length_penalties(experiences, args)

    exp_len = [len(experience.index) for experience in experiences]
    indices = torch.tensor(list(itertools.chain.from_iterable(experience.index for experience in experiences)))
    raw_rewards = torch.cat([experience.rewards for experience in experiences], dim=0)
    if n > 1:
        for experience, std in zip(experiences, _group_reward_std(raw_rewards, n, indices, exp_len)):
            experience.info["group_reward_std"] = std

    # one [N, T_max] batch over every experience: scalar reward on the last valid token
    t_max = max(int(e.action_mask.shape[1]) for e in experiences)
    masks, token_rewards = [], []
    for experience in experiences:
        mask = experience.action_mask
        pad = t_max - mask.shape[1]
        mask = torch.nn.functional.pad(mask.to(raw_rewards.dtype), (0, pad))
        masks.append(mask)
        token_rewards.append(scores_on_last_token(experience.rewards.to(mask.dtype), mask) * mask)
    mask_all = torch.cat(masks)
    settings = advantage_settings(selection)  # one precedence rule; printed once per process
    spec = stablerl.get_spec(stablerl.ADVANTAGE_ESTIMATOR, selection.advantage_estimator)
    log_effective_settings(OPENRLHF, spec, settings)
    # the old-log-prob pass's entropy, for an estimator that declares it (._inputs)
    extra = {"entropy": padded_old_entropy(experiences, t_max)} if "entropy" in spec.requires else {}
    extras = {}
    if selection.reward_components:  # the reward function's extra_logs named on the command line (GDPO)
        from ._shape_filter import _from_info

        extras["reward_components"] = {
            key: _from_info(key, experiences, stablerl.ADVANTAGE_ESTIMATOR, selection.advantage_estimator)
            for key in selection.reward_components}
        if selection.reward_weights:
            extras["reward_weights"] = list(selection.reward_weights)
    advantages, returns = stablerl.compute_advantage(
        selection.advantage_estimator,
        token_level_rewards=torch.cat(token_rewards),
        response_mask=mask_all,
        index=torch.div(indices, n, rounding_mode="floor"),  # OpenRLHF's prompt groups
        ctx=stablerl.Context(),
        **extra,
        **({"extras": extras} if extras else {}),
        **as_params(settings),
    )

    # OpenRLHF's clamp of the baseline-shaped reward: only when the user gave --reward.clip_range (its
    # default (-10, 10) would cut a stablerl estimator's advantages in OpenRLHF alone)
    clip_range = selection.reward_clip_range
    for experience, adv, ret in zip(experiences, advantages.split(exp_len), returns.split(exp_len)):
        mask = experience.action_mask
        t = mask.shape[1]
        adv, ret = adv[:, :t], ret[:, :t]
        if clip_range:
            # OpenRLHF clamps the baseline-shaped reward to --reward.clip_range before adding KL
            adv = adv.clamp(min=clip_range[0], max=clip_range[1])
            ret = ret.clamp(min=clip_range[0], max=clip_range[1])
        # KL folded in after the baseline, by OpenRLHF's own code (zero shaped reward: KL part only)
        kl = experience.kl if experience.kl is not None else torch.zeros_like(adv)
        kl_reward = compute_reward(
            torch.zeros(mask.shape[0], dtype=adv.dtype, device=adv.device),
            maker.kl_ctl.value,
            kl,
            action_mask=mask,
            reward_clip_range=None,
        )
        kl_returns = maker.get_cumulative_returns(kl_reward, mask, 1.0)
        valid = mask.to(adv.dtype)
        experience.advantages = (adv + kl_returns) * valid
        experience.returns = (ret + kl_returns) * valid
        first = mask.long().argmax(dim=1, keepdim=True)  # the return seen from the first response token
        experience.info["return"] = experience.returns.gather(1, first).squeeze(1)
        experience.kl = None
    return experiences
