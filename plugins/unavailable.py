"""Policy losses that are listed but deliberately not implemented (status ``unavailable``).

Each one's formula could not be verified from a primary source (see the catalogue,
``LOSSES.md`` B4, F2, G1); ``stablerl list`` shows them with the reason, and asking for one
raises an error that quotes it.
"""

from __future__ import annotations

from stablerl import UNAVAILABLE, hookimpl

UNAVAILABLE_LOSSES = (
    dict(
        name="st_ppo",
        paper="2511.20718",
        title="ST-PPO / SO-PPO: turn-level importance sampling with clipping-bias correction (multi-turn agents)",
        notes=(
            "the clipping-bias correction (v1 Eq. 8; 'clipping-triggered normalization', CTN, in v2) of arXiv "
            "2511.20718 could not be read: every stored copy of the paper (arXiv HTML v1 and v2, summaries) exposes "
            "only its abstract, which says the correction 'normalizes gradients by downweighting highly off-policy "
            "samples' but not how, and the authors' code (Cloud0723/SORL) is not available here. Secondary accounts "
            "still contradict each other (bias subtraction, advantage normalisation above a clip-fraction threshold, "
            "a clip-fraction-scaled KL). Its turn-level IS alone (Turn-PPO, v1 Eq. 4) is offered as the experimental "
            "turn_ppo."
        ),
    ),
    dict(
        name="haepo",
        paper="2508.18884",
        title="HAEPO: History-Aggregated Exploratory Policy Optimization (Plackett-Luce trajectory weights)",
        notes=(
            "the paper (arXiv 2508.18884) defines the objective, but every stored copy of it (arXiv HTML v1, "
            "listings, summaries) exposes only the abstract (a Plackett-Luce softmax over summed trajectory "
            "log-likelihoods weighted by return, an entropy term and a KL to a frozen previous policy); the return "
            "normalisation, whether the weights are detached, any temperature, the coefficients and the KL estimator "
            "could not be read, and no code was found (rechecked for issue 16)."
        ),
    ),
    dict(
        name="sfpo",
        paper="2510.04072",
        title="SFPO: Slow-Fast Policy Optimization (reposition-before-update)",
        notes=(
            "SFPO (arXiv 2510.04072) is a training-loop schedule (K fast passes, a reposition of the weights, "
            "one slow pass, an entropy stop rule), not a loss: select it as the trainer hook 'sfpo' (kind "
            "trainer_hook; TRL: GRPOConfig(trainer_hook='sfpo', num_iterations=4); verl: "
            "+actor_rollout_ref.actor.policy_loss.stablerl_trainer_hook=sfpo) with your usual loss."
        ),
    ),
)


@hookimpl
def register_policy_losses(register):
    for entry in UNAVAILABLE_LOSSES:
        register(fn=None, status=UNAVAILABLE, **entry)
