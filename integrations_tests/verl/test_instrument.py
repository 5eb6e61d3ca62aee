"""instrument() / uninstrument(): every verl object the adapter touches comes back as verl's own object
(``is``), and instrumenting twice is instrumenting once."""

import sys

import pytest

pytest.importorskip("verl")


def _touched():
    """Every verl object the adapter replaces or adds, by where it lives (the modules imported first, so
    that the patches apply now rather than on import)."""
    import verl.trainer.distillation.losses as distill
    import verl.trainer.ppo.ray_trainer as ray_trainer
    import verl.utils.tracking as tracking
    import verl.workers.engine.fsdp.transformer_impl  # noqa: F401  (the engine registry's FSDP entries)
    import verl.workers.engine_workers as engine_workers
    import verl.workers.utils.losses as losses
    from verl.checkpoint_engine.base import CheckpointEngineManager
    from verl.trainer.ppo import core_algos
    from verl.workers.engine.base import EngineRegistry

    engines = EngineRegistry._engines["language_model"]
    return {
        "policy_losses": dict(core_algos.POLICY_LOSS_REGISTRY),
        "estimators": dict(core_algos.ADV_ESTIMATOR_REGISTRY),
        "losses.ppo_loss": losses.ppo_loss,
        "distill.ppo_loss": distill.ppo_loss,
        "engine_workers.ppo_loss": engine_workers.ppo_loss,
        "ray_trainer.compute_advantage": ray_trainer.compute_advantage,
        "RayPPOTrainer": dict(vars(ray_trainer.RayPPOTrainer)),
        "Tracking": dict(vars(tracking.Tracking)),
        "ActorRolloutRefWorker": dict(vars(engine_workers.ActorRolloutRefWorker)),
        "engines": {b: dict(engines.get(b, {})) for b in ("fsdp", "fsdp2")},
        "meta_path": list(sys.meta_path),
        "CheckpointEngineManager": dict(vars(CheckpointEngineManager)),
    }


def _same(a, b) -> list[str]:
    """The entries of two snapshots that are not the identical objects."""
    diff = []
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            if set(x) != set(y) or any(
                    (x[k] is not y[k]) if not isinstance(x[k], dict) else _same(x[k], y[k]) for k in x):
                diff.append(key)
        elif isinstance(x, list):
            if len(x) != len(y) or any(p is not q for p, q in zip(x, y)):
                diff.append(key)
        elif x is not y:
            diff.append(key)
    return diff


def test_uninstrument_restores_every_original_and_instrument_is_idempotent(adapter):
    from stablerl.adapters.verl._ledger import LEDGER

    _touched()  # import the patched modules while instrumented: the patches are applied, not deferred
    adapter.uninstrument()
    try:
        original = _touched()
        assert not LEDGER.keys()
        assert not [n for n in original["policy_losses"] if n.startswith("stablerl_")]
        assert original["losses.ppo_loss"].__module__ == "verl.workers.utils.losses"
        assert not hasattr(original["losses.ppo_loss"], "__wrapped__")
        assert original["ray_trainer.compute_advantage"].__module__ == "verl.trainer.ppo.ray_trainer"
        assert not hasattr(original["ray_trainer.compute_advantage"], "__wrapped__")

        adapter.instrument()
        once = _touched()
        keys = LEDGER.keys()
        changed = set(_same(original, once))
        # everything the adapter touches was touched
        assert changed == {"policy_losses", "estimators", "losses.ppo_loss", "distill.ppo_loss",
                           "engine_workers.ppo_loss", "ray_trainer.compute_advantage", "RayPPOTrainer",
                           "Tracking", "ActorRolloutRefWorker", "engines", "meta_path",
                           "CheckpointEngineManager"}, changed
        assert once["policy_losses"]["stablerl_vanilla"]._stablerl_verl == ("policy_loss", "vanilla")
        assert once["distill.ppo_loss"] is once["losses.ppo_loss"]  # the callers' bound names follow

        adapter.instrument()  # twice == once: the same objects, nothing new in the ledger
        assert _same(once, _touched()) == [] and LEDGER.keys() == keys

        adapter.uninstrument()
        assert _same(original, _touched()) == [] and not LEDGER.keys()
        adapter.uninstrument()  # twice is harmless
        assert _same(original, _touched()) == []
        assert adapter.registration_report()["registered"] == [] and not adapter.VERL_NAMES["policy_loss"]
    finally:
        adapter.instrument()  # the other tests of the session run instrumented
    assert adapter.registration_report()["ok"]


