"""instrument() / uninstrument() of the TRL adapter: TRL is extended by subclassing only, so importing,
instrumenting (twice) and uninstrumenting leaves every TRL object as it was (checked in a fresh process,
against a snapshot taken before the adapter was imported)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("trl")

_PROBE = r"""
import json, sys
import trl, trl.trainer.grpo_trainer as gt

def snapshot():
    objects = {"trl": vars(trl), "grpo_trainer": vars(gt), "GRPOTrainer": vars(trl.GRPOTrainer),
               "GRPOConfig": vars(trl.GRPOConfig)}
    return {k: {n: id(v) for n, v in d.items() if not n.startswith("__")} for k, d in objects.items()}, \
        [id(f) for f in sys.meta_path]

before = snapshot()
import stablerl.adapters.trl as adapter
adapter.GRPOTrainer  # imports the trainer module (it instruments on import)
adapter.instrument(); adapter.instrument()
once = snapshot()
adapter.uninstrument()
after = snapshot()

def diff(a, b):
    return sorted(f"{k}.{n}" for k in a[0] for n in set(a[0][k]) | set(b[0][k]) if a[0][k].get(n) != b[0][k].get(n)) \
        + (["sys.meta_path"] if a[1] != b[1] else [])

print(json.dumps({"instrumented": diff(before, once), "after": diff(before, after)}))
"""


def test_trl_objects_are_untouched_by_instrument_and_uninstrument():
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # trl imports its own submodules lazily: a name that appeared is one of TRL's modules, never a stablerl object
    assert all(n.startswith("trl.") for n in got["instrumented"]), got
    assert got["after"] == got["instrumented"]


def test_version_policy_reads_the_declared_range(monkeypatch):
    import stablerl
    from stablerl.adapters import trl as adapter

    assert adapter.SUPPORTED_TRL == stablerl.frameworks.get_framework("trl").supported
    monkeypatch.delenv("STABLERL_TRL_SKIP_VERSION_CHECK", raising=False)
    monkeypatch.delenv("STABLERL_ALLOW_UNSUPPORTED", raising=False)
    import types

    import trl

    fake = types.SimpleNamespace(__version__="1.18.1", GRPOTrainer=trl.GRPOTrainer)
    with pytest.raises(adapter.UnsupportedTRLVersionError, match="STABLERL_ALLOW_UNSUPPORTED=1"):
        adapter.check_trl(fake)
    monkeypatch.setenv("STABLERL_ALLOW_UNSUPPORTED", "1")
    with pytest.warns(RuntimeWarning, match="found trl 1.18.1"):
        adapter.check_trl(fake)
