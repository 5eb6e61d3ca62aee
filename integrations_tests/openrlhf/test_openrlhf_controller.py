"""Entropy controllers in OpenRLHF 0.11.2 (adapters/openrlhf/_controller.py): ``adaptive_entropy`` steers OpenRLHF's
own ``--actor.entropy_coef`` through the real ActorPPOTrainer.training_step and Actor.forward (tiny dense Qwen3 on
CPU, DeepSpeed replaced by a plain backward), stepped once per optimizer step with the step's token-mean entropy.
The coefficient sequence equals the controller's own run on the reference entropy, and OpenRLHF's loss carries
``-c * H`` with that coefficient."""

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (nox -s openrlhf installs it)")

import math
from types import SimpleNamespace

import torch

import stablerl
import stablerl.adapters.openrlhf as adapter
from orlhf_helpers import dry_run, make_args, training_strategy
from stablerl.adapters.openrlhf import Selection
from test_openrlhf_loss_inputs import ORDER, TEMPERATURE, _batch, _reference_entropy, _tiny_dense

PARAMS = {"entropy_coef": 0.0, "entropy_target": 10.0, "entropy_coef_delta": 0.01}  # H ~ 4 <= 10: c rises


def _trainer(monkeypatch, params=PARAMS, loss="ppo", entropy_coef=None, gas=1, lr=0.0):
    """ActorPPOTrainer with the controller selected; with ``gas`` > 1 the model carries DeepSpeed's
    ``global_steps``, advanced every ``gas`` optimizer_step calls (as DeepSpeed's engine.step() does)."""
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from openrlhf.models import Actor

    adapter.instrument(now=True)
    monkeypatch.setattr(ppo_actor, "NaiveReplayBuffer", lambda *a, **k: SimpleNamespace())
    monkeypatch.setattr(ppo_actor, "torch_dist_barrier_and_cuda_sync", lambda: None)
    sel = Selection(policy_loss=None if loss == "ppo" else loss, entropy_controller="adaptive_entropy",
                    entropy_controller_params=dict(params))
    args = make_args(policy_loss_type=loss, stablerl=sel)
    args.ds = SimpleNamespace(packing_samples=False, ring_attn_size=1, tensor_parallel_size=1)
    args.actor.entropy_coef = entropy_coef
    model = _tiny_dense()
    actor = Actor(model)
    actor.packing_samples, actor.temperature = False, TEMPERATURE
    optim = torch.optim.SGD(actor.parameters(), lr=lr)
    calls = []
    if gas > 1:
        model.global_steps = 0

    def optimizer_step(optimizer, *a, **k):
        calls.append(1)
        if len(calls) % gas == 0:
            optimizer.step()
            optimizer.zero_grad()
            if gas > 1:
                model.global_steps += 1

    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1)
    trainer = ppo_actor.ActorPPOTrainer(training_strategy(args, optimizer_step), actor, None, optim, scheduler)
    return trainer, model


def _step(trainer, batch):
    n_tokens = float(batch.action_mask.sum())
    return trainer.training_step(batch, 0.0, 0, dict(dp_size=1, batch_num_tokens=n_tokens,
                                                        global_batch_size=float(len(ORDER))))


def test_adaptive_entropy_steers_openrlhfs_entropy_coef_as_the_controller_does(monkeypatch):
    trainer, model = _trainer(monkeypatch)
    batch, _ = _batch(False)
    mask = batch.action_mask.bool()
    entropy = float(_reference_entropy(model, batch)[mask].mean())  # lr 0: the same policy at every step
    assert 3.0 < entropy < math.log(64)
    reference = stablerl.make_controller("adaptive_entropy", **PARAMS)
    applied = []
    for _ in range(3):
        expected_coef = reference.applied_coef
        status = _step(trainer, batch)
        applied.append(trainer.args.actor.entropy_coef)
        assert trainer.args.actor.entropy_coef == expected_coef  # what OpenRLHF's training_step read
        metrics = status["metrics"]
        # OpenRLHF's own entropy term ran (entropy_coef not None) on the same entropy
        assert float(metrics["entropy_loss"]) == pytest.approx(entropy, rel=1e-5)
        reference.step(entropy=entropy)
        assert metrics["stablerl/adaptive_entropy/applied_coef"] == expected_coef
        assert metrics["stablerl/adaptive_entropy/entropy_coef"] == pytest.approx(reference.coef, abs=1e-12)
        assert status["weights"]["stablerl/adaptive_entropy/entropy_coef"] is None  # not reduced: every rank has it
    assert applied == pytest.approx([0.0, 0.01, 0.02])  # inactive until the first entropy, then +delta per step
    driver = adapter.OpenRLHFAdapter().worker(trainer).controller
    assert driver.controller.last_entropy == pytest.approx(entropy, rel=1e-6)  # float32 forward
    assert driver.controller.coef == pytest.approx(0.03)


