"""MoE routing replay in OpenRLHF 0.11.2 (``--actor.stablerl_routing_replay R2``): glue only.

The mechanics (capture, replay, alignment, gate-weight recomputation) are ``stablerl.routing_replay``'s;
this module only decides where OpenRLHF's code is wrapped and how the routes travel.

R2, vanilla routing replay (Zheng et al., arXiv 2512.01374; GSPO arXiv 2507.18071): the experts the
actor chose in its old-log-prob pass are forced in every training forward (and backward) on the
same tokens. In the Ray workers that own the code:

* ``Actor.forward`` (``openrlhf/models/actor.py``): on the armed policy actor in eval mode under
  no_grad, i.e. called by ``PolicyModelActor.forward`` for the old log-probs, the forward runs under
  ``rr.capture``; the routes of each sample's ``attention_mask == 1`` tokens ride back on the log-prob
  tensor (attribute ``stablerl_routes``). It is returned on the CPU already, so the ``.to("cpu")`` of
  ``PolicyModelActor.forward`` returns that same tensor, and torch's pickling keeps the attribute
  through Ray. (``PolicyModelActor`` itself is a ``@ray.remote`` class shipped by value, with copies
  of its inherited methods: a worker cannot patch it.)
* ``RemoteExperienceMaker.make_experience``: moves them into ``Experience.mm_train_inputs``, one
  :class:`SampleRoutes` per row (a list field OpenRLHF splits, re-batches and shuffles with the rows
  and reads only for vision-language models);
* ``ActorPPOTrainer.training_step``: rebuilds the batch routes for the micro-batch's layout (right
  padding, or ``unpad(attention_mask)`` under ``--ds.packing_samples``) and keeps ``rr.replay`` on
  from the forward until after backward and the optimizer step (gradient checkpointing re-runs the
  routers in backward).

R3 is refused with :data:`R3_MISSING` (OpenRLHF 0.11.2 cannot get the rollout's experts out of vLLM).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from stablerl import routing_replay as rr
from stablerl.params import StableRLError, UnknownNameError, unknown_name_message

FLAG = "--actor.stablerl_routing_replay"
MODES = ("R2", "R3")
#: attribute of the policy's OpenRLHF ``Actor`` once armed (set in ActorPPOTrainer.__init__)
ARMED = "_stablerl_routing_replay"
#: attribute of the old-log-prob tensor that carries the routes from the actor worker to the maker
ON_LOG_PROBS = "stablerl_routes"

R3_MISSING = (
    f"{FLAG} R3 is not available with OpenRLHF 0.11.2: the experts vLLM chose never reach the trainer. "
    "Missing in OpenRLHF: (1) create_vllm_engines (trainer/ray/vllm_engine.py) passes a fixed set of "
    "vllm.AsyncEngineArgs kwargs, so enable_return_routed_experts=True (vLLM PR #28284) cannot be set; "
    "(2) the agent executors (utils/agent.py) keep only token_ids, finish_reason and logprobs of "
    "request_output.outputs[0] and drop routed_experts; (3) SamplesGenerator._process_response_into_experience "
    "builds the Experience from a fixed set of response keys. Use R2 (experts of the actor's old-log-prob "
    "pass replayed in every training step)."
)


def parse_mode(value) -> Optional[str]:
    """``"R2"``, ``"R3"`` or None (case-insensitive); an unknown name raises naming the valid ones."""
    if value is None or value == "":
        return None
    mode = str(value).strip().upper()
    if mode not in MODES:
        raise UnknownNameError(unknown_name_message(FLAG, str(value), MODES))
    return mode


def check_mode(mode: Optional[str], args) -> Optional[str]:
    """Raise a :class:`StableRLError` for what OpenRLHF cannot do with ``mode`` (driver and workers)."""
    mode = parse_mode(mode)
    if mode is None:
        return None
    if mode == "R3":
        raise StableRLError(R3_MISSING)
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


@dataclass
class SampleRoutes:
    """The routes of one sample's ``attention_mask == 1`` tokens, in order: ``indices [n, L, k]``
    (uint8 up to 256 experts, else int16/int32, as ``Routes.batch_tensor``). One per row of
    ``Experience.mm_train_inputs``; not a tensor, so ``Experience.to_device`` leaves it on the CPU."""

    indices: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.indices.shape[0])


@dataclass
class _Armed:
    mode: str
    num_experts: int
    layer_ids: tuple
    packing: bool

    def split(self, routes: rr.Routes, attention_mask: torch.Tensor) -> list[SampleRoutes]:
        """Routes of one old-log-prob forward (padded ``[B, T]`` or packed ``(1, N)``) -> one per sample."""
        mask = attention_mask.detach().bool().cpu()
        if routes.batch_shape != tuple(mask.shape):  # packed: the N = mask.sum() kept tokens, row-major
            routes = routes.pad(mask)
        return [SampleRoutes(rr.Routes.pad_batch([seq]).batch_tensor()[0][0]) for seq in routes.unpad(mask).sequences()]

    def batch(self, samples: list, attention_mask: torch.Tensor) -> rr.Routes:
        """Per-sample routes -> the routes of this micro-batch's forward (padded, or packed)."""
        mask = attention_mask.detach().bool().cpu()
        counts = mask.sum(-1).tolist()
        for i, (s, n) in enumerate(zip(samples, counts)):
            if s.num_tokens != n:
                raise rr.RoutesMismatchError(
                    f"routing replay: row {i} carries routes for {s.num_tokens} tokens but its attention_mask has {n}")
        seqs = [rr.Routes.from_batch_tensor(s.indices.unsqueeze(0), num_experts=self.num_experts,
                                            layer_ids=self.layer_ids) for s in samples]
        padded = rr.Routes.pack(seqs).pad(mask)  # row-major mask order = the samples one after the other
        return padded.unpad(mask) if self.packing else padded


