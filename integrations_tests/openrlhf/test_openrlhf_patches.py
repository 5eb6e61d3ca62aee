"""Patching: reversible, once per process, light setup, version guard, real ActorPPOTrainer construction."""

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (nox -s openrlhf installs it)")

import subprocess
import sys
from types import SimpleNamespace

import torch

import stablerl.adapters.openrlhf as adapter
from orlhf_helpers import STUBS_PATH, loss_batch, make_args
from stablerl.adapters.openrlhf import Selection


def _trainer(monkeypatch, args):
    """OpenRLHF's real ActorPPOTrainer.__init__, with its CPU-hostile helpers replaced."""
    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    monkeypatch.setattr(ppo_actor, "NaiveReplayBuffer", lambda *a, **k: SimpleNamespace())
    monkeypatch.setattr(ppo_actor, "torch_dist_barrier_and_cuda_sync", lambda: None)
    return ppo_actor.ActorPPOTrainer(SimpleNamespace(args=args), None, None, None, None)


def _snapshot() -> dict:
    """Every attribute of every module the adapter patches, and of the classes defined there (by identity)."""
    import importlib

    from stablerl.adapters.openrlhf._patches import PATCHERS

    snap = {"sys.meta_path": dict(enumerate(sys.meta_path))}
    for name in PATCHERS:
        module = importlib.import_module(name)
        snap[name] = dict(vars(module))
        for value in vars(module).values():  # its classes, and the ones it imported (e.g. Actor in ppo_actor)
            if isinstance(value, type) and value.__module__.startswith(("openrlhf", "vllm")):
                snap[f"{value.__module__}.{value.__qualname__}"] = dict(vars(value))
    return snap


def _changed(a: dict, b: dict) -> set:
    return {f"{owner}.{attr}" for owner in a for attr in set(a[owner]) | set(b[owner])
            if a[owner].get(attr, None) is not b[owner].get(attr, None)}


def test_instrument_uninstrument_idempotent_and_reversible():
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    init, cadv = ActorPPOTrainer.__init__, RemoteExperienceMaker.compute_advantages_and_returns
    adapter.instrument(now=True)
    adapter.uninstrument()
    original = _snapshot()  # every patched module imported, nothing patched
    assert ActorPPOTrainer.__init__ is init and RemoteExperienceMaker.compute_advantages_and_returns is cadv
    adapter.instrument(now=True)
    patched = ActorPPOTrainer.__init__, RemoteExperienceMaker.compute_advantages_and_returns
    assert patched[0] is not init and patched[1] is not cadv
    assert patched[0].__wrapped__ is init and patched[1].__wrapped__ is cadv
    assert all(adapter.is_applied().values())
    once = _snapshot()
    changed = _changed(original, once)
    # each ledger entry changed one attribute (no post-import hook: every patched module is imported already)
    assert len(changed) == len(adapter.is_applied()), sorted(changed)
    assert "openrlhf.models.actor.Actor.forward" in changed and "sys.meta_path.0" not in changed
    adapter.instrument(now=True)
    adapter.instrument()
    assert not _changed(once, _snapshot())  # twice == once
    adapter.uninstrument()
    assert not _changed(original, _snapshot())  # every original object is back
    assert not any(adapter.is_applied().values())
    adapter.uninstrument()  # twice is fine
    assert not _changed(original, _snapshot())
    with pytest.warns(DeprecationWarning):  # the older names still work
        adapter.apply()
    assert all(adapter.is_applied().values())
    with pytest.warns(DeprecationWarning):
        adapter.remove()
    assert not _changed(original, _snapshot())


