"""Framework-free adapter helpers: the envelope of stablerl's state in framework checkpoints (kind and version
checked; adapters/_state_format.py) and the patch ledger (adapters/_patching.py; more in test_patching.py)."""

import pytest

from stablerl.adapters import _state_format as fmt


def test_round_trip_and_in_place_replace():
    blob = fmt.pack("loss", {"entropic": {"integral": 0.5}})
    assert blob == {"stablerl_state": "loss", "version": fmt.FORMAT_VERSION, "state": {"entropic": {"integral": 0.5}}}
    held = {"stale": 1}
    alias = held
    fmt.replace(held, fmt.unpack(blob, "loss", "ckpt"))
    assert alias == {"entropic": {"integral": 0.5}}  # whoever holds the dict sees the restored state


@pytest.mark.parametrize("blob,message", [
    ({"stablerl_state": "driver", "version": 1, "state": {}}, r"ckpt\.pt is not a stablerl loss state"),
    ([1, 2], r"ckpt\.pt is not a stablerl loss state"),
    ({"stablerl_state": "loss", "version": fmt.FORMAT_VERSION + 1, "state": {}},
     r"ckpt\.pt was written by a newer stablerl \(state format 2, this one reads 1\): upgrade stablerl"),
])
def test_wrong_kind_or_newer_format_is_refused(blob, message):
    with pytest.raises(RuntimeError, match=message):
        fmt.unpack(blob, "loss", "ckpt.pt")


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
