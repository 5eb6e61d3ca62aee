"""What TRL can feed to stablerl algorithms: one provider per input (:mod:`stablerl.providers`), in two mixins of
:class:`~stablerl.adapters.trl._adapter.TRLAdapter`:

* :class:`LossInputs`: the policy loss's inputs, from a :class:`~stablerl.adapters.trl._records.LossBatch` (one
  micro-batch of ``_compute_loss``);
* :class:`GenerationInputs`: prompt groups, scores and the generating policy's statistics, from a
  :class:`~stablerl.adapters.trl._records.GenerationBatch` (the advantage step's, gathered over processes), and what
  the training loop offers controllers and trainer hooks.

A provider marked ``extra_pass`` costs a forward TRL would not run, and runs only when a selected algorithm declares
its input. Framework-free at import.
"""

from __future__ import annotations

import torch

from stablerl.contracts import (ADVANTAGE_ESTIMATOR, BATCH_FILTER, CONTROLLER, POLICY_LOSS, REWARD_SHAPER,
                                ROLLOUT_CORRECTION, TRAINER_HOOK)
from stablerl.providers import collect, provides

_EXTENSIONS = (REWARD_SHAPER, BATCH_FILTER)
_ROUTING_REPLAY = "routing_replay='R2' or 'R3' on an MoE model"
_SAMPLING_REPLAY = ("sampling_mask_replay='auto' (on when top_k > 0, top_p < 1 or min_p > 0) or 'true', with use_vllm=True "
                    "or a rollout_func, and a ratio against the rollout (vLLM IS correction, off_policy_mask_threshold, "
                    "a stablerl correction)")
# the sampler's log-probs, or (TRL generating with the policy itself) the generating weights' own log-probs
BEHAVIOUR_LOG_PROBS = (
    "use_vllm=False (TRL generates with the policy itself: the behaviour log-probs are its old-log-prob pass at "
    "generation, run whenever steps_per_generation * num_iterations spans more than one optimizer step; else the "
    "batch is on-policy and they are the training forward's, detached), or use_vllm=True with "
    "vllm_importance_sampling_correction=True (the engine's sampling log-probs)")
#: per-row tensor of the trainer's generation batch: the generation round (A-3PO's weight version, AReaL's sense) that
#: generated the row (travels with the rows through TRL's shuffles and splits)
VERSION_KEY = "stablerl_policy_version"
SYNCHRONOUS_VERSIONS = (
    "TRL's synchronous GRPOTrainer: versions are generation rounds (AReaL's weight versions), and every batch is "
    "trained in the round that generated it (steps_per_generation / num_iterations reuse one generation batch), so "
    "versions == policy_version and A-3PO's alpha = 0 (decoupled PPO with the behaviour log-probs as proximal policy)")
# per-response inputs the user provides (a reward function's TRL log_extra, a rollout_func field or a dataset column)
USER_INPUTS = ("correct", "flawed", "void_turn", "pos_count", "neg_count")


def _user_input(name: str):
    @provides(name, to=_EXTENSIONS)
    def provider(self, record):
        """A per-completion value of the user's: TRL's log_extra(name, values), a rollout_func field or a column."""
        return record.user_inputs.get(name)

    provider.__name__ = name
    return provider


class LossInputs:
    """The policy loss's inputs."""

    # -- the policy loss's inputs (a LossBatch: one micro-batch of _compute_loss) ------------------------

    @provides("entropy", to=(POLICY_LOSS,))
    def entropy(self, record):
        """The training forward's entropies (TRL's _get_per_token_logps_and_entropies in _compute_loss)."""
        return record.entropies

    @provides("old_entropy", to=(POLICY_LOSS,))
    def old_entropy(self, record):
        """TRL's old-log-prob pass's entropies, carried with the rows; without that pass, the current ones."""
        old = record.host.get("stablerl_old_entropy")
        return record.entropies.detach() if old is None else old

    @provides("token_ids", to=(POLICY_LOSS,))
    def token_ids(self, record):
        """TRL's completion_ids."""
        return record.host["completion_ids"]

    @provides("rollout_log_prob", to=(POLICY_LOSS,), condition=BEHAVIOUR_LOG_PROBS)
    @provides("rollout_log_prob", to=(ROLLOUT_CORRECTION,),
              condition="use_vllm=True (or a rollout_func returning logprobs) and vllm_importance_sampling_correction=False")
    def rollout_log_prob(self, record):
        """The rollout engine's sampling log-probs (TRL's sampling_per_token_logps; NaN: not scored, no mismatch);
        without vLLM (losses only), the generating weights' own: TRL's old-log-prob pass at generation."""
        return record.rollout_log_prob

    @provides("sampling_mask", to=(POLICY_LOSS, ADVANTAGE_ESTIMATOR), condition=_SAMPLING_REPLAY)
    def sampling_mask(self, record):
        """The rollout's kept set replayed into sampling_per_token_logps: a rollout_func's per-completion masks (the
        generation batch), else TRL's SamplingRule (top_k/top_p/min_p, temperature)."""
        return record.sampling_mask
    # -- policy versions (A-3PO): generation rounds, AReaL's weight versions ---------------------------------

    @provides("versions", to=(POLICY_LOSS,), condition=SYNCHRONOUS_VERSIONS)
    def versions(self, record):
        """The generation round that generated the row, on its generated tokens (-1 elsewhere)."""
        stamp = record.host.get(VERSION_KEY)
        if stamp is None:
            return None
        mask = record.response_mask
        stamp = stamp.to(mask.device).unsqueeze(1).expand(mask.shape)
        return torch.where(mask.bool(), stamp, torch.full_like(stamp, -1))

    @provides("policy_version", to=(POLICY_LOSS,), condition="TRL's synchronous GRPOTrainer, as for versions")
    def policy_version(self, record):
        """The generation round of the batch being trained (constant over the optimizer steps that reuse it)."""
        return record.policy_version

    @provides("router_log_prob", to=(POLICY_LOSS,), condition=_ROUTING_REPLAY)
    def router_log_prob(self, record):
        """Router log-probs at the replayed experts, recorded in the training forward."""
        return record.router_log_prob

    @provides("old_router_log_prob", to=(POLICY_LOSS,), condition=_ROUTING_REPLAY)
    def old_router_log_prob(self, record):
        """Router log-probs of the old-log-prob pass; without that pass, the training forward's (old == current)."""
        old = record.host.get("stablerl_old_router_log_prob")
        return record.router_log_prob if old is None or record.router_log_prob is None else \
            old.to(record.router_log_prob.device)

    providers = collect(dict(locals()))  # what TRLAdapter inherits (FrameworkAdapter.__init_subclass__)


