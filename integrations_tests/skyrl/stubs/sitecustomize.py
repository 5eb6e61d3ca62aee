"""Test-only start-up shim for SkyRL 0.3.0 on Python 3.11 (on PYTHONPATH, so Ray workers get it too).

``skyrl/tinker/types.py`` puts ``typing.TypedDict`` classes inside pydantic models, which pydantic refuses on
Python < 3.12 ("Please use typing_extensions.TypedDict"); ``typing_extensions.TypedDict`` is the same class
there with the metadata pydantic needs. Nothing else is changed.
"""

import sys

if sys.version_info < (3, 12):
    import typing

    import typing_extensions

    typing.TypedDict = typing_extensions.TypedDict

import os

if os.environ.get("STABLERL_SKYRL_CPU") == "1":  # the end-to-end test's Ray processes: SkyRL's workers on CPU
    import skyrl_cpu  # noqa: F401  (integrations_tests/skyrl/e2e, on PYTHONPATH in that test only)
