"""MoE routing replay (R2 / R3) for Hugging Face-style MoE routers.

R3: Ma et al., "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference Routers",
arXiv 2510.11370. R2 ("vanilla routing replay"): Zheng et al., arXiv 2512.01374 / GSPO arXiv 2507.18071.

Replay forces the experts recorded earlier (by the rollout engine, R3, or by the training engine's
old-policy pass, R2) while the gate weights are recomputed from the *current* router logits with
the model family's own normalisation, so the router keeps learning::

    w = normalise_family( score(router_logits) ).gather(-1, recorded_indices)

API (framework-free; torch only at import)::

    from stablerl import routing_replay as rr

    with rr.capture(model) as cap:          # any forward or model.generate(...)
        model.generate(input_ids, attention_mask=mask, max_new_tokens=16)
    routes = cap.routes()                   # Routes: uint8 [num_moe_layers, B*T, k], batch_shape (B, T)

    with rr.replay(model, routes):          # every router uses the recorded experts
        out = model(sequences, attention_mask=...)

    routes = rr.Routes.from_vllm(output.routed_experts, moe_layers=[...])   # one sequence
    routes = rr.Routes.from_sglang(meta_info["routed_experts"], num_hidden_layers, top_k)
    batch = rr.Routes.pad_batch([r1, r2], side="left")                       # padded batch
    rr.mismatch_fraction(a, b)              # fraction of (layer, token, slot) choices that differ

Layout of :class:`Routes`: ``indices`` is layer-major ``[L, N, k]`` over the L MoE layers (dense
layers are not stored) and the N tokens of one forward pass, in the row-major order of the
pass's flattened ``[B, T]`` input (``batch_shape``) or of a packed sequence (``cu_seqlens``).
Dtype is uint8 for at most 256 experts, uint16 above, so a route costs exactly ``L * k`` bytes per
token (uint8). A row (layer, token) is *invalid* (routed natively during replay) when its k
indices are not distinct (k >= 2; the all-zero rows vLLM leaves for tokens it never forwarded,
and the rows the alignment helpers add for padding), or, for top-1 models, when the optional
``valid`` mask says so.

Router families (how to recognise a router and recompute its weights) are plugins registered through
the ``register_router_families`` hook; the built-ins are in ``stablerl.plugins.moe_families``.

Layout: :mod:`.routes` (the recorded routes), :mod:`.families` (router families, finding routers),
:mod:`.capturing` (recording), :mod:`.replaying` (replay) and :mod:`.rows` (routes carried row by row through
a framework's batch lists; the vLLM version that returns routes). Import from ``stablerl.routing_replay``.
"""

from __future__ import annotations

from .capturing import RouteCapture, capture
from .families import (
    RouterFamily,
    RouterInfo,
    find_routers,
    require_routers,
    router_families,
    sigmoid_gather_weights,
    softmax_gather_weights,
)
from .replaying import RouteReplay, replay, replay_row_chunks
from .routes import Routes, RoutesMismatchError, index_dtype, mismatch_fraction
from .rows import (VLLM_ROUTES_MIN, RecordingEngine, RolloutRoutes, RowLayout, SampleRoutes, check_vllm_routes,
                   last_call_routes, vllm_version)

#: the routing-replay modes: R2 (routes of the training engine's old-log-prob pass), R3 (the rollout's)
MODES = ("R2", "R3")


def parse_mode(value, key: str):
    """``"R2"``, ``"R3"`` or None (None, "", "none", "off", "false") from config key ``key``, case-insensitive;
    anything else raises naming the valid modes."""
    from ..params import UnknownNameError, unknown_name_message

    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "off", "false")):
        return None
    if not isinstance(value, str) or value.strip().upper() not in MODES:
        raise UnknownNameError(unknown_name_message(key, str(value), MODES))
    return value.strip().upper()


__all__ = [
    "MODES",
    "parse_mode",
    "replay_row_chunks",
    "Routes",
    "RouterFamily",
    "RouterInfo",
    "RouteCapture",
    "RouteReplay",
    "capture",
    "replay",
    "find_routers",
    "require_routers",
    "router_families",
    "mismatch_fraction",
    "index_dtype",
    "softmax_gather_weights",
    "sigmoid_gather_weights",
    "RoutesMismatchError",
    "RowLayout",
    "RecordingEngine",
    "SampleRoutes",
    "RolloutRoutes",
    "VLLM_ROUTES_MIN",
    "vllm_version",
    "check_vllm_routes",
    "last_call_routes",
]
