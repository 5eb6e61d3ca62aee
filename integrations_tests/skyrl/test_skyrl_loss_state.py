"""A stablerl loss's state (``ctx.state``) in SkyRL's policy checkpoints: ``Worker.save_checkpoint`` /
``load_checkpoint`` of ``PolicyWorkerBase`` (SkyRL's real methods, a recording strategy in place of FSDP's) also
write / read ``stablerl_loss_state_rank0.pt`` once the adapter armed the worker, and a foreign blob is refused."""

import pytest

pytest.importorskip("skyrl", reason="SkyRL is not installed (nox -s skyrl installs it)")

import torch  # noqa: E402

import stablerl  # noqa: E402
import stablerl.adapters.skyrl as adapter  # noqa: E402


class _Strategy:
    def __init__(self):
        self.calls = []

    def save_checkpoint(self, **kwargs):
        self.calls.append(("save", kwargs["ckpt_dir"]))

    def load_checkpoint(self, **kwargs):
        self.calls.append(("load", kwargs["ckpt_dir"]))
        return None, {"skyrl": "states"}


class _Worker:
    model = optimizer = scheduler = None

    def __init__(self):
        self.strategy = _Strategy()

    def get_node_local_rank(self):
        return 0


@pytest.fixture
def armed():
    from skyrl.backends.skyrl_train.workers.worker import PolicyWorkerBase

    ours = adapter.SkyRLAdapter()
    ours.instrument(register=False)
    ours.loss_state.clear()
    yield PolicyWorkerBase, ours
    adapter.uninstrument()
    ours.loss_state.clear()


def test_loss_state_saved_and_restored_with_the_policy_checkpoint(armed, tmp_path):
    PolicyWorkerBase, ours = armed
    ours.loss_state.slot(stablerl.POLICY_LOSS, "entropic")["integral"] = torch.tensor(0.25)
    ours.loss_state.advance()
    worker = _Worker()
    PolicyWorkerBase.save_checkpoint(worker, str(tmp_path))
    assert worker.strategy.calls == [("save", str(tmp_path))]  # SkyRL's own save ran
    assert (tmp_path / "stablerl_loss_state_rank0.pt").exists()
    ours.loss_state.clear()
    states = PolicyWorkerBase.load_checkpoint(worker, str(tmp_path))
    assert states == {"skyrl": "states"}  # SkyRL's return value untouched
    assert float(ours.loss_state.slot(stablerl.POLICY_LOSS, "entropic")["integral"]) == 0.25
    assert ours.loss_state.step == 1


def test_a_foreign_state_file_is_refused(armed, tmp_path):
    PolicyWorkerBase, ours = armed
    torch.save({"stablerl_state": "stablerl.state", "version": 2, "holds": "driver", "step": 3, "slots": {},
                "generators": {}, "objects": {}}, tmp_path / "stablerl_loss_state_rank0.pt")
    with pytest.raises(RuntimeError, match="is not a stablerl loss state"):
        PolicyWorkerBase.load_checkpoint(_Worker(), str(tmp_path))


def test_uninstrument_restores_skyrls_methods(armed):
    PolicyWorkerBase, _ = armed
    assert "save_checkpoint" in vars(PolicyWorkerBase)
    adapter.uninstrument()
    assert "save_checkpoint" not in vars(PolicyWorkerBase)  # inherited from Worker again