def test_the_bonus_is_minus_c_times_the_token_mean_entropy_in_the_gradient(monkeypatch):
    """lr 0, the same micro-batch twice: the first step runs at c = 0, the second at c = 0.01; their gradients
    differ by exactly -0.01 * grad(token-mean entropy) (OpenRLHF's own term, at the coefficient set)."""
    trainer, model = _trainer(monkeypatch)
    batch, _ = _batch(False)
    grads = []

    def capture_backward(loss, *a):
        model.zero_grad()
        loss.backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])

    trainer.strategy.backward = capture_backward
    _step(trainer, batch)
    _step(trainer, batch)
    assert trainer.args.actor.entropy_coef == pytest.approx(0.01)
    model.zero_grad()
    mask = batch.action_mask
    attention = batch.attention_mask
    position_ids = (attention.long().cumsum(-1) - 1).masked_fill(attention == 0, 1)
    logits = model(batch.sequences, attention_mask=attention, position_ids=position_ids).logits.float() / TEMPERATURE
    logp = logits.log_softmax(-1)[:, :-1][:, -mask.shape[1]:]
    entropy = -(logp.exp() * logp).sum(-1)
    ((entropy * mask).sum() / mask.sum()).backward()
    changed = 0
    for g0, g1, p in zip(grads[0], grads[1], model.parameters()):
        torch.testing.assert_close(g1 - g0, -0.01 * p.grad, rtol=1e-3, atol=1e-7)
        changed += int(p.grad.abs().max() > 1e-6)
    assert changed > 0  # the entropy term moves the weights


def test_one_controller_step_per_deepspeed_optimizer_step(monkeypatch):
    """Gradient accumulation 2: DeepSpeed steps the optimizer at every second micro-batch, so does the controller,
    with the token-mean entropy of both micro-batches."""
    trainer, model = _trainer(monkeypatch, gas=2)
    batch, _ = _batch(False)
    driver = adapter.OpenRLHFAdapter().worker(trainer).controller
    seen = []
    for _ in range(4):
        _step(trainer, batch)
        seen.append(driver.controller.coef)
    assert seen == pytest.approx([0.0, 0.01, 0.01, 0.02])
    meter = adapter.OpenRLHFAdapter().worker(trainer).meter
    assert (meter.total, meter.count) == (0.0, 0.0)  # emptied at the optimizer step


def test_above_target_the_coefficient_stays_at_its_floor(monkeypatch):
    """OpenRLHF's tiny model is far above the default target 0.2: c falls to entropy_coef_min, the bonus stays 0."""
    params = {"entropy_coef": 0.02, "entropy_coef_delta": 0.015}
    trainer, _ = _trainer(monkeypatch, params=params)
    batch, _ = _batch(False)
    coefs = []
    for _ in range(3):
        _step(trainer, batch)
        coefs.append(adapter.OpenRLHFAdapter().worker(trainer).controller.controller.coef)
        assert trainer.args.actor.entropy_coef == 0.0
    assert coefs == pytest.approx([0.005, 0.0, 0.0])


def test_with_a_stablerl_loss(monkeypatch):
    """The controller works beside a stablerl policy loss (the bonus is OpenRLHF's, outside the loss)."""
    trainer, _ = _trainer(monkeypatch, loss="gmpo")
    batch, _ = _batch(False)
    status = _step(trainer, batch)
    assert "stablerl/adaptive_entropy/entropy_coef" in status["metrics"] and "entropy_loss" in status["metrics"]
    assert type(trainer.actor_loss_fn).__name__ == "StablePolicyLoss"


