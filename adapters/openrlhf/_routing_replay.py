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
  through Ray. (``PolicyModelActor`` itself is a ``@ray.remote`` class shipped by value: a worker
  cannot patch its own ``forward``.)
* ``RemoteExperienceMaker.make_experience``: moves them into ``Experience.mm_train_inputs``, one
  :class:`SampleRoutes` per row (a list field OpenRLHF splits, re-batches and shuffles with the rows
  and reads only for vision-language models);
* ``ActorPPOTrainer.training_step``: rebuilds the batch routes for the micro-batch's layout (right
  padding, or ``unpad(attention_mask)`` under ``--ds.packing_samples``) and keeps ``rr.replay`` on
  from the forward until after backward and the optimizer step (gradient checkpointing re-runs the
  routers in backward).

R3, rollout routing replay (Ma et al., arXiv 2510.11370): the experts vLLM chose while generating are
forced in the actor's old-log-prob pass and in every training forward. OpenRLHF 0.11.2 drops them in
three places; thin patches close each one in the process that runs it:

* vLLM ``RolloutRayActor`` (shipped by value; what it calls by reference is patched): ``vllm.engine.
  arg_utils.AsyncEngineArgs.__init__`` gets ``enable_return_routed_experts=True`` (vLLM PR #28284,
  vllm>=0.14, checked), and the built-in agent executors (``SingleTurnAgentExecutor``,
  ``MultiTurnAgentExecutor`` and subclasses that keep its ``execute``) see the engine through a
  recorder and add the ``routed_experts`` of the trajectory's last engine call to their output
  (its prompt is the whole history, checked token by token). This process has no ``args``: the mode
  comes from ``$STABLERL_ROUTING_REPLAY`` (the wrapper forwards it to every Ray worker).
* ``SamplesGenerator._process_response_into_experience``: that array, cut to OpenRLHF's truncated
  sequence, becomes the row's :class:`RolloutRoutes` in ``Experience.mm_train_inputs``;
