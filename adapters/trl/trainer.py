"""stablerl in TRL: a drop-in ``GRPOTrainer`` / ``GRPOConfig`` pair (TRL >= 1.16, < 1.17); see docs/trl.md.

    from stablerl.adapters.trl import GRPOConfig, GRPOTrainer
    args = GRPOConfig(loss_type="m2po", advantage_estimator="qae",
                      stablerl_loss_params={"m2_threshold": 0.04}, stablerl_advantage_params={"quantile_k": 0.4})

Glue only. Each of TRL's methods the trainer overrides calls one collaborator and TRL's own method:

* ``_generate_and_score_completions`` / ``_calculate_rewards``: the advantage step's call site
  (:mod:`._rollout`: core's ``AdvantageStep`` on one :class:`~._records.GenerationBatch` record per generation batch);
* ``_get_per_token_logps_and_entropies``: what the adapter records in TRL's forwards (:mod:`._passes`);
* ``_compute_loss``: the stablerl policy loss around TRL's own (:mod:`._loss`);
* ``_generate_single_turn`` / ``_generate`` / ``compute_loss`` / ``training_step``: MoE routing replay
  (:mod:`._routing`) and the trainer hook;
* a callback and ``_load_optimizer_and_scheduler``: the controller, the trainer hook, the checkpointed state
  (:mod:`._loop`).

TRL's config keys are read in :mod:`._config`; the decisions are core's (``stablerl.frameworks``, ``stablerl.steps``,
``stablerl.trainer_loop``, ``stablerl.state``, ``stablerl.routing_replay``). Nothing of TRL's is patched (the
adapter checks TRL's version and private signatures, :class:`~._adapter.TRLAdapter`); a trainer rebinds two things
of its own, through its own :class:`~stablerl.patching.PatchLedger` (``_stablerl_ledger``): ``self.loss_type`` while
TRL's ``_compute_loss`` hosts a stablerl loss, and the policy's ``model.forward`` (TRL's fused LM head, asked also
for ``log_sum_sq_probs``) when a selected estimator reads ``sum_pi_squared``.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Optional

import torch

import stablerl
from stablerl.contracts import POLICY_LOSS, ROLLOUT_CORRECTION
from stablerl.frameworks import effective_hyperparameters, log_effective_settings
from stablerl.params import StableRLError
from stablerl.patching import PatchLedger

from ._adapter import VERSION_KEY, TRLAdapter, UnsupportedTRLVersionError
from ._config import (EXTENSION_KINDS, SUPPORTED_TRL, TRL, TRL_LOSS_TYPES, GRPOConfig, TRL_GRPOTrainer,
                      advantage_settings, check_rollout_correction, loss_inputs_trl_can_feed, loss_settings,
                      resolve_loss_type, rollout_correction_setting, routing_replay_mode, selection_of,
                      validate_stablerl_args, validate_stablerl_extensions, without_rollout_correction)
from ._loop import STATE_FILE, LoopExtras, StateCallback
from ._loss import PolicyLossStep
from ._passes import ForwardPasses
from ._records import GenerationBatch, LossBatch
from ._rollout import AdvantageCallSite
from ._teacher import setup as setup_teacher
from ._routing import RoutingReplay, check_rollout
from ._sampling_mask import SamplingMaskReplay

instrument = TRLAdapter().instrument  # TRL's version and private signatures (done on import); idempotent
uninstrument = TRLAdapter().uninstrument  # nothing of TRL's to put back


def check_trl(trl_module=None) -> None:
    """Raise :class:`UnsupportedTRLVersionError` unless TRL is in the supported range (core's one version policy;
    ``STABLERL_ALLOW_UNSUPPORTED=1``, or the older ``STABLERL_TRL_SKIP_VERSION_CHECK=1``, makes it a warning) and
    the private methods this adapter uses have the expected signatures (always checked)."""
    TRLAdapter().check(trl_module)


class GRPOTrainer(TRL_GRPOTrainer):
    """TRL's ``GRPOTrainer`` with stablerl policy losses, advantage estimators, shapers, filters, controllers, trainer
    hooks and MoE routing replay. Accepts this module's :class:`GRPOConfig` (or TRL's: stablerl fields at defaults).

    Extension points: :meth:`stablerl_loss_inputs` (with ``stablerl_extra_loss_inputs``), :meth:`save_stablerl_state`
    / :meth:`load_stablerl_state`."""

    # the record of the generation batch / the loss micro-batch under way while TRL's own method runs (None between)
    _stablerl_batch: Optional[GenerationBatch] = None
    _stablerl_pass: Optional[LossBatch] = None
    _stablerl_replay: Optional[SamplingMaskReplay] = None  # sampling-mask replay (set up in _stablerl_setup)

    def __init__(self, *args, **kwargs):
        check_rollout(args, kwargs)  # before TRL builds (or imports) vLLM
        super().__init__(*args, **kwargs)
        self._stablerl_setup()

    def _stablerl_setup(self) -> None:
        """The collaborators, from ``self.args`` (a stablerl GRPOConfig was validated when it was built; a plain TRL
        one is validated here); the effective hyper-parameters are printed once with their sources."""
        cfg = self.args
        self._stablerl_ledger = PatchLedger("__stablerl_trl_trainer_patch__")
        sel = selection_of(cfg)
        loss, estimator = self._stablerl_loss, self._stablerl_estimator = sel.policy_loss, sel.advantage_estimator
        spec = stablerl.get_spec(POLICY_LOSS, loss) if loss else None
        loss_params, call_options = sel.effective_loss_params() if loss else ({}, {})
        call_options = without_rollout_correction(call_options)  # the correction: its own key
        selection = sel.advantage_selection(sel.effective_estimator_params() if estimator else {})
        correction, correction_params = check_rollout_correction(cfg, loss), rollout_correction_setting(cfg)[1]
        if correction:
            if not (self.use_vllm or self.rollout_func is not None):
                raise StableRLError(f"stablerl_rollout_correction={correction!r} needs the rollout engine's sampling "
                                    "log-probs: use_vllm=True or a rollout_func returning logprobs")
            cspec = stablerl.get_spec(ROLLOUT_CORRECTION, correction)
            log_effective_settings(TRL, cspec, effective_hyperparameters(TRL, cspec, correction_params, {}))
        needs = set(spec.requires) if spec else set()
        self._stablerl_versions = "versions" in needs
        # A-3PO's weight versions (AReaL's sense): training generation rounds so far, and the round of the batch now
        # being trained (TRL's synchronous loop trains only its latest generation batch: versions == policy_version)
        self._stablerl_generation_rounds, self._stablerl_policy_version = 0, 0
        self._stablerl_routing = RoutingReplay(self, routing_replay_mode(cfg), router_lp="router_log_prob" in needs)
        self._stablerl_losses = PolicyLossStep(
            self, loss, params=loss_params, call_options=call_options, correction=correction,
            agg_mode=getattr(cfg, "stablerl_loss_agg_mode", "token-mean"), correction_params=correction_params)
        self._stablerl_loop = LoopExtras(self, {key: getattr(sel, key) for key in EXTENSION_KINDS})
        self._stablerl_store = self._stablerl_loop.store  # every algorithm's state, saved in TRL's checkpoints
        self._stablerl_replay = SamplingMaskReplay(self, reads_rollout=bool(
            (getattr(self, "use_vllm", False) and getattr(self, "vllm_importance_sampling_correction", False))
            or correction or getattr(self, "off_policy_mask_threshold", None) is not None
            or "rollout_log_prob" in needs))
        self._stablerl_teacher = setup_teacher(self, selection.reads("teacher_log_prob"))  # on-policy distillation
        self._stablerl_passes = ForwardPasses(self, self._stablerl_routing, sum_sq=selection.reads("sum_pi_squared"))
        self._stablerl_rollout = AdvantageCallSite(self, self._stablerl_passes, selection, loss_reads=needs)
        per_process = cfg.per_device_train_batch_size * cfg.steps_per_generation
        if "index" in needs and (cfg.steps_per_generation > 1 or per_process % cfg.num_generations):
            warnings.warn(
                f"policy loss {loss!r} uses prompt groups, but TRL shuffles the generation batch and splits it into "
                f"steps_per_generation={cfg.steps_per_generation} micro-batches (and {per_process} rows per process "
                f"for groups of {cfg.num_generations}), so the loss sees partial groups. For whole groups use "
                "steps_per_generation=1 (gradient_accumulation_steps=1) and a per_device_train_batch_size divisible "
                "by num_generations.", UserWarning, stacklevel=3)
        if loss or selection.active or self._stablerl_loop.driver or self._stablerl_loop.passes:
            self.add_callback(StateCallback(self))

    def _mode(self) -> str:
        return "train" if self.model.training else "eval"

    def _stablerl_log(self, mode: str, metrics: dict, prefix: str = "stablerl/", gathered: bool = False) -> None:
        """Log ``metrics`` as ``prefix + key``, averaged over processes unless ``gathered`` (the same everywhere)."""
        if not metrics:
            return
        values = [float(v) for v in metrics.values()]
        if not gathered:
            local = torch.tensor(values, dtype=torch.float32, device=self.accelerator.device)
            values = self.accelerator.gather(local).view(-1, len(metrics)).mean(0).tolist()
        for key, value in zip(metrics, values):
            self._metrics[mode][prefix + key].append(value)

    # -- generation: routes of the rollout, rewards, the advantage step ------------------------------------

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return self._stablerl_routing.generate_single_turn(
            super()._generate_single_turn, self._stablerl_batch, prompt_ids, images, multimodal_fields,
            num_generations, has_tool_images=has_tool_images)

    def _generate(self, prompts):
        out = super()._generate(prompts)
        if self._stablerl_replay is not None:
            out = self._stablerl_replay.generated(self._stablerl_batch, out)
        return self._stablerl_routing.generated(self._stablerl_batch, out)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        return self._stablerl_rollout.rewards(
            self._stablerl_batch, super()._calculate_rewards(inputs, prompts, completions, completion_ids_list), inputs)

    def _generate_and_score_completions(self, inputs):
        batch = self._stablerl_batch = self._stablerl_rollout.begin(self._mode())
        try:
            out = super()._generate_and_score_completions(inputs)
            self._stablerl_routing.finish(batch, out)
            if self._stablerl_replay is not None:
                self._stablerl_replay.finish(batch, out, self._stablerl_passes)
        finally:
            self._stablerl_batch = None
        out = self._stablerl_rollout.finish(batch, out)
        if self._stablerl_versions:  # A-3PO: the version of the weights that generated each row
            rows = out["completion_ids"].size(0)
            out[VERSION_KEY] = torch.full((rows,), self._stablerl_generation_round(), dtype=torch.long,
                                          device=out["completion_ids"].device)
        return out

    def _stablerl_generation_round(self) -> int:
        """A-3PO's version of the weights generating now, in AReaL's sense (one version per weight sync to the
        rollout engine, constant over the optimizer steps that train one rollout batch): the index of this training
        generation round (each new generation batch sees the weights after all updates so far); it becomes the
        policy version of the batch now being trained. An evaluation generation is of the latest round's version."""
        if self._mode() == "train":
            self._stablerl_policy_version = self._stablerl_generation_rounds
            self._stablerl_generation_rounds += 1
        return self._stablerl_policy_version

    # -- the forwards and the loss -----------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        parent = functools.partial(super()._get_per_token_logps_and_entropies, model, input_ids, attention_mask,
                                   logits_to_keep, *args)
        return self._stablerl_passes.forward(parent, model, input_ids, logits_to_keep, kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return self._stablerl_routing.compute_loss(super().compute_loss, model, inputs, return_outputs=return_outputs,
                                                   num_items_in_batch=num_items_in_batch)

    def training_step(self, model, inputs, num_items_in_batch):
        self._stablerl_loop.before_pass()  # the trainer hook, at the first pass over a generation batch
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._stablerl_routing.release()  # after backward (nothing to release without routing replay)

    def _compute_loss(self, model, inputs):
        return self._stablerl_losses.compute(super()._compute_loss, model, inputs)

    def _stablerl_policy_loss(self, inputs, logps, entropies, mode, router_log_prob=None):
        """The stablerl policy term on TRL's micro-batch (``(loss, value for TRL's policy_loss metric)``), which
        ``_compute_loss`` adds to TRL's surroundings."""
        return self._stablerl_losses.policy_loss(inputs, logps, entropies, mode, router_log_prob=router_log_prob)

    def stablerl_loss_inputs(self, inputs: dict, log_prob: torch.Tensor) -> dict[str, Any]:
        """Extension point: ``{name: value}`` for the names in ``stablerl_extra_loss_inputs`` (``[B, C]`` tensors like
        ``log_prob``, or scalars); ``inputs``: TRL's micro-batch dict. See docs/trl.md. Default: nothing."""
        return {}

    # -- checkpointed state: the controller, every ctx.state dict, the shapers/filters' generator -----------

    def stablerl_state_dict(self) -> dict[str, Any]:
        """What :meth:`save_stablerl_state` writes (``StateStore.state_dict()``): the same on every process."""
        return self._stablerl_store.state_dict()

    def load_stablerl_state_dict(self, state: dict[str, Any]) -> None:
        self._stablerl_loop.load_state_dict(state)

    def save_stablerl_state(self, folder: str) -> str:
        return self._stablerl_store.save(os.path.join(folder, STATE_FILE))

    def load_stablerl_state(self, folder: str) -> bool:
        """Restore from ``folder``/stablerl_state.pt (or stablerl_controller.json); False when it has neither."""
        state = LoopExtras.read(folder)
        if state is not None:
            self.load_stablerl_state_dict(state)
        return state is not None

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and getattr(self, "_stablerl_loop", None) is not None:
            self.load_stablerl_state(checkpoint)  # every process reads the same file


__all__ = ["GRPOConfig", "GRPOTrainer", "SUPPORTED_TRL", "TRL_LOSS_TYPES", "UnsupportedTRLVersionError", "check_trl",
           "instrument", "uninstrument", "resolve_loss_type", "routing_replay_mode", "validate_stablerl_args",
           "validate_stablerl_extensions",
           # the config's helpers, also read from here by tests and tools
           "advantage_settings", "loss_inputs_trl_can_feed", "loss_settings", "rollout_correction_setting",
           "without_rollout_correction"]