def _inner(model):
    module = getattr(model, "module", None)  # DeepSpeed engine -> the HF model it runs
    return module if isinstance(module, torch.nn.Module) else model


def arm(trainer, mode: Optional[str]) -> None:
    """In ``ActorPPOTrainer.__init__``: validate and mark the policy actor (checks that it is MoE)."""
    mode = check_mode(mode, trainer.args)
    if mode is None:
        return
    actor = trainer.actor
    if getattr(actor, "is_vlm", False):
        raise StableRLError(f"{FLAG} {mode} supports text models only: a vision-language model uses "
                            "Experience.mm_train_inputs, the field the routes travel in")
    if getattr(trainer.strategy, "ring_attn_group", None) is not None:
        raise StableRLError(f"{FLAG} {mode} does not support ring attention / sequence parallelism")
    model = actor.model
    routers = rr.find_routers(model)
    if not routers:
        try:
            rr.capture(_inner(model)).stop()  # raises core's error naming the known router families
        except StableRLError as e:
            raise StableRLError(f"{FLAG} {mode} needs a Mixture-of-Experts actor: {e}") from None
    packing = bool(getattr(actor, "packing_samples", trainer.args.ds.packing_samples))  # what Actor.forward reads
    setattr(actor, ARMED, _Armed(mode, max(r.num_experts for r in routers),
                                 tuple(r.layer_id for r in routers), packing))


def _recording_forward(forward, actor, state: _Armed, *args, **kwargs):
    """The old-log-prob ``Actor.forward`` under a capture; the routes ride on the (CPU) log-probs."""
    with rr.capture(_inner(actor.model)) as cap:
        out = forward(actor, *args, **kwargs)
    if not isinstance(out, torch.Tensor):
        raise StableRLError(f"{FLAG} {state.mode}: the actor's old-log-prob forward returned "
                            f"{type(out).__name__}, expected the action log-prob tensor")
    mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
    out = out.cpu()  # PolicyModelActor.forward's .to("cpu") then keeps this tensor and its attribute
    setattr(out, ON_LOG_PROBS, state.split(cap.routes(), mask))
    return out


