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
            "the clipping-bias correction / 'clipping-triggered normalization' (CTN) equation "
            "of arXiv 2511.20718 is unverified (secondary accounts contradict each other: bias subtraction, "
            "advantage normalisation above a clip-fraction threshold, or a clip-fraction-scaled KL), and the "
            "turn-level ratio's mean type (geometric vs arithmetic) is unconfirmed; the authors' code "
            "(Cloud0723/SORL) was not read."
        ),
    ),
    dict(
        name="haepo",
        paper="2508.18884",
        title="HAEPO: History-Aggregated Exploratory Policy Optimization (Plackett-Luce trajectory weights)",
        notes=(
            "only an abstract-level formulation of arXiv 2508.18884 is known (softmax over "
            "summed trajectory log-likelihoods times normalised returns, plus entropy and a KL to the previous "
            "policy); the reward normalisation, whether the weights are detached, any temperature, the "
            "coefficients and the KL estimator are unverified, and no code was found."
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
