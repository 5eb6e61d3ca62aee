"""Framework-free adapter helpers: the version parser of the range checks (adapters/_versions.py) and the patch
ledger (adapters/_patching.py). The state envelope moved to core: tests/test_state_store.py."""

import pytest


@pytest.mark.parametrize("text,parts,expected", [
    ("0.11.2", 3, (0, 11, 2)), ("0.9.1+cu121", 3, (0, 9, 1)), ("1.16.0rc1", 2, (1, 16)), ("1.16rc1", 2, (1, 16)),
    ("0.14", 3, (0, 14, 0)), ("unknown", 2, (0, 0)),
])
def test_version_tuple(text, parts, expected):
    from stablerl.adapters._versions import version_tuple

    assert version_tuple(text, parts) == expected


def test_patch_ledger_sets_once_marks_and_restores():
    from stablerl.adapters._patching import PatchLedger

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