def _attach(samples_list) -> None:
    """In the experience maker: routes from the old log-probs into ``Experience.mm_train_inputs``."""
    for i, samples in enumerate(samples_list):
        routes = getattr(samples.action_log_probs, ON_LOG_PROBS, None)
        if routes is None:
            raise StableRLError(
                f"{FLAG}: the actor's old-log-prob forward returned no routes (experience {i}). Is the stablerl "
                "setup hook active in the actor workers (python -m stablerl.adapters.openrlhf.train_ppo_ray), and "
                "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS unset (its tensor serializer drops tensor attributes)?")
        delattr(samples.action_log_probs, ON_LOG_PROBS)
        if any(m is not None for m in samples.mm_train_inputs):
            raise StableRLError(f"{FLAG} supports text models only (these samples carry multimodal inputs)")
        if len(routes) != len(samples.sequences):
            raise rr.RoutesMismatchError(f"{FLAG}: {len(routes)} routed samples for {len(samples.sequences)} rows")
        samples.mm_train_inputs = list(routes)


def batch_routes(state: _Armed, experience) -> rr.Routes:
    samples = experience.mm_train_inputs
    if len(samples) != len(experience.sequences) or not all(isinstance(s, SampleRoutes) for s in samples):
        raise StableRLError(f"{FLAG} {state.mode}: the experience carries no routes in mm_train_inputs "
                            "(the experience maker was not patched, or another component replaced the field)")
    return state.batch(samples, experience.attention_mask)


# ----------------------------------------------------------------------------- patches


def patch_actor_module(module, set_patch) -> None:
    """``ActorPPOTrainer.training_step`` and ``Actor.forward`` (both plain classes, shipped by reference)."""
    trainer_cls = module.ActorPPOTrainer
    training_step = trainer_cls.__dict__["training_step"]

    @functools.wraps(training_step)
    def training_step_with_replay(self, experience, *args, **kwargs):
        state = getattr(self.actor, ARMED, None)
        if state is None:
            return training_step(self, experience, *args, **kwargs)
        # kept until the optimizer step: gradient checkpointing re-runs the routers in backward
        with rr.replay(_inner(self.actor.model), batch_routes(state, experience)):
            return training_step(self, experience, *args, **kwargs)

    training_step_with_replay.__wrapped__ = training_step
    set_patch("ActorPPOTrainer.training_step", trainer_cls, "training_step", training_step_with_replay)

    actor_cls = module.Actor
    forward = actor_cls.__dict__["forward"]

    @functools.wraps(forward)
    def forward_recording(self, *args, **kwargs):
        state = self.__dict__.get(ARMED)
        # the old-log-prob pass: PolicyModelActor.forward runs the policy in eval mode under no_grad
        if state is None or self.training or torch.is_grad_enabled():
            return forward(self, *args, **kwargs)
        return _recording_forward(forward, self, state, *args, **kwargs)

    forward_recording.__wrapped__ = forward
    set_patch("Actor.forward", actor_cls, "forward", forward_recording)


def patch_maker_module(module, set_patch, selection_from_args) -> None:
    """``RemoteExperienceMaker.make_experience``: routes into the experiences (R2 only)."""
    cls = module.RemoteExperienceMaker
    make_experience = cls.__dict__["make_experience"]

    @functools.wraps(make_experience)
    def make_experience_with_routes(self, samples_list):
        out = make_experience(self, samples_list)
        if parse_mode(selection_from_args(self.strategy.args).routing_replay) is not None:
            _attach(out)
        return out

    make_experience_with_routes.__wrapped__ = make_experience
    set_patch("RemoteExperienceMaker.make_experience", cls, "make_experience", make_experience_with_routes)
