"""The envelope of stablerl's state in framework checkpoints (adapters/_state_format.py): kind and version checked."""

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