def test_version_policy_reads_the_declared_range(monkeypatch):
    import stablerl
    from stablerl.frameworks import check_version

    import stablerl.adapters.verl as adapter

    assert adapter.SUPPORTED_VERL == stablerl.frameworks.get_framework("verl").supported == ">=0.9.1,<0.10"
    monkeypatch.delenv("STABLERL_ALLOW_UNSUPPORTED", raising=False)
    with pytest.raises(adapter.UnsupportedVerlVersion, match=r"supports verl>=0\.9\.1,<0\.10, found verl 0\.9\.0"):
        check_version("verl", "0.9.0", error=adapter.UnsupportedVerlVersion)
    monkeypatch.setenv("STABLERL_ALLOW_UNSUPPORTED", "1")
    with pytest.warns(RuntimeWarning, match="found verl 0.10.1"):
        assert check_version("verl", "0.10.1") == "0.10.1"


def test_fsdp_turbo_engine_carries_the_losses_state(adapter):
    """verl 0.9.1's fsdp_turbo engine is re-pointed like fsdp/fsdp2, so the losses' state (EntroPIC, CAPO)
    rides in its checkpoints too; uninstrument gives verl's class back."""
    import verl.workers.engine.fsdp.fsdp_turbo_impl as turbo
    from verl.workers.engine.base import EngineRegistry

    entries = EngineRegistry._engines["language_model"]["fsdp_turbo"]
    assert entries, "verl registers the fsdp_turbo engine"
    for cls in entries.values():
        assert issubclass(cls, turbo.FSDPTurboEngineWithLMHead) and cls is not turbo.FSDPTurboEngineWithLMHead
        assert cls.save_checkpoint.__qualname__.startswith("engine_class.<locals>.StableRLFSDPEngineWithLMHead")
    adapter.uninstrument()
    try:
        assert all(c is turbo.FSDPTurboEngineWithLMHead for c in entries.values())
    finally:
        adapter.instrument()
    assert all(c is not turbo.FSDPTurboEngineWithLMHead for c in entries.values())


def test_tracking_log_carries_the_advantage_sites_metrics(adapter, tmp_path, monkeypatch):
    """The step's stablerl metrics (filter, shaper, estimator) reach verl's logger with the step's metrics,
    once: a step without a stablerl call logs none."""
    import json

    from verl.utils.tracking import Tracking

    from stablerl.adapters.verl import _advantage

    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    tracker = Tracking("p", "e", default_backend=["file"])
    _advantage.verl_adapter().state.metrics.update({"stablerl/filter/kept_row_frac": 0.75})
    tracker.log({"critic/score/mean": 0.5}, step=1)
    tracker.log({"critic/score/mean": 0.25}, step=2)
    tracker.logger["file"].finish()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"step": 1, "data": {"critic/score/mean": 0.5, "stablerl/filter/kept_row_frac": 0.75}},
                    {"step": 2, "data": {"critic/score/mean": 0.25}}]
    assert not _advantage.verl_adapter().state.metrics


def test_a_new_run_does_not_log_an_earlier_runs_unlogged_metrics(adapter, tmp_path, monkeypatch):
    """Metrics of a compute_advantage call that no Tracking.log took (a run that stopped, or a test that called
    compute_advantage alone) are not the next run's: a new Tracking, and the adapter's reset_state, drop them."""
    import json

    from verl.utils.tracking import Tracking

    from stablerl.adapters.verl import _advantage

    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(path))
    _advantage.verl_adapter().state.metrics.update({"stablerl/d3s/progress": 0.25})  # left by an earlier run
    tracker = Tracking("p", "e", default_backend=["file"])
    tracker.log({"critic/score/mean": 0.5}, step=1)
    tracker.logger["file"].finish()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "data": {"critic/score/mean": 0.5}}]
    _advantage.verl_adapter().state.metrics.update({"stablerl/d3s/progress": 0.25})
    _advantage.reset_state()
    assert not _advantage.verl_adapter().state.metrics
