"""stablerl state in OpenRLHF 0.11.2 checkpoints: the policy loss's state (EntroPIC) through the real
DeepspeedStrategy.save_ckpt / load_ckpt and DeepSpeed engine, the reward shapers' / batch filters' state through
the real BasePPOTrainer checkpoint methods; a resumed step equals the uninterrupted one."""

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (nox -s openrlhf installs it)")
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")

import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import torch

import stablerl
from stablerl.state import StateStore
import stablerl.adapters.openrlhf as adapter
from orlhf_helpers import HERE_PATH, STUBS_PATH, clone, make_args, make_experiences, make_maker
from stablerl.adapters.openrlhf import Selection, _state
from stablerl.checkpoint_slot import restore_store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_policy_loss_and_controller_state_survive_a_deepspeed_checkpoint():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE_PATH, STUBS_PATH, os.environ.get("PYTHONPATH", "")])}
    # 900 s: DeepSpeed start-up took 245 s at load 15 on 2 cores; a timeout that kills its JIT build of an op
    # leaves a stale lock in ~/.cache/torch_extensions that every later DeepSpeed start waits on
    run = subprocess.run([sys.executable, os.path.join(HERE_PATH, "_ds_checkpoint_roundtrip.py"), str(_free_port())],
                         capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["loss_class"] == "StablePolicyLoss"
    assert out["saved_state"]["updates"] == 2 and out["saved_state"]["integral"] != 0
    # DeepSpeed returned the driver's client_states; the loss's own key was taken out (it stays in the worker)
    assert out["states_keys"] == ["global_step"]
    assert out["restored_state"] == out["saved_state"]
    assert out["same_third_step"] is True and out["third_integral"] != out["saved_state"]["integral"]
    assert out["plain_states_keys"] == ["global_step"] and out["fresh_state"] == {}
    # the entropy controller: saved beside the loss state, taken out on load, restored into the next trainer
    assert out["saved_controller"] == {"entropy_coef": 0.02, "last_entropy": 2.5}
    assert out["controller_states_keys"] == ["global_step"]
    assert out["restored_controller"] == out["saved_controller"] and out["restored_entropy_coef"] == 0.02


class _TrainerStandIn:
    """The attributes BasePPOTrainer's real checkpoint methods read (one actor group, no critic, no loggers)."""

    def __init__(self, ckpt_path, loaded=None):
        self.args = SimpleNamespace(logger=SimpleNamespace(logging_steps=1), ckpt=SimpleNamespace(
            save_steps=2, path=ckpt_path, load_enable=True))
        self.wandb_logger = self.tensorboard_logger = self.critic_model_group = None
        self.best_eval_metric_key, self.best_eval_metric_value, self._latest_eval_metric_value = None, None, None
        self.saved, self.loaded = [], loaded

        def async_run_method(method_name, **kwargs):
            if method_name == "save_checkpoint":
                self.saved.append(kwargs["client_states"])
                return []
            assert method_name == "get_checkpoint_states"
            return [self.loaded]

        self.actor_model_group = SimpleNamespace(async_run_method=async_run_method)


def _redit(args, exps):
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    out = RemoteExperienceMaker.compute_advantages_and_returns(make_maker(args, "group_norm"), clone(exps))
    return torch.cat([e.rewards for e in out])


def test_shaper_and_filter_state_survive_the_trainers_checkpoint(monkeypatch, tmp_path):
    import ray
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer

    monkeypatch.setattr(ray, "get", lambda refs: refs)
    adapter.instrument(now=True)
    adapter.OpenRLHFAdapter().driver_state.clear()
    args = make_args(estimator="group_norm", stablerl=Selection(reward_shaper="redit", reward_shaper_params={"scale": 0.1}))
    args.train.seed = 5
    exps = make_experiences(seed=21)
    _redit(args, exps), _redit(args, exps)  # two steps of seeded noise drawn, the call counter at 2

    trainer = _TrainerStandIn(str(tmp_path))
    BasePPOTrainer.save_logs_and_checkpoints(trainer, 1, {}, None)  # not a save step: nothing sent
    BasePPOTrainer.save_logs_and_checkpoints(trainer, 2, {}, {"global_step": 2})
    assert len(trainer.saved) == 1 and trainer.saved[0]["global_step"] == 2
    saved = trainer.saved[0][_state.DRIVER_KEY]
    assert saved["holds"] == "driver" and saved["step"] == 2
    # what DeepSpeed writes: a pickled copy (torch.save round trip), generators included
    path = tmp_path / "client_states.pt"
    torch.save(trainer.saved[0], path)
    loaded = torch.load(path, weights_only=False)
    reference = _redit(args, exps)  # the uninterrupted third step

    adapter.OpenRLHFAdapter().driver_state.clear()  # a fresh trainer process
    (tmp_path / "_actor").mkdir()
    states = BasePPOTrainer.init_checkpoint_states(_TrainerStandIn(str(tmp_path), loaded=loaded))
    assert states["global_step"] == 2 and adapter.OpenRLHFAdapter().driver_state.step == 2
    resumed = _redit(args, exps)
    torch.testing.assert_close(resumed, reference, rtol=0, atol=0)
    fresh = _redit(args, exps)
    assert not torch.equal(fresh, resumed)  # the noise moves on: the restored generator is live, not a copy
    adapter.OpenRLHFAdapter().driver_state.clear()


def test_a_newer_state_format_is_refused_with_its_name():
    blob = {_state.DRIVER_KEY: {**StateStore(holds="driver").state_dict(), "version": 99}}
    with pytest.raises(RuntimeError, match=r"stablerl_driver_state was written by a newer stablerl .*format 99"):
        _state.restore_driver_state(adapter.OpenRLHFAdapter(), blob)
    # a checkpoint from before stablerl
    assert _state.restore_driver_state(adapter.OpenRLHFAdapter(), {"global_step": 3}) is False


def test_patches_are_listed_and_removed():
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer
    from openrlhf.utils.deepspeed.deepspeed import DeepspeedStrategy

    originals = DeepspeedStrategy.save_ckpt, DeepspeedStrategy.load_ckpt, BasePPOTrainer.init_checkpoint_states
    adapter.instrument(now=True)
    applied = adapter.is_applied()
    for key in ("DeepspeedStrategy.save_ckpt", "DeepspeedStrategy.load_ckpt", "BasePPOTrainer.save_logs_and_checkpoints",
                "BasePPOTrainer.save_best_checkpoint", "BasePPOTrainer.init_checkpoint_states"):
        assert applied[key] is True, key
    assert DeepspeedStrategy.save_ckpt is not originals[0]
    adapter.uninstrument()
    assert (DeepspeedStrategy.save_ckpt, DeepspeedStrategy.load_ckpt, BasePPOTrainer.init_checkpoint_states) == originals


def test_restored_tensors_follow_the_worker_device():
    # DeepSpeed loads client_state onto the CPU; on a GPU worker the loss state goes to its current device
    # (here the meta device stands in for it): nested dicts, lists and tuples keep their shape, non-tensors are kept
    state = {"capo": {"exp_avg": torch.ones(2, 3), "step": 4}, "pair": (torch.zeros(1), [torch.ones(1), "x"])}
    store = StateStore(holds="loss")
    store.slot(stablerl.POLICY_LOSS, "capo").update(state)
    restore_store(store, store.state_dict(), "ckpt", device=torch.device("meta"))
    moved = store.slot(stablerl.POLICY_LOSS, "capo")
    assert moved["capo"]["step"] == 4 and moved["capo"]["exp_avg"].shape == (2, 3)
    assert isinstance(moved["pair"], tuple) and moved["pair"][1][1] == "x"
    assert moved["capo"]["exp_avg"].device.type == "meta" and moved["pair"][1][0].device.type == "meta"
