"""MoE routing replay (R2 / R3) for verl's FSDP engine, on Hugging Face transformers MoE models.

R3, rollout routing replay: Ma et al., arXiv 2510.11370; R2, vanilla routing replay: Zheng et al.,
arXiv 2512.01374 (GSPO, arXiv 2507.18071).

verl 0.9.1 replays routes only on Megatron and VeOmni; its FSDP engine never reads the
``routed_experts`` batch field and its worker forces ``router_replay`` off for ``fsdp``/``fsdp2``.
Two pieces close that gap:

* the engine side, :func:`session_for` / :func:`begin` (core's :class:`~stablerl.routing_replay.jagged.JaggedSession`
  on verl's jagged ``routed_experts``), called by stablerl's FSDP engine subclass
  (:mod:`stablerl.adapters.verl._engine`, installed in verl's engine registry);
* the worker switch (this module's :func:`instrument`): ``ActorRolloutRefWorker.__init__`` turns verl's
  routing-replay flag on for an FSDP actor whose ``fsdp_config.router_replay.mode`` is ``R2``/``R3``,
  exactly as verl does for Megatron. verl's own decorators then mark ``compute_log_prob`` and
  ``update_actor`` (not the reference model's pass) as routing-replay steps, and its trainer carries
  ``routed_experts``.

Config (the same key shape as ``actor.megatron.router_replay.mode``)::

    +actor_rollout_ref.actor.fsdp_config.router_replay.mode=R3
    actor_rollout_ref.rollout.enable_rollout_routing_replay=True    # R3: vLLM / SGLang return the routes
    +actor_rollout_ref.actor.fsdp_config.router_replay.mode=R2      # R2: routes of the old-log-prob pass

Per step (the routing itself is :mod:`stablerl.routing_replay`):

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

from typing import Any

from stablerl.adapters.verl._ledger import LEDGER, guarded
from stablerl.params import StableRLError, UnknownNameError, unknown_name_message

MODES = ("disabled", "R2", "R3")
WORKER_MODULE = "verl.workers.engine_workers"
FSDP_BACKENDS = ("fsdp", "fsdp2")
_STATE: dict[str, Any] = {"error": None}
#: the FSDP engine subclass (:mod:`._engine` fills it): the class, or why it is not installed
ENGINE_STATE: dict[str, Any] = {"engine_class": None, "error": None}
_WORKER_KEY = "routing_replay:ActorRolloutRefWorker.__init__"  # ledger key of the worker switch


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
# The engine's per-step entry point and the worker switch
# ------------------------------------------------------------------------------------------------


def _patch_worker_module(module) -> None:
    worker = module.ActorRolloutRefWorker
    if _WORKER_KEY in LEDGER:
        return
    original = worker.__init__

    def __init__(self, config, *args, **kwargs):
        original(self, config, *args, **kwargs)
        actor = config.get("actor") if hasattr(config, "get") else None
        strategy = actor.get("strategy") if actor is not None else None
        mode = mode_of(actor.get("fsdp_config")) if actor is not None else "disabled"
        if mode == "disabled":
            return
        if strategy not in FSDP_BACKENDS:
            raise StableRLError(
                f"fsdp_config.router_replay.mode={mode} is stablerl's routing replay for actor.strategy fsdp/fsdp2; "
                f"this actor uses {strategy!r} (Megatron and VeOmni have verl's own: "
                "actor.megatron.router_replay.mode / actor.veomni.router_replay.mode)")
        if ENGINE_STATE["error"]:
            raise StableRLError(f"fsdp_config.router_replay.mode={mode}: stablerl's FSDP engine subclass is not "
                                f"installed ({ENGINE_STATE['error']})")
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
    LEDGER.set_attr(_WORKER_KEY, worker, "__init__", __init__)


def num_hidden_layers(hf_config) -> int:
    cfg = getattr(hf_config, "text_config", None) or hf_config
    return int(cfg.num_hidden_layers)


def session_for(engine, data, forward_only: bool):
    """The routing-replay session (:class:`stablerl.routing_replay.jagged.JaggedSession`) of one
    ``forward_backward_batch`` of a verl FSDP engine, or None when ``router_replay`` is disabled or verl did not flag
    the step (the reference model's pass)."""
    from verl.utils import tensordict_utils as tu

    from stablerl.routing_replay.jagged import JaggedSession

    mode = mode_of(engine.engine_config)
    if mode == "disabled" or not tu.get_non_tensor_data(data, key="enable_routing_replay", default=False):
        return None
    if getattr(engine, "use_ulysses_sp", False):
        raise StableRLError(
            "stablerl routing replay on verl's FSDP engine does not support Ulysses sequence parallelism yet "
            "(ulysses_sequence_parallel_size > 1)")
    record = mode == "R2" and forward_only and data.get("routed_experts", None) is None
    return JaggedSession(engine.module, record=record)


def begin(session, micro_batch, output_args: dict, use_remove_padding: bool) -> None:
    """Before a micro-batch's forward: its ``routed_experts`` replayed (or, R2's old-log-prob pass, captured)."""
    routed = micro_batch.get("routed_experts", None)
    if routed is None and not session.record:
        raise StableRLError(
            "routing replay: the micro-batch has no 'routed_experts'. R3 needs "
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=True (vLLM >= 0.22 or SGLang return the "
            "routes); R2 records them in compute_log_prob, so the update must follow it in the same step")
    session.begin(micro_batch["input_ids"], routed, packed=use_remove_padding, pad=int(output_args.get("pad_size", 0)))


def instrument() -> None:
    """Arm the worker switch (now if its module is imported, else on import). Idempotent; the adapter's
    ``uninstrument()`` undoes it. The engine side is :mod:`stablerl.adapters.verl._engine`."""
    LEDGER.on_import("routing_replay:on_import",
                     {WORKER_MODULE: guarded(_patch_worker_module, "fsdp_config.router_replay is ignored", _STATE)})


def status() -> dict[str, Any]:
    return {"worker_switch": _WORKER_KEY in LEDGER, "error": _STATE["error"]}
