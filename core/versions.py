"""The version policy of every framework adapter: the installed framework must be inside the range its
adapter declares (``FrameworkSpec.supported``, a PEP 440 specifier read with ``packaging``), or the adapter
refuses to load, naming the found version and the range (``STABLERL_ALLOW_UNSUPPORTED=1``: a warning)."""

from __future__ import annotations

import inspect
import os
import warnings
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Mapping, Optional

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from .registry import get_framework

#: ``STABLERL_ALLOW_UNSUPPORTED=1``: a framework version outside an adapter's supported range is a warning,
#: not an error (to try a newer release before stablerl declares it)
ALLOW_UNSUPPORTED_ENV = "STABLERL_ALLOW_UNSUPPORTED"

#: the comparisons a declared range may use, on release numbers (no ``~=``, ``===`` or ``==1.*``)
_OPERATORS = frozenset({">=", "<=", ">", "<", "==", "!="})


class UnsupportedVersionError(ImportError):
    """The installed framework is outside the range its adapter declares (``FrameworkSpec.supported``)."""


def _is_release(text: str) -> bool:
    """Whether ``text`` is plain release numbers (``0.9.1``; no epoch, pre-, post-, dev-release or local part)."""
    try:
        v = Version(text)
    except InvalidVersion:
        return False
    return not (v.epoch or v.pre or v.post is not None or v.dev is not None or v.local)


def version_in_range(found_version: str, specifier: str) -> bool:
    """Whether ``found_version`` satisfies ``specifier``: comma-separated ``>=``, ``>``, ``<=``, ``<``, ``==``,
    ``!=`` clauses on release numbers (PEP 440 comparison, so missing parts count as 0: ``0.10`` == ``0.10.0``).

    ``found_version`` counts as its release: a pre-, post- or dev-release and a local part are dropped
    (``1.17.0rc1`` is 1.17.0, ``0.11.2+cu121`` is 0.11.2), so a release candidate of a supported version is
    supported. A ``found_version`` that is no PEP 440 version is outside every range; any other clause
    (``~=1.2``, ``==1.*``, a bound with a pre-release) raises ValueError."""
    try:
        clauses = SpecifierSet(specifier, prereleases=True)
    except InvalidSpecifier as e:
        raise ValueError(f"unsupported version specifier {specifier!r}: {e}") from None
    for clause in clauses:
        if clause.operator not in _OPERATORS or not _is_release(clause.version):
            raise ValueError(f"unsupported version clause {str(clause)!r} in {specifier!r}")
    if not len(clauses):
        return True
    try:
        release = Version(Version(found_version.strip()).base_version)
    except InvalidVersion:
        return False
    return clauses.contains(release, prereleases=True)


def installed_version(distribution: str) -> Optional[str]:
    """The installed version of ``distribution`` from its metadata (imports nothing), or None."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def check_version(framework_name: str, found_version: Optional[str], *, error: type = UnsupportedVersionError,
                  allow: Optional[bool] = None) -> Optional[str]:
    """The one version policy of every framework adapter: a version outside the framework's declared
    ``supported`` range (or no framework at all) raises ``error`` naming the found version and the range;
    with ``STABLERL_ALLOW_UNSUPPORTED=1`` (or ``allow=True``) an out-of-range version is a RuntimeWarning
    instead. Returns ``found_version``."""
    spec = get_framework(framework_name)
    install = f"pip install '{spec.distribution}{spec.supported}'"
    if found_version is None:
        raise error(f"{spec.adapter} needs {spec.distribution}{spec.supported}, which is not installed: {install}")
    if version_in_range(found_version, spec.supported):
        return found_version
    message = (f"{spec.adapter} supports {spec.distribution}{spec.supported}, found {spec.distribution} "
               f"{found_version}: install a supported version ({install})")
    if allow is None:
        allow = os.environ.get(ALLOW_UNSUPPORTED_ENV, "") == "1"
    if not allow:
        raise error(f"{message}, or set {ALLOW_UNSUPPORTED_ENV}=1 to try this one anyway")
    warnings.warn(f"{message}. Continuing because {ALLOW_UNSUPPORTED_ENV}=1.", RuntimeWarning, stacklevel=2)
    return found_version


def check_signatures(framework_name: str, cls: type, required: Mapping[str, Any], found_version: str, *,
                     error: type = UnsupportedVersionError) -> None:
    """Raise ``error`` unless each method of ``cls`` named in ``required`` exists with the parameters listed
    (the framework's private methods an adapter overrides or calls); never waived, unlike the version range."""
    spec = get_framework(framework_name)
    supported = f"{spec.adapter} supports {spec.distribution}{spec.supported}"
    for method, needed in required.items():
        fn = getattr(cls, method, None)
        if fn is None:
            raise error(f"{spec.distribution} {found_version}: {cls.__name__}.{method} no longer exists; {supported}")
        missing = [p for p in needed if p not in inspect.signature(fn).parameters]
        if missing:
            raise error(f"{spec.distribution} {found_version}: {cls.__name__}.{method} lacks parameter(s) {missing}; "
                        f"{supported}")
