"""A stablerl TRL ``GRPOTrainer`` subclass that feeds the off-policy losses ``decoupled_ppo`` (Hilton et al.,
arXiv 2110.00641; AReaL, arXiv 2505.24298) and ``a3po`` (arXiv 2512.06547) in the staleness experiment.

TRL 1.16 without vLLM gives a stablerl loss neither behaviour log-probs nor policy versions, and the adapter's
validation refuses both losses. In the staleness setup (``steps_per_generation = k + 1``,
``num_iterations = 1``, ``gradient_accumulation_steps = 1``) the three policies of decoupled PPO are all
available inside TRL:

* **behaviour** (``rollout_log_prob``): TRL's ``old_per_token_logps``. TRL computes them with a forward pass
  at generation time whenever the generation batch spans more than one optimizer step, i.e. with the weights
  that sampled the rollout. For k = 0 TRL skips that pass because the rollout is on-policy; the behaviour
  log-probs are then the training forward's own (detached).
* **proximal** (``old_log_prob``): the current policy, detached. AReaL's proximal policy is the one at the
  start of the training step (a recompute with the weights about to be updated). Every micro-batch here
  gets exactly one optimizer step, so those are the weights of the training forward itself and a recompute
  returns the same numbers (the demo model has no dropout) at the cost of one more forward pass. The PPO
  ratio ``exp(lp - lp_prox)`` is therefore 1 and its clip never fires: decoupled PPO reduces to a policy
  gradient weighted by ``w = pi_theta / pi_behav``, with tokens outside ``w <= 5`` rejected.
* **versions / policy_version** (a3po): the optimizer step (``state.global_step``) at which the row was
  generated, on every completion token (-1 on padding, AReaL's "not generated"), and the optimizer step at
  which it is trained. That is AReaL's convention (the engine's version = updates done), so a row i updates
  stale gets ``alpha = (i - 1) / i`` (0 for i <= 1).

The adapter is not changed. The subclass works around it in two places (a documented adapter hook for
extra loss inputs would replace both):

1. validation: while a config or this trainer is built, :func:`feedable_off_policy_inputs` makes the
   adapter's ``loss_inputs_trl_can_feed`` report the three inputs as feedable;
2. the loss call: ``_stablerl_policy_loss`` hands the behaviour log-probs to the adapter's existing
   vLLM path (``sampling_per_token_logps`` -> ``rollout_log_prob``, switched on for this call only; no IS
   ratio is applied there for a loss that requires ``rollout_log_prob``), drops ``old_per_token_logps`` so
   the adapter's proximal is the detached current log-prob, and passes ``versions`` / ``policy_version``
   through the keyword arguments the adapter forwards to ``stablerl.compute_policy_loss``.

Losses that do not declare ``rollout_log_prob`` (TRL's ``grpo``, ``stablerl_m2po``) pass through unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

OFF_POLICY_INPUTS = ("rollout_log_prob", "versions", "policy_version")
GENERATION_STEP_KEY = "stablerl_generation_step"  # per-row tensor: travels with the rows through TRL's shuffles


@contextlib.contextmanager
def feedable_off_policy_inputs() -> Iterator[None]:
    """While active, the adapter's input check counts :data:`OFF_POLICY_INPUTS` as feedable."""
    from stablerl.adapters.trl import trainer as adapter

    original = adapter.loss_inputs_trl_can_feed

    def can_feed(use_vllm_is: bool, routing_replay: bool = False) -> set[str]:
        return original(use_vllm_is, routing_replay) | set(OFF_POLICY_INPUTS)

    adapter.loss_inputs_trl_can_feed = can_feed
    try:
        yield
    finally:
        adapter.loss_inputs_trl_can_feed = original


def make_config(output_dir: str, loss: str, **kwargs: Any):
    """:func:`stablerl.adapters.trl.demo.make_config`, accepting decoupled_ppo / a3po."""
    from stablerl.adapters.trl import demo

    with feedable_off_policy_inputs():
        return demo.make_config(output_dir, loss, **kwargs)


def _trainer_class():
    from stablerl.adapters.trl import GRPOTrainer

    class OffPolicyGRPOTrainer(GRPOTrainer):
        """Feeds behaviour log-probs, the detached current policy as proximal, and policy versions."""

        def __init__(self, *args, **kwargs):
            with feedable_off_policy_inputs():
                super().__init__(*args, **kwargs)
            spec = self._stablerl_spec
            self._off_policy_requires = set(spec.requires) & set(OFF_POLICY_INPUTS) if spec else set()

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if self._off_policy_requires:
                rows = out["completion_ids"].size(0)
                out[GENERATION_STEP_KEY] = torch.full((rows,), int(self.state.global_step), dtype=torch.long,
                                                      device=out["completion_ids"].device)
            return out

        def _stablerl_policy_loss(self, inputs, logps, entropies, mode, router_log_prob=None):
            if "rollout_log_prob" not in self._off_policy_requires:
                return super()._stablerl_policy_loss(inputs, logps, entropies, mode, router_log_prob=router_log_prob)
            inputs = dict(inputs)
            behaviour = inputs.pop("old_per_token_logps", None)  # without it the adapter's proximal is logps.detach()
            inputs["sampling_per_token_logps"] = logps.detach() if behaviour is None else behaviour
            params = dict(self._stablerl_loss_params)
            if "versions" in self._off_policy_requires:
                step = int(self.state.global_step)
                generated = inputs.get(GENERATION_STEP_KEY)
                generated = torch.full((logps.size(0),), step, dtype=torch.long) if generated is None else generated
                versions = generated.to(logps.device).unsqueeze(1).expand(logps.shape)
                generated_token = inputs["completion_mask"].bool()
                params["versions"] = torch.where(generated_token, versions, torch.full_like(versions, -1))
                params["policy_version"] = step
            saved = (self.use_vllm, self.vllm_importance_sampling_correction, self._stablerl_loss_params)
            self.use_vllm, self.vllm_importance_sampling_correction, self._stablerl_loss_params = True, True, params
            try:
                return super()._stablerl_policy_loss(inputs, logps, entropies, mode, router_log_prob=router_log_prob)
            finally:
                self.use_vllm, self.vllm_importance_sampling_correction, self._stablerl_loss_params = saved

    return OffPolicyGRPOTrainer


_CLASS = None


def trainer_class():
    """The subclass of ``stablerl.adapters.trl.GRPOTrainer`` (built on first use: TRL loads lazily)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _trainer_class()
    return _CLASS


def make_trainer(args, callbacks=None, seed: int = 0, **kwargs: Any):
    """:func:`stablerl.adapters.trl.demo.make_trainer` with the off-policy subclass."""
    from transformers.trainer_callback import PrinterCallback

    from stablerl.adapters.trl import demo

    tokenizer = kwargs.pop("tokenizer", None) or demo.build_tokenizer()
    model = kwargs.pop("model", None)
    model = model if model is not None else demo.build_model(tokenizer, seed=seed)
    dataset = kwargs.pop("dataset", None)
    dataset = dataset if dataset is not None else demo.build_dataset(seed=seed)
    trainer = trainer_class()(model=model, reward_funcs=kwargs.pop("reward", demo.copy_reward), args=args,
                              train_dataset=dataset, processing_class=tokenizer, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)
    return trainer
