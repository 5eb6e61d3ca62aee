"""``SkyRLAdapter``: stablerl in SkyRL 0.3 (framework-free at import: SkyRL is imported when it instruments).

SkyRL has registries for both policy losses and advantage estimators (``PolicyLossRegistry`` /
``AdvantageEstimatorRegistry``, selected by ``trainer.algorithm.policy_loss_type`` / ``advantage_estimator``), which
SkyRL shares with every Ray worker through a named registry actor once ``initialize_ray`` syncs them. So
:meth:`SkyRLAdapter._instrument` registers every stablerl loss and estimator SkyRL can feed, in the driver before
Ray starts, under the bare name where SkyRL has none of its own and always as ``stablerl_<name>`` (SkyRL's own
names are never replaced), and adds the loss state to SkyRL's policy-worker checkpoints.

The ``@provides`` methods say what SkyRL feeds: at the advantage step ``record.host`` is the trainer's
``TrainingInputBatch`` (None when SkyRL's own trainer calls a registered estimator); at the loss SkyRL's call passes
log-probs, old and rollout log-probs, advantages, config and loss mask; the micro-batch's ``token_ids`` and the
update forward's ``entropy`` come from the worker glue (``_micro``).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from stablerl.adapter import FrameworkAdapter
from stablerl.framework_batch import check_whole_groups
from stablerl.contracts import ADVANTAGE_ESTIMATOR as _ADV, BATCH_FILTER as _FILTER, POLICY_LOSS as _LOSS
from stablerl.contracts import REWARD_SHAPER as _SHAPER
from stablerl.params import MissingInputError
from stablerl.providers import provides
from stablerl.state import StateStore

from ._names import NAME, SKYRL_ADV_ESTIMATORS, SKYRL_POLICY_LOSSES, UnsupportedSkyRLVersionError, skyrl_names

_ADVANTAGE_SIDE = (_ADV, _SHAPER, _FILTER)
ROLLOUT_LOGPROBS = ("the generator returns rollout_logprobs (generator.sampling_params.logprobs set: SkyRL's "
                    "default 1)")
LOSS_STATE_FILE = "stablerl_loss_state_rank{rank}.pt"
WHOLE_GROUPS = ("trainer.micro_train_batch_size_per_gpu a multiple of generator.n_samples_per_prompt, "
                "trainer.max_tokens_per_microbatch off (whole prompt groups per micro-batch)")
TEACHER = ("trainer.ref.model.path=TEACHER (the teacher, with the policy's vocabulary: checked at start-up) and "
           "trainer.algorithm.use_kl_loss=true (SkyRL builds its reference model only with a KL term; the KL loss to "
           "the teacher stays, weight kl_loss_coef: a second pull toward it; use_kl_in_reward is refused)")


#: per-trajectory values an environment's get_metrics() may return (SkyRL's env_metrics), for shapers / filters
ENV_VALUES = ("correct", "flawed", "void_turn")


def _env_value(what: str):
    def value(self, record):
        return _field(record, "stablerl_" + what)

    value.__doc__ = f"The environment's per-trajectory {what!r} (its get_metrics(): SkyRL's env_metrics)."
    return provides(what, to=(_SHAPER, _FILTER), condition=f"the environment's get_metrics() returns {what!r} for "
                    "every trajectory (SkyRL's env_metrics; not step-wise)")(value)


def _field(record, key: str):
    host = record.host
    return None if host is None else host.get(key) if hasattr(host, "get") else None


class SkyRLAdapter(FrameworkAdapter):
    """The SkyRL adapter: one instance per process (``SkyRLAdapter()``)."""

    name = NAME
    version_error = UnsupportedSkyRLVersionError

    def __init__(self) -> None:
        if "driver_state" in vars(self):
            return
        #: the trainer process's estimator / shaper / filter state (checkpointed by the entry point's trainer)
        self.driver_state = StateStore(holds="driver")
        #: a policy worker's loss state (saved next to SkyRL's policy checkpoint, per rank)
        self.loss_state = StateStore(holds="loss")
        #: the trainer's batch while its advantage step runs (the estimator's record reads it)
        self.pending: Any = None
        #: a policy worker's update micro-batch while ``_forward_backward_micro`` runs (``_micro``)
        self.micro: Any = None
        self.seed = 42
        self.last_metrics: dict[str, float] = {}

    def __reduce__(self):
        return type(self), ()

    def _instrument(self, ledger, register: bool = True) -> None:
        """Register the stablerl losses and estimators SkyRL can feed (``register``), and add the loss state to
        the policy workers' checkpoints."""
        from skyrl.backends.skyrl_train.utils import ppo_utils

        if register:
            from stablerl.reach import runnable_names

            from ._loss import StableSkyRLEstimator, StableSkyRLLoss

            for registry, builtin, kind, make in (
                    (ppo_utils.PolicyLossRegistry, SKYRL_POLICY_LOSSES, _LOSS, StableSkyRLLoss),
                    (ppo_utils.AdvantageEstimatorRegistry, SKYRL_ADV_ESTIMATORS, _ADV, StableSkyRLEstimator)):
                for name in runnable_names(NAME, kind):
                    for skyrl_name in skyrl_names(name, builtin):
                        ledger.set_item(f"{registry.__name__}:{skyrl_name}", registry._functions, skyrl_name, make(name))
                registry._synced_to_actor = False  # the next sync pushes them to the registry actor
        self.arm_worker(ledger)

    def arm_worker(self, ledger=None) -> None:
        """Save / restore this process's loss state with SkyRL's policy checkpoint (``Worker.save_checkpoint`` /
        ``load_checkpoint`` of ``PolicyWorkerBase``) and arm routing replay (``_routing``); run when a worker
        unpickles a stablerl loss or the stablerl config."""
        from skyrl.backends.skyrl_train.workers.worker import PolicyWorkerBase

        ledger = ledger or self.ledger
        adapter = self

        def save_checkpoint(worker, ckpt_dir, *args, **kwargs):
            out = _original_save(worker, ckpt_dir, *args, **kwargs)
            if adapter.loss_state:
                adapter.loss_state.save(os.path.join(ckpt_dir, _state_file()))
            return out

        def load_checkpoint(worker, ckpt_dir, *args, **kwargs):
            out = _original_load(worker, ckpt_dir, *args, **kwargs)
            adapter.loss_state.load(os.path.join(ckpt_dir, _state_file()))
            return out

        from . import _micro, _routing

        _routing.arm(ledger, PolicyWorkerBase)  # routing replay; the old pass's extras (``_micro``)
        _micro.arm(ledger)  # the trainer's per-row loss inputs into experience.info
        _original_save, _original_load = PolicyWorkerBase.save_checkpoint, PolicyWorkerBase.load_checkpoint
        if getattr(_original_save, ledger.mark, False):
            return
        ledger.set_attr("PolicyWorkerBase.save_checkpoint", PolicyWorkerBase, "save_checkpoint", save_checkpoint)
        ledger.set_attr("PolicyWorkerBase.load_checkpoint", PolicyWorkerBase, "load_checkpoint", load_checkpoint)

    def context(self, kind: str, name: str):
        """The driver-side :class:`~stablerl.context.Context` of one estimator / shaper / filter call."""
        return self.driver_state.context(kind, name, self.seed)

    # -- providers: the advantage step (record.host: the trainer's TrainingInputBatch, or None) ----------

    @provides("index", to=_ADVANTAGE_SIDE)
    @provides("index", to=(_LOSS,), condition=WHOLE_GROUPS)
    def index(self, record):
        """The prompt groups: SkyRL's ``uids`` (at the loss: as numbers, carried with the rows, every group whole)."""
        if record.index is not None:
            return record.index
        ids = _carried(record, "stablerl_index")
        if ids is not None:
            check_whole_groups(ids, _carried(record, "stablerl_group_size"), why=WHOLE_GROUPS)
        return ids

    @provides("scores", to=_ADVANTAGE_SIDE + (_LOSS,))
    def scores(self, record):
        """One reward per response: the masked sum of SkyRL's per-token ``rewards`` (at the loss: carried)."""
        return _carried(record, "stablerl_scores") if record.token_level_rewards is None else record.response_scores()

    @provides("lengths", to=_ADVANTAGE_SIDE)
    def lengths(self, record):
        """The response lengths (``response_mask`` sums)."""
        return record.response_mask.sum(-1).float()

    @provides("old_log_prob", to=(_ADV,))
    def old_log_prob(self, record):
        """The old-log-prob pass's ``action_log_probs`` (the entry point's trainer; SkyRL's own estimator call
        does not pass them)."""
        value = _field(record, "action_log_probs")
        if value is None:
            raise MissingInputError("the estimator needs old_log_prob: SkyRL's batch has no action_log_probs here "
                                    "(run python -m stablerl.adapters.skyrl.main; rollout_is / dppo skip that pass)")
        return value

    @provides("rollout_log_prob", to=(_ADV, _LOSS), condition=ROLLOUT_LOGPROBS)
    def rollout_log_prob(self, record):
        """The generator's ``rollout_logprobs`` (the entry point's trainer; SkyRL's loss call passes them itself)."""
        return _field(record, "rollout_logprobs")

    correct, flawed, void_turn = (_env_value(what) for what in ENV_VALUES)

    @provides("entropy", to=_ADVANTAGE_SIDE, extra_pass=True)
    def old_pass_entropy(self, record):
        """The old-log-prob pass's per-token entropy at SkyRL's temperature (``_micro.old_pass``)."""
        return _old_pass(record, "stablerl_old_entropy")

    @provides("sum_pi_squared", to=(_ADV,), extra_pass=True)
    def sum_pi_squared(self, record):
        """The old-log-prob pass's per-token sum over the vocabulary of pi(v)^2 at SkyRL's temperature."""
        return _old_pass(record, "stablerl_sum_pi_squared")

    @provides("teacher_log_prob", to=(_ADV,), condition=TEACHER)
    def teacher_log_prob(self, record):
        """SkyRL's reference model's log-probs (``base_action_log_probs``), the reference loading the teacher."""
        return _old_pass(record, "base_action_log_probs")

    # -- providers: the loss (SkyRL's call passes them itself) -----------------------------------------------

    @provides("token_ids", to=(_LOSS,))
    def token_ids(self, record):
        """The micro-batch's response tokens (``experience.sequences[:, -num_actions:]``, ``_micro``)."""
        return record.host.sequences[:, -record.host.num_actions:]

    @provides("entropy", to=(_LOSS,))
    def training_entropy(self, record):
        """The update forward's entropy: ``_micro``'s hook puts SkyRL's ``output["entropy"]`` into
        ``record.produced`` (None before that forward ran)."""
        return None

    @provides("old_entropy", to=(_LOSS,), extra_pass=True)
    def old_entropy(self, record):
        """The old-log-prob pass's entropy, carried with the rows (``_micro.ROW_INPUTS``)."""
        return _carried(record, "stablerl_old_entropy")


def _old_pass(record, key: str):  # None: not in this batch (core's error then says what to set)
    value = _field(record, key)
    return None if value is None else value.float() * record.response_mask.to(value.device)


def _carried(record, key: str):
    value = record.host.info.get(key)
    return None if value is None else value.to(record.response_mask.device)


def _state_file() -> str:
    import torch

    rank = torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0
    return LOSS_STATE_FILE.format(rank=rank)


__all__ = ["SkyRLAdapter", "UnsupportedSkyRLVersionError"]
