"""Registration: entry point in a fresh process, opt-out, fallbacks, idempotence, version gate."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import stablerl

LOSSES = {"stablerl_vanilla", "stablerl_m2po", "m2po", "stablerl_gmpo", "gmpo", "stablerl_cpgd", "cpgd"}
ESTIMATORS = {"stablerl_qae", "qae", "stablerl_grpo", "stablerl_rloo", "stablerl_opo", "bnpo", "dr_grpo"}

PROBE = """
import json, verl
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, ADV_ESTIMATOR_REGISTRY
print(json.dumps({"losses": sorted(POLICY_LOSS_REGISTRY), "estimators": sorted(ADV_ESTIMATOR_REGISTRY),
                  "adapter": "stablerl.adapters.verl" in __import__("sys").modules}))
"""


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=240, cwd="/"
    )


def _probe(**env) -> dict:
    proc = _run(PROBE, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _expected(kind: str, names: set[str]) -> set[str]:
    # only the names whose algorithm exists in this checkout (plugins are being added)
    have = set(stablerl.get_registry().names(kind))
    return {n for n in names if n.removeprefix("stablerl_") in have}


def test_entry_point_registers_in_a_fresh_process():
    out = _probe()
    assert out["adapter"]
    assert _expected("policy_loss", LOSSES) <= set(out["losses"])
    assert _expected("advantage_estimator", ESTIMATORS) <= set(out["estimators"])
    assert "stablerl_vanilla" in out["losses"] and "stablerl_grpo" in out["estimators"]


def test_opt_out_disables_it():
    out = _probe(VERL_USE_EXTERNAL_PLUGINS="none")
    assert not out["adapter"]
    assert not [n for n in out["losses"] + out["estimators"] if n.startswith("stablerl_")]
    assert "m2po" not in out["losses"] and "qae" not in out["estimators"]


def test_allow_list_by_entry_point_name():
    assert "stablerl_vanilla" in _probe(VERL_USE_EXTERNAL_PLUGINS="stablerl")["losses"]
    assert "stablerl_vanilla" not in _probe(VERL_USE_EXTERNAL_PLUGINS="someone_else")["losses"]


def test_fallback_external_modules_env():
    out = _probe(VERL_USE_EXTERNAL_PLUGINS="none", VERL_USE_EXTERNAL_MODULES="stablerl.adapters.verl")
    assert out["adapter"] and "stablerl_vanilla" in out["losses"] and "stablerl_grpo" in out["estimators"]


def test_fallback_external_lib_loader_and_double_load():
    # actor_rollout_ref.model.external_lib goes through verl's import_external_libs (HFModelConfig);
    # both the env var and external_lib active: the second import must be a no-op
    code = (
        "import verl\nfrom verl.utils.import_utils import import_external_libs\n"
        "import_external_libs('stablerl.adapters.verl')\nimport_external_libs(['stablerl.adapters.verl'])\n" + PROBE
    )
    proc = _run(code, VERL_USE_EXTERNAL_MODULES="stablerl.adapters.verl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stablerl_vanilla" in json.loads(proc.stdout.strip().splitlines()[-1])["losses"]


def test_builtins_never_replaced(adapter, core_algos):
    for name in ("vanilla", "gspo", "cispo", "geo_mean", "gpg", "dro"):
        assert core_algos.POLICY_LOSS_REGISTRY[name].__module__ == "verl.trainer.ppo.core_algos", name
    for name in ("grpo", "rloo", "opo", "gpg", "gae"):
        assert core_algos.ADV_ESTIMATOR_REGISTRY[name].__module__ == "verl.trainer.ppo.core_algos", name
    skipped = {(s["kind"], s["name"]) for s in adapter.registration_report()["skipped"]}
    assert ("policy_loss", "vanilla") in skipped and ("advantage_estimator", "grpo") in skipped


def test_every_available_algorithm_is_registered(adapter, core_algos):
    report = adapter.registration_report()
    assert report["ok"] and report["error"] is None and report["verl_version"] == "0.9.1"
    regs = {"policy_loss": core_algos.POLICY_LOSS_REGISTRY, "advantage_estimator": core_algos.ADV_ESTIMATOR_REGISTRY}
    for kind, registry in regs.items():
        for spec in stablerl.list_algorithms(kind):
            verl_name = "stablerl_" + spec.name
            if spec.status == stablerl.UNAVAILABLE:
                assert verl_name not in registry
                continue
            if spec.requires and set(spec.requires) - {"index"}:
                continue
            assert adapter.VERL_NAMES[kind][verl_name] == spec.name
            assert getattr(registry[verl_name], "_stablerl_verl") == (kind, spec.name)
    assert all(r["live"] for r in report["registered"])
    for name in ("m2po", "gmpo", "cpgd"):
        if name in stablerl.get_registry().names("policy_loss"):
            assert adapter.VERL_NAMES["policy_loss"][name] == name
            assert core_algos.get_policy_loss_fn(name) is core_algos.get_policy_loss_fn("stablerl_" + name)
    for name in ("qae", "bnpo", "dr_grpo"):
        if name in stablerl.get_registry().names("advantage_estimator"):
            assert core_algos.get_adv_estimator_fn(name) is core_algos.get_adv_estimator_fn("stablerl_" + name)


def test_import_twice_and_under_a_second_module_name(adapter, core_algos):
    import importlib

    before = dict(core_algos.POLICY_LOSS_REGISTRY), dict(core_algos.ADV_ESTIMATOR_REGISTRY)
    importlib.reload(adapter)  # runs the module body again
    path = Path(adapter.__file__)
    spec = importlib.util.spec_from_file_location(
        "stablerl_verl_copy", path, submodule_search_locations=[str(path.parent)]
    )
    copy = importlib.util.module_from_spec(spec)
    sys.modules["stablerl_verl_copy"] = copy
    try:
        spec.loader.exec_module(copy)  # a distinct module object with its own wrapper functions
    finally:
        sys.modules.pop("stablerl_verl_copy", None)
    after = dict(core_algos.POLICY_LOSS_REGISTRY), dict(core_algos.ADV_ESTIMATOR_REGISTRY)
    assert before[0] == after[0] and before[1] == after[1]  # same function objects: nothing replaced
    assert copy.registration_report()["ok"] and copy.VERL_NAMES == adapter.VERL_NAMES
    assert all(r["live"] for r in copy.registration_report()["registered"])


def test_registration_report_shape(adapter):
    r = adapter.registration_report()
    assert r["supported"] == ">=0.7.0,<0.10"
    assert {"kind", "verl_name", "stablerl_name", "live"} <= set(r["registered"][0])
    assert all({"kind", "name", "reason"} <= set(s) for s in r["skipped"])
    json.dumps(r)  # serialisable for `stablerl doctor`


GATE = """
import importlib.metadata as md, logging, sys
_orig = md.version
md.version = lambda name: {version!r} if name == "verl" else _orig(name)
try:
    import stablerl.adapters.verl as a
