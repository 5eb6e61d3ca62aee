"""Policy losses that are listed but deliberately not implemented (status ``unavailable``).

Each one's formula could not be verified from a primary source (see the catalogue,
``LOSSES.md`` B4, F2, G1); ``stablerl list`` shows them with the reason (what was searched and
what is missing, last rechecked for issue 16), and asking for one raises an error that quotes it.
"""

from __future__ import annotations

from stablerl import UNAVAILABLE, hookimpl

UNAVAILABLE_LOSSES = (
    dict(
        name="st_ppo",
        paper="2511.20718",
        title="ST-PPO / SO-PPO: turn-level importance sampling with clipping-bias correction (multi-turn agents)",
        notes=(
            "the clipping-bias correction of arXiv 2511.20718 (S-PPO; v1 Eq. 8, 'clipping-triggered "
            "normalization', CTN, in v2) could not be read. Searched for issue 16: the stored arXiv HTML v1 and v2, "
            "OpenReview MgUtdOdTwZ, chatpaper 213594, emergentmind (st-ppo, turn-level-importance-sampling), "
            "sciencestack and airesearch.news all stop at the abstract, the setup or the Fig. 1 caption ('adding the "
            "clipping bias to normalize gradients yields S-PPO and ST-PPO (Eq. 8 ...)'); the authors' code "
            "(Cloud0723/SORL) has no snapshot here and no indexed file quotes it. The rules third parties give "
            "contradict each other and none cites the equation: a KL penalty scaled by the clip fraction (a wiki "
            "note), advantage z-scoring when the clip fraction exceeds 0.2 (a reimplementation that calls itself a "
            "reconstruction), subtracting alpha times a bias C = (1/|y|) sum over clipped tokens of w_t A_t "
            "(another wiki note, with unsourced result tables). Missing: what the correction normalises, by which statistic of "
            "the clipped tokens, and its constants. Its turn-level IS alone (Turn-PPO, v1 Eq. 4) is offered as the "
            "experimental turn_ppo."
        ),
    ),
    dict(
        name="haepo",
        paper="2508.18884",
        title="HAEPO: History-Aggregated Exploratory Policy Optimization (Plackett-Luce trajectory weights)",
        notes=(
            "the objective of arXiv 2508.18884 could not be read in full. Searched for issue 16: the stored arXiv "
            "HTML v1, Hugging Face papers, emergentmind, chatpaper, deeppaper, tomesphere and alphapapers copies stop "
            "after the abstract; a Moonlight AI review stops after its step 1 (L_k = sum_t log pi(a_t|s_t), a sum "
            "over the episode) and the heading of step 2 (a Plackett-Luce softmax of the L_k into weights w_k(theta)); "
            "no code is indexed. Missing: how the weights meet the returns (the abstract says only 'normalized weights "
            "proportional to their returns'; -sum_k w_k R_k is a reading, not the paper's equation), the return "
            "normalisation, any temperature on L_k, over which set the softmax runs (batch or prompt group), the "
            "entropy and KL estimators and their coefficients."
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
