"""stablerl's subclass of verl's FSDP language-model engine: routing replay and checkpointed loss state.

When (and if) a process imports ``verl.workers.engine.fsdp.transformer_impl``, a post-import hook
re-points the engine registry's ``fsdp``/``fsdp2`` language-model entries (every device/vendor key that
held verl's ``FSDPEngineWithLMHead``) to :class:`StableRLFSDPEngineWithLMHead`, built from that class.
Everything else is verl's own:

* ``forward_backward_batch`` / ``prepare_model_inputs`` / ``prepare_model_outputs``: MoE routing replay
  (R2/R3) when ``fsdp_config.router_replay.mode`` is set and verl flags the step
  (:mod:`stablerl.adapters.verl._routing_replay`); verl's methods untouched otherwise;
* ``save_checkpoint`` / ``load_checkpoint``: also the stablerl losses' ``Context.state``
  (:mod:`stablerl.adapters.verl._state`), e.g. EntroPIC's controller, so a resumed run continues it.
"""

from __future__ import annotations

import logging
from typing import Any

from stablerl.adapters.verl._ledger import LEDGER, guarded

from . import _routing_replay as routing
from . import _sampling_mask, _state

logger = logging.getLogger("stablerl.adapters.verl")

ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
FSDP_BACKENDS = routing.FSDP_BACKENDS
# verl 0.9.1's fsdp_turbo engine (a subclass of the FSDP engine, cuda/npu only): re-pointed too, so the
# losses' state rides in its checkpoints as well (routing replay stays fsdp/fsdp2 only, and says so)
TURBO_MODULE = "verl.workers.engine.fsdp.fsdp_turbo_impl"
TURBO_BACKENDS = ("fsdp_turbo",)
_KEY = "engine"  # ledger keys of the registry entries re-pointed to the subclass, and of the hook
_STATE = routing.ENGINE_STATE  # the worker switch reads it (it never imports this module)


def engine_class(base):
    """The stablerl subclass of verl's ``FSDPEngineWithLMHead`` (``base``)."""

    class StableRLFSDPEngineWithLMHead(base):
        def forward_backward_batch(self, data, loss_function, forward_only=False):
            session = routing.session_for(self, data, forward_only)
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
                from verl.utils import tensordict_utils as tu

                use_rmpad = tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True)
                routing.begin(session, micro_batch, output_args, use_rmpad)
            return model_inputs, output_args

        def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
            model_output = super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
            session = getattr(self, "_stablerl_rr", None)
            if session is not None and session.record:
                model_output["routed_experts"] = session.recorded(
                    micro_batch["input_ids"], routing.num_hidden_layers(self.model_config.hf_config),
                    int(output_args.get("pad_size", 0)))
            log_mass = _sampling_mask.engine_log_kept_mass(self, output, output_args, micro_batch)
            if log_mass is not None:  # the old-log-prob pass under sampling-mask replay
                model_output[_sampling_mask.OUTPUT] = log_mass
            return model_output

        def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
            # before verl's save, so that its copy to hdfs_path (if any) includes the file
            _state.save_loss_state(local_path, self.rank)
            return super().save_checkpoint(local_path, hdfs_path, global_step, max_ckpt_to_keep, **kwargs)

        def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
            # before verl's load, which may delete the local copy (del_local_after_load)
            if _state.load_loss_state(local_path, self.rank):
                logger.info("stablerl: restored the losses' state from %s (rank %d)", local_path, self.rank)
            return super().load_checkpoint(local_path, hdfs_path, del_local_after_load, **kwargs)

    StableRLFSDPEngineWithLMHead.__module__ = __name__
    return StableRLFSDPEngineWithLMHead


def _repoint(base, cls, backends) -> None:
    from verl.workers.engine.base import EngineRegistry

    registry = EngineRegistry._engines.get("language_model", {})
    for backend in backends:
        for key, engine in list(registry.get(backend, {}).items()):
            if engine is base:
                LEDGER.set_item(f"{_KEY}:{backend}:{key}", registry[backend], key, cls)


def _patch_engine_module(module) -> None:
    base = module.FSDPEngineWithLMHead
    cls = _STATE["engine_class"] or engine_class(base)
    _STATE["engine_class"] = cls
    _repoint(base, cls, FSDP_BACKENDS)


def _patch_turbo_module(module) -> None:
    base = module.FSDPTurboEngineWithLMHead
    cls = _STATE.get("turbo_engine_class") or engine_class(base)
    _STATE["turbo_engine_class"] = cls
    _repoint(base, cls, TURBO_BACKENDS)


# a failed patch: routing replay refuses to start (the worker switch checks status()), no loss state in checkpoints
_LOST = "no routing replay, no loss state in checkpoints"
_apply = guarded(_patch_engine_module, _LOST, _STATE)


def instrument() -> None:
    """Re-point verl's FSDP (and fsdp_turbo) engine entries (now if the modules are imported, else on
    import). Idempotent; the adapter's ``uninstrument()`` gives them back to verl's classes."""
    LEDGER.on_import(f"{_KEY}:on_import", {ENGINE_MODULE: _apply,
                                            TURBO_MODULE: guarded(_patch_turbo_module, _LOST, _STATE)})


def status() -> dict[str, Any]:
    return {
        "engine_class": None if _STATE["engine_class"] is None else _STATE["engine_class"].__name__,
        "registry_entries": [k[len(_KEY) + 1:] for k in LEDGER.keys()
                             if k.startswith(_KEY + ":") and k != f"{_KEY}:on_import"],
        "error": _STATE["error"],
    }
