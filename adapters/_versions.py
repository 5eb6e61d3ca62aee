"""Version strings of the frameworks, as comparable tuples (one parser for every adapter's range check)."""

from __future__ import annotations

import re


def version_tuple(text: str, parts: int = 3) -> tuple[int, ...]:
    """The first ``parts`` numbers of a version string, 0-padded: ``"0.11.2+cu121"`` -> ``(0, 11, 2)``,
    ``"1.16.0rc1"`` -> ``(1, 16, 0)``, ``"unknown"`` -> ``(0, 0, 0)``. A local suffix (``+...``) is ignored."""
    nums = [int(x) for x in re.findall(r"\d+", text.split("+")[0])[:parts]]
    return tuple((nums + [0] * parts)[:parts])
