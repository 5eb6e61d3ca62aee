"""One version policy for every framework adapter (stablerl.frameworks.check_version), reading the ranges the
adapters declare once (adapters/frameworks.py), and pyproject's extras agreeing with them."""

import re
from pathlib import Path

import pytest

from stablerl.frameworks import UnsupportedVersionError, check_version, get_framework, version_in_range


@pytest.mark.parametrize("version,specifier,inside", [
    ("0.9.1", ">=0.9.1,<0.10", True), ("0.9.0", ">=0.9.1,<0.10", False), ("0.10.0", ">=0.9.1,<0.10", False),
    ("0.9.9+cu121", ">=0.9.1,<0.10", True), ("1.16.0rc1", ">=1.16,<1.17", True), ("1.17", ">=1.16,<1.17", False),
    ("0.11.2", ">=0.11.2,<0.11.3", True), ("0.11.3", ">=0.11.2,<0.11.3", False), ("0.11", ">=0.11.2,<0.11.3", False),
    ("2.0", "==2", True), ("2.0.1", "!=2.0.1", False), ("unknown", ">=0.1", False), ("0.1", "", True),
])
def test_version_in_range(version, specifier, inside):
    assert version_in_range(version, specifier) is inside


def test_unsupported_clause_is_an_error():
    with pytest.raises(ValueError, match="~=1.2"):
        version_in_range("1.2", "~=1.2")


def test_outside_the_range_is_refused_unless_allowed(monkeypatch):
    monkeypatch.delenv("STABLERL_ALLOW_UNSUPPORTED", raising=False)
    assert check_version("openrlhf", "0.11.2") == "0.11.2"
    with pytest.raises(UnsupportedVersionError) as e:
        check_version("openrlhf", "0.12.0")
    message = str(e.value)
    assert "found openrlhf 0.12.0" in message and "openrlhf>=0.11.2,<0.11.3" in message
    assert "STABLERL_ALLOW_UNSUPPORTED=1" in message
    with pytest.raises(UnsupportedVersionError, match="not installed"):
        check_version("verl", None)

    class Mine(UnsupportedVersionError):
        pass

    with pytest.raises(Mine):  # an adapter raises its own subclass
        check_version("trl", "1.15.2", error=Mine)
    monkeypatch.setenv("STABLERL_ALLOW_UNSUPPORTED", "1")
    with pytest.warns(RuntimeWarning, match=r"found trl 1\.17\.0.*STABLERL_ALLOW_UNSUPPORTED=1"):
        assert check_version("trl", "1.17.0") == "1.17.0"
    with pytest.raises(UnsupportedVersionError, match="not installed"):  # allowed means another version, not none
        check_version("trl", None)
    with pytest.raises(UnsupportedVersionError):
        check_version("trl", "1.17.0", allow=False)


def test_pyproject_extras_match_the_declared_ranges():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    for name in ("verl", "trl"):
        spec = get_framework(name)
        extra = re.search(rf'^{name} = \[(.*)\]$', text, re.M).group(1)
        assert f'"{spec.distribution}{spec.supported}"' in extra, (name, extra, spec.supported)
