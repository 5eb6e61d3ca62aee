"""Test stand-in: vllm.distributed.utils.StatelessProcessGroup, a TCPStore outside torch.distributed's
default group (OpenRLHF's trainer rank 0 and the rollout engines form their own group)."""

import datetime
from dataclasses import dataclass

import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=300)


@dataclass
class StatelessProcessGroup:
    rank: int
    world_size: int
    store: dist.Store

    @classmethod
    def create(cls, host: str, port: int, rank: int, world_size: int) -> "StatelessProcessGroup":
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=TIMEOUT)
        return cls(rank=rank, world_size=world_size, store=store)
