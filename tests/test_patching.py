"""The patch ledger every adapter records its changes in (adapters/_patching.py): module functions rebound
with their callers' names, post-import hooks, partial restore, and restore giving back the very objects."""

import sys
import textwrap
from types import ModuleType

import pytest

from stablerl import post_import as _post_import
from stablerl.patching import PatchLedger


def _module(name: str, **attrs) -> ModuleType:
    module = ModuleType(name)
    module.__dict__.update(attrs)
    return module


@pytest.fixture
def fake_modules(monkeypatch):
    def original(x):
        return x

    target = _module("fake_target", fn=original)
    early = _module("fake_early_caller", fn=original)  # did `from fake_target import fn` before the patch
    for m in (target, early):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    return target, early, original


def test_rebind_follows_the_callers_and_restore_gives_back_the_originals(fake_modules, monkeypatch):
    target, early, original = fake_modules
    ledger = PatchLedger("_test_rebind")

    def wrapper(x):
        return original(x) + 1

    assert ledger.rebind("fn", target, "fn", wrapper, callers=("fake_early_caller", "fake_late_caller"))
    assert target.fn is wrapper and early.fn is wrapper and target.fn(1) == 2
    late = _module("fake_late_caller", fn=target.fn)  # imported after the patch: bound the wrapper itself
    monkeypatch.setitem(sys.modules, late.__name__, late)
    assert not ledger.rebind("fn", target, "fn", lambda x: x)  # once
    ledger.restore()
    assert target.fn is original and early.fn is original and late.fn is original
    assert ledger.keys() == []


def test_restore_by_prefix_leaves_the_rest(fake_modules):
    target, early, original = fake_modules
    registry = {"builtin": "framework's"}
    ledger = PatchLedger("_test_prefix")
    ledger.rebind("fn", target, "fn", lambda x: -x, callers=("fake_early_caller",))
    ledger.set_item("policy_loss:mine", registry, "mine", "ours")
    ledger.restore("fn")
    assert target.fn is original and early.fn is original
    assert registry == {"builtin": "framework's", "mine": "ours"} and ledger.keys() == ["policy_loss:mine"]
    ledger.restore()
    assert registry == {"builtin": "framework's"}


def test_a_new_module_object_is_patched_again_under_its_own_key(monkeypatch):
    ledger = PatchLedger("_test_reimport")
    first, second = _module("m", f=1), _module("m", f=1)
    assert ledger.set_attr("m.f", first, "f", 2) and ledger.set_attr("m.f", second, "f", 3)
    assert ledger.keys() == ["m.f", "m.f#2"]
    ledger.restore()
    assert first.f == 1 and second.f == 1


def test_wrap_function_on_import_and_uninstrument(tmp_path, monkeypatch):
    (tmp_path / "fake_framework_losses.py").write_text(textwrap.dedent("""
        def ppo_loss(x):
            return x
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fake_framework_losses", raising=False)
    ledger = PatchLedger("_test_wrap")
    meta_path = list(sys.meta_path)

    def wrap(original):
        def ppo_loss(x):
            return original(x) * 10

        ppo_loss.__wrapped__ = original
        return ppo_loss

    try:
        assert ledger.wrap_function("ppo_loss", "fake_framework_losses", "ppo_loss", wrap) == "deferred"
        assert _post_import.installed("ppo_loss:on_import")
        import fake_framework_losses as losses  # the hook wraps it right after the module executes

        assert losses.ppo_loss(2) == 20 and ledger.function_status("ppo_loss", losses.__name__, "ppo_loss") == "patched"
        original = losses.ppo_loss.__wrapped__
        assert ledger.wrap_function("ppo_loss", "fake_framework_losses", "ppo_loss", wrap) == "patched"  # idempotent
        assert losses.ppo_loss.__wrapped__ is original
        ledger.restore()
        assert losses.ppo_loss is original and sys.meta_path == meta_path  # the hook is gone too
        assert ledger.function_status("ppo_loss", losses.__name__, "ppo_loss") == "off"
        assert ledger.wrap_function("ppo_loss", "fake_framework_losses", "ppo_loss", wrap) == "patched"  # loaded: now
        assert losses.ppo_loss(3) == 30
        missing = []
        assert ledger.wrap_function("nope", "fake_framework_losses", "no_such_fn", wrap, missing=missing.append) \
            == "failed" and missing == [losses]
    finally:
        ledger.restore()
    assert sys.meta_path == meta_path


def test_an_entry_someone_else_replaced_is_patched_again():
    registry = {}
    ledger = PatchLedger("_test_stale")
    assert ledger.set_item("est:empg", registry, "empg", "ours")
    del registry["empg"]  # e.g. a test or the framework dropped it
    assert ledger.set_item("est:empg", registry, "empg", "ours again") and registry["empg"] == "ours again"
    ledger.restore()
    assert registry == {} and ledger.keys() == []  # what was there before the patch in place (nothing)


def test_around_wraps_methods_and_coroutines_and_restores_them():
    import asyncio

    class Engine:
        def step(self, x):
            """doc"""
            return x + 1

        async def run(self, x):
            return x * 2

    original_step, original_run = Engine.__dict__["step"], Engine.__dict__["run"]
    ledger = PatchLedger("_test_around")

    @ledger.around(Engine, "step")
    def step(step, self, x):
        return step(self, x) * 10

    @ledger.around(Engine, "run", key="custom")
    async def run(run, self, x):
        return await run(self, x) + 1

    engine = Engine()
    assert engine.step(1) == 20 and asyncio.run(engine.run(3)) == 7
    assert Engine.step.__wrapped__ is original_step and Engine.step.__doc__ == "doc" and Engine.step.__name__ == "step"
    assert set(ledger.keys()) == {"Engine.step", "custom"}
    ledger.around(Engine, "step")(step)  # twice: not wrapped again
    assert engine.step(1) == 20
    ledger.restore()
    assert Engine.__dict__["step"] is original_step and Engine.__dict__["run"] is original_run
