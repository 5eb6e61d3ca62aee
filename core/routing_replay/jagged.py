"""Routing replay on jagged per-token routes: the ``[b, j, num_hidden_layers, k]`` nested layout (absolute decoder
layers, one row per token of each sequence) in which training engines hand routes around (Megatron's
``routed_experts``, verl's batch field), over one engine step of micro-batches.

A :class:`JaggedSession` either replays (R3, and R2's update: each micro-batch's routes forced in its forward and
through backward, so gradient-checkpoint recomputation replays the same experts) or captures (R2's old-log-prob
pass: the experts each router used, returned in the same jagged layout). The model input is packed (remove-padding,
plus the engine's static pad of unrouted tokens) or right-padded to the micro-batch's longest row.
"""

from __future__ import annotations

import torch

from ..params import StableRLError
from .capturing import capture
from .families import require_routers
from .replaying import replay
from .routes import Routes


class JaggedSession:
    """Replay (``record=False``) or capture (``record=True``) across one engine step of ``model``'s micro-batches."""

    def __init__(self, model, record: bool):
        self.model, self.record = model, record
        routers = require_routers(model)
        if any(r.top_k < 2 for r in routers):
            raise StableRLError("routing replay on jagged routes needs top-k >= 2 routers: the int16 layout cannot "
                                "mark padding rows of a top-1 model")
        self.moe_layers = [r.layer_id for r in routers]
        self.num_experts = max(r.num_experts for r in routers)
        self._replay = None if record else replay(model, None)
        self._capture = None

    def begin(self, input_ids: torch.Tensor, routed: torch.Tensor, *, packed: bool, pad: int = 0) -> None:
        """Before a micro-batch's forward: start capturing, or force ``routed`` (jagged like the nested
        ``input_ids``). ``packed``: the input is the sequences packed (``pad`` unrouted tokens appended), else
        right-padded rows."""
        if self.record:
            self._capture = capture(self.model)
            return
        if not routed.is_nested:
            raise StableRLError(f"routing replay: expected jagged routed_experts, got a {tuple(routed.shape)} tensor")
        offsets = input_ids.offsets().cpu()
        values = routed.values()
        if values.shape[0] != int(offsets[-1]):
            raise StableRLError(f"routing replay: routed_experts hold {values.shape[0]} token rows, the micro-batch "
                                f"{int(offsets[-1])} tokens")
        if packed:
            if pad:  # the engine's static bucket pad; no route, routed natively
                values = torch.cat([values, values.new_zeros((pad, *values.shape[1:]))])
            routes = Routes.from_token_layer_slot(values, moe_layers=self.moe_layers, num_experts=self.num_experts)
        else:  # right-padded to the micro-batch's longest row
            lens = offsets.diff()
            mask = torch.arange(int(lens.max())).unsqueeze(0) < lens.unsqueeze(1)
            routes = Routes.from_token_layer_slot(values, moe_layers=self.moe_layers, num_experts=self.num_experts,
                                                  cu_seqlens=offsets).pad(mask)
        self._replay.set_routes(routes)

    def recorded(self, input_ids: torch.Tensor, num_hidden_layers: int, pad: int = 0) -> torch.Tensor:
        """After a captured forward: its experts as jagged int16 ``[b, j, num_hidden_layers, k]``."""
        cap, self._capture = self._capture, None
        cap.stop()
        routes = cap.routes(device=input_ids.device)
        offsets = input_ids.offsets()
        n = int(offsets[-1])
        if routes.batch_shape is not None and routes.batch_shape[0] > 1:  # padded forward: back to packed rows
            lens = offsets.diff().cpu()
            mask = torch.arange(routes.batch_shape[1]).unsqueeze(0) < lens.unsqueeze(1)
            routes = routes.unpad(mask)
        per_token = routes.to_token_layer_slot(num_hidden_layers)[: n if pad else None]
        if per_token.shape[0] != n:
            raise StableRLError(f"routing replay: captured {per_token.shape[0]} token rows for {n} tokens")
        return torch.nested.nested_tensor_from_jagged(per_token.to(torch.int16), offsets)

    def close(self) -> None:
        if self._capture is not None:
            self._capture.stop()
            self._capture = None
        if self._replay is not None:
            self._replay.remove()
            self._replay = None


__all__ = ["JaggedSession"]
