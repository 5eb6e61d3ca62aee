"""What stablerl algorithms carry from one step to the next, in one store with one checkpoint format.

A :class:`StateStore` holds, per process (or per trainer / loss object, where the framework has several in
one process), the state an adapter owns on the algorithms' behalf:

* ``slot(kind, name)``: the algorithm's ``Context.state`` dict (EntroPIC's controller integral, CAPO's
  tracked Adam moments, a filter's running statistics), one per (kind, name);
* ``generator(stream, seed)``: seeded random generators of filters and shapers;
* ``step``: the adapter's call counter (``Context.step`` of scheduled algorithms);
* ``track(kind, name, obj)``: objects with their own ``state_dict()`` / ``load_state_dict()`` (controllers).

:meth:`StateStore.state_dict` is the one format every adapter saves (tensors stay tensors: save it with
``torch.save``, never as text: CAPO's moments are ``[V, H]``); each adapter only decides *where* the
framework keeps it (a file next to verl's shards, DeepSpeed's ``client_state``, TRL's checkpoint folder).
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch

from .context import Context
from .contracts import ADVANTAGE_ESTIMATOR, BATCH_FILTER, CONTROLLER, POLICY_LOSS, REWARD_SHAPER

FORMAT = "stablerl.state"
FORMAT_VERSION = 2  # 1 was the per-adapter envelope of unreleased development versions


def to_device(value: Any, device: Any) -> Any:
    """``value`` with every tensor in it (dicts, lists, tuples) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


class StateStore:
    """The state stablerl algorithms keep between steps (see the module docstring). ``holds`` names what the
    store is for (``"loss"``, ``"driver"``): a checkpoint of another store is refused on load."""

    def __init__(self, holds: str = "") -> None:
        self.holds = holds
        self.step = 0
        self._slots: dict[tuple[str, str], dict] = {}
        self._generators: dict[tuple[str, int], torch.Generator] = {}
        self._tracked: dict[tuple[str, str], Any] = {}
        self._untracked: dict[tuple[str, str], Any] = {}  # loaded before its object was tracked

    # -- what adapters hand to algorithms --------------------------------------------------------

    def slot(self, kind: str, name: str) -> dict:
        """The persistent ``Context.state`` of algorithm ``name`` of ``kind`` (created empty on first use)."""
        return self._slots.setdefault((kind, name), {})

    def generator(self, stream: str, seed: int) -> torch.Generator:
        """The generator of random ``stream`` (e.g. ``"batch_filter:shuffle_r1"``) seeded with ``seed``; it
        continues where it stopped on every later call, and after a restore."""
        key = (stream, int(seed))
        if key not in self._generators:
            self._generators[key] = torch.Generator().manual_seed(int(seed))
        return self._generators[key]

    def context(self, kind: str, name: str, seed: int, **fields: Any) -> Context:
        """A ``Context`` for one call of ``name``: this store's step, the algorithm's own generator and state."""
        return Context(step=self.step, generator=self.generator(f"{kind}:{name}", seed), state=self.slot(kind, name),
                       **fields)

    def advance(self) -> None:
        """One more adapter call done (``Context.step`` of the next one)."""
        self.step += 1

    def track(self, kind: str, name: str, obj: Any) -> None:
        """Save ``obj.state_dict()`` with this store and restore it through ``obj.load_state_dict``; a state
        loaded before ``obj`` was tracked is restored now."""
        self._tracked[(kind, name)] = obj
        if (kind, name) in self._untracked:
            obj.load_state_dict(self._untracked.pop((kind, name)))

    def __bool__(self) -> bool:
        """True when there is something to save (a slot an algorithm only looked at does not count)."""
        return bool(self.step or any(self._slots.values()) or self._generators or self._tracked or self._untracked)

    def clear(self) -> None:
        """Forget everything but the tracked objects (a fresh process)."""
        self.step = 0
        self._slots.clear()
        self._generators.clear()
        self._untracked.clear()

    # -- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Everything in the store, as nested dicts of Python values and tensors (for ``torch.save``)."""
        slots: dict[str, dict] = {}
        for (kind, name), state in self._slots.items():
            slots.setdefault(kind, {})[name] = dict(state)
        generators: dict[str, dict] = {}
        for (stream, seed), gen in self._generators.items():
            generators.setdefault(stream, {})[seed] = gen.get_state()
        objects: dict[str, dict] = {}
        for (kind, name), state in self._untracked.items():
            objects.setdefault(kind, {})[name] = state
        for (kind, name), obj in self._tracked.items():
            objects.setdefault(kind, {})[name] = obj.state_dict()
        return {"stablerl_state": FORMAT, "version": FORMAT_VERSION, "holds": self.holds, "step": self.step,
                "slots": slots, "generators": generators, "objects": objects}

    def check(self, state: Any, where: str = "the checkpoint") -> None:
        """Raise unless ``state`` is a :meth:`state_dict` of a store like this one, in a format this stablerl reads."""
        if (not isinstance(state, dict) or state.get("stablerl_state") != FORMAT
                or (self.holds and state.get("holds") != self.holds)):
            raise RuntimeError(f"{where} is not a stablerl {self.holds + ' ' if self.holds else ''}state "
                               "(StateStore.state_dict())")
        if state.get("version", 0) > FORMAT_VERSION:
            raise RuntimeError(f"{where} was written by a newer stablerl (state format {state['version']}, this one "
                               f"reads {FORMAT_VERSION}): upgrade stablerl to resume from it")

    def load_state_dict(self, state: Any, where: str = "the checkpoint", device: Optional[Any] = None) -> None:
        """Replace the store's content by ``state`` (from :meth:`state_dict`); the slots' tensors go to
        ``device`` when given. ``where`` names the file or checkpoint key in errors."""
        self.check(state, where)
        objects = {(kind, name): s for kind, names in state.get("objects", {}).items() for name, s in names.items()}
        for kind, name in self._tracked:  # a run whose controller differs from the checkpoint's is refused
            saved = sorted(n for k, n in objects if k == kind)
            if saved and name not in saved:
                raise RuntimeError(f"{where} holds the {kind} state of {saved}, this run uses {kind} {name!r}")
        self.clear()
        self.step = int(state.get("step", 0))
        for kind, names in state.get("slots", {}).items():
            for name, slot in names.items():
                self._slots[(kind, name)] = dict(slot if device is None else to_device(slot, device))
        for stream, seeds in state.get("generators", {}).items():
            for seed, gen_state in seeds.items():
                self.generator(stream, seed).set_state(gen_state)
        for key, saved_state in objects.items():
            if key in self._tracked:
                self._tracked[key].load_state_dict(saved_state)
            else:
                self._untracked[key] = saved_state

    # -- files ------------------------------------------------------------------------------------

    def save(self, path: str) -> str:
        """``torch.save`` :meth:`state_dict` to ``path`` (tensors as tensors); a crash mid-save leaves the
        previous file, never a torn one."""
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(self.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)
        return path

    def load(self, path: str, map_location: Any = None) -> bool:
        """Restore from a file written by :meth:`save`; False (nothing changed) when there is none."""
        state = read_state(path, map_location)
        if state is not None:
            self.load_state_dict(state, where=path)
        return state is not None


