"""Framework-free adapter helper: the patch ledger (adapters/_patching.py; more in test_patching.py). The
version policy is tested in test_version_policy.py, the state store in test_state_store.py."""

import pytest


def test_patch_ledger_sets_once_marks_and_restores():
    from stablerl.patching import PatchLedger

    class Base:
        def run(self):
            return "base"

    class Child(Base):
        pass

    registry = {"fsdp": "verl-engine"}
    ledger = PatchLedger("_test_mark")
    assert ledger.set_attr("Child.run", Child, "run", lambda self: "patched")
    assert not ledger.set_attr("Child.run", Child, "run", lambda self: "again")  # once per key
    assert ledger.set_item("fsdp", registry, "fsdp", "stablerl-engine") and registry["fsdp"] == "stablerl-engine"
    assert Child().run() == "patched" and Base().run() == "base"
    # a second copy of an adapter (another ledger, same mark) sees the patch and does not wrap it again
    assert not PatchLedger("_test_mark").set_attr("other", Child, "run", lambda self: "double")
    assert ledger.keys() == ["Child.run", "fsdp"]
    ledger.restore()
    assert "run" not in Child.__dict__ and Child().run() == "base"  # inherited again, not shadowed by a copy
    assert registry == {"fsdp": "verl-engine"} and ledger.keys() == []
