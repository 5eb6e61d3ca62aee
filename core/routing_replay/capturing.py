"""Capture: record the experts every router of a model chooses (:func:`capture`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from ..params import StableRLError
from .families import RouterFamily, require_routers
from .routes import Routes, index_dtype


def _input_shape(args, kwargs) -> Optional[tuple[int, int]]:
    for key in ("input_ids", "inputs_embeds"):
        t = kwargs.get(key)
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return int(t.shape[0]), int(t.shape[1])
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2:
        return int(args[0].shape[0]), int(args[0].shape[1])
    return None


def _in_backward() -> bool:
    f = getattr(torch._C, "_current_graph_task_id", None)
    return f is not None and f() != -1


@dataclass
class _Pass:
    shape: Optional[tuple[int, int]]
    group: int
    auto: bool = False  # started by a router call, not by a call of the captured model
    layers: dict = field(default_factory=dict)  # layer position -> indices [N, k] (compact dtype, model device)
    log_probs: dict = field(default_factory=dict)  # layer position -> fp32 [N, k] (record_log_probs=True)


class RouteCapture:
    """Records the experts every MoE router actually uses (after any replay) during forwards and
    ``generate``. Starts on construction; stops on ``stop()`` / leaving the ``with`` block.

    A forward pass is one call of the captured model (``capture(model)``'s ``model``); calls of the same
    router within one pass after its first (gradient-checkpoint recomputation) are ignored. All passes
    inside one ``model.generate`` call form one group: the prefill ``(B*P, k)`` and each decode step
    ``(B, k)`` are concatenated to ``[B, P + steps]``. :meth:`routes` returns the one group's routes;
    :meth:`routes_list` every group's, in order.
    """

    def __init__(self, model, families: Optional[Iterable[RouterFamily]] = None, record_log_probs: bool = False):
        self.model = model
        self.record_log_probs = bool(record_log_probs)
        self.routers = require_routers(model, families)
        self._pos = {id(r.module): i for i, r in enumerate(self.routers)}
        self.num_experts = max(r.num_experts for r in self.routers)
        self.dtype = index_dtype(self.num_experts)
        self.passes: list[_Pass] = []
        self._group = 0
        self._in_generate = 0
        self._handles: list = []
        self._generate_patched = False
        self._had_instance_generate = False
        self._active = False
        self.start()

    # -- lifecycle
    def start(self) -> "RouteCapture":
        if self._active:
            return self
        self._handles.append(self.model.register_forward_pre_hook(self._on_model_forward, with_kwargs=True))
        for r in self.routers:
            self._handles.append(r.module.register_forward_hook(self._on_router))
        gen = getattr(self.model, "generate", None)
        if callable(gen):
            self._had_instance_generate = "generate" in vars(self.model)
            self._orig_generate = vars(self.model).get("generate")
            cap = self

            def generate(*args, **kwargs):
                cap._group += 1
                cap._in_generate += 1
                try:
                    return gen(*args, **kwargs)
                finally:
                    cap._in_generate -= 1
                    cap._group += 1

            vars(self.model)["generate"] = generate
            self._generate_patched = True
        self._active = True
        return self

    def stop(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._generate_patched:
            if self._had_instance_generate:
                vars(self.model)["generate"] = self._orig_generate
            else:
                vars(self.model).pop("generate", None)
            self._generate_patched = False
        self._active = False

    remove = stop

    def __enter__(self) -> "RouteCapture":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- hooks
    def _on_model_forward(self, module, args, kwargs):
        group = self._group if self._in_generate else self._next_group()
        self.passes.append(_Pass(_input_shape(args, kwargs), group))

    def _next_group(self) -> int:
        self._group += 1
        return self._group

    def _on_router(self, module, args, output):
        pos = self._pos[id(module)]
        last = self.passes[-1] if self.passes else None
        if last is not None and pos in last.layers:
            if _in_backward() or not last.auto:
                return  # recomputation (gradient checkpointing in backward) or a second call in one pass
            last = None  # routers called without the captured model: each first-router call starts a pass
        if last is None:
            last = _Pass(None, self._next_group(), auto=True)
            self.passes.append(last)
        idx = output[2].detach()
        # uint8 on any device; wider ids as int32 until routes() (uint16 kernels are CPU-limited)
        last.layers[pos] = idx.reshape(-1, idx.shape[-1]).to(torch.uint8 if self.dtype == torch.uint8 else torch.int32)
        if self.record_log_probs:  # log-softmax over all experts of the live logits, at the experts used (no grad)
            logits = output[0].detach()
            lp = torch.log_softmax(logits.reshape(-1, logits.shape[-1]).float(), dim=-1)
            last.log_probs[pos] = lp.gather(-1, idx.reshape(-1, idx.shape[-1]).long())

    # -- results
    def _group_routes(self, passes: list[_Pass], device) -> Routes:
        L = len(self.routers)
        k = self.routers[0].top_k
        for p in passes:
            missing = [self.routers[i].name for i in range(L) if i not in p.layers]
            if missing:
                raise StableRLError(f"capture: routers {missing} did not run in a forward pass")
        ids = [r.layer_id for r in self.routers]
        if len(passes) == 1:
            p = passes[0]
            n = p.layers[0].shape[0]
            shape = p.shape if p.shape is not None and p.shape[0] * p.shape[1] == n else None
            idx = torch.stack([p.layers[i] for i in range(L)]).to(device)
            return Routes(idx, num_experts=self.num_experts, batch_shape=shape, layer_ids=ids)
        # one generate call: concatenate passes along time
        per_layer = [[] for _ in range(L)]
        B = None
        for p in passes:
            n = p.layers[0].shape[0]
            b = p.shape[0] if p.shape is not None else None
            if b is None or n % b or (B is not None and b != B):
                raise StableRLError(
                    f"capture: cannot align a generate pass of {n} tokens (input shape {p.shape}) with batch size {B}")
            B = b
            for i in range(L):
                per_layer[i].append(p.layers[i].view(B, n // B, k))
        idx = torch.stack([torch.cat(x, dim=1) for x in per_layer]).to(device)  # [L, B, T, k]
        T = idx.shape[2]
        return Routes(idx.reshape(L, B * T, k), num_experts=self.num_experts, batch_shape=(B, T), layer_ids=ids)

    def routes_list(self, device="cpu") -> list[Routes]:
        """Routes of every forward pass / generate call, in order (``device=None``: the model's device)."""
        groups: dict[int, list[_Pass]] = {}
        for p in self.passes:
            groups.setdefault(p.group, []).append(p)
        return [self._group_routes(g, device) for g in groups.values()]

    def routes(self, device="cpu") -> Routes:
        """The routes of the one forward pass or generate call recorded."""
        rl = self.routes_list(device)
        if len(rl) != 1:
            raise StableRLError(
                f"capture recorded {len(rl)} forward passes / generate calls; use routes_list() to get each")
        return rl[0]

    def log_probs_list(self, device="cpu", batch_first: bool = False) -> list[torch.Tensor]:
        """With ``record_log_probs=True``: per forward pass / generate call, in the order and token layout of
        :meth:`routes_list`, the router log-probabilities ``log_softmax(router_logits, fp32)`` over all experts,
        gathered at the k experts each token used (after any replay): fp32 ``[L, N, k]``, or ``[B, T, L, k]``
        with ``batch_first`` (needs the pass's batch shape). Detached. RSPO's ``router_log_prob`` per token."""
        if not self.record_log_probs:
            raise StableRLError("capture(model, record_log_probs=True) is needed for log_probs_list()")
        groups: dict[int, list[_Pass]] = {}
        for p in self.passes:
            groups.setdefault(p.group, []).append(p)
        out = []
        L = len(self.routers)
        for passes in groups.values():
            routes = self._group_routes(passes, "cpu")  # validates the passes and gives the layout
            per_layer = []
            for i in range(L):
                parts = []
                for p in passes:
                    lp = p.log_probs[i]
                    b = p.shape[0] if len(passes) > 1 else 1
                    parts.append(lp.view(b, -1, lp.shape[-1]))
                per_layer.append(torch.cat(parts, dim=1).reshape(-1, parts[0].shape[-1]))
            lp = torch.stack(per_layer).to(device)  # [L, N, k]
            if batch_first:
                if routes.batch_shape is None:
                    raise StableRLError("log_probs_list(batch_first=True): the pass has no [B, T] batch shape")
                lp = lp.view(L, *routes.batch_shape, lp.shape[-1]).permute(1, 2, 0, 3).contiguous()
            out.append(lp)
        return out

    def clear(self) -> None:
        self.passes.clear()


def capture(model, families: Optional[Iterable[RouterFamily]] = None, record_log_probs: bool = False) -> RouteCapture:
    """Record the top-k experts of every MoE layer and token (see :class:`RouteCapture`). Records stay on
    the model's device in the compact dtype until :meth:`RouteCapture.routes` moves them (default CPU).
    ``record_log_probs=True`` also records the router log-probs at those experts (:meth:`RouteCapture.log_probs_list`)."""
    return RouteCapture(model, families, record_log_probs=record_log_probs)