def read_state(path: str, map_location: Any = None) -> Optional[dict]:
    """The state saved at ``path`` (``torch.load``; a ``.json`` file: the legacy JSON of development versions,
    see :func:`from_legacy_json`), or None when there is no such file."""
    if not os.path.exists(path):
        return None
    if path.endswith(".json"):
        with open(path) as f:
            return json.load(f)
    return torch.load(path, map_location=map_location, weights_only=False)


# -- the JSON state of stablerl 0.1 development versions (TRL's stablerl_controller.json), still read ----

LEGACY_FORMAT = 1  # its "format" field
_LEGACY_SLOT_KINDS = {"filter:": BATCH_FILTER, "shaper:": REWARD_SHAPER, "adv:": ADVANTAGE_ESTIMATOR}


def _json_decode(value: Any) -> Any:
    if isinstance(value, dict):
        if "__tensor__" in value:  # tensors were tagged with their dtype and shape
            return torch.tensor(value["__tensor__"], dtype=getattr(torch, value["dtype"])).reshape(value["shape"])
        return {k: _json_decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_decode(v) for v in value]
    return value


def from_legacy_json(state: dict, holds: str, generator: tuple[str, int]) -> dict:
    """The ``{"format": 1}`` JSON as a :meth:`StateStore.state_dict` of a store holding ``holds``: its slots
    (a loss's under its bare name), its random state as ``generator`` ``(stream, seed)``, its controller."""
    slots: dict[str, dict] = {}
    for key, value in _json_decode(state.get("ctx_state") or {}).items():
        kind, name = next(((k, key[len(p):]) for p, k in _LEGACY_SLOT_KINDS.items() if key.startswith(p)),
                          (POLICY_LOSS, key))
        slots.setdefault(kind, {})[name] = value
    generators = {}
    if state.get("rng") is not None:
        generators[generator[0]] = {generator[1]: torch.tensor(state["rng"], dtype=torch.uint8)}
    objects = {}
    if state.get("controller") is not None:
        ctrl = state["controller"]
        objects[CONTROLLER] = {ctrl.get("name"): {"state": _json_decode(ctrl["state"]),
                                                    "decision": _json_decode(ctrl.get("decision") or {})}}
    return {**StateStore(holds=holds).state_dict(), "slots": slots, "generators": generators, "objects": objects}


__all__ = ["FORMAT", "FORMAT_VERSION", "LEGACY_FORMAT", "StateStore", "from_legacy_json", "read_state", "to_device"]
