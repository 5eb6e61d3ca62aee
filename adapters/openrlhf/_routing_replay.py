"""MoE routing replay in OpenRLHF 0.11.2 (``--actor.stablerl_routing_replay R2|R3``): where OpenRLHF's code is
wrapped and how the routes travel (docs/openrlhf.md, "Routing replay", lists every patch and process); the
mechanics (capture, replay, per-row routes) are ``stablerl.routing_replay``'s.

R2 (arXiv 2512.01374): the armed actor's old-log-prob pass records its routes, which ride back on the CPU
log-prob tensor (:data:`ON_LOG_PROBS`), become one ``SampleRoutes`` per row of ``Experience.mm_train_inputs``
(the list the replay buffer splits and shuffles with the rows) and are replayed by ``training_step`` until after
the optimizer step. R3 (arXiv 2510.11370): vLLM returns the routes (``enable_return_routed_experts``), the agent
executors hand back the last call's, the samples generator stores them per row (``RolloutRoutes``), and the
actor's old-log-prob pass replays them (``BaseModelActor.execute_batch`` passes them on); from there as R2.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import os
from typing import Optional

import torch

from stablerl import routing_replay as rr
from stablerl.routing_replay import RolloutRoutes, SampleRoutes
from stablerl.params import StableRLError

from . import _controller
from . import _inputs as loss_inputs
from ._flags import ENV_ROUTING_REPLAY as ENV_MODE  # the mode where no args exist (vLLM rollout workers)
from ._flags import ROUTING_REPLAY_FLAG as FLAG
from ._flags import SAMPLING_REPLAY_FLAG
from ._sampling_mask import MASK_ATTR, replay_experiences
from ._selection import selection_from_args

MODES = rr.MODES
#: attribute of the old-log-prob tensor that carries the routes from the actor worker to the maker (Ray pickles the
#: tensor with it: the one field that travels from the actor worker's forward back to the experience maker)
ON_LOG_PROBS = "stablerl_routes"

#: R3: the rollout routes of the rows ``BaseModelActor.execute_batch`` is forwarding (its old-log-prob pass)
ROLLOUT_ROUTES: contextvars.ContextVar = contextvars.ContextVar("stablerl_rollout_routes", default=None)
#: key of an agent executor's output carrying vLLM's routed experts (R3)
ROUTED_EXPERTS = "routed_experts"


def parse_mode(value) -> Optional[str]:
    """``"R2"``, ``"R3"`` or None (core's :func:`stablerl.routing_replay.parse_mode` for :data:`FLAG`)."""
    return rr.parse_mode(value, FLAG)


def check_mode(mode: Optional[str], args) -> Optional[str]:
    """Raise a :class:`StableRLError` for what OpenRLHF cannot do with ``mode`` (driver and workers)."""
    mode = parse_mode(mode)
    if mode is None:
        return None
    if mode == "R3":
        check_vllm_for_r3()
    ds = getattr(args, "ds", None)
    if getattr(ds, "ring_attn_size", 1) not in (None, 1):
        raise StableRLError(
            f"{FLAG} {mode} does not support ring attention / sequence parallelism (--ds.ring_attn_size "
            f"{ds.ring_attn_size}): each rank forwards a slice of the packed tokens, the routes are not sliced "
            "with them. Use --ds.ring_attn_size 1")
    if getattr(ds, "tensor_parallel_size", 1) not in (None, 1):
        raise StableRLError(
            f"{FLAG} {mode} is not supported with DeepSpeed tensor parallelism (--ds.tensor_parallel_size "
            f"{ds.tensor_parallel_size}; untested). Use --ds.tensor_parallel_size 1")
    return mode


def check_vllm_for_r3(found: Optional[str] = None) -> str:
    """Raise a :class:`StableRLError` unless vLLM can return routed experts (vllm>=0.14)."""
    return rr.check_vllm_routes(f"{FLAG} R3", found)


def rollout_mode() -> Optional[str]:
    """The mode where only the environment tells it (vLLM rollout workers): ``$STABLERL_ROUTING_REPLAY``."""
    return parse_mode(os.environ.get(ENV_MODE))


class _Armed(rr.RowLayout):
    """The armed policy actor's mode and routers (its ``PolicyWorker.routes``)."""

    def __init__(self, mode: str, num_experts: int, layer_ids, packing: bool, top_k: Optional[int] = None):
        super().__init__(num_experts, tuple(layer_ids), packing, top_k)
        self.mode = mode

    def from_rollout(self, rows: list) -> list[SampleRoutes]:
        return super().from_rollout(rows, f"{FLAG} R3")


def _inner(model):
    module = getattr(model, "module", None)  # DeepSpeed engine -> the HF model it runs
    return module if isinstance(module, torch.nn.Module) else model


def arm(trainer, mode: Optional[str], adapter) -> None:
    """In ``ActorPPOTrainer.__init__``: validate and mark the policy actor (checks that it is MoE)."""
    mode = check_mode(mode, trainer.args)
    if mode is None:
        return
    actor = trainer.actor
    if getattr(actor, "is_vlm", False):
        raise StableRLError(f"{FLAG} {mode} supports text models only: a vision-language model uses "
                            "Experience.mm_train_inputs, the field the routes travel in")
    model = actor.model
    try:
        routers = rr.require_routers(model)
    except StableRLError as e:
        raise StableRLError(f"{FLAG} {mode} needs a Mixture-of-Experts actor: {e}") from None
    packing = bool(getattr(actor, "packing_samples", trainer.args.ds.packing_samples))  # what Actor.forward reads
    top_k = max(r.top_k for r in routers)
    if mode == "R3" and min(r.top_k for r in routers) < 2:
        # SampleRoutes marks natively routed tokens by zero rows (not k distinct experts): no top-1 routers
        raise StableRLError(f"{FLAG} R3 supports routers with top-k >= 2 (this actor has a top-1 router); use R2")
    adapter.worker(actor, create=True).routes = _Armed(mode, max(r.num_experts for r in routers),
                                                       tuple(r.layer_id for r in routers), packing, top_k)


def _old_pass(forward, actor, state: _Armed, *args, **kwargs):
    """The armed actor's old-log-prob ``Actor.forward``: R2 records the routers' choices, R3 replays the rollout's
    routes; either way the per-row routes ride back on the (CPU) log-probs."""
    mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
    model = _inner(actor.model)
    if state.mode == "R3":
        rows = ROLLOUT_ROUTES.get()
        if rows is None:
            raise StableRLError(
                f"{FLAG} R3: the actor's old-log-prob forward got no rollout routes. Is the stablerl setup hook active "
                "in the actor workers (it patches BaseModelActor.execute_batch), and did the experience maker pass "
                "mm_train_inputs_list?")
        samples = state.from_rollout(list(rows))
        scope = rr.replay(model, state.join(samples, mask))
    else:
        scope = recording = rr.capture(model)
    with scope:
        out = forward(actor, *args, **kwargs)
    if not isinstance(out, torch.Tensor):
        raise StableRLError(f"{FLAG} {state.mode}: the actor's old-log-prob forward returned "
                            f"{type(out).__name__}, expected the action log-prob tensor")
    out = out.cpu()  # PolicyModelActor.forward's .to("cpu") then keeps this tensor and its attribute
    setattr(out, ON_LOG_PROBS, samples if state.mode == "R3" else state.split(recording.routes(), mask))
    return out


def _attach(samples_list) -> None:
    """In the experience maker: routes from the old log-probs into ``Experience.mm_train_inputs``."""
    for i, samples in enumerate(samples_list):
        routes = getattr(samples.action_log_probs, ON_LOG_PROBS, None)
        if routes is None:
            raise StableRLError(
                f"{FLAG}: the actor's old-log-prob forward returned no routes (experience {i}). Is the stablerl "
                "setup hook active in the actor workers (python -m stablerl.adapters.openrlhf.train_ppo_ray), and "
                "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=0 in the workers (its tensor serializer drops tensor attributes; "
                "OpenRLHF's train() sets it to 1 unless it is set, the wrapper sets 0)?")
        delattr(samples.action_log_probs, ON_LOG_PROBS)
        if any(m is not None and not isinstance(m, RolloutRoutes) for m in samples.mm_train_inputs):
            raise StableRLError(f"{FLAG} supports text models only (these samples carry multimodal inputs)")
        if len(routes) != len(samples.sequences):
            raise rr.RoutesMismatchError(f"{FLAG}: {len(routes)} routed samples for {len(samples.sequences)} rows")
        samples.mm_train_inputs = list(routes)


def batch_routes(state: _Armed, experience) -> rr.Routes:
    samples = experience.mm_train_inputs
    if len(samples) != len(experience.sequences) or not all(isinstance(s, SampleRoutes) for s in samples):
        raise StableRLError(f"{FLAG} {state.mode}: the experience carries no routes in mm_train_inputs "
                            "(the experience maker was not patched, or another component replaced the field)")
    return state.join(samples, experience.attention_mask)


# ----------------------------------------------------------------------------- patches


def patch_actor_module(module, ledger, adapter) -> None:
    """``ActorPPOTrainer.training_step`` and ``Actor.forward`` (plain classes, shipped by reference); the same
    two patches feed a stablerl loss's declared inputs and the old-log-prob pass's entropy (``._inputs``)."""

    @ledger.around(module.ActorPPOTrainer, "training_step")
    def training_step_with_replay(training_step, self, experience, *args, **kwargs):
        worker = adapter.worker(self)
        controller = _controller.before_step(self, worker)  # the entropy controller's coefficient, if one is selected
        with loss_inputs.step_inputs(adapter, self, experience):
            state = worker.routes if worker is not None else None
            if state is None:
                status = training_step(self, experience, *args, **kwargs)
            else:
                # kept until the optimizer step: gradient checkpointing re-runs the routers in backward
                with rr.replay(_inner(self.actor.model), batch_routes(state, experience)):
                    status = training_step(self, experience, *args, **kwargs)
        _controller.after_step(self, controller, status)
        return status

    @ledger.around(module.Actor, "forward")
    def forward_recording(forward, self, *args, **kwargs):
        # the old-log-prob pass: PolicyModelActor.forward runs the policy in eval mode under no_grad
        worker = adapter.worker(self)
        if self.training or torch.is_grad_enabled():
            out = loss_inputs.train_forward(forward, self, *args, **kwargs)  # entropy for the loss, if declared
            _controller.record_entropy(worker, args, kwargs, out)  # and for the entropy controller, if one is armed
            return out
        old_pass = functools.partial(loss_inputs.old_pass_forward, forward, worker)  # + old-pass statistics
        state = worker.routes if worker is not None else None
        return old_pass(self, *args, **kwargs) if state is None else _old_pass(old_pass, self, state, *args, **kwargs)


def patch_maker_module(module, ledger, adapter) -> None:
    """``RemoteExperienceMaker.make_experience``: routes into the experiences (R2: recorded; R3: converted), and
    the old-log-prob pass's entropy / sum_pi_squared when an algorithm declares it (``._inputs``)."""

    @ledger.around(module.RemoteExperienceMaker, "make_experience")
    def make_experience_with_routes(make_experience, self, samples_list):
        selection = selection_from_args(self.strategy.args)
        mode = parse_mode(selection.routing_replay)
        if mode == "R3":  # the rows go to the actor as OpenRLHF's own mm_train_inputs_list argument
            for i, samples in enumerate(samples_list):
                if not all(isinstance(m, RolloutRoutes) for m in samples.mm_train_inputs):
                    raise StableRLError(
                        f"{FLAG} R3: experience {i} carries no rollout routes. Is the stablerl setup hook active in "
                        "the trainer and vLLM workers, and does the vLLM rollout return routed experts?")
        out = make_experience(self, samples_list)
        if mode is not None:
            _attach(out)
        stats = selection.old_pass_stats()
        engine_masks = [getattr(s.action_mask, MASK_ATTR, None) is not None for s in samples_list]
        if stats:
            sources = [getattr(s.action_log_probs, loss_inputs.KEPT_SET_SOURCE, None) for s in out]
            loss_inputs.attach_old_pass_stats(out, stats)
        if "log_kept_mass" in stats:  # sampling-mask replay: vLLM's log-probs over the full vocabulary
            if any(m and src != "engine" for m, src in zip(engine_masks, sources)):
                raise StableRLError(f"{SAMPLING_REPLAY_FLAG}: the rollout attached engine sampling masks, but the "
                                    "actor's old-log-prob pass did not receive them (it recomputed the kept set)")
            replay_experiences(out, loss_inputs.OLD_PASS_STATS["log_kept_mass"][1])
        return out


# ----------------------------------------------------------------------------- R3: rollout side


def patch_vllm_arg_utils(module, ledger, adapter) -> None:
    """``AsyncEngineArgs.__init__`` (what ``RolloutRayActor.__init__`` builds as ``vllm.AsyncEngineArgs``):
    ``enable_return_routed_experts=True`` under R3, after the version check."""

    @ledger.around(module.AsyncEngineArgs, "__init__")
    def init_returning_routes(init, self, *args, **kwargs):
        if rollout_mode() == "R3":
            check_vllm_for_r3()
            kwargs.setdefault("enable_return_routed_experts", True)
        return init(self, *args, **kwargs)


def patch_agent_module(module, ledger, adapter) -> None:
    """``execute`` of OpenRLHF's agent executors: the output gains ``routed_experts`` (R3 only): the engine is
    seen through core's ``RecordingEngine``, which gives the routes of the trajectory's last call."""
    for cls in (module.SingleTurnAgentExecutor, module.MultiTurnAgentExecutor):

        @ledger.around(cls, "execute")
        async def execute_with_routes(execute, self, *args, **kwargs):
            if rollout_mode() != "R3":
                return await execute(self, *args, **kwargs)
            bound = inspect.signature(execute).bind(self, *args, **kwargs)
            engine = bound.arguments["llm_engine"] = rr.RecordingEngine(bound.arguments["llm_engine"])
            out = await execute(*bound.args, **bound.kwargs)
            out[ROUTED_EXPERTS] = engine.trajectory_routes(out["observation_tokens"], f"{FLAG} R3", hint=(
                f"is the stablerl setup hook active in the vLLM rollout workers, with {ENV_MODE}=R3 in their "
                "environment (the wrapper CLI forwards it)?"))
            return out


def patch_samples_module(module, ledger, adapter) -> None:
    """``SamplesGenerator._process_response_into_experience``: the response's routes into the Experience row."""

    @ledger.around(module.SamplesGenerator, "_process_response_into_experience")
    def process_with_routes(process, self, response, **generate_kwargs):
        experience = process(self, response, **generate_kwargs)
        if parse_mode(selection_from_args(self.args).routing_replay) != "R3":
            return experience
        if ROUTED_EXPERTS not in response:
            raise StableRLError(
                f"{FLAG} R3: the agent executor's output has no '{ROUTED_EXPERTS}'. stablerl adds it to "
                "SingleTurnAgentExecutor and MultiTurnAgentExecutor (and subclasses that keep their execute) in the "
                f"vLLM workers, where the setup hook must be active with {ENV_MODE}=R3; a custom execute must return "
                "vLLM's request_output.outputs[0].routed_experts of its last engine call under that key")
        if any(m is not None for m in experience.mm_train_inputs):
            raise StableRLError(f"{FLAG} R3 supports text models only (this response carries multimodal inputs)")
        n = int(experience.sequences.shape[-1])  # OpenRLHF cut the tokens to max_len: cut the routes with them
        routed = response[ROUTED_EXPERTS]
        experience.mm_train_inputs = [RolloutRoutes(None if routed is None else routed[:n], n)]
        return experience


def patch_launcher_module(module, ledger, adapter) -> None:
    """``BaseModelActor.execute_batch`` (a plain base class of the by-value ``PolicyModelActor``): under R3, each
    ``forward`` item runs through ``_stablerl_forward_with_rollout_routes`` (added to the class, inherited), which
    hands the item's ``mm_train_inputs_list`` (the rows' rollout routes) to the armed Actor's old-log-prob pass
    (:data:`ROLLOUT_ROUTES`, for that call)."""
    ledger.set_attr("BaseModelActor.forward_with_rollout_routes", module.BaseModelActor,
                    "_stablerl_forward_with_rollout_routes", _forward_with_rollout_routes)

    @ledger.around(module.BaseModelActor, "execute_batch")
    def execute_batch_with_routes(execute_batch, self, method_name, all_data, start_idx, end_idx):
        # Ray pickles this closure with the by-value actor class: it references module-level names only
        if method_name == "forward" and _armed_mode(adapter, self) == "R3":
            method_name = "_stablerl_forward_with_rollout_routes"
        return execute_batch(self, method_name, all_data, start_idx, end_idx)


def _armed_mode(adapter, model_actor) -> Optional[str]:
    worker = adapter.worker(model_actor.__dict__.get("actor"))
    return worker.routes.mode if worker is not None and worker.routes is not None else None


def _forward_with_rollout_routes(self, *args, **kwargs):
    token = ROLLOUT_ROUTES.set(kwargs.get("mm_train_inputs_list"))
    try:
        return self.forward(*args, **kwargs)
    finally:
        ROLLOUT_ROUTES.reset(token)
