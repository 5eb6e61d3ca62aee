"""``StableRayPPOTrainer``: SkyRL's ``RayPPOTrainer`` with the stablerl steps SkyRL's registries cannot hold (imported
by the entry point in SkyRL's trainer process; imports SkyRL).

- **Advantage pre-scaling taken over** (``_normalize_advantages``), for a stablerl policy loss only: the advantages
  stay as the estimator made them (``advantage_batch_normalize``: SkyRL's z-score, its scaling divided out again
  with its own weights) and the loss mask carries ``1 / D`` (:mod:`stablerl.mask_weights`; ``_loss``).
- **Reward shaper / batch filter** around SkyRL's estimator (``compute_advantages_and_returns``): core's
  :class:`~stablerl.steps.AdvantageStep` shape -> estimator (SkyRL's registry: its own or a stablerl one, which
  reads the whole batch through the adapter's providers) -> filter (a dropped row or token gets loss mask 0: SkyRL's
  batch is fixed-size, rows cannot be duplicated) -> the driver state advanced once.
- **The old-log-prob pass's extras** into the batch: R2's routes as ``rollout_expert_indices`` (``_routing``), the
  entropy / ``sum_pi_squared`` a selected algorithm reads (``_micro``); after the advantage step the loss's per-row
  inputs (prompt groups, scores, the old entropy: ``_micro.ROW_INPUTS``) stay in it, the rest leaves.
- **Checkpoints**: the driver state next to SkyRL's ``trainer_state.pt`` (``stablerl_state.pt``), restored on
  resume; the loss state is saved by the policy workers (``SkyRLAdapter.arm_worker``).
"""

from __future__ import annotations

import os

import torch

from skyrl.backends.skyrl_train.utils.ppo_utils import apply_loss_reduction_to_advantages_minibatch
from skyrl.train.trainer import RayPPOTrainer
from stablerl import BATCH_FILTER, POLICY_LOSS, REWARD_SHAPER, get_spec
from stablerl.mask_weights import span_weights
from stablerl.ops import group_ids
from stablerl.params import StableRLError
from stablerl.steps import AdvantageSelection, AdvantageStep, BatchRecord

from ._adapter import ENV_VALUES, SkyRLAdapter
from ._config import params, selected
from ._micro import OLD_PASS
from ._names import ALGORITHM, FILTER
from ._routing import KEY, batch_field, mode_of, old_pass_keys

STATE_FILE = "stablerl_state.pt"
WHY_NO_RESAMPLING = ("SkyRL's training batch has a fixed size at compute_advantages_and_returns: rows can be "
                     "dropped (loss mask 0), not duplicated")


