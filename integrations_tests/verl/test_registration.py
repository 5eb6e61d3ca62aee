"""Registration: entry point in a fresh process, opt-out, fallbacks, idempotence, version gate."""

from __future__ import annotations

import importlib
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


class _Proc:
    """A python subprocess started at once; ``result()`` waits for it (tests run them concurrently,
    each fresh ``import verl`` takes seconds)."""

    def __init__(self, code: str, **env):
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
        full_env.update(env)
        self.popen = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, cwd="/"
        )
        self._done = None

    def result(self) -> subprocess.CompletedProcess:
        if self._done is None:
            out, err = self.popen.communicate(timeout=600)
            self._done = subprocess.CompletedProcess(self.popen.args, self.popen.returncode, out, err)
        return self._done

    def probe(self) -> dict:
        proc = self.result()
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])


def _expected(kind: str, names: set[str]) -> set[str]:
    # only the names whose algorithm exists in this checkout (plugins are being added)
    have = set(stablerl.get_registry().names(kind))
    return {n for n in names if n.removeprefix("stablerl_") in have}


EXTERNAL_LIB = (
    "import verl\nfrom verl.utils.import_utils import import_external_libs\n"
    "import_external_libs('stablerl.adapters.verl')\nimport_external_libs(['stablerl.adapters.verl'])\n" + PROBE
)

GATE = """
import importlib.metadata as md, logging, sys
_orig = md.version
md.version = lambda name: {version!r} if name == "verl" else _orig(name)
import verl  # the adapter instruments on import where verl is imported (here without verl's entry point)
import stablerl.adapters.verl as a  # never raises through verl's import: the refusal is logged
print("LOADED", "stablerl_vanilla" in a.VERL_NAMES["policy_loss"])
try:
    a.instrument()
except ImportError as e:
    print("RAISED", type(e).__name__, e)
"""

# verl swallows the entry point's exception at DEBUG; the adapter's own WARNING must show
GATE_ENTRY_POINT = (
    "import importlib.metadata as md\n_o = md.version\n"
    "md.version = lambda n: '0.6.0' if n == 'verl' else _o(n)\n" + PROBE
)

# runs in every verl process (vLLM workers included): it may add nothing heavy on top of core_algos
LIGHT = """
import sys
import verl.trainer.ppo.core_algos
before = set(sys.modules)
import stablerl.adapters.verl
import torch
new = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in
             ("verl", "vllm", "sglang", "transformers", "ray", "megatron", "flash_attn", "tensordict"))
print("NEW", new, torch.cuda.is_initialized())
"""

_SCENARIOS = {
    "auto": (PROBE, {}),
    "none": (PROBE, {"VERL_USE_EXTERNAL_PLUGINS": "none"}),
    "allow": (PROBE, {"VERL_USE_EXTERNAL_PLUGINS": "stablerl"}),
    "allow_other": (PROBE, {"VERL_USE_EXTERNAL_PLUGINS": "someone_else"}),
    "modules_env": (PROBE, {"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": "stablerl.adapters.verl"}),
    "external_lib": (EXTERNAL_LIB, {"VERL_USE_EXTERNAL_MODULES": "stablerl.adapters.verl"}),
    "gate_old": (GATE.format(version="0.6.0"), {"VERL_USE_EXTERNAL_PLUGINS": "none"}),
    "gate_new": (GATE.format(version="0.10.0"), {"VERL_USE_EXTERNAL_PLUGINS": "none"}),
    "gate_new_allowed": (GATE.format(version="0.10.0"),
                         {"VERL_USE_EXTERNAL_PLUGINS": "none", "STABLERL_ALLOW_UNSUPPORTED": "1"}),
    "gate_entry_point": (GATE_ENTRY_POINT, {}),
    "light": (LIGHT, {"VERL_USE_EXTERNAL_PLUGINS": "none"}),
}


