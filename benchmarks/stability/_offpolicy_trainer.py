"""A stablerl TRL ``GRPOTrainer`` subclass that feeds the off-policy losses ``decoupled_ppo`` (Hilton et al.,
arXiv 2110.00641; AReaL, arXiv 2505.24298) and ``a3po`` (arXiv 2512.06547) in the staleness experiment.

(The TRL adapter itself now feeds a3po the behaviour log-probs and versions in AReaL's sense, generation rounds, so
alpha = 0 in TRL's synchronous trainer: see docs/trl.md. This subclass stays for the experiment: it counts every
optimizer step as a version, standing in for an asynchronous rollout, and supplies its proximal policy.) In the
staleness setup (``steps_per_generation = k + 1``,
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

The subclass uses the TRL adapter's extension point for trainer-supplied loss inputs: the config lists
them in ``stablerl_extra_loss_inputs`` (so validation accepts the losses) and the trainer returns them from
``stablerl_loss_inputs(inputs, log_prob)``: ``rollout_log_prob`` (behaviour), ``old_log_prob`` (proximal:
the detached current log-probs) and, for a3po, ``versions`` / ``policy_version``.

Losses that do not declare ``rollout_log_prob`` (TRL's ``grpo``, ``stablerl_m2po``) pass through unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

OFF_POLICY_INPUTS = ("rollout_log_prob", "versions", "policy_version")
GENERATION_STEP_KEY = "stablerl_generation_step"  # per-row tensor: travels with the rows through TRL's shuffles


def off_policy_inputs_of(loss: str) -> list[str]:
    """What this trainer supplies for ``loss`` (nothing for losses that do not declare a behaviour policy)."""
    import stablerl
    from stablerl.adapters.trl import resolve_loss_type

    name = resolve_loss_type(loss)
    requires = set(stablerl.get_spec(stablerl.POLICY_LOSS, name).requires) if name else set()
    if "rollout_log_prob" not in requires:
        return []
    return ["old_log_prob"] + [i for i in OFF_POLICY_INPUTS if i in requires]


def make_config(output_dir: str, loss: str, **kwargs: Any):
    """:func:`stablerl.tools.demo.make_config`, declaring the inputs this trainer supplies."""
    from stablerl.tools import demo

    return demo.make_config(output_dir, loss, stablerl_extra_loss_inputs=off_policy_inputs_of(loss) or None, **kwargs)


def _trainer_class():
    from stablerl.adapters.trl import GRPOTrainer

    class OffPolicyGRPOTrainer(GRPOTrainer):
        """Feeds behaviour log-probs, the detached current policy as proximal, and policy versions."""

        def _supplies(self) -> set:
            return set(self.args.stablerl_extra_loss_inputs or ())

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if "versions" in self._supplies():
                rows = out["completion_ids"].size(0)
                out[GENERATION_STEP_KEY] = torch.full((rows,), int(self.state.global_step), dtype=torch.long,
                                                      device=out["completion_ids"].device)
            return out

        def stablerl_loss_inputs(self, inputs, log_prob):
            supplies = self._supplies()
            if not supplies:
                return {}
            behaviour = inputs.get("old_per_token_logps")  # None at k = 0: TRL skipped the on-policy pass
            out = {"old_log_prob": log_prob.detach(),
                   "rollout_log_prob": log_prob.detach() if behaviour is None else behaviour}
            if "versions" in supplies:
                step = int(self.state.global_step)
                generated = inputs.get(GENERATION_STEP_KEY)
                generated = torch.full((log_prob.size(0),), step, dtype=torch.long) if generated is None else generated
                versions = generated.to(log_prob.device).unsqueeze(1).expand(log_prob.shape)
                generated_token = inputs["completion_mask"].bool()
                out["versions"] = torch.where(generated_token, versions, torch.full_like(versions, -1))
                out["policy_version"] = step
            return {k: v for k, v in out.items() if k in supplies}

    return OffPolicyGRPOTrainer


_CLASS = None


def trainer_class():
    """The subclass of ``stablerl.adapters.trl.GRPOTrainer`` (built on first use: TRL loads lazily)."""
    global _CLASS
    if _CLASS is None:
        _CLASS = _trainer_class()
    return _CLASS


def make_trainer(args, callbacks=None, seed: int = 0, **kwargs: Any):
    """:func:`stablerl.tools.demo.make_trainer` with the off-policy subclass."""
    from transformers.trainer_callback import PrinterCallback

    from stablerl.tools import demo

    tokenizer = kwargs.pop("tokenizer", None) or demo.build_tokenizer()
    model = kwargs.pop("model", None)
    model = model if model is not None else demo.build_model(tokenizer, seed=seed)
    dataset = kwargs.pop("dataset", None)
    dataset = dataset if dataset is not None else demo.build_dataset(seed=seed)
    trainer = trainer_class()(model=model, reward_funcs=kwargs.pop("reward", demo.copy_reward), args=args,
                              train_dataset=dataset, processing_class=tokenizer, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)
    return trainer