class StableRayPPOTrainer(RayPPOTrainer):
    """SkyRL's trainer with the stablerl steps of this module's docstring."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._stablerl_setup()

    def _stablerl_setup(self) -> None:
        algorithm = self.cfg.trainer.algorithm
        if mode_of(algorithm) and self.cfg.trainer.strategy not in ("fsdp", "fsdp2"):
            raise StableRLError(f"{ALGORITHM}{KEY} is stablerl's routing replay for SkyRL's FSDP policy worker, not "
                                f"trainer.strategy={self.cfg.trainer.strategy} (Megatron has SkyRL's own)")
        self.stablerl_loss = selected(algorithm, POLICY_LOSS)
        self.stablerl_adapter = SkyRLAdapter()
        self.stablerl_adapter.seed = int(getattr(self.cfg.trainer, "seed", 42))
        shaper, filt = selected(algorithm, REWARD_SHAPER), selected(algorithm, BATCH_FILTER)
        self.stablerl_step = AdvantageStep(
            AdvantageSelection(reward_shaper=shaper, reward_shaper_params=params(algorithm, REWARD_SHAPER) if shaper else {},
                               batch_filter=filt, batch_filter_params=params(algorithm, BATCH_FILTER) if filt else {}),
            ctx=self.stablerl_adapter.context, filter_key=ALGORITHM + FILTER, why_no_resampling=WHY_NO_RESAMPLING)

    # -- what the policy's old-log-prob pass also returns (R2's routes, entropy, sum_pi_squared) into the batch --

    def _execute_forward_pass(self, model, data_fwd_pass, key, mini_batch_boundaries):
        keys = old_pass_keys(self.cfg.trainer.algorithm) if model == "policy" else []
        if not keys:
            return super()._execute_forward_pass(model, data_fwd_pass, key, mini_batch_boundaries)
        outputs, dispatch = [], self.dispatch

        def keeping(fn):  # the per-sample outputs SkyRL turns into the log-prob tensor, kept
            return lambda *args, **kwargs: (lambda out: outputs.extend(out.loss_fn_outputs) or out)(fn(*args, **kwargs))

        dispatch.forward, dispatch.forward_from_staged = keeping(dispatch.forward), keeping(dispatch.forward_from_staged)
        try:
            return super()._execute_forward_pass(model, data_fwd_pass, key, mini_batch_boundaries)
        finally:
            del dispatch.forward, dispatch.forward_from_staged
            self.stablerl_old_pass = {k: batch_field(outputs, k) for k in keys}

    def fwd_logprobs_values_reward(self, training_input):
        out = super().fwd_logprobs_values_reward(training_input)
        fields, self.stablerl_old_pass = getattr(self, "stablerl_old_pass", None) or {}, None
        for key, value in fields.items():
            if value is not None:
                out[key] = value[: len(out["sequences"])]
        return out

    # -- the advantage step ---------------------------------------------------------------------------------

    def convert_to_training_input(self, generator_output, uids):
        """SkyRL's batch, plus the environments' per-trajectory values a shaper / filter reads (``ENV_VALUES``)."""
        data, rows = super().convert_to_training_input(generator_output, uids), generator_output.get("env_metrics")
        for what in ENV_VALUES:
            values = [m.get(what) for m in rows or ()]
            if len(values) == len(uids) and None not in values:
                data["stablerl_" + what] = torch.tensor([bool(v) for v in values])
        return data

    @torch.no_grad()
    def compute_advantages_and_returns(self, data):
        adapter, step = self.stablerl_adapter, self.stablerl_step
        adapter.total_steps = getattr(self, "total_training_steps", None)
        record = BatchRecord(adapter=adapter, response_mask=data["response_mask"], index=list(data.metadata["uids"]),
                             token_level_rewards=data["rewards"], host=data)
        scores = record.response_scores()  # a loss's scores: the rewards before a shaper (verl's token_level_scores)
        metrics = step.shape(record) if step.selection.reward_shaper else {}
        if step.selection.reward_shaper:
            data["rewards"] = record.token_level_rewards
        adapter.pending = data
        try:
            data = super().compute_advantages_and_returns(data)
        finally:
            adapter.pending = None
        if step.selection.batch_filter:
            record.response_mask = data["response_mask"]
            _, filtered = step.filter(record, data["advantages"])
            keep = filtered.response_mask.to(data["loss_mask"].dtype)
            data["advantages"] = filtered.advantages.to(data["advantages"].dtype)
            data["loss_mask"] = data["loss_mask"] * keep
            metrics.update(filtered.metrics)
        adapter.driver_state.advance()
        self._loss_rows(data, record.index, scores)
        metrics.update(adapter.last_metrics)
        if metrics:
            self.all_metrics.update({f"stablerl/{k}": float(v) for k, v in metrics.items()})
        return data

    def _loss_rows(self, data, uids, scores) -> None:
        """The per-row inputs the stablerl loss reads (``_micro.ROW_INPUTS``) into the batch; the old pass's
        statistics no loss reads out of it."""
        loss = self.stablerl_loss and get_spec(POLICY_LOSS, self.stablerl_loss)
        if loss and "index" in loss.requires:
            ids = group_ids(uids)
            data["stablerl_index"], data["stablerl_group_size"] = ids, torch.bincount(ids)[ids]
        if loss and "scores" in loss.requires:
            data["stablerl_scores"] = scores.float()
        for stat, key in OLD_PASS.items():
            if not (loss and stat == "entropy" and "old_entropy" in loss.requires) and key in data:
                data.pop(key)

    # -- SkyRL's advantage pre-scaling, taken over for a stablerl loss -----------------------------------------

    @torch.no_grad()
    def _normalize_advantages(self, data, mini_batch_boundaries, prompt_boundaries=None):
        if self.stablerl_loss is None:
            return super()._normalize_advantages(data, mini_batch_boundaries, prompt_boundaries)
        algorithm = self.cfg.trainer.algorithm
        loss_mask = data["loss_mask"]
        if algorithm.advantage_batch_normalize:  # SkyRL's z-score, then its scaling divided out (float rounding)
            data = super()._normalize_advantages(data, mini_batch_boundaries, prompt_boundaries)
            data["advantages"] = self._unscaled(data["advantages"], loss_mask, mini_batch_boundaries)
        data["loss_mask"] = span_weights(loss_mask, mini_batch_boundaries, algorithm.loss_reduction == "token_mean")
        return data

    def _unscaled(self, scaled, loss_mask, mini_batch_boundaries):
        """SkyRL's per-mini-batch scaling divided out again, with SkyRL's own weights."""
        algorithm, out = self.cfg.trainer.algorithm, torch.zeros_like(scaled)
        for start, end in mini_batch_boundaries:
            mask = loss_mask[start:end]
            weight = apply_loss_reduction_to_advantages_minibatch(
                advantages=torch.ones_like(scaled[start:end]), loss_mask=mask, loss_reduction=algorithm.loss_reduction,
                micro_batch_size=self.cfg.trainer.micro_train_batch_size_per_gpu, max_seq_len=algorithm.max_seq_len)
            valid = (mask > 0) & (weight != 0)
            out[start:end] = torch.where(valid, scaled[start:end] / torch.where(valid, weight, 1.0), 0.0)
        return out

    # -- checkpoints -------------------------------------------------------------------------------------------

    def save_checkpoints(self) -> str:
        folder = super().save_checkpoints()
        if self.stablerl_adapter.driver_state:
            self.stablerl_adapter.driver_state.save(os.path.join(folder, STATE_FILE))
        return folder

    def load_checkpoints(self):
        out = super().load_checkpoints()
        if isinstance(out, tuple) and len(out) > 1 and out[1]:
            self.stablerl_adapter.driver_state.load(os.path.join(str(out[1]), STATE_FILE))
        return out
