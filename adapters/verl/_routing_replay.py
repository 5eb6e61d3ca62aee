"""MoE routing replay (R2 / R3) for verl's FSDP engine, on Hugging Face transformers MoE models.

verl 0.9.1 replays routes only on Megatron and VeOmni; its FSDP engine never reads the
``routed_experts`` batch field and its worker forces ``router_replay`` off for ``fsdp``/``fsdp2``.
This module closes that gap with two patches, applied when (and if) the process imports the module
that owns each class (a ``sys.meta_path`` post-import hook; nothing is imported here):

* ``verl.workers.engine.fsdp.transformer_impl``: :func:`engine_class` subclasses verl's
  ``FSDPEngineWithLMHead`` and re-points the engine registry's ``fsdp``/``fsdp2`` language-model entries
  to the subclass. With ``router_replay`` disabled (the default) every method is verl's own.
* ``verl.workers.engine_workers``: ``ActorRolloutRefWorker.__init__`` turns verl's routing-replay flag
  on for an FSDP actor whose ``fsdp_config.router_replay.mode`` is ``R2``/``R3``, exactly as verl does
  for Megatron. verl's own decorators then mark ``compute_log_prob`` and ``update_actor`` (not the
  reference model's pass) as routing-replay steps, and its trainer carries ``routed_experts``.

Config (the same key shape as ``actor.megatron.router_replay.mode``)::

    +actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3
    actor_rollout_ref.rollout.enable_rollout_routing_replay=True    # R3: vLLM / SGLang return the routes
    +actor_rollout_ref.actor.fsdp_config.router_replay.mode=R2      # R2: routes of the old-log-prob pass

What the engine does per step (the routing itself is :mod:`stablerl.routing_replay`):

* R3, and R2's update: each micro-batch's ``routed_experts`` (jagged ``[b, j, num_hidden_layers, k]``,
  absolute decoder layers, zero rows where the engine has no route) is converted to
  :class:`~stablerl.routing_replay.Routes` in the model input's layout (packed under
  ``use_remove_padding``, plus verl's static pad; right-padded otherwise) and replayed in the forward
  and through backward (gradient-checkpoint recomputation replays the same experts).
* R2's ``compute_log_prob``: the experts each router used are captured per micro-batch and returned as
  ``model_output["routed_experts"]`` (jagged int16, absolute layers), the format Megatron returns; verl's
  trainer puts it into the batch for the update.

Ulysses sequence parallelism is refused with a clear error (the routes would need verl's SP slicing; not
built yet), as are top-1 routers (the int16 layout cannot mark padding rows for k = 1).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from stablerl.adapters import _post_import as post_import
from stablerl.params import StableRLError, UnknownNameError, unknown_name_message

logger = logging.getLogger("stablerl.adapters.verl")

MODES = ("disabled", "R2", "R3")
ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
WORKER_MODULE = "verl.workers.engine_workers"
FSDP_BACKENDS = ("fsdp", "fsdp2")
_HOOK_TAG = "stablerl.verl.routing_replay"
_STATE: dict[str, Any] = {"engine_class": None, "replaced": [], "worker_init": None}


def mode_of(engine_config) -> str:
    """``router_replay.mode`` of an FSDP engine config: a dataclass, or the plain dict Hydra leaves when the
    key was added with ``+`` (the FSDP yaml has no ``router_replay`` section). Unknown values raise."""
    rr = getattr(engine_config, "router_replay", None)
    if rr is None:
        return "disabled"
    mode = rr.get("mode", "disabled") if hasattr(rr, "get") else getattr(rr, "mode", "disabled")
    mode = "disabled" if mode in (None, "", False) else str(mode)
    canon = {m.lower(): m for m in MODES}
    if mode.lower() not in canon:
        raise UnknownNameError(unknown_name_message("fsdp_config.router_replay.mode", mode, MODES))
    return canon[mode.lower()]


# ------------------------------------------------------------------------------------------------
# One step's routing-replay session (framework-free apart from the tensors verl hands over)
# ------------------------------------------------------------------------------------------------


class _Session:
    """Replay (or, for R2's old-log-prob pass, capture) across one ``forward_backward_batch``."""

    def __init__(self, model, record: bool):
        from stablerl import routing_replay as rr

        self.model, self.record = model, record
        routers = rr.find_routers(model)
        if not routers:
            rr._require_routers(model, None)  # raises the error that names the known families
        if any(r.top_k < 2 for r in routers):
            raise StableRLError(
                "routing replay in verl needs top-k >= 2 routers: verl's int16 routed_experts layout cannot mark "
                "padding rows of a top-1 model")
        self.moe_layers = [r.layer_id for r in routers]
        self.num_experts = max(r.num_experts for r in routers)
        self._replay = None if record else rr.replay(model, None)
        self._capture = None
        self.micro_batches = 0

    def begin(self, micro_batch, output_args: dict, use_remove_padding: bool) -> None:
        from stablerl import routing_replay as rr

        self.micro_batches += 1
        if self.record:
            self._capture = rr.capture(self.model)
            return
        routed = micro_batch.get("routed_experts", None)
        if routed is None:
            raise StableRLError(
                "routing replay: the micro-batch has no 'routed_experts'. R3 needs "
                "actor_rollout_ref.rollout.enable_rollout_routing_replay=True (vLLM >= 0.22 or SGLang return the "
                "routes); R2 records them in compute_log_prob, so the update must follow it in the same step")
        if not routed.is_nested:
            raise StableRLError(f"routing replay: expected jagged routed_experts, got a {tuple(routed.shape)} tensor")
        offsets = micro_batch["input_ids"].offsets().cpu()
        values = routed.values()
        if values.shape[0] != int(offsets[-1]):
            raise StableRLError(
                f"routing replay: routed_experts hold {values.shape[0]} token rows, the micro-batch "
                f"{int(offsets[-1])} tokens")
        if use_remove_padding:
            pad = int(output_args.get("pad_size", 0))  # verl's static bucket pad; no route, routed natively
            if pad:
                values = torch.cat([values, values.new_zeros((pad, *values.shape[1:]))])
            routes = rr.Routes.from_token_layer_slot(values, moe_layers=self.moe_layers, num_experts=self.num_experts)
        else:  # verl right-pads each row to the micro-batch's longest
            lens = offsets.diff()
            mask = torch.arange(int(lens.max())).unsqueeze(0) < lens.unsqueeze(1)
            packed = rr.Routes.from_token_layer_slot(values, moe_layers=self.moe_layers, num_experts=self.num_experts,
                                                     cu_seqlens=offsets)
            routes = packed.pad(mask)
        self._replay.set_routes(routes)

    def recorded(self, micro_batch, num_hidden_layers: int, pad_size: int) -> torch.Tensor:
        """This micro-batch's captured experts as verl's jagged int16 ``[b, j, num_hidden_layers, k]``."""
        cap, self._capture = self._capture, None
        cap.stop()
        routes = cap.routes(device=micro_batch["input_ids"].device)
        offsets = micro_batch["input_ids"].offsets()
        n = int(offsets[-1])
        if routes.batch_shape is not None and routes.batch_shape[0] > 1:  # padded forward: back to packed rows
            lens = offsets.diff().cpu()
            mask = torch.arange(routes.batch_shape[1]).unsqueeze(0) < lens.unsqueeze(1)
            routes = routes.unpad(mask)
        per_token = routes.to_token_layer_slot(num_hidden_layers)[: n if pad_size else None]
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


# ------------------------------------------------------------------------------------------------
# The engine subclass and the worker switch
# ------------------------------------------------------------------------------------------------


def _num_hidden_layers(hf_config) -> int:
    cfg = getattr(hf_config, "text_config", None) or hf_config
    return int(cfg.num_hidden_layers)


def engine_class(base):
    """A subclass of verl's ``FSDPEngineWithLMHead`` that replays (or records) MoE routes when its
    ``router_replay.mode`` is ``R2``/``R3`` and verl flags the step; verl's own methods otherwise."""
    from verl.utils import tensordict_utils as tu

    class RoutingReplayFSDPEngineWithLMHead(base):
        _stablerl_routing_replay = True

        def _stablerl_session(self, data, forward_only: bool) -> Optional[_Session]:
            mode = mode_of(self.engine_config)
            if mode == "disabled" or not tu.get_non_tensor_data(data, key="enable_routing_replay", default=False):
                return None
            if getattr(self, "use_ulysses_sp", False):
                raise StableRLError(
                    "stablerl routing replay on verl's FSDP engine does not support Ulysses sequence parallelism yet "
                    "(ulysses_sequence_parallel_size > 1)")
            record = mode == "R2" and forward_only and data.get("routed_experts", None) is None
            return _Session(self.module, record=record)

        def forward_backward_batch(self, data, loss_function, forward_only=False):
            session = self._stablerl_session(data, forward_only)
            if session is None:
                return super().forward_backward_batch(data, loss_function, forward_only=forward_only)
            self._stablerl_rr = session
            try:  # the replay hooks stay through backward (gradient-checkpoint recomputation)
                return super().forward_backward_batch(data, loss_function, forward_only=forward_only)
            finally:
                session.close()
                self._stablerl_rr = None

        def prepare_model_inputs(self, micro_batch):
            model_inputs, output_args = super().prepare_model_inputs(micro_batch)
            session = getattr(self, "_stablerl_rr", None)
            if session is not None:
                use_rmpad = tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
                session.begin(micro_batch, output_args, use_rmpad)
            return model_inputs, output_args

        def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
            model_output = super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
            session = getattr(self, "_stablerl_rr", None)
            if session is not None and session.record:
                model_output["routed_experts"] = session.recorded(
                    micro_batch, _num_hidden_layers(self.model_config.hf_config), int(output_args.get("pad_size", 0)))
            return model_output

    RoutingReplayFSDPEngineWithLMHead.__qualname__ = RoutingReplayFSDPEngineWithLMHead.__name__
    RoutingReplayFSDPEngineWithLMHead.__module__ = __name__
    return RoutingReplayFSDPEngineWithLMHead


def _patch_engine_module(module) -> None:
    from verl.workers.engine.base import EngineRegistry

    base = module.FSDPEngineWithLMHead
    cls = _STATE["engine_class"] or engine_class(base)
    _STATE["engine_class"] = cls
    registry = EngineRegistry._engines.get("language_model", {})
    for backend in FSDP_BACKENDS:
        for key, engine in list(registry.get(backend, {}).items()):
            if engine is base:
                registry[backend][key] = cls
                _STATE["replaced"].append((backend, key, base))


def _patch_worker_module(module) -> None:
    worker = module.ActorRolloutRefWorker
    if _STATE["worker_init"] is not None:
        return
    original = worker.__init__

    def __init__(self, config, *args, **kwargs):
        original(self, config, *args, **kwargs)
        actor = config.get("actor") if hasattr(config, "get") else None
        strategy = actor.get("strategy") if actor is not None else None
        if strategy not in FSDP_BACKENDS:
            return
        mode = mode_of(actor.get("fsdp_config"))
        if mode == "disabled":
            return
        rollout_rr = bool(config.get("rollout", {}).get("enable_rollout_routing_replay", False))
        if mode == "R3" and not rollout_rr and getattr(self, "_is_actor", False):
            raise StableRLError(
                "fsdp_config.router_replay.mode=R3 replays the rollout engine's routes: set "
                "actor_rollout_ref.rollout.enable_rollout_routing_replay=True (vLLM >= 0.22 or SGLang)")
        if mode == "R2" and rollout_rr:
            raise StableRLError(
                "fsdp_config.router_replay.mode=R2 records the routes itself: unset "
                "actor_rollout_ref.rollout.enable_rollout_routing_replay (it is R3's switch)")
        self.enable_routing_replay = True

    __init__.__wrapped__ = original
    worker.__init__ = __init__
    _STATE["worker_init"] = (worker, original)


def _apply(name: str, module) -> None:
    try:
        (_patch_engine_module if name == ENGINE_MODULE else _patch_worker_module)(module)
    except Exception as e:  # noqa: BLE001 - say it loudly: verl hides plugin errors
        logger.warning("stablerl: verl routing replay patch of %s failed: %s: %s", name, type(e).__name__, e)
        raise


def install() -> None:
    """Arm the two patches (now for modules already imported, else on their import). Idempotent."""
    import sys

    pending = {}
    for name in (ENGINE_MODULE, WORKER_MODULE):
        if name in sys.modules:
            _apply(name, sys.modules[name])
        else:
            pending[name] = (lambda n: (lambda m: _apply(n, m)))(name)
    if pending:
        post_import.install(_HOOK_TAG, pending, once=False)


def uninstall() -> None:
    """Undo both patches and disarm the hook."""
    from stablerl.adapters._post_import import remove

    remove(_HOOK_TAG)
    if _STATE["replaced"]:
        from verl.workers.engine.base import EngineRegistry

        registry = EngineRegistry._engines.get("language_model", {})
        for backend, key, base in _STATE["replaced"]:
            registry[backend][key] = base
        _STATE["replaced"].clear()
    if _STATE["worker_init"] is not None:
        worker, original = _STATE["worker_init"]
        worker.__init__ = original
        _STATE["worker_init"] = None


def status() -> dict[str, Any]:
    return {
        "engine_class": None if _STATE["engine_class"] is None else _STATE["engine_class"].__name__,
        "registry_entries": [f"{b}:{k}" for b, k, _ in _STATE["replaced"]],
        "worker_switch": _STATE["worker_init"] is not None,
    }
