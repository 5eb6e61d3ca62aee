"""What acts between TRL's optimizer steps: the entropy controller and the trainer hook (``stablerl.trainer_loop``
drives them), and the stablerl state they and every algorithm keep (one :class:`~stablerl.state.StateStore` per
trainer, saved as ``stablerl_state.pt`` in each of TRL's checkpoint folders). A ``TrainerCallback`` calls them after
each optimizer step and at each save.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

from transformers import TrainerCallback

import stablerl
from stablerl.contracts import CONTROLLER, TRAINER_HOOK, ParamsView
from stablerl.params import StableRLError
from stablerl.state import LEGACY_FORMAT, StateStore, from_legacy_json, read_state
from stablerl.trainer_loop import ControllerDriver, HookPasses

from ._config import EXTENSION_PARAMS_KEYS, params_of

STATE_FILE = "stablerl_state.pt"
LEGACY_STATE_FILE = "stablerl_controller.json"  # JSON of stablerl 0.1 development versions, still read
RNG_STREAM = "reward_shaper+batch_filter"  # one generator for shapers and filters (AdvantageCallSite.ctx)


class LoopExtras:
    """One trainer's controller, trainer hook and state store (``names``: the validated extension selections)."""

    def __init__(self, trainer, names: dict[str, Optional[str]]):
        self.trainer = trainer
        cfg = trainer.args
        # algorithm state kept across steps, per trainer (several may share a process), saved in TRL's checkpoints
        self.store = StateStore(holds="trainer")
        self.rng = self.store.generator(RNG_STREAM, int(cfg.seed))
        self.driver: Optional[ControllerDriver] = None
        self.passes: Optional[HookPasses] = None
        self._entropy_seen: tuple = (None, 0)
        self._step_entropy: tuple = (None, None)
        name = names["entropy_controller"]
        if name:
            # a controller that sets an entropy bonus (it declares the input: adaptive_entropy) adds its own
            bonus = "entropy_bonus" in stablerl.get_spec(CONTROLLER, name).requires
            if bonus and (getattr(cfg, "use_adaptive_entropy", False) or getattr(cfg, "entropy_coef", 0.0)):
                raise StableRLError(
                    f"entropy_controller={name!r} adds its own entropy bonus: leave TRL's use_adaptive_entropy "
                    "False and entropy_coef 0 (set the initial coefficient in stablerl_entropy_controller_params)")
            self.driver = ControllerDriver(name, params_of(cfg, EXTENSION_PARAMS_KEYS["entropy_controller"]),
                                           apply=self.apply, provides=("entropy", "turn_entropy"), framework="TRL",
                                           gives="TRL gives the mean entropy of each optimizer step")
            self.store.track(CONTROLLER, name, self.driver)
            if self.driver.per_turn:
                warnings.warn(
                    f"entropy_controller {name!r} works per turn; TRL's GRPOTrainer has no turn ids, so every sample is "
                    "turn 0 and the controller keeps one entropy history (for epo: its penalty applies only to turns >= "
                    "max_steps/2, so with turn 0 it stays 0 -- epo is meant for multi-turn agent loops)",
                    UserWarning, stacklevel=4)
        self.hook_name = names["trainer_hook"]
        if self.hook_name:
            self.passes = HookPasses(self.hook_name, params_of(cfg, EXTENSION_PARAMS_KEYS["trainer_hook"]))
            self._check_hook(self.passes.hook.passes_per_batch())
            self.store.track(TRAINER_HOOK, self.hook_name, self.passes.hook)

    @property
    def controller(self) -> Any:
        return None if self.driver is None else self.driver.controller

    @property
    def hook(self) -> Any:
        return None if self.passes is None else self.passes.hook

    # -- the controller -------------------------------------------------------------------------------

    def apply(self, decision: dict[str, Any]) -> None:
        """A controller's ``temperature`` decision sets the sampling temperature of the next generations (not TRL's
        ``self.temperature``, which scales the logits of every log-prob pass: AEPO computes log-probs at the training
        temperature)."""
        if decision.get("temperature") is None:
            return
        t, temperature = self.trainer, float(decision["temperature"])
        if t.use_vllm:
            t.vllm_generation.temperature = temperature
        if getattr(t, "generation_config", None) is not None:
            t.generation_config.temperature = temperature
        if isinstance(getattr(t, "generation_kwargs", None), dict):
            t.generation_kwargs["temperature"] = temperature

    def loss_term(self, entropies, mask, ctx):
        """The controller's own term (EPO) on the training forward's entropies: ``(term, metrics)``."""
        return self.driver.loss_term(entropies, mask, ctx)

    def controller_step(self) -> None:
        """Once per optimizer step, with TRL's mean entropy of the step (the same on every process)."""
        if self.driver is None:
            return
        entropy = self.step_entropy()
        metrics = self.driver.step(entropy=entropy, turn_entropy=[float("nan") if entropy is None else entropy])
        self.trainer._stablerl_log("train", metrics, prefix=f"stablerl/{self.driver.name}/", gathered=True)

    def step_entropy(self) -> Optional[float]:
        """TRL's mean entropy of the micro-batches of the optimizer step that just ended (each value already
        reduced over processes by TRL); read once per step, shared by the controller and the trainer hook."""
        t = self.trainer
        step = int(t.state.global_step)
        if self._step_entropy[0] == step:
            return self._step_entropy[1]
        values = t._metrics["train"].get("entropy")
        values = [] if values is None else values
        seen, count = self._entropy_seen
        new = values[count:] if seen is values else values  # TRL's log() replaces the lists after logging
        self._entropy_seen = (values, len(values))
        new = [v for v in new if not (isinstance(v, float) and v != v)]
        entropy = sum(new) / len(new) if new else None
        self._step_entropy = (step, entropy)
        return entropy

    # -- the trainer hook -----------------------------------------------------------------------------

    def _check_hook(self, passes: int) -> None:
        t, cfg, name = self.trainer, self.trainer.args, self.hook_name
        if cfg.num_iterations != passes:
            raise StableRLError(
                f"trainer_hook={name!r} runs {passes} optimizer passes over each generation batch: set "
                f"num_iterations={passes} (TRL reuses a generation batch num_iterations times), got {cfg.num_iterations}")
        if cfg.steps_per_generation != cfg.gradient_accumulation_steps:
            raise StableRLError(
                f"trainer_hook={name!r} needs one optimizer step per pass over the generation batch: "
                f"steps_per_generation ({cfg.steps_per_generation}) must equal gradient_accumulation_steps "
                f"({cfg.gradient_accumulation_steps})")
        if getattr(t, "is_deepspeed_enabled", False):
            # ZeRO keeps the fp32 master weights in the optimizer's own flat partitions and copies them over the
            # model's parameters after every step (ZeRO-3 also partitions the parameters themselves)
            raise StableRLError(f"trainer_hook={name!r} changes the parameters in place between passes; under "
                                "DeepSpeed the next optimizer step would overwrite them from its fp32 master "
                                "partitions: use DDP or FSDP (the optimizer then steps the parameters themselves)")

    def params_view(self) -> ParamsView:
        model = self.trainer.model
        return ParamsView(parameters=lambda: [p for p in model.parameters() if p.requires_grad],
                          optimizer=self.trainer.optimizer)

    def before_pass(self) -> None:
        """At the first micro-batch of an optimizer step: a new generation batch starts when no pass is under way."""
        t, passes = self.trainer, self.passes
        if passes is None or not t.model.training or passes.pass_index is not None:
            return
        generate_every = t.args.steps_per_generation * t.num_iterations
        if t._step % generate_every != 0:
            raise StableRLError(f"trainer_hook={self.hook_name!r}: a generation batch starts at micro-step "
                                f"{t._step}, not a multiple of {generate_every} (resumed mid-batch?)")
        passes.before_pass(self.params_view(), passes=t.num_iterations)

    def after_pass(self) -> None:
        """After each optimizer step (one pass over the generation batch); after a batch's last pass, the hook's
        passes per batch become TRL's num_iterations."""
        passes = self.passes
        if passes is None or passes.pass_index is None:
            return
        metrics = passes.after_pass(self.params_view(), entropy=self.step_entropy())
        self.trainer._stablerl_log("train", metrics, prefix=f"stablerl/{self.hook_name}/", gathered=True)
        if passes.pass_index is None:
            # e.g. sfpo after its stop rule: one pass per batch from now on. TRL's sampler still repeats each
            # prompt batch for the num_iterations it was built with, so each repeat is generated afresh.
            self.trainer.num_iterations = self.hook.passes_per_batch()

    # -- the state --------------------------------------------------------------------------------------

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") == LEGACY_FORMAT:  # stablerl_controller.json of earlier development versions
            state = from_legacy_json(state, "trainer", (RNG_STREAM, int(self.trainer.args.seed)))
        self.store.load_state_dict(state, where="the checkpoint's " + STATE_FILE)
        self.rng = self.store.generator(RNG_STREAM, int(self.trainer.args.seed))

    @staticmethod
    def read(folder: str) -> Optional[dict]:
        """The state in ``folder``/stablerl_state.pt (or stablerl_controller.json); None when it has neither."""
        for name in (STATE_FILE, LEGACY_STATE_FILE):
            state = read_state(os.path.join(folder, name), map_location="cpu")
            if state is not None:
                return state
        return None


class StateCallback(TrainerCallback):
    """After each optimizer step: the trainer hook and the entropy controller act; at each save, the stablerl state
    (``stablerl_state.pt``) goes into the checkpoint folder (restored in ``_load_optimizer_and_scheduler``)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._stablerl_loop.after_pass()
        self.trainer._stablerl_loop.controller_step()

    def on_save(self, args, state, control, **kwargs):
        if not args.should_save:
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = os.path.join(self.trainer._get_output_dir(trial=None), f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if os.path.isdir(folder):
            self.trainer.save_stablerl_state(folder)


__all__ = ["LoopExtras", "StateCallback", "STATE_FILE"]
