"""OpenRLHF 0.11.2 integration tests (CPU): real OpenRLHF code, import stand-ins under stubs/ only.

stubs/ is appended to sys.path (and to PYTHONPATH, for Ray workers): it provides flash_attn's
padding helpers and vLLM's engine classes, which OpenRLHF imports at module level but which the
tested code paths never run. A really installed flash_attn / vllm would take precedence.
"""

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
STUBS = str(HERE / "stubs")

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# OpenRLHF torch.compile's its entropy; Inductor's CPU kernel depends on the vector ISA (wrong under
# ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU): the same as noxfile's openrlhf session, for direct runs
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
if STUBS not in sys.path:
    sys.path.append(STUBS)
_pp = os.environ.get("PYTHONPATH", "")
if STUBS not in _pp.split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join([p for p in (_pp, STUBS) if p])
sys.path.insert(0, str(HERE))  # for `import orlhf_helpers` under --import-mode=importlib
# each test module starts with pytest.importorskip("openrlhf"): without OpenRLHF they are skipped


@pytest.fixture(autouse=True)
def _no_leftover_patches():
    """Every test starts and ends without stablerl patches in this process."""
    import stablerl.adapters.openrlhf as adapter

    adapter.uninstrument()
    yield
    adapter.uninstrument()
