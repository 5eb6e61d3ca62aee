"""ReMax: REINFORCE with the greedy response's reward as baseline (Li et al., arXiv 2310.10505).

    G_t = sum_{k>=t} m_k r_k,   A_t = G_t - b_i,   b_i = reward of the greedy (argmax) response to the prompt

Input: ``reward_baselines`` ([B], one per response: its prompt's greedy-response reward). No
hyper-parameters.
"""

from __future__ import annotations

import torch

from stablerl import STABLE, NoParams, hookimpl
from stablerl.params import MissingInputError, StableRLError


def _reward_baselines(b) -> torch.Tensor:
    value = b.extras.get("reward_baselines")
    if value is None:
        raise MissingInputError(
            "advantage estimator 'remax' needs reward_baselines ([B]: the reward of the greedy response to each "
            "response's prompt; verl's trainer writes batch['reward_baselines'] only for its own adv_estimator=remax)"
        )
    t = torch.as_tensor(value, device=b.token_level_rewards.device).to(b.token_level_rewards.dtype)
    B = b.token_level_rewards.shape[0]
    if tuple(t.shape) != (B,):
        raise StableRLError(f"remax: reward_baselines has shape {tuple(t.shape)}, expected [{B}]")
    if not bool(torch.isfinite(t).all()):
        raise StableRLError("remax: reward_baselines has non-finite values (NaN or inf)")
    return t


def remax_advantage(b, p, ctx):
    mask = b.response_mask.to(b.token_level_rewards.dtype)
    r = torch.where(b.response_mask.bool(), b.token_level_rewards, torch.zeros_like(b.token_level_rewards))
    returns = torch.flip(torch.cumsum(torch.flip(r, [-1]), -1), [-1]) * mask
    adv = returns - _reward_baselines(b).unsqueeze(-1) * mask
    return adv, returns


@hookimpl
def register_advantage_estimators(register):
    register(
        name="remax",
        fn=remax_advantage,
        params=NoParams,
        paper="2310.10505",
        title="ReMax: REINFORCE with a greedy-response baseline",
        formula="A_t = sum_{k>=t} m_k r_k - b_i, b_i = reward of the greedy response to the prompt",
        status=STABLE,
        requires=("reward_baselines",),
        reference="verl core_algos.compute_remax_outcome_advantage (adv_estimator=remax)",
        notes="The greedy generation and its scoring are the trainer's (verl's RayPPOTrainer does it only when "
        "algorithm.adv_estimator=remax, its built-in; TRL and OpenRLHF generate no greedy baseline). returns: the "
        "undiscounted returns-to-go before the baseline (verl).",
    )
