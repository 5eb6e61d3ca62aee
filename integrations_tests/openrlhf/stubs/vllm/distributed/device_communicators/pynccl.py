"""Test stand-in: vllm's PyNcclCommunicator, as gloo on CPU (broadcast only: all OpenRLHF's weight sync uses)."""

import torch.distributed as dist

from vllm.distributed.utils import TIMEOUT


class PyNcclCommunicator:
    def __init__(self, group, device=None):
        self.rank, self.world_size = group.rank, group.world_size
        self._pg = dist.ProcessGroupGloo(group.store, group.rank, group.world_size, TIMEOUT)

    def broadcast(self, tensor, src: int, stream=None):
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self._pg.broadcast([tensor], opts).wait()
