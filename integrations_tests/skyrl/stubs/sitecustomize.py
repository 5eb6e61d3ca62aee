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
