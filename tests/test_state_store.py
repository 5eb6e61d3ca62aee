"""stablerl.state.StateStore: the one store and checkpoint format of what algorithms keep between steps."""

import io

import pytest
import torch

from stablerl import BATCH_FILTER, CONTROLLER, POLICY_LOSS
from stablerl.state import FORMAT_VERSION, StateStore


def _through_disk(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


class _Controller:
    def __init__(self, value=0.0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def test_slots_generators_step_and_tracked_objects_round_trip_through_torch_save():
    store = StateStore(holds="driver")
    store.slot(POLICY_LOSS, "capo")["m"] = torch.arange(6.0).reshape(2, 3)  # a tensor stays a tensor
    store.slot(BATCH_FILTER, "d3s")["seen"] = 3
    ctx = store.context(BATCH_FILTER, "shuffle_r1", seed=5)
    torch.rand(7, generator=ctx.generator)
    store.advance()
    store.advance()
    controller = _Controller(0.75)
    store.track(CONTROLLER, "aepo", controller)
    expected_next = torch.rand(4, generator=torch.Generator().set_state(ctx.generator.get_state()))

    saved = _through_disk(store.state_dict())
    assert saved["version"] == FORMAT_VERSION and saved["step"] == 2
    assert isinstance(saved["slots"][POLICY_LOSS]["capo"]["m"], torch.Tensor)

    fresh, fresh_controller = StateStore(holds="driver"), _Controller()
    fresh.track(CONTROLLER, "aepo", fresh_controller)
    fresh.load_state_dict(saved)
    assert fresh.step == 2 and fresh_controller.value == 0.75
    assert torch.equal(fresh.slot(POLICY_LOSS, "capo")["m"], torch.arange(6.0).reshape(2, 3))
    ctx = fresh.context(BATCH_FILTER, "shuffle_r1", seed=5)
    assert ctx.step == 2 and fresh.slot(BATCH_FILTER, "d3s") == {"seen": 3}
    assert torch.equal(torch.rand(4, generator=ctx.generator), expected_next)


def test_each_algorithm_has_its_own_slot_and_stream():
    store = StateStore()
    a, b = store.context(BATCH_FILTER, "a", seed=1), store.context(BATCH_FILTER, "b", seed=1)
    assert a.state is not b.state and a.generator is not b.generator
    assert store.context(BATCH_FILTER, "a", seed=1).generator is a.generator  # continues, not re-seeded
    assert store.context(BATCH_FILTER, "a", seed=2).generator is not a.generator
    # a shared stream (one generator for several algorithms) is asked for by name
    assert store.generator("shared", 0) is store.generator("shared", 0)


def test_an_object_loaded_before_it_is_tracked_is_restored_when_tracked():
    store = StateStore()
    store.track(CONTROLLER, "epo", _Controller(0.5))
    saved = store.state_dict()
    later = StateStore()
    later.load_state_dict(saved)
    assert later.state_dict()["objects"] == {CONTROLLER: {"epo": {"value": 0.5}}}  # kept for the next save
    controller = _Controller()
    later.track(CONTROLLER, "epo", controller)
    assert controller.value == 0.5


def test_load_replaces_everything_and_clear_forgets():
    store = StateStore()
    store.slot(POLICY_LOSS, "entropic")
    assert not store  # a stateless algorithm's empty slot: nothing to save
    store.slot(POLICY_LOSS, "entropic")["integral"] = 1.0
    assert store
    empty = StateStore().state_dict()
    store.load_state_dict(empty)
    assert not store and store.step == 0
    store.slot(POLICY_LOSS, "x")
    store.clear()
    assert not store


def test_tensors_go_to_the_given_device_on_load():
    store = StateStore()
    store.slot(POLICY_LOSS, "capo")["moments"] = [torch.ones(2, dtype=torch.float64)]
    loaded = StateStore()
    loaded.load_state_dict(store.state_dict(), device="meta")
    assert loaded.slot(POLICY_LOSS, "capo")["moments"][0].device.type == "meta"


@pytest.mark.parametrize("blob,message", [
    ({"something": "else"}, r"ckpt\.pt is not a stablerl loss state"),
    ([1, 2], r"ckpt\.pt is not a stablerl loss state"),
    (StateStore(holds="driver").state_dict(), r"ckpt\.pt is not a stablerl loss state"),
    ({**StateStore(holds="loss").state_dict(), "version": FORMAT_VERSION + 1},
     rf"ckpt\.pt was written by a newer stablerl \(state format {FORMAT_VERSION + 1}, this one reads "
     rf"{FORMAT_VERSION}\): upgrade stablerl"),
])
def test_another_store_or_a_newer_format_is_refused(blob, message):
    with pytest.raises(RuntimeError, match=message):
        StateStore(holds="loss").load_state_dict(blob, where="ckpt.pt")


def test_a_checkpoint_of_another_controller_is_refused():
    store = StateStore()
    store.track(CONTROLLER, "aepo", _Controller(1.0))
    other = StateStore()
    other.track(CONTROLLER, "epo", _Controller())
    with pytest.raises(RuntimeError, match=r"holds the controller state of \['aepo'\], this run uses controller 'epo'"):
        other.load_state_dict(store.state_dict())
