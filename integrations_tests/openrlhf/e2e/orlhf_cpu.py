"""Test-only: run OpenRLHF 0.11.2's Ray actors on a machine without CUDA (the end-to-end test's CPU shim).

OpenRLHF calls ``torch.cuda`` directly on its training path (``torch.cuda.current_device()`` as the device
of every batch, ``set_device``, ``synchronize``, ``empty_cache``, ``current_stream`` for the weight
broadcast, ``init_device_mesh("cuda", ...)``); a CPU build of torch raises on each. :func:`install` is the
Ray ``worker_process_setup_hook`` the test chains behind stablerl's (``STABLERL_CHAINED_SETUP_HOOK``): in
each Ray worker it points those calls at the CPU. OpenRLHF's code and stablerl's are not changed; on a GPU
machine nothing here is used.
"""

from __future__ import annotations

import functools
import os


def install() -> None:
    import torch
    import torch.distributed.device_mesh as device_mesh

    torch.cuda.current_device = lambda: "cpu"  # every `.to(torch.cuda.current_device())`
    torch.cuda.set_device = lambda device: None
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.current_stream = lambda device=None: None  # the gloo stand-in of PyNcclCommunicator ignores it

    init_device_mesh = device_mesh.init_device_mesh

    @functools.wraps(init_device_mesh)
    def cpu_device_mesh(device_type, *args, **kwargs):
        return init_device_mesh("cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    device_mesh.init_device_mesh = cpu_device_mesh  # before openrlhf.utils.deepspeed imports the name

    # DeepSpeed's CPU accelerator would JIT-compile a shared-memory collective op (minutes, and a lock file in
    # ~/.cache/torch_extensions that a killed build leaves behind); gloo is enough here: the op is marked
    # incompatible, so deepspeed.comm.torch.build_shm_op returns None
    import deepspeed.comm.torch as ds_comm_torch
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    ds_comm_torch.build_shm_op = lambda: None

    # NaiveReplayBuffer builds torch.device(f"cuda:{current_device()}"): the CPU instead
    from stablerl import post_import as _post_import

    def patch_replay_buffer(module):
        cls = module.NaiveReplayBuffer
        original = cls.__init__

        def __init__(self, *args, **kwargs):
            torch.cuda.current_device = lambda: 0
            try:
                original(self, *args, **kwargs)
            finally:
                torch.cuda.current_device = lambda: "cpu"
            self.target_device = torch.device("cpu")

        cls.__init__ = __init__

    _post_import.patch_now_or_on_import("orlhf_cpu.replay_buffer",
                                        {"openrlhf.trainer.ppo_utils.replay_buffer": patch_replay_buffer})
    os.environ.setdefault("STABLERL_E2E_CPU_SHIM", "1")
