"""Test-only stand-ins that let verl's own trainer (``python -m verl.trainer.main_ppo``) run on CPU.

Never shipped: this file lives under integrations_tests/ and reaches verl's processes through verl's
own mechanisms only -- ``VERL_USE_EXTERNAL_MODULES=verl_cpu_standins`` (verl imports it on every
``import verl``: driver, TaskRunner, FSDP workers, agent-loop workers, rollout servers) with this
folder on ``PYTHONPATH`` (a local ``ray.init`` passes the driver's environment to every worker).

What it replaces, and nothing else:

* **the accelerator**: :class:`PlatformCPU`, registered in verl's ``PlatformRegistry`` as ``cpu`` and
  selected with ``VERL_PLATFORM=cpu`` (verl's override of its platform auto-detection). Device
  ``cpu``, collectives on ``gloo``. Ray's scheduling still counts ``GPU`` slots (verl's resource
  check reads only ``GPU``/``NPU``), so the run starts Ray with ``num_gpus`` = the number of training
  processes: a slot is a CPU process here.
* **the vLLM / SGLang server**: :class:`HFRolloutReplica` (server replica, in verl's
  ``RolloutReplicaRegistry``) launches one :class:`HFGenerateServer` Ray actor per replica, which
  samples with Hugging Face ``generate`` and returns verl's ``TokenOutput`` (token ids and their
  log-probs); :class:`HFServerAdapter` (in verl's ``_ROLLOUT_REGISTRY``, the object verl's FSDP
  worker drives) pushes the actor's weights to that server at every weight sync, as vLLM's adapter
  does (and, as vLLM's does, tells the server the sync's ``global_steps``, which it returns with every sample).
  Selected with ``actor_rollout_ref.rollout.name=hf``.
* **the NCCL checkpoint engine** of verl's disaggregated trainers (``verl.experimental``: the rollout replicas in a
  resource pool of their own): ``cpu_ray`` (in verl's ``CheckpointEngineRegistry``) passes the weights through a
  named Ray actor. Selected with ``actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_ray``.

Everything else is verl's: Hydra config and validation, Ray, the TaskRunner, the legacy PPO trainer,
the FSDP2 engine and workers (on gloo), the agent loop, the data loader and the reward manager.
"""

from __future__ import annotations

import os
import types
from typing import Any, Optional

import ray
import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

ROLLOUT_NAME = "hf"


# ----------------------------------------------------------------------------- platform


def _noop(*args, **kwargs):
    return None


def _cpu_device_module() -> types.ModuleType:
    """``torch.cuda``'s surface as verl calls it (``get_torch_device().X``), answered for the CPU."""
    mod = types.ModuleType("verl_cpu_standins.device")
    cpu = torch.cpu
    mod.is_available = lambda: True
    mod.device_count = lambda: 1
    mod.current_device = lambda: "cpu"
    mod.set_device = _noop
    mod.synchronize = _noop
    mod.empty_cache = _noop
    mod.ipc_collect = _noop
    mod.set_per_process_memory_fraction = _noop
    mod.manual_seed = torch.manual_seed
    mod.manual_seed_all = torch.manual_seed
    mod.get_rng_state = lambda *a, **k: torch.get_rng_state()
    mod.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mod.mem_get_info = lambda *a, **k: (64 << 30, 64 << 30)
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(mod, name, lambda *a, **k: 0)
    mod.reset_peak_memory_stats = _noop
    mod.get_device_name = lambda *a, **k: "cpu"
    mod.Stream = cpu.Stream
    mod.current_stream = cpu.current_stream
    mod.stream = cpu.stream
    mod.Event = cpu.Event
    mod.is_initialized = lambda: True
    return mod


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl's platform interface for a CPU-only machine (test stand-in; select with VERL_PLATFORM=cpu)."""

    _module = _cpu_device_module()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return self._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return False  # never auto-detected: only VERL_PLATFORM=cpu selects it

    def current_device(self) -> str:
        # verl uses it only as a target of .to() / torch.device(); an int would mean an accelerator
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # Ray sets it for its (fake) GPU slots; nothing reads it on CPU

    def nvtx_range(self, msg: str):
        import contextlib

        return contextlib.nullcontext()

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"  # verl's resource check counts GPU/NPU only: one Ray "GPU" slot = one CPU process

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def _patch_process_group_backend() -> None:
    """verl builds its backend string as ``cpu:gloo,<device>:<backend>``, which torch refuses when the
    device is ``cpu`` itself (``Duplicate device type cpu``): the one verl function that cannot take a
    CPU platform. Wrapped here (this module loads during ``import verl``, before verl's workers bind
    the name) to ask for plain ``gloo``; every other argument is verl's."""
    from verl.utils import distributed

    original = distributed.initialize_global_process_group_ray

    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        if backend is None or backend.replace(" ", "") in ("cpu:gloo,cpu:gloo", "cpu:gloo"):
            backend = "gloo"
        return original(timeout_second=timeout_second, backend=backend)

    distributed.initialize_global_process_group_ray = initialize_global_process_group_ray