def test_a_set_entropy_coef_is_refused(monkeypatch):
    with pytest.raises(stablerl.StableRLError, match=r"sets OpenRLHF's entropy bonus itself: leave --actor.entropy_coef "
                                                     r"unset \(got 0.01\)"):
        _trainer(monkeypatch, entropy_coef=0.01)
    _trainer(monkeypatch, entropy_coef=0.0)  # 0 (only log the entropy) is what the controller starts from anyway


def test_controller_state_is_saved_with_the_worker_and_restored(monkeypatch):
    trainer, _ = _trainer(monkeypatch)
    batch, _ = _batch(False)
    _step(trainer, batch), _step(trainer, batch)
    store = adapter.OpenRLHFAdapter().controller_state.store()
    saved = store.state_dict()
    assert saved["holds"] == "controller"
    states = {"global_step": 2, adapter.OpenRLHFAdapter().controller_state.key: saved}
    # a fresh actor process: load_ckpt runs before ActorPPOTrainer is built
    adapter.OpenRLHFAdapter().controller_state.live = None
    adapter.OpenRLHFAdapter().controller_state.take(states, "ckpt")
    assert states == {"global_step": 2}  # taken out: it never reaches the driver
    resumed, _ = _trainer(monkeypatch)
    controller = adapter.OpenRLHFAdapter().worker(resumed).controller.controller
    assert controller.coef == pytest.approx(0.02) and math.isfinite(controller.last_entropy)
    assert resumed.args.actor.entropy_coef == pytest.approx(0.02)  # the restored coefficient is in force at once
    with pytest.raises(RuntimeError, match="is not a stablerl controller state"):
        state = adapter.OpenRLHFAdapter().controller_state
        state.take({state.key: {**saved, "holds": "loss"}}, "ckpt")


def test_controllers_openrlhf_cannot_feed_are_refused_with_the_reason():
    from stablerl.adapters.openrlhf import resolve

    with pytest.raises(stablerl.MissingInputError, match=r"rollout_temperature: OpenRLHF samples every rollout at one "
                                                         r"--rollout.temperature"):
        resolve(stablerl.CONTROLLER, "aepo")
    with pytest.raises(stablerl.MissingInputError, match=r"loss_term: a controller's own term is defined per agent turn"):
        resolve(stablerl.CONTROLLER, "epo")
    with pytest.raises(stablerl.StableRLError, match=r"entropy_target"):
        Selection(entropy_controller="adaptive_entropy", entropy_controller_params={"entropy_traget": 0.3}).validate()


def test_the_wrapper_flags_and_the_environment_route(monkeypatch):
    base = ["--actor.model_name_or_path", "Qwen/Qwen3-0.6B", "--rollout.n_samples_per_prompt", "4",
            "--algo.advantage.estimator", "group_norm"]
    args, init_kwargs = dry_run(monkeypatch, base + [
        "--actor.stablerl_entropy_controller", "adaptive_entropy",
        "--actor.stablerl_entropy_controller_params", "entropy_target=0.5", "entropy_coef_delta=0.002"])
    assert args.stablerl.entropy_controller == "adaptive_entropy"
    assert args.stablerl.entropy_controller_params == {"entropy_target": 0.5, "entropy_coef_delta": 0.002}
    with pytest.raises(SystemExit):
        dry_run(monkeypatch, base + ["--actor.stablerl_entropy_controller", "adaptive_entropy",
                                     "--actor.entropy_coef", "0.01"])
    monkeypatch.setenv("STABLERL_ENTROPY_CONTROLLER", "adaptive_entropy")
    monkeypatch.setenv("STABLERL_ENTROPY_CONTROLLER_PARAMS", "entropy_target=0.4")
    sel = adapter.selection_from_args(make_args())
    assert (sel.entropy_controller, sel.entropy_controller_params) == ("adaptive_entropy", {"entropy_target": 0.4})
    env = adapter.add_setup_hook({})["env_vars"]
    assert env["STABLERL_ENTROPY_CONTROLLER"] == "adaptive_entropy"
    assert env["STABLERL_ENTROPY_CONTROLLER_PARAMS"] == "entropy_target=0.4"