* ``RemoteExperienceMaker.make_experience`` sends them to the actor as ``mm_train_inputs_list``
  (OpenRLHF's own argument); ``BaseModelActor.execute_batch`` (a plain base class of the by-value
  ``PolicyModelActor``) hands each item's rows to the armed ``Actor``, whose old-log-prob forward
  converts them (``Routes.from_vllm`` with the actor's MoE layers: the last sampled token and anything
  after the engine's last call are routed natively) and replays them. The converted
  :class:`SampleRoutes` come back on the log-probs and replace the rows' ``mm_train_inputs``, so
  ``training_step`` replays them exactly as in R2.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch

from stablerl import routing_replay as rr
from stablerl.params import StableRLError, UnknownNameError, unknown_name_message

from . import _inputs as loss_inputs

FLAG = "--actor.stablerl_routing_replay"
MODES = ("R2", "R3")
#: attribute of the policy's OpenRLHF ``Actor`` once armed (set in ActorPPOTrainer.__init__)
ARMED = "_stablerl_routing_replay"
#: attribute of the old-log-prob tensor that carries the routes from the actor worker to the maker
ON_LOG_PROBS = "stablerl_routes"

#: attribute of the armed ``Actor`` holding the rollout routes of the rows being forwarded (R3, old-log-prob pass)
PENDING = "_stablerl_rollout_routes"
#: key of an agent executor's output carrying vLLM's routed experts (R3)
ROUTED_EXPERTS = "routed_experts"
#: vLLM PR #28284 (``enable_return_routed_experts``, ``CompletionOutput.routed_experts``) shipped in 0.14
VLLM_R3_MIN = (0, 14)
#: the environment variable that selects the mode where no ``args`` exist (vLLM rollout workers)
ENV_MODE = "STABLERL_ROUTING_REPLAY"


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


def vllm_version() -> Optional[str]:
    """The vLLM version of this process: an imported ``vllm``'s ``__version__``, else the installed
    distribution, else that of ``import vllm``; None when there is no vLLM."""
    module = sys.modules.get("vllm")
    if getattr(module, "__version__", None):
        return str(module.__version__)
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("vllm")
    except (ImportError, PackageNotFoundError):
        pass
    try:
        import vllm
    except Exception:  # noqa: BLE001  (a broken install is reported as missing)
        return None
    return getattr(vllm, "__version__", None)


def check_vllm_for_r3(found: Optional[str] = None) -> str:
    """Raise a :class:`StableRLError` unless vLLM can return routed experts (vllm>=0.14)."""
    found = found if found is not None else vllm_version()
    need = ".".join(map(str, VLLM_R3_MIN))
    if found is None:
        raise StableRLError(f"{FLAG} R3 needs vLLM >= {need} (enable_return_routed_experts, vLLM PR #28284) in the "
                            "rollout engines; vLLM is not installed")
    nums = [int(x) for x in re.findall(r"\d+", str(found).split("+")[0])[:2]]
    if tuple((nums + [0, 0])[:2]) < VLLM_R3_MIN:
        raise StableRLError(f"{FLAG} R3 needs vLLM >= {need} (enable_return_routed_experts, vLLM PR #28284; "
                            f"hybrid-attention models need >= 0.22), found vllm {found}; use R2 or upgrade vLLM")
    return str(found)


def rollout_mode() -> Optional[str]:
    """The mode where only the environment tells it (vLLM rollout workers): ``$STABLERL_ROUTING_REPLAY``."""
    return parse_mode(os.environ.get(ENV_MODE))


@dataclass
class RolloutRoutes:
    """R3, from the samples generator to the actor's old-log-prob pass: one row's vLLM ``routed_experts``
    (``[R, num_hidden_layers, k]``, absolute decoder layers, rows of tokens ``0..R-1``, already cut to the
    row) and the row's token count ``num_tokens``. ``routed_experts`` None: every token routed natively
    (the executor never called the engine)."""

    routed_experts: Any
    num_tokens: int


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
    top_k: Optional[int] = None

    def from_rollout(self, rows: list) -> list[SampleRoutes]:
        """R3: the rows' vLLM routes -> one :class:`SampleRoutes` per row (missing rows: natively routed)."""
        out = []
        for i, row in enumerate(rows):
            if not isinstance(row, RolloutRoutes):
                raise StableRLError(f"{FLAG} R3: row {i} carries {type(row).__name__} instead of the rollout's routes "
                                    "(the samples generator was not patched, or another component replaced "
                                    "Experience.mm_train_inputs)")
            n = int(row.num_tokens)
            if row.routed_experts is None:
                idx = torch.zeros(n, len(self.layer_ids), self.top_k, dtype=rr.index_dtype(self.num_experts))
                out.append(SampleRoutes(idx))  # zero rows: not distinct, so routed natively (k >= 2)
                continue
            m = len(row.routed_experts)
            if m > n:
                raise rr.RoutesMismatchError(f"{FLAG} R3: row {i} carries {m} routed rows for {n} tokens")
            seq = rr.Routes.from_vllm(row.routed_experts, moe_layers=self.layer_ids, num_experts=self.num_experts,
                                      num_tokens=n if m == n else m + 1)
            if seq.top_k != self.top_k:
                raise rr.RoutesMismatchError(f"{FLAG} R3: row {i}: vLLM returned top-{seq.top_k} routes, the actor's "
                                             f"routers pick {self.top_k} experts (is vLLM serving the same model?)")
            if seq.num_tokens < n:  # tokens after the engine's last call (final tool/environment output)
                seq = seq.extend(n - seq.num_tokens)
            out.append(SampleRoutes(rr.Routes.pad_batch([seq]).batch_tensor()[0][0]))
        return out

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
    try:
        routers = rr.require_routers(model)
    except StableRLError as e:
        raise StableRLError(f"{FLAG} {mode} needs a Mixture-of-Experts actor: {e}") from None
    packing = bool(getattr(actor, "packing_samples", trainer.args.ds.packing_samples))  # what Actor.forward reads
    top_k = max(r.top_k for r in routers)
    if mode == "R3" and min(r.top_k for r in routers) < 2:
        # SampleRoutes marks natively routed tokens by zero rows (not k distinct experts): no top-1 routers
        raise StableRLError(f"{FLAG} R3 supports routers with top-k >= 2 (this actor has a top-1 router); use R2")
    setattr(actor, ARMED, _Armed(mode, max(r.num_experts for r in routers),
                                 tuple(r.layer_id for r in routers), packing, top_k))


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


def _replaying_forward(forward, actor, state: _Armed, *args, **kwargs):
    """R3: the old-log-prob ``Actor.forward`` under replay of the rollout's routes; the converted
    per-row routes ride back on the (CPU) log-probs, as R2's recorded ones do."""
    rows = actor.__dict__.get(PENDING)
    if rows is None:
        raise StableRLError(
            f"{FLAG} R3: the actor's old-log-prob forward got no rollout routes. Is the stablerl setup hook active in "
            "the actor workers (it patches BaseModelActor.execute_batch), and did the experience maker pass "
            "mm_train_inputs_list?")
    mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
    samples = state.from_rollout(list(rows))
    with rr.replay(_inner(actor.model), state.batch(samples, mask)):
        out = forward(actor, *args, **kwargs)
    if not isinstance(out, torch.Tensor):
        raise StableRLError(f"{FLAG} R3: the actor's old-log-prob forward returned {type(out).__name__}, expected "
                            "the action log-prob tensor")
    out = out.cpu()
    setattr(out, ON_LOG_PROBS, samples)
    return out


def _attach(samples_list) -> None:
    """In the experience maker: routes from the old log-probs into ``Experience.mm_train_inputs``."""
    for i, samples in enumerate(samples_list):
        routes = getattr(samples.action_log_probs, ON_LOG_PROBS, None)
        if routes is None:
            raise StableRLError(
                f"{FLAG}: the actor's old-log-prob forward returned no routes (experience {i}). Is the stablerl "
                "setup hook active in the actor workers (python -m stablerl.adapters.openrlhf.train_ppo_ray), and "
                "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=0 in the workers (its tensor serializer drops tensor attributes; OpenRLHF's "
                "train() sets it to 1 unless it is set, the wrapper sets 0)?")
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
    return state.batch(samples, experience.attention_mask)


# ----------------------------------------------------------------------------- patches


def patch_actor_module(module, set_patch) -> None:
    """``ActorPPOTrainer.training_step`` and ``Actor.forward`` (both plain classes, shipped by reference).

    Besides routing replay, these two patches feed a stablerl loss's declared ``entropy``,
    ``token_ids``, ``scores`` and ``old_entropy``, and the old-log-prob pass's entropy for the advantage step
    (``._inputs``); both do nothing when neither is in use."""
    trainer_cls = module.ActorPPOTrainer
    training_step = trainer_cls.__dict__["training_step"]

    @functools.wraps(training_step)
    def training_step_with_replay(self, experience, *args, **kwargs):
        # the same patch feeds a stablerl loss's declared entropy / token_ids / scores (._inputs)
        with loss_inputs.step_inputs(self, experience):
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
        # the old-log-prob pass: PolicyModelActor.forward runs the policy in eval mode under no_grad
        if self.training or torch.is_grad_enabled():
            return loss_inputs.train_forward(forward, self, *args, **kwargs)  # entropy for the loss, if declared
        # the old-pass entropy, if a selected algorithm declares it (rides on the log-probs, as the routes do)
        old_pass = functools.partial(loss_inputs.old_pass_forward, forward)
        state = self.__dict__.get(ARMED)
        if state is None:
            return old_pass(self, *args, **kwargs)
        if state.mode == "R3":
            return _replaying_forward(old_pass, self, state, *args, **kwargs)
        return _recording_forward(old_pass, self, state, *args, **kwargs)

    forward_recording.__wrapped__ = forward
    set_patch("Actor.forward", actor_cls, "forward", forward_recording)


def patch_maker_module(module, set_patch, selection_from_args) -> None:
    """``RemoteExperienceMaker.make_experience``: routes into the experiences (R2: recorded; R3: converted);
    the same patch moves the old-log-prob pass's entropy into them when an algorithm declares it (``._inputs``)."""
    cls = module.RemoteExperienceMaker
    make_experience = cls.__dict__["make_experience"]

    @functools.wraps(make_experience)
    def make_experience_with_routes(self, samples_list):
        mode = parse_mode(selection_from_args(self.strategy.args).routing_replay)
        if mode == "R3":  # the rows go to the actor as OpenRLHF's own mm_train_inputs_list argument
            for i, samples in enumerate(samples_list):
                if not all(isinstance(m, RolloutRoutes) for m in samples.mm_train_inputs):
                    raise StableRLError(
                        f"{FLAG} R3: experience {i} carries no rollout routes. Is the stablerl setup hook active in "
                        "the trainer and vLLM workers, and does the vLLM rollout return routed experts?")
        out = make_experience(self, samples_list)
        if mode is not None:
            _attach(out)
        if loss_inputs.needs_old_pass_entropy(selection_from_args(self.strategy.args)):
            loss_inputs.attach_old_entropy(out)  # the old-pass entropy, into experience.info (._inputs)
        return out

    make_experience_with_routes.__wrapped__ = make_experience
    set_patch("RemoteExperienceMaker.make_experience", cls, "make_experience", make_experience_with_routes)


# ----------------------------------------------------------------------------- R3: rollout side


def patch_vllm_arg_utils(module, set_patch) -> None:
    """``vllm.engine.arg_utils.AsyncEngineArgs.__init__`` (what ``RolloutRayActor.__init__`` builds through
    ``vllm.AsyncEngineArgs``): ``enable_return_routed_experts=True`` under R3, after the version check."""
    cls = module.AsyncEngineArgs
    init = cls.__dict__["__init__"]

    @functools.wraps(init)
    def init_returning_routes(self, *args, **kwargs):
        if rollout_mode() == "R3":
            check_vllm_for_r3()
            kwargs.setdefault("enable_return_routed_experts", True)
        return init(self, *args, **kwargs)

    init_returning_routes.__wrapped__ = init
    set_patch("AsyncEngineArgs.__init__", cls, "__init__", init_returning_routes)


class _RecordingEngine:
    """The ``llm_engine`` an agent executor sees: the rollout actor, with every ``generate`` call recorded."""

    def __init__(self, engine):
        self._engine = engine
        self.calls: list = []  # (prompt token ids, RequestOutput)

    async def generate(self, prompt_token_ids, *args, **kwargs):
        out = await self._engine.generate(prompt_token_ids, *args, **kwargs)
        self.calls.append((list(prompt_token_ids), out))
        return out

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def trajectory_routes(self, observation_tokens):
        """vLLM's ``routed_experts`` of the last engine call, whose prompt + completion must begin the
        trajectory's tokens (every turn re-sends the whole history): rows of tokens ``0..R-1``."""
        if not self.calls:
            return None
        prompt_ids, out = self.calls[-1]
        completion = out.outputs[0]
        routed = getattr(completion, "routed_experts", None)
        if routed is None:
            raise StableRLError(
                f"{FLAG} R3: vLLM returned no routed_experts. The engine needs enable_return_routed_experts=True "
                f"(vllm>=0.14): is the stablerl setup hook active in the vLLM rollout workers, with {ENV_MODE}=R3 "
                "in their environment (the wrapper CLI forwards it)?")
        covered = prompt_ids + list(completion.token_ids)
        tokens = list(observation_tokens)
        if tokens[:len(covered)] != covered:
            raise StableRLError(
                f"{FLAG} R3: the agent's final tokens do not begin with the prompt + completion of its last vLLM call "
                f"({len(self.calls)} calls; the executor rewrote or truncated the history), so vLLM's routes cannot be "
                "aligned to OpenRLHF's sequence. R3 needs executors whose every call re-sends the whole history")
        if len(routed) not in (len(covered) - 1, len(covered)):
            raise rr.RoutesMismatchError(
                f"{FLAG} R3: vLLM returned {len(routed)} routed rows for {len(covered)} prompt + completion tokens "
                f"(expected {len(covered) - 1}: the last sampled token is never forwarded)")
        return routed


def patch_agent_module(module, set_patch) -> None:
    """``execute`` of OpenRLHF's agent executors: the output gains ``routed_experts`` (R3 only)."""
    for cls in (module.SingleTurnAgentExecutor, module.MultiTurnAgentExecutor):
        execute = cls.__dict__["execute"]
        signature = inspect.signature(execute)

        def make(execute, signature):
            @functools.wraps(execute)
            async def execute_with_routes(self, *args, **kwargs):
                if rollout_mode() != "R3":
                    return await execute(self, *args, **kwargs)
                bound = signature.bind(self, *args, **kwargs)
                engine = _RecordingEngine(bound.arguments["llm_engine"])
                bound.arguments["llm_engine"] = engine
                out = await execute(*bound.args, **bound.kwargs)
                out[ROUTED_EXPERTS] = engine.trajectory_routes(out["observation_tokens"])
                return out

            execute_with_routes.__wrapped__ = execute
            return execute_with_routes

        set_patch(f"{cls.__name__}.execute", cls, "execute", make(execute, signature))


def patch_samples_module(module, set_patch, selection_from_args) -> None:
    """``SamplesGenerator._process_response_into_experience``: the response's routes into the Experience row."""
    cls = module.SamplesGenerator
    process = cls.__dict__["_process_response_into_experience"]

    @functools.wraps(process)
    def process_with_routes(self, response, **generate_kwargs):
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

    process_with_routes.__wrapped__ = process
    set_patch("SamplesGenerator._process_response_into_experience", cls, "_process_response_into_experience",
              process_with_routes)


def patch_launcher_module(module, set_patch) -> None:
    """``BaseModelActor.execute_batch`` (a plain base class of the by-value ``PolicyModelActor``): under R3,
    each ``forward`` item's ``mm_train_inputs_list`` (the rows' rollout routes) goes to the armed Actor."""
    cls = module.BaseModelActor
    execute_batch = cls.__dict__["execute_batch"]

    @functools.wraps(execute_batch)
    def execute_batch_with_routes(self, method_name, all_data, start_idx, end_idx):
        actor = self.__dict__.get("actor")
        state = getattr(actor, "__dict__", {}).get(ARMED) if actor is not None else None
        if method_name != "forward" or state is None or state.mode != "R3":
            return execute_batch(self, method_name, all_data, start_idx, end_idx)
        forward = self.forward

        def forward_with_rollout_routes(*args, **kwargs):
            actor.__dict__[PENDING] = kwargs.get("mm_train_inputs_list")
            try:
                return forward(*args, **kwargs)
            finally:
                actor.__dict__.pop(PENDING, None)

        self.forward = forward_with_rollout_routes  # execute_batch looks the method up on the instance
        try:
            return execute_batch(self, method_name, all_data, start_idx, end_idx)
        finally:
            self.__dict__.pop("forward", None)

    execute_batch_with_routes.__wrapped__ = execute_batch
    set_patch("BaseModelActor.execute_batch", cls, "execute_batch", execute_batch_with_routes)
