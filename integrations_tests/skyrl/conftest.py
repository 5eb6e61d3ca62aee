"""SkyRL 0.3 integration tests (CPU): real SkyRL code; import stand-ins under stubs/ only.

stubs/ goes first on sys.path and on PYTHONPATH (Ray workers): its sitecustomize gives SkyRL's
``skyrl/tinker/types.py`` the ``typing_extensions.TypedDict`` pydantic needs on Python 3.11, and ``flash_attn``
stands in for the padding helpers SkyRL's model wrapper imports at module level (used only with sample packing,
which the tests turn off). The end-to-end test adds the CPU shim of e2e/ for its own processes only.
"""

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
STUBS = str(HERE / "stubs")

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if STUBS not in sys.path:
    sys.path.insert(0, STUBS)
# this process started before stubs/ was on the path: run the shim now (it only rebinds typing.TypedDict)
exec(compile((HERE / "stubs" / "sitecustomize.py").read_text(), str(HERE / "stubs" / "sitecustomize.py"), "exec"))
_pp = os.environ.get("PYTHONPATH", "")
if STUBS not in _pp.split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join([p for p in (STUBS, _pp) if p])
sys.path.insert(0, str(HERE))  # skyrl_helpers under --import-mode=importlib


@pytest.fixture
def worker_class(monkeypatch):
    """SkyRL's ``PolicyWorkerBase`` with the adapter's worker glue armed (no registration), on CPU."""
    import torch
    from skyrl.backends.skyrl_train.workers.worker import PolicyWorkerBase

    from stablerl.adapters.skyrl import SkyRLAdapter

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # SkyRL's device of every micro-batch
    SkyRLAdapter().instrument(register=False)
    yield PolicyWorkerBase
    SkyRLAdapter().uninstrument()
