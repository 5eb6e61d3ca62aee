"""The envelope of stablerl's per-process state inside a framework checkpoint (one format for every adapter).

``pack(kind, state)`` wraps a state dict as ``{"stablerl_state": kind, "version": FORMAT_VERSION, "state": ...}``;
``unpack(blob, kind, where)`` checks the kind and refuses a format newer than this stablerl reads, naming
``where`` (a file, a checkpoint key) in the error. verl stores the envelope in files of its own, OpenRLHF in
DeepSpeed's ``client_state``.
"""

from __future__ import annotations

from typing import Any

FORMAT_VERSION = 1


def pack(kind: str, state: dict) -> dict:
    return {"stablerl_state": kind, "version": FORMAT_VERSION, "state": state}


def unpack(blob: Any, kind: str, where: str) -> dict:
    if not isinstance(blob, dict) or blob.get("stablerl_state") != kind:
        raise RuntimeError(f"{where} is not a stablerl {kind} state")
    if blob.get("version", 0) > FORMAT_VERSION:
        raise RuntimeError(f"{where} was written by a newer stablerl (state format {blob['version']}, this one "
                           f"reads {FORMAT_VERSION}): upgrade stablerl to resume from it")
    return blob["state"]


def replace(target: dict, state: dict) -> None:
    """Make ``target`` (a module-level or per-object state dict that others hold) equal ``state``, in place."""
    target.clear()
    target.update(state)
