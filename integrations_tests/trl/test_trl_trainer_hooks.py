"""Trainer hooks through TRL 1.16 (tiny model, CPU): SFPO's fast passes, reposition and slow pass.

Checks: after the K-th fast pass the parameters are exactly theta0 + alpha (theta_K - theta0); the whole
run equals, bit for bit, a run of the same trainer without the hook whose test callback does the
reposition by hand (so the slow pass is one ordinary step from the repositioned weights on the same batch);
the stop rule switches to one pass (one generation) per step; the state is checkpointed; refusals.
"""

import math
import os

import pytest
import torch
from transformers import TrainerCallback

import trl_helpers as H  # noqa: I001

import stablerl
from stablerl.adapters.trl import GRPOConfig, GRPOTrainer

K, ALPHA = 2, 0.6


def cfg(tmp_path, **kw):
    base = dict(num_iterations=K + 1, gradient_accumulation_steps=1, max_steps=2 * (K + 1))
    base.update(kw)
    return GRPOConfig(**H.base_kwargs(tmp_path, **base))


def flat(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


class Spy(GRPOTrainer):
    """Records theta0 at each batch start, the parameters right after each hook call, and the generations."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.slow, self.after_hook, self.generations = [], [], 0
        loop = self._stablerl_loop  # the trainer hook's passes (stablerl.adapters.trl._loop)
        before, after = loop.before_pass, loop.after_pass

        def before_pass():
            starts = loop.passes.pass_index is None and self.model.training
            before()
            if starts:
                self.slow.append(flat(self.model))

        def after_pass():
            after()
            self.after_hook.append(flat(self.model))

        loop.before_pass, loop.after_pass = before_pass, after_pass

    def _generate_and_score_completions(self, inputs):
        self.generations += 1
        return super()._generate_and_score_completions(inputs)


class HandReposition(TrainerCallback):
    """The reference schedule written literally: theta0 at each batch start, reposition after fast pass K."""

    def __init__(self, model):
        self.model, self.step, self.theta0 = model, 0, None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.step % (K + 1) == 0:
            self.theta0 = [p.detach().clone() for p in self.model.parameters() if p.requires_grad]

    def on_step_end(self, args, state, control, **kwargs):
        self.step += 1
        if self.step % (K + 1) == K:
            with torch.no_grad():
                for p, p0 in zip([p for p in self.model.parameters() if p.requires_grad], self.theta0):
                    p.copy_(p0 + ALPHA * (p - p0))


def sfpo_params(**kw):
    return {"inner_steps": K, "alpha": ALPHA, **kw}


@pytest.mark.parametrize("ga", [1, 2])  # GA = steps_per_generation: each pass is one optimizer step of GA micro-batches
def test_sfpo_reposition_and_slow_pass(tmp_path, ga):
    trainer, rec, initial = H.train(Spy, cfg(tmp_path / "a", trainer_hook="sfpo", stablerl_trainer_hook_params=sfpo_params(),
                                             gradient_accumulation_steps=ga), reward=H.binary_digit_reward)
    assert trainer.generations == 2  # one generation per K + 1 passes
    assert len(trainer.slow) == 2 and torch.equal(trainer.slow[0], initial)
    for b in range(2):
        theta0 = trainer.slow[b]
        fast = rec.params[b * (K + 1) + K - 1]  # the Recorder runs before the hook: theta_K
        assert not torch.equal(fast, theta0)
        repositioned = trainer.after_hook[b * (K + 1) + K - 1]
        assert torch.equal(repositioned, theta0 + ALPHA * (fast - theta0))
        slow_step = rec.params[b * (K + 1) + K]
        assert not torch.equal(slow_step, repositioned)  # the slow pass moved the weights
    assert torch.equal(trainer.slow[1], rec.params[K])  # the next batch starts from the slow pass's result
    logs = rec.logs[K - 1]
    assert logs["stablerl/sfpo/repositioned"] == 1.0

    # the same run without the hook, repositioned by hand: identical weights at every step
    model = H.tiny_model(0)
    hand = HandReposition(model)
    ref = GRPOTrainer(model=model, reward_funcs=H.binary_digit_reward, args=cfg(tmp_path / "b", gradient_accumulation_steps=ga),
                      train_dataset=H.build_dataset(64, seed=0), processing_class=H.TOKENIZER, callbacks=[hand])
    ref.train()
    assert torch.equal(flat(ref.model), rec.params[-1])


def test_sfpo_stop_rule_switches_to_one_pass(tmp_path):
    # window 2, threshold -1e9: the z-score exists from the 2nd batch on and always passes the threshold
    params = sfpo_params(zscore_window=2, zscore_threshold=-1e9)
    trainer, rec, _ = H.train(Spy, cfg(tmp_path, trainer_hook="sfpo", stablerl_trainer_hook_params=params,
                                       max_steps=2 * (K + 1) + 2), reward=H.binary_digit_reward)
    hook = trainer._stablerl_loop.hook
    assert hook.stopped and trainer.num_iterations == 1
    assert trainer.generations == 2 + 2  # two SFPO batches, then one generation per step
    assert len(hook.entropy_history) == 2  # window 2 (one slow-pass entropy per batch; later ones roll in)
    assert hook.batches == 4
    assert rec.logs[-1]["stablerl/sfpo/active"] == 0.0
    assert all(math.isfinite(log["loss"]) for log in rec.logs)


def test_sfpo_state_in_checkpoint(tmp_path):
    trainer, rec, _ = H.train(Spy, cfg(tmp_path, trainer_hook="sfpo", stablerl_trainer_hook_params=sfpo_params(),
                                       save_strategy="steps", save_steps=K + 1), reward=H.binary_digit_reward)
    state = torch.load(os.path.join(tmp_path, f"checkpoint-{2 * (K + 1)}", "stablerl_state.pt"), weights_only=False)
    saved = state["objects"]["trainer_hook"]["sfpo"]
    assert saved == trainer._stablerl_loop.hook.state_dict()
    assert saved["batches"] == 2 and len(saved["entropy_history"]) == 2
    assert saved["entropy_history"][-1] == pytest.approx(rec.logs[-1]["entropy"], rel=1e-6)


def test_trainer_hook_refusals(tmp_path):
    with pytest.raises(stablerl.StableRLError, match="num_iterations=3"):
        H.train(GRPOTrainer, cfg(tmp_path, trainer_hook="sfpo", num_iterations=2,
                                 stablerl_trainer_hook_params=sfpo_params()))
    with pytest.raises(stablerl.StableRLError, match="steps_per_generation"):
        H.train(GRPOTrainer, cfg(tmp_path, trainer_hook="sfpo", steps_per_generation=2,
                                 stablerl_trainer_hook_params=sfpo_params()))
    with pytest.raises(stablerl.StableRLError, match="sampling_rounds"):
        cfg(tmp_path, trainer_hook="reinforce_ada_sampler")
    with pytest.raises(stablerl.StableRLError, match="alpha"):
        cfg(tmp_path, trainer_hook="sfpo", stablerl_trainer_hook_params={"alpha": 1.5})


# ----------------------------------------------------------------------------- adaptive entropy vs TRL's own


@pytest.mark.parametrize("target", [100.0, 0.5])  # always below target (c rises) / always above (c falls to 0)
def test_adaptive_entropy_controller_equals_trl(tmp_path, target):
    """The adaptive_entropy controller against TRL 1.16's use_adaptive_entropy: same coefficient after every
    step, same weights (float64; GA=1 so both take the same entropy mean)."""
    trl_params = dict(entropy_coef=0.2, entropy_target=target, entropy_coef_delta=0.05, entropy_coef_min=0.0,
                      entropy_coef_max=0.3)
    common = dict(num_iterations=1, gradient_accumulation_steps=1, max_steps=3)
    native, rec_native, _ = H.train(GRPOTrainer, cfg(tmp_path / "trl", use_adaptive_entropy=True, **trl_params, **common),
                                    reward=H.binary_digit_reward, dtype=torch.float64)
    ours, rec_ours, _ = H.train(
        GRPOTrainer, cfg(tmp_path / "ours", entropy_controller="adaptive_entropy", stablerl_entropy_controller_params=trl_params,
                         **common), reward=H.binary_digit_reward, dtype=torch.float64)
    trl_coefs = [log["entropy_coef"] for log in rec_native.logs]
    our_coefs = [log["stablerl/adaptive_entropy/entropy_coef"] for log in rec_ours.logs]
    expected = [0.25, 0.3, 0.3] if target == 100.0 else [0.15, 0.1, 0.05]
    assert trl_coefs == pytest.approx(expected, abs=1e-12)
    assert our_coefs == pytest.approx(trl_coefs, abs=1e-12)
    assert ours._stablerl_loop.controller.last_entropy == pytest.approx(native._last_world_entropy, rel=1e-9)
    for a, b in zip(rec_native.params, rec_ours.params):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    # the bonus acted: without it the weights differ
    plain, rec_plain, _ = H.train(GRPOTrainer, cfg(tmp_path / "plain", **common), reward=H.binary_digit_reward,
                                  dtype=torch.float64)
    if target == 100.0:
        assert not torch.allclose(rec_plain.params[-1], rec_ours.params[-1], rtol=0, atol=1e-9)


def test_adaptive_entropy_refuses_trl_double_bonus(tmp_path):
    with pytest.raises(stablerl.StableRLError, match="use_adaptive_entropy"):
        H.train(GRPOTrainer, cfg(tmp_path, entropy_controller="adaptive_entropy", use_adaptive_entropy=True,
                                 num_iterations=1))


def test_trainer_hook_refuses_deepspeed():
    """Under DeepSpeed ZeRO the optimizer copies its fp32 master partitions over the parameters after each step,
    which would undo a reposition: refused (checked on the adapter's check, no DeepSpeed engine on CPU here)."""
    from types import SimpleNamespace

    fake = SimpleNamespace(args=SimpleNamespace(num_iterations=3, steps_per_generation=1, gradient_accumulation_steps=1),
                           accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=2))),
                           is_deepspeed_enabled=True)
    from stablerl.adapters.trl._loop import LoopExtras

    loop = SimpleNamespace(trainer=fake, hook_name="sfpo")
    with pytest.raises(stablerl.StableRLError, match="DeepSpeed"):
        LoopExtras._check_hook(loop, 3)
    fake.is_deepspeed_enabled = False
    LoopExtras._check_hook(loop, 3)  # DDP / single process: fine
