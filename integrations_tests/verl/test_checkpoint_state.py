"""stablerl state survives verl checkpoints: the losses' ``Context.state`` (actor workers, saved by the FSDP
engine subclass next to the actor's shards) and the advantage site's state (driver, saved by the trainers'
``_save_checkpoint``). A resumed run continues exactly where the uninterrupted one is."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from test_ppo_loss import _nt, _worker_batch  # noqa: E402  (conftest puts this folder on sys.path)
from tiny_moe import tiny_moe


class _CheckpointManagerStub:
    """verl's FSDPCheckpointManager writes the FSDP shards; the stub only records the calls."""

    def __init__(self):
        self.calls = []

    def save_checkpoint(self, local_path, **kw):
        os.makedirs(local_path, exist_ok=True)
        self.calls.append(("save", local_path))

    def load_checkpoint(self, local_path, **kw):
        self.calls.append(("load", local_path))


def _engine(make_engine):
    eng = make_engine(None, tiny_moe())
    eng.checkpoint_manager = _CheckpointManagerStub()
    eng._uses_fsdp2_cpu_offload_policy = True  # skip verl's "load the FSDP model to the GPU" before saving
    return eng


def _entropic_step(adapter, actor_config):
    """One call of verl's (wrapped) ppo_loss with EntroPIC; returns the loss and the log-prob gradient."""
    from verl.workers.utils.losses import ppo_loss

    data, leaves = _worker_batch(seed=0)
    # high-probability tokens (p > 0.95), where EntroPIC's alpha acts
    leaves = [(torch.full_like(x, -0.02) + 0.005 * torch.arange(len(x))).requires_grad_(True) for x in leaves]
    data["old_log_probs"] = _nt([torch.full_like(x, -0.03) for x in data["old_log_probs"].unbind()])
    entropy = [torch.full_like(x, 0.3) for x in leaves]  # below the target: the controller integrates
    cfg = actor_config(policy_loss=adapter.StablePolicyLossConfig(
        loss_mode="entropic", target_entropy=0.6, entropy_control_p=0.5, entropy_control_i=0.5))
    loss, _ = ppo_loss(cfg, {"log_probs": _nt(leaves), "entropy": _nt(entropy)}, data)
    return loss.detach(), torch.cat(torch.autograd.grad(loss, leaves))


def test_engine_saves_and_restores_the_losses_state(adapter, actor_config, make_engine, tmp_path):
    from stablerl.adapters.verl import _inputs

    eng = _engine(make_engine)
    _inputs.verl_adapter().state.loss.clear()
    uninterrupted = [_entropic_step(adapter, actor_config) for _ in range(4)]
    assert _inputs.state_for("entropic")["entropic"]["updates"] == 4

    _inputs.verl_adapter().state.loss.clear()
    for _ in range(3):
        _entropic_step(adapter, actor_config)
    saved = _inputs.verl_adapter().state.loss.state_dict()["slots"]
    saved = {name: dict(s["entropic"]) for name, s in saved["policy_loss"].items()}
    actor_dir = str(tmp_path / "global_step_3" / "actor")
    eng.save_checkpoint(actor_dir, None, global_step=3)
    assert eng.checkpoint_manager.calls == [("save", actor_dir)]
    assert os.path.exists(os.path.join(actor_dir, "stablerl_loss_state_rank0.pt"))

    _inputs.verl_adapter().state.loss.clear()  # a fresh process
    fresh = _entropic_step(adapter, actor_config)
    assert not torch.allclose(fresh[1], uninterrupted[3][1])  # without the state the step differs

    _inputs.verl_adapter().state.loss.clear()
    eng.load_checkpoint(actor_dir)
    restored = _inputs.verl_adapter().state.loss.state_dict()["slots"]["policy_loss"]
    assert {name: dict(s["entropic"]) for name, s in restored.items()} == saved
    resumed = _entropic_step(adapter, actor_config)
    torch.testing.assert_close(resumed[0], uninterrupted[3][0], rtol=0, atol=0)
    torch.testing.assert_close(resumed[1], uninterrupted[3][1], rtol=0, atol=0)


