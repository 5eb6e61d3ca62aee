"""Replay: force recorded experts while recomputing the gate weights from the live router logits
(:func:`replay`)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

from ..params import StableRLError
from .families import RouterFamily, require_routers
from .routes import Routes, RoutesMismatchError


_REPLAYING: set[int] = set()  # id() of routers under replay (no nesting)


class RouteReplay:
    """Forces recorded experts in every MoE router; gate weights recomputed from the live logits.

    Applied on construction; ``remove()`` / leaving the ``with`` block removes every hook. The hook
    runs before any other forward hook of the router (so a capture inside a replay records the
    replayed experts) and looks its layer up by ``id(module)``, so gradient-checkpoint recomputation
    replays the same experts. Invalid rows keep the router's native choice and weights.
    ``set_routes`` swaps the routes (next micro-batch) without re-installing hooks.
    """

    def __init__(self, model, routes: Optional[Routes], families: Optional[Iterable[RouterFamily]] = None):
        self.model = model
        self.routers = require_routers(model, families)
        self._pos = {id(r.module): i for i, r in enumerate(self.routers)}
        self._handles: list = []
        self._cache: dict = {}
        self.routes: Optional[Routes] = None
        self.calls = [0] * len(self.routers)
        self.set_routes(routes)
        self.apply()

    def set_routes(self, routes: Optional[Routes]) -> None:
        if routes is not None:
            if not isinstance(routes, Routes):
                raise StableRLError(f"replay needs a stablerl.routing_replay.Routes, got {type(routes).__name__}")
            ks = {r.top_k for r in self.routers}
            routes.check(num_layers=len(self.routers), top_k=ks.pop() if len(ks) == 1 else None,
                         num_experts=min(r.num_experts for r in self.routers), where="replay")
            for r in self.routers:
                if r.top_k != routes.top_k:
                    raise RoutesMismatchError(f"router {r.name} selects top-{r.top_k}, routes hold top-{routes.top_k}")
        self.routes = routes
        self._cache = {}

    def _targets(self, device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        key = str(device)
        hit = self._cache.get(key)
        if hit is None:
            idx = self.routes.indices.to(device, non_blocking=True).long()
            valid = self.routes.valid.to(device)
            hit = (idx, None if bool(valid.all()) else valid)
            self._cache[key] = hit
        return hit

    def apply(self) -> "RouteReplay":
        if self._handles:
            return self
        busy = [r.name for r in self.routers if id(r.module) in _REPLAYING]
        if busy:
            raise StableRLError(f"routing replay is already active on {busy}; remove it first (no nesting)")
        for r in self.routers:
            self._handles.append(r.module.register_forward_hook(self._hook, prepend=True))
            _REPLAYING.add(id(r.module))
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for r in self.routers:
            _REPLAYING.discard(id(r.module))
        self._cache = {}

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def __enter__(self) -> "RouteReplay":
        return self.apply()

    def __exit__(self, *exc) -> None:
        self.remove()

    def _hook(self, module, args, output):
        if self.routes is None:
            return None
        pos = self._pos[id(module)]
        info = self.routers[pos]
        logits, weights, native_idx = output[0], output[1], output[2]
        n = logits.shape[0]
        idx_all, valid_all = self._targets(logits.device)
        if idx_all.shape[1] != n:
            raise RoutesMismatchError(
                f"routing replay: router {info.name} (MoE layer {pos}, decoder layer {info.layer_id}) received "
                f"{n} tokens but the routes hold {idx_all.shape[1]} tokens"
                + (f" (batch_shape {self.routes.batch_shape})" if self.routes.batch_shape else "")
                + "; align the routes to this forward's [B, T] / packed layout")
        target = idx_all[pos]
        new_w = info.family.recompute_weights(logits, target, module)
        if new_w.dtype != weights.dtype:
            new_w = new_w.to(weights.dtype)
        self.calls[pos] += 1
        if valid_all is None:
            new_idx = target
        else:
            v = valid_all[pos].unsqueeze(-1)
            new_idx = torch.where(v, target, native_idx.long()).to(native_idx.dtype)
            new_w = torch.where(v, new_w, weights)
        return (logits, new_w, new_idx.to(native_idx.dtype)) + tuple(output[3:])


def replay(model, routes: Optional[Routes], families: Optional[Iterable[RouterFamily]] = None) -> RouteReplay:
    """Force ``routes`` in every MoE router of ``model`` (see :class:`RouteReplay`)."""
    return RouteReplay(model, routes, families)



def replay_row_chunks(replay: RouteReplay, model, routes: Routes, input_shape, fn: Callable[[], Any],
                      keep: bool = False) -> Any:
    """``fn()`` under ``replay`` (a :func:`replay` of ``model``), where ``fn`` forwards the ``[B, T]`` batch
    ``input_shape`` of ``routes`` as consecutive row chunks, one ``model`` forward each (a framework's chunked
    log-prob pass): each forward replays its chunk's rows. ``replay`` is removed afterwards, unless ``keep`` and
    ``fn`` returned (gradient checkpointing re-runs the routers in backward: remove it after backward)."""
    if routes.batch_shape != tuple(input_shape[:2]):
        raise RoutesMismatchError(f"routing replay: routes for a batch of {routes.batch_shape}, the forward input is "
                                  f"{tuple(input_shape[:2])}")
    cursor = [0]

    def next_rows(module, args, kwargs):
        n = kwargs.get("input_ids", args[0] if args else None).shape[0]
        replay.set_routes(routes.rows(slice(cursor[0], cursor[0] + n)))
        cursor[0] += n

    pre_hook = model.register_forward_pre_hook(next_rows, with_kwargs=True)
    kept = False
    try:
        out = fn()
        kept = keep
    finally:
        pre_hook.remove()
        if not kept:
            replay.remove()
    return out