class GenerationInputs:
    """Inputs of the advantage step, reward shapers, batch filters, controllers and trainer hooks."""

    # -- prompt groups and scores (both records: the advantage step's gathered batch, or carried rows) -------

    @provides("index", to=(POLICY_LOSS, ADVANTAGE_ESTIMATOR, *_EXTENSIONS))
    def index(self, record):
        """Prompt groups: RepeatSampler's contiguous groups of num_generations."""
        return record.index

    @provides("scores", to=(POLICY_LOSS, *_EXTENSIONS))
    def scores(self, record):
        """TRL's reward: the weighted sum of the reward functions (after a reward shaper)."""
        return record.scores

    @provides("lengths", to=_EXTENSIONS)
    def lengths(self, record):
        """The number of trained tokens of each completion."""
        return record.response_mask.sum(-1).to(torch.float64)

    correct, flawed, void_turn, pos_count, neg_count = map(_user_input, USER_INPUTS)

    # -- statistics of the generating policy (extra passes: only when a selected algorithm reads them) -----

    @provides("entropy", to=(ADVANTAGE_ESTIMATOR,), extra_pass=True)
    def rollout_entropy(self, record):
        """The generating policy's entropies (one extra no-grad forward, shared with an entropy-reading filter)."""
        return record.gathered(record.rollout_entropy()) * record.response_mask

    @provides("entropy", to=(BATCH_FILTER,), extra_pass=True)
    def filter_entropy(self, record):
        """As :meth:`rollout_entropy`, unmasked (the filter masks)."""
        return record.gathered(record.rollout_entropy())

    @provides("old_log_prob", to=(ADVANTAGE_ESTIMATOR,), extra_pass=True)
    def old_log_prob(self, record):
        """The old-log-prob pass's log-probs (TRL's, or one extra forward through the fused LM head)."""
        return record.gathered(record.old_pass_stats()["old_log_prob"]) * record.response_mask

    @provides("sum_pi_squared", to=(ADVANTAGE_ESTIMATOR,), extra_pass=True)
    def sum_pi_squared(self, record):
        """sum_v pi(v)^2 of each token: the fused LM head's log_sum_sq_probs, in the same forward as old_log_prob."""
        return record.gathered(record.old_pass_stats()["sum_pi_squared"]) * record.response_mask

    @provides("teacher_log_prob", to=(ADVANTAGE_ESTIMATOR,), extra_pass=True,
              condition="stablerl_teacher_model=<path of a teacher with the student's tokenizer>")
    def teacher_log_prob(self, record):
        """The frozen teacher's log-probs of the sampled tokens (one extra no-grad forward of the teacher)."""
        teacher = getattr(record.site.trainer, "_stablerl_teacher", None)
        if teacher is None:
            return None
        return record.gathered(teacher.log_probs(record.host, record.mode)) * record.response_mask

    # -- what the training loop offers controllers and trainer hooks (record: the trainer's LoopExtras) -----

    @provides("params_view", to=(TRAINER_HOOK,))
    def params_view(self, record):
        """The trainable parameters and the optimizer, between TRL's num_iterations passes."""
        return record.params_view()

    @provides("entropy_bonus", to=(CONTROLLER,))
    def entropy_bonus(self, record):
        """The controller's entropy bonus, added to the loss of each micro-batch."""
        return record.loss_term

    @provides("loss_term", to=(CONTROLLER,))
    def loss_term(self, record):
        """The controller's own loss term on the training forward's entropies."""
        return record.loss_term

    @provides("rollout_temperature", to=(CONTROLLER,))
    def rollout_temperature(self, record):
        """Sets the sampling temperature of the next generations."""
        return record.apply

    providers = collect(dict(locals()))


__all__ = ["LossInputs", "GenerationInputs", "USER_INPUTS", "VERSION_KEY", "BEHAVIOUR_LOG_PROBS", "SYNCHRONOUS_VERSIONS"]