def test_actor_trainer_builds_stablerl_loss(monkeypatch):
    adapter.instrument(now=True)
    sel = Selection(policy_loss="m2po", policy_loss_params={"m2_threshold": 0.05})
    args = make_args(policy_loss_type="m2po", eps=(0.2, 0.3), loss_agg_mode="seq-mean-token-mean", stablerl=sel)
    trainer = _trainer(monkeypatch, args)
    fn = trainer.actor_loss_fn
    assert type(fn).__name__ == "StablePolicyLoss" and fn.stablerl_name == "m2po"
    assert fn.stablerl_params == {"m2_threshold": 0.05}  # m2po has no clip fields
    assert fn.token_level_loss is False
    b = loss_batch(dtype=torch.float32)
    out = fn(b.new, b.old, b.adv, action_mask=b.mask, rollout_log_probs=None, dp_size=1,
             batch_num_tokens=torch.tensor(40.0), global_batch_size=torch.tensor(6.0))
    assert len(out) == 5 and torch.isfinite(out[0])
    # OpenRLHF clip flags given on the command line set the clip fields of a loss that has them;
    # flags left at OpenRLHF's defaults leave the paper's defaults
    sel = Selection(policy_loss="vanilla", openrlhf_clip={"clip_ratio_low": 0.1, "clip_ratio_high": 0.3})
    fn = _trainer(monkeypatch, make_args(policy_loss_type="vanilla", stablerl=sel)).actor_loss_fn
    assert fn.stablerl_params == {"clip_ratio_low": 0.1, "clip_ratio_high": 0.3}
    sel = Selection(policy_loss="cispo")
    assert _trainer(monkeypatch, make_args(policy_loss_type="cispo", stablerl=sel)).actor_loss_fn.stablerl_params == {}
    # an OpenRLHF name keeps OpenRLHF's own PolicyLoss object
    from openrlhf.models.loss import PolicyLoss

    trainer = _trainer(monkeypatch, make_args(policy_loss_type="gspo"))
    assert type(trainer.actor_loss_fn) is PolicyLoss and trainer.actor_loss_fn.policy_loss_type == "gspo"


def test_env_selection_no_wrapper_route(monkeypatch):
    adapter.instrument(now=True)
    monkeypatch.setenv(adapter.ENV_POLICY_LOSS, "cispo")
    monkeypatch.setenv(adapter.ENV_POLICY_LOSS_PARAMS, '{"clip_ratio_high": 4.0}')
    trainer = _trainer(monkeypatch, make_args(policy_loss_type="ppo"))
    assert trainer.actor_loss_fn.stablerl_name == "cispo"
    assert trainer.actor_loss_fn.stablerl_params["clip_ratio_high"] == 4.0


def test_add_setup_hook_runtime_env(monkeypatch):
    monkeypatch.setenv(adapter.ENV_ADVANTAGE, "qae")
    env = adapter.add_setup_hook({"env_vars": {"NCCL_DEBUG": "WARN"}})
    assert env["worker_process_setup_hook"] == "stablerl.adapters.openrlhf.instrument"
    assert env["env_vars"] == {"NCCL_DEBUG": "WARN", "STABLERL_ADVANTAGE_ESTIMATOR": "qae"}
    chained = adapter.add_setup_hook({"worker_process_setup_hook": "mypkg.hooks.setup"})
    assert chained["env_vars"][adapter.ENV_CHAINED_SETUP_HOOK] == "mypkg.hooks.setup"
    assert adapter.add_setup_hook(None)["worker_process_setup_hook"] == adapter.SETUP_HOOK


def test_version_guard_names_the_supported_range(monkeypatch):
    import stablerl

    assert adapter.SUPPORTED_OPENRLHF == stablerl.frameworks.get_framework("openrlhf").supported
    assert adapter.check_openrlhf() == "0.11.2"
    monkeypatch.delenv("STABLERL_ALLOW_UNSUPPORTED", raising=False)
    for bad in ("0.11.1", "0.11.3", "0.10.0", "1.0.0"):
        with pytest.raises(adapter.UnsupportedOpenRLHFVersionError, match=r"openrlhf>=0\.11\.2,<0\.11\.3"):
            adapter.check_openrlhf(bad)
    monkeypatch.setenv("STABLERL_ALLOW_UNSUPPORTED", "1")
    with pytest.warns(RuntimeWarning, match="found openrlhf 0.11.3"):
        assert adapter.check_openrlhf("0.11.3") == "0.11.3"


def test_instrument_is_light_and_patches_on_import():
    """instrument() imports no OpenRLHF module; the post-import hook patches the module when it is imported."""
    code = f"""
import sys
sys.path.append({STUBS_PATH!r})
import stablerl.adapters.openrlhf as a
a.instrument(); a.instrument()
heavy = [m for m in sys.modules if m.startswith(("openrlhf", "deepspeed", "ray", "transformers"))]
assert not heavy, heavy
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
f = RemoteExperienceMaker.compute_advantages_and_returns
assert getattr(f, "__stablerl_openrlhf_patch__", False), f
assert "openrlhf.trainer.ray.ppo_actor" not in sys.modules
print("OK")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
