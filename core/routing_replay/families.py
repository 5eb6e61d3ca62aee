"""Router families: how a router module is recognised and its gate weights recomputed, and finding the
routers of a model."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

from ..params import StableRLError


def softmax_gather_weights(router_logits: torch.Tensor, indices: torch.Tensor, renormalize: bool,
                           out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``softmax(logits, fp32)`` over all experts, gathered at ``indices``, divided by its sum if
    ``renormalize``, cast to ``out_dtype`` (default fp32)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    w = probs.gather(-1, indices)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w if out_dtype is None else w.to(out_dtype)


def sigmoid_gather_weights(router_logits: torch.Tensor, indices: torch.Tensor, renormalize: bool,
                           scale: float = 1.0, eps: float = 1e-20) -> torch.Tensor:
    """``sigmoid(logits)`` gathered at ``indices`` (no selection bias), divided by ``sum + eps`` if
    ``renormalize``, times ``scale`` (DeepSeek-V3 style)."""
    w = router_logits.sigmoid().gather(-1, indices)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + eps)
    return w * scale


def _mro_names(module) -> set[str]:
    return {c.__name__ for c in type(module).__mro__}


@dataclass(frozen=True)
class RouterFamily:
    """How to recognise one family's router modules and recompute their gate weights.

    The router's forward must return ``(router_logits [N, E], top_k_weights [N, k], top_k_index [N, k], ...)``
    (the transformers >= 5 contract). ``recompute`` is ``fn(router_logits, indices_int64, module) ->
    weights`` with the dtype the router itself returns; it must carry gradient to ``router_logits``.
    A module matches when one of ``class_names`` is in its class's MRO, or when ``matcher(module)``.
    Register with ``register(family.spec(...))`` in a ``register_router_families`` hook.
    """

    name: str
    recompute: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]
    class_names: tuple[str, ...] = ()
    matcher: Optional[Callable[[Any], bool]] = None
    top_k_attr: str = "top_k"
    num_experts_attr: str = "num_experts"
    priority: int = 0
    description: str = ""

    def match(self, module) -> bool:
        if self.class_names and _mro_names(module) & set(self.class_names):
            return True
        return bool(self.matcher(module)) if self.matcher is not None else False

    def recompute_weights(self, router_logits: torch.Tensor, indices: torch.Tensor, module) -> torch.Tensor:
        return self.recompute(router_logits, indices, module)

    __call__ = recompute_weights

    def top_k(self, module) -> int:
        return int(getattr(module, self.top_k_attr))

    def num_experts(self, module) -> int:
        return int(getattr(module, self.num_experts_attr))

    def spec(self, **fields):
        """The :class:`~stablerl.AlgorithmSpec` to register (``fn`` is this family)."""
        from ..contracts import ROUTER_FAMILY, AlgorithmSpec

        fields.setdefault("title", self.description)
        return AlgorithmSpec(name=self.name, kind=ROUTER_FAMILY, fn=self, **fields)


def router_families() -> list[RouterFamily]:
    """Registered router families, highest priority first."""
    from ..contracts import ROUTER_FAMILY, UNAVAILABLE
    from ..registry import get_registry

    fams = [s.fn for s in get_registry().list(ROUTER_FAMILY) if s.status != UNAVAILABLE and s.fn is not None]
    return sorted(fams, key=lambda f: -getattr(f, "priority", 0))


@dataclass
class RouterInfo:
    name: str
    module: Any
    family: RouterFamily
    layer_id: int  # absolute decoder-layer index (parsed from "layers.<i>."; else ordinal)
    top_k: int
    num_experts: int


_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")


def find_routers(model, families: Optional[Iterable[RouterFamily]] = None) -> list[RouterInfo]:
    """Every MoE router of ``model`` in module order, with its family and absolute layer index."""
    fams = sorted(families, key=lambda f: -getattr(f, "priority", 0)) if families is not None else router_families()
    out: list[RouterInfo] = []
    for name, mod in model.named_modules():
        hits = [f for f in fams if f.match(mod)]
        if not hits:
            continue
        top = [f for f in hits if getattr(f, "priority", 0) == getattr(hits[0], "priority", 0)]
        if len(top) > 1:
            raise StableRLError(
                f"router {name} ({type(mod).__name__}) matches several router families: {[f.name for f in top]}; "
                "give one a higher priority")
        fam = hits[0]
        m = _LAYER_RE.findall(name)
        layer_id = int(m[-1]) if m else len(out)
        out.append(RouterInfo(name, mod, fam, layer_id, fam.top_k(mod), fam.num_experts(mod)))
    return out


def require_routers(model, families: Optional[Iterable[RouterFamily]] = None, needed_by: str = "") -> list[RouterInfo]:
    """:func:`find_routers`, raising a :class:`StableRLError` that names the known families when there is none
    (``needed_by``: the setting that needs them, e.g. ``"routing_replay='R2'"``)."""
    routers = find_routers(model, families)
    if not routers:
        names = [f.name for f in (families if families is not None else router_families())]
        raise StableRLError(
            (f"{needed_by} needs a Mixture-of-Experts model (remove it for a dense model): " if needed_by else "")
            + f"no MoE router of a known family found in {type(model).__name__}; known families: {names}. "
            "Register a RouterFamily through the register_router_families hook for other models.")
    return routers