_patch_process_group_backend()


# ----------------------------------------------------------------------------- rollout


def _server_name(replica_rank: int) -> str:
    return f"stablerl_hf_server_{replica_rank}"


@ray.remote(num_cpus=0)
class HFGenerateServer:
    """One rollout replica: Hugging Face ``generate`` on the actor's current weights (CPU, fp32)."""

    def __init__(self, model_path: str, response_length: int, seed: int):
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.response_length = response_length
        self.generator = torch.Generator().manual_seed(seed)
        self.weight_version = 0
        self.global_steps = None  # the trainer's version of the weights, set at each sync (vLLM's set_global_steps)

    async def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps

    def load_weights(self, state: dict[str, torch.Tensor]) -> int:
        """The actor's weights, as verl's FSDP worker hands them to a rollout engine at each sync."""
        own = self.model.state_dict()
        unknown = sorted(set(state) - set(own))
        if unknown:
            raise KeyError(f"rollout weight sync: names the HF model does not have: {unknown[:5]}")
        missing = sorted(set(own) - set(state))
        if missing:
            raise KeyError(f"rollout weight sync: weights not sent by the actor: {missing[:5]}")
        self.model.load_state_dict(state, strict=True)
        self.weight_version += 1
        return self.weight_version

    async def generate(self, request_id: str = "", *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data=None, video_data=None, **kwargs):
        """Token in, token out, like verl's vLLM server: sampled ids and their log-probs."""
        from verl.workers.rollout.replica import TokenOutput

        sp = dict(sampling_params)
        max_tokens = int(sp.pop("max_tokens", sp.pop("max_new_tokens", self.response_length)))
        max_tokens = max(1, min(max_tokens, self.response_length))
        temperature = float(sp.get("temperature", 1.0))
        top_k = int(sp.get("top_k", -1))
        top_p = float(sp.get("top_p", 1.0))
        eos = self.model.generation_config.eos_token_id
        ids = torch.tensor([prompt_ids])
        out_ids: list[int] = []
        out_lp: list[float] = []
        with torch.no_grad():
            past = None
            inp = ids
            for _ in range(max_tokens):
                o = self.model(input_ids=inp, past_key_values=past, use_cache=True)
                past = o.past_key_values
                logits = o.logits[0, -1].float()
                if temperature <= 0:
                    tok = int(logits.argmax())
                    lp = torch.log_softmax(logits, -1)
                else:
                    logits = logits / temperature
                    if top_k > 0:
                        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    if top_p < 1.0:
                        srt, idx = torch.sort(logits, descending=True)
                        cut = torch.softmax(srt, -1).cumsum(-1) - torch.softmax(srt, -1) > top_p
                        logits[idx[cut]] = float("-inf")
                    lp = torch.log_softmax(logits, -1)
                    tok = int(torch.multinomial(lp.exp(), 1, generator=self.generator))
                out_ids.append(tok)
                out_lp.append(float(lp[tok]))
                if tok == eos:
                    break
                inp = torch.tensor([[tok]])
        return TokenOutput(token_ids=out_ids, log_probs=out_lp, stop_reason="completed",
                           extra_fields={"weight_version": self.weight_version,
                                         # what vLLM's server returns: verl's agent loop makes min/max_global_steps
                                         "global_steps": self.global_steps})

    # verl's replica controls; nothing to free or pause in a CPU generate loop
    async def wake_up(self):
        return None

    async def sleep(self):
        return None

    async def clear_kv_cache(self):
        return None

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        return None

    async def abort_all_requests(self, reject_request: bool = False):
        return None

    async def resume_generation(self):
        return None

    async def start_profile(self, **kwargs):
        return None

    async def stop_profile(self):
        return None

    def get_weight_version(self) -> int:
        return self.weight_version


def _make_replica_class():
    from verl.workers.rollout.replica import RolloutReplica

    class HFRolloutReplica(RolloutReplica):
        """verl's server replica for the HF stand-in: one :class:`HFGenerateServer` per replica."""

        def rollout_worker_use_gpu(self) -> bool:
            return False

        async def launch_servers(self):
            name = _server_name(self.replica_rank)
            self.servers = [
                HFGenerateServer.options(name=name, max_concurrency=self.max_concurrency).remote(
                    str(self.model_config.path), self.config.response_length, self.config.seed + self.replica_rank
                )
            ]
            self._server_handle = self.servers[0]
            self._server_address = f"hf-generate://{name}"

    return HFRolloutReplica


