"""Test-only CPU shim for SkyRL's FSDP workers (imported at start-up of every process of the end-to-end test, via
``stubs/sitecustomize.py`` when ``STABLERL_SKYRL_CPU=1``).

SkyRL's workers are written for CUDA: ``torch.cuda.current_device()`` as the device of every micro-batch,
``torch.cuda.set_device`` / ``synchronize`` / ``empty_cache``, a ``"cpu:gloo,cuda:nccl"`` process group and a
``"cuda"`` device mesh. On a CPU-only machine this maps them to the CPU: the device is ``cpu``, the CUDA
housekeeping calls do nothing, the process group is gloo and the mesh a CPU mesh (FSDP2 shards over gloo, as in
verl's CPU end-to-end test). SkyRL's own code runs unchanged otherwise.
"""

import torch
import torch.distributed
import torch.distributed.device_mesh as _mesh

_CPU = torch.device("cpu")


def _returning(name, value):
    def stand_in(*args, **kwargs):  # one function object per name (torch._dynamo's trace rules key on them)
        return value

    stand_in.__name__ = stand_in.__qualname__ = f"cpu_{name}"
    return stand_in


for _name, _value in (("set_device", None), ("synchronize", None), ("empty_cache", None), ("manual_seed_all", None),
                      ("reset_peak_memory_stats", None), ("ipc_collect", None), ("current_device", _CPU),
                      ("device_count", 1), ("memory_allocated", 0), ("memory_reserved", 0),
                      ("max_memory_allocated", 0), ("mem_get_info", (1 << 34, 1 << 34))):
    setattr(torch.cuda, _name, _returning(_name, _value))

_init_process_group = torch.distributed.init_process_group


def init_process_group(*args, backend=None, **kwargs):
    return _init_process_group(*args, backend="gloo", **kwargs)


torch.distributed.init_process_group = init_process_group
_init_device_mesh = _mesh.init_device_mesh


def init_device_mesh(device_type, *args, **kwargs):
    return _init_device_mesh("cpu", *args, **kwargs)


_mesh.init_device_mesh = init_device_mesh


def _stay(self, *args, **kwargs):  # tensor.cuda() / module.cuda(): stays on the CPU
    return self


torch.Tensor.cuda = _stay
torch.nn.Module.cuda = _stay