def test_checkpoint_without_stablerl_state_loads_as_before(adapter, make_engine, tmp_path, monkeypatch):
    from stablerl.adapters.verl import _inputs
    from stablerl.state import StateStore

    eng = _engine(make_engine)
    # a fresh worker's store: clear() keeps tracked objects (a controller or trainer hook an earlier test in this
    # process built would still be saved), so the test must not depend on which tests ran before it
    monkeypatch.setattr(_inputs.verl_adapter().state, "loss", StateStore(holds="loss"))
    eng.save_checkpoint(str(tmp_path / "actor"))  # no stateful loss ran: no file
    assert not [f for f in os.listdir(tmp_path / "actor") if f.startswith("stablerl")]
    _inputs.state_for("entropic")["entropic"] = {"integral": 1.0}
    eng.load_checkpoint(str(tmp_path / "actor"))
    untouched = {"policy_loss": {"entropic": {"entropic": {"integral": 1.0}}}}
    assert _inputs.verl_adapter().state.loss.state_dict()["slots"] == untouched
    torch.save({"something": "else"}, tmp_path / "actor" / "stablerl_loss_state_rank0.pt")
    with pytest.raises(RuntimeError, match="stablerl_loss_state_rank0.pt is not a stablerl loss state"):
        eng.load_checkpoint(str(tmp_path / "actor"))


def _trainer(tmp_path, steps, resume_mode="auto"):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({
        "trainer": {"default_local_dir": str(tmp_path), "default_hdfs_dir": None, "resume_mode": resume_mode,
                    "resume_from_path": None, "del_local_ckpt_after_load": False},
        "actor_rollout_ref": {"actor": {"checkpoint": {"async_save": False}}},
    })
    worker_group = SimpleNamespace(save_checkpoint=lambda *a, **k: None, load_checkpoint=lambda *a, **k: None)
    class _Loader:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

        def __len__(self):
            return 100

    loader = _Loader()
    return SimpleNamespace(config=cfg, global_steps=steps, actor_rollout_wg=worker_group, use_critic=False,
                           train_dataloader=loader)


def test_driver_state_rides_with_the_trainer_checkpoint(adapter, tmp_path):
    """verl's legacy RayPPOTrainer._save_checkpoint / _load_checkpoint (wrapped) on a stand-in trainer."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from stablerl.adapters.verl import _advantage

    assert getattr(RayPPOTrainer._save_checkpoint, "__stablerl_verl_patch__", False)  # the verl ledger's mark
    _advantage.verl_adapter().state.driver.clear()
    ctx = _advantage._context({}, "reward_shaper", "redit")  # what the advantage wrapper hands a shaper/filter
    _advantage.verl_adapter().state.driver.step = 7
    ctx.state["seen"] = 3
    torch.rand(5, generator=ctx.generator)
    expected_next = torch.rand(4, generator=torch.Generator().set_state(ctx.generator.get_state()))

    trainer = _trainer(tmp_path, steps=7)
    RayPPOTrainer._save_checkpoint(trainer)
    assert os.path.exists(tmp_path / "global_step_7" / "stablerl_driver_state.pt")

    _advantage.verl_adapter().state.driver.clear()  # a fresh driver
    trainer = _trainer(tmp_path, steps=0)
    (tmp_path / "global_step_7" / "actor").mkdir(exist_ok=True)
    RayPPOTrainer._load_checkpoint(trainer)
    assert trainer.global_steps == 7 and _advantage.verl_adapter().state.driver.step == 7
    ctx = _advantage._context({}, "reward_shaper", "redit")
    assert ctx.state == {"seen": 3}
    torch.testing.assert_close(torch.rand(4, generator=ctx.generator), expected_next, rtol=0, atol=0)