def _make_adapter_class():
    from verl.workers.rollout.base import BaseRollout

    class HFServerAdapter(BaseRollout):
        """What verl's FSDP worker holds as ``self.rollout``: sends the actor's weights to the server."""

        def __init__(self, config, model_config, device_mesh, *args, **kwargs):
            super().__init__(config, model_config, device_mesh, *args, **kwargs)
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            world = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                     * self.config.pipeline_model_parallel_size)
            self.replica_rank, self.replica_local_rank = divmod(rank, world)

        async def resume(self, tags: list[str]):
            return None

        async def release(self):
            return None

        async def update_weights(self, weights, wire_format: str = "named_tensors", global_steps=None, **kwargs):
            if wire_format != "named_tensors":
                raise NotImplementedError(f"HF stand-in rollout: wire_format {wire_format!r}")
            if hasattr(weights, "__aiter__"):  # a checkpoint engine's receive_weights (disaggregated rollout)
                pairs = [pair async for pair in weights]
            else:
                pairs = list(weights)
            state = {name: t.detach().to("cpu", torch.float32).clone() for name, t in pairs}
            if self.replica_local_rank == 0:
                server = ray.get_actor(_server_name(self.replica_rank))
                await server.load_weights.remote(state)
                if global_steps is not None:  # as vLLM's adapter does after a sync
                    await server.set_global_steps.remote(global_steps)

    return HFServerAdapter


def _register_rollout() -> None:
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    global HFRolloutReplica, HFServerAdapter
    HFRolloutReplica = _make_replica_class()
    HFServerAdapter = _make_adapter_class()
    RolloutReplicaRegistry.register(ROLLOUT_NAME, lambda: HFRolloutReplica)
    rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.HFServerAdapter"


HFRolloutReplica = None
HFServerAdapter = None
_register_rollout()


# ----------------------------------------------------------------------------- weight sync between resource pools

CHECKPOINT_BACKEND = "cpu_ray"


@ray.remote(num_cpus=0)
class _WeightMailbox:
    """The last weights the trainer sent, and a count of sends."""

    def __init__(self):
        self.sent = 0
        self.state = None

    def put(self, state) -> int:
        self.state = state
        self.sent += 1
        return self.sent

    def get(self, after: int):
        return (self.sent, self.state) if self.sent > after else (self.sent, None)


def _register_checkpoint_engine() -> None:
    """verl's disaggregated trainers (``verl.experimental``: one-step-off, fully async) send the weights from the
    trainer's resource pool to the rollout replicas' through a checkpoint engine (NCCL, NIXL, ...: GPU only). This
    one passes them through a named Ray actor (CPU, any process); select with
    ``actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_ray``."""
    import asyncio

    from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

    @CheckpointEngineRegistry.register(CHECKPOINT_BACKEND)
    class RayObjectCheckpointEngine(CheckpointEngine):
        def __init__(self, bucket_size: int = 0, **kwargs):
            self.role, self.rank, self.received, self.box = None, 0, 0, None

        def _mailbox(self):
            # the handle is kept: a named actor that is not detached ends when its creator holds no handle
            if self.box is None:
                self.box = _WeightMailbox.options(name="stablerl_cpu_weight_mailbox", get_if_exists=True).remote()
            return self.box

        def prepare(self):
            return {}

        @classmethod
        def build_topology(cls, actor_wg_world_size, rollout_world_size, metadata):
            return ({"role": ["sender"] * actor_wg_world_size, "rank": list(range(actor_wg_world_size))},
                    {"role": ["receiver"] * rollout_world_size, "rank": list(range(rollout_world_size))})

        def init_process_group(self, role: str = "receiver", rank: int = 0, **kwargs):
            self.role, self.rank = role, rank

        def finalize(self):
            return None

        async def send_weights(self, weights, global_steps=None):
            state = {name: t.detach().full_tensor() if hasattr(t, "full_tensor") else t.detach()
                     for name, t in weights}
            if self.rank == 0:
                await self._mailbox().put.remote({k: v.to("cpu", torch.float32).clone() for k, v in state.items()})
            return {}

        async def receive_weights(self, global_steps=None):
            mailbox = self._mailbox()
            for _ in range(12000):  # 10 min
                sent, state = await mailbox.get.remote(self.received)
                if state is not None:
                    break
                await asyncio.sleep(0.05)
            else:
                raise TimeoutError("cpu_ray checkpoint engine: the trainer sent no weights in 10 min")
            self.received = sent
            for name, tensor in state.items():
                yield name, tensor


_register_checkpoint_engine()