except ImportError as e:
    print("RAISED", type(e).__name__, e)
else:
    print("LOADED", "stablerl_vanilla" in a.VERL_NAMES["policy_loss"])
"""


def test_version_gate_too_old_raises_and_warns():
    proc = _run(GATE.format(version="0.6.0"), VERL_USE_EXTERNAL_PLUGINS="none")
    assert "RAISED UnsupportedVerlVersion" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert ">=0.7.0,<0.10" in proc.stdout
    assert "WARNING" in proc.stderr or "failed" in proc.stderr  # logged, since verl hides plugin errors


def test_version_gate_entry_point_failure_is_logged_at_warning():
    # verl swallows the entry point's exception at DEBUG; the adapter's own WARNING must show
    code = (
        "import importlib.metadata as md\n_o = md.version\n"
        "md.version = lambda n: '0.6.0' if n == 'verl' else _o(n)\n" + PROBE
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "stablerl" in proc.stderr and ">=0.7.0,<0.10" in proc.stderr
    assert "stablerl_vanilla" not in json.loads(proc.stdout.strip().splitlines()[-1])["losses"]


def test_version_gate_too_new_warns_but_registers():
    proc = _run(GATE.format(version="0.10.0"), VERL_USE_EXTERNAL_PLUGINS="none")
    assert "LOADED True" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert ">=0.7.0,<0.10" in proc.stderr and "0.10.0" in proc.stderr


def test_adapter_module_is_light():
    # runs in every verl process (vLLM workers included): no trainer/worker/ray-trainer imports
    code = (
        "import sys\nimport stablerl.adapters.verl\n"
        "bad = [m for m in ('verl.trainer.ppo.ray_trainer', 'verl.workers.engine_workers', 'vllm', 'sglang', "
        "'transformers', 'verl.workers.utils.losses') if m in sys.modules]\n"
        "import torch\nprint('BAD', bad, torch.cuda.is_initialized())"
    )
    proc = _run(code, VERL_USE_EXTERNAL_PLUGINS="none")
    assert "BAD [] False" in proc.stdout, proc.stdout + proc.stderr[-2000:]
