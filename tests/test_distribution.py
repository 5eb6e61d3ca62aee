"""The distribution a user installs (issue 30, item 6): the sdist and the wheel build from the tracked files, the
wheel installs non-editable, and everything the source tree has is in it.

Built from a copy of ``git ls-files`` (what a clean clone has), with ``python -m build --no-isolation`` (no
download), installed with ``pip install --no-deps --target`` and imported from there ahead of the editable install.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> import path in the wheel (pyproject's package-dir)
FOLDERS = {"core": "stablerl", "plugins": "stablerl/plugins", "adapters": "stablerl/adapters"}


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the distribution is built from the tracked files")
    return [line for line in out.splitlines() if line and (ROOT / line).is_file()]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("build")
    work = tmp_path_factory.mktemp("dist")
    src = work / "src"
    tracked = _tracked()
    for rel in tracked:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    out = work / "out"
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--skip-dependency-check", "--sdist", "--wheel", "--outdir", str(out), str(src)],
                   check=True, capture_output=True, text=True)
    wheel = next(out.glob("stablerl-*.whl"))
    sdist = next(out.glob("stablerl-*.tar.gz"))
    site = work / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, capture_output=True, text=True)
    return {"wheel": wheel, "sdist": sdist, "site": site, "tracked": tracked}


def _run(site: Path, code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(site), "STABLERL_PLUGINS": os.environ.get("STABLERL_PLUGINS", "")}
    env.pop("STABLERL_PLUGINS") if not env["STABLERL_PLUGINS"] else None
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=site.parent)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_source_file_is_in_the_wheel(built):
    names = set(zipfile.ZipFile(built["wheel"]).namelist())
    missing = []
    for rel in built["tracked"]:
        folder, _, rest = rel.partition("/")
        if folder in FOLDERS and rest:
            if f"{FOLDERS[folder]}/{rest}" not in names:
                missing.append(rel)
    assert not missing, f"tracked files not in the wheel (pyproject.toml's packages / package-data): {missing}"


def test_the_sdist_holds_every_tracked_source_file(built):
    import tarfile

    with tarfile.open(built["sdist"]) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    missing = [rel for rel in built["tracked"] if rel.split("/", 1)[0] in FOLDERS and rel not in names]
    assert not missing, f"tracked source files not in the sdist: {missing}"


def test_wheel_declares_the_entry_points(built):
    with zipfile.ZipFile(built["wheel"]) as whl:
        text = whl.read(next(n for n in whl.namelist() if n.endswith(".dist-info/entry_points.txt"))).decode()
    points = configparser.ConfigParser()
    points.read_string(text)
    assert dict(points["stablerl.builtin"]) == {"algorithms": "stablerl.plugins:BUILTIN_PLUGINS",
                                                "frameworks": "stablerl.adapters.frameworks"}
    assert dict(points["verl.plugins"]) == {"stablerl": "stablerl.adapters.verl"}
    assert points["console_scripts"]["stablerl"] == "stablerl.cli:main"


def test_the_installed_wheel_lists_every_algorithm_and_framework(built):
    out = _run(built["site"], (
        "import json, stablerl, stablerl.frameworks as f\n"
        "from importlib.metadata import distribution\n"
        "print(json.dumps({'file': stablerl.__file__, 'n': len(stablerl.list_algorithms()),\n"
        "                  'frameworks': [fw.name for fw in f.list_frameworks()],\n"
        "                  'dist': str(distribution('stablerl')._path.resolve())}))"))
    import json

    got = json.loads(out.strip().splitlines()[-1])
    assert got["file"].startswith(str(built["site"])), got  # the wheel's copy, not the editable checkout
    assert got["dist"].startswith(str(built["site"]))
    from stablerl import list_algorithms

    assert got["n"] == len(list_algorithms()) and got["n"] >= 87
    assert got["frameworks"][:3] == ["verl", "trl", "openrlhf"]
    listing = _run(built["site"], "from stablerl.cli import main; main(['list'])")
    assert "m2po" in listing and "qae" in listing