@pytest.fixture(scope="module")
def procs():
    started = {k: _Proc(code, **env) for k, (code, env) in _SCENARIOS.items()}
    yield started
    for p in started.values():
        if p.popen.poll() is None:
            p.popen.kill()
            p.popen.wait()


def test_entry_point_registers_in_a_fresh_process(procs):
    out = procs["auto"].probe()
    assert out["adapter"]
    assert _expected("policy_loss", LOSSES) <= set(out["losses"])
    assert _expected("advantage_estimator", ESTIMATORS) <= set(out["estimators"])
    assert "stablerl_vanilla" in out["losses"] and "stablerl_grpo" in out["estimators"]


def test_opt_out_disables_it(procs):
    out = procs["none"].probe()
    assert not out["adapter"]
    assert not [n for n in out["losses"] + out["estimators"] if n.startswith("stablerl_")]
    assert "m2po" not in out["losses"] and "qae" not in out["estimators"]


def test_allow_list_by_entry_point_name(procs):
    assert "stablerl_vanilla" in procs["allow"].probe()["losses"]
    assert "stablerl_vanilla" not in procs["allow_other"].probe()["losses"]


def test_fallback_external_modules_env(procs):
    out = procs["modules_env"].probe()
    assert out["adapter"] and "stablerl_vanilla" in out["losses"] and "stablerl_grpo" in out["estimators"]


def test_fallback_external_lib_loader_and_double_load(procs):
    # actor_rollout_ref.model.external_lib goes through verl's import_external_libs (HFModelConfig);
    # entry point, env var and external_lib all active: the later imports must be no-ops
    assert "stablerl_vanilla" in procs["external_lib"].probe()["losses"]


def test_version_gate_too_old_refuses_and_logs(procs):
    proc = procs["gate_old"].result()
    assert "LOADED False" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "RAISED UnsupportedVerlVersion" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert ">=0.9.1,<0.10" in proc.stdout and "found verl 0.6.0" in proc.stdout
    assert "verl adapter failed" in proc.stderr  # logged at ERROR: verl hides plugin errors


def test_version_gate_entry_point_failure_is_logged(procs):
    proc = procs["gate_entry_point"].result()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "verl adapter failed" in proc.stderr and ">=0.9.1,<0.10" in proc.stderr
    assert "stablerl_vanilla" not in json.loads(proc.stdout.strip().splitlines()[-1])["losses"]


def test_version_gate_too_new_refuses_unless_allowed(procs):
    proc = procs["gate_new"].result()
    assert "LOADED False" in proc.stdout and "found verl 0.10.0" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "STABLERL_ALLOW_UNSUPPORTED=1" in proc.stdout
    proc = procs["gate_new_allowed"].result()
    assert "LOADED True" in proc.stdout and "RAISED" not in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert ">=0.9.1,<0.10" in proc.stderr and "0.10.0" in proc.stderr  # the warning


def test_adapter_module_is_light(procs):
    proc = procs["light"].result()
    assert "NEW [] False" in proc.stdout, proc.stdout + proc.stderr[-2000:]


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
    assert r["supported"] == stablerl.frameworks.get_framework("verl").supported == ">=0.9.1,<0.10"
    assert {"kind", "verl_name", "stablerl_name", "live"} <= set(r["registered"][0])
    assert all({"kind", "name", "reason"} <= set(s) for s in r["skipped"])
    json.dumps(r)  # serialisable for `stablerl doctor`


def test_names_agree_with_the_documented_rule(adapter):
    """`stablerl describe` / the generated docs name verl keys by core's one naming rule."""
    from stablerl.frameworks import framework_names, get_framework

    by_algo: dict = {}
    for r in adapter.registration_report()["registered"]:
        by_algo.setdefault((r["kind"], r["stablerl_name"]), set()).add(r["verl_name"])
    for (kind, name), verl_names in by_algo.items():
        assert set(framework_names(get_framework("verl"), stablerl.get_spec(kind, name))) == verl_names, name
