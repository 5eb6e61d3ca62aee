"""Prompt groups through OpenRLHF 0.11.2's replay buffer, for stablerl policy losses that take ``index`` (pacs,
gvpo, gtpo). OpenRLHF drops ``Experience.index`` when it splits the batch and shuffles single rows, so the groups
ride in ``info`` (the one field the buffer carries row by row) from :func:`tag_groups` (advantage step) to
:func:`pop_index` (``training_step``), and ``ppo_actor.DataLoader`` batches whole groups (core's
``GroupBatchSampler``). Dynamic batching is refused with these losses before Ray starts.
"""

from __future__ import annotations

from typing import Any

import torch

from stablerl.frameworks import GroupBatchSampler, check_whole_groups
from stablerl.params import MissingInputError

#: per-row prompt group id and group size, in ``Experience.info`` between the advantage step and the loss
GROUP_KEY = "stablerl_group"
GROUP_SIZE_KEY = "stablerl_group_size"


def group_index(experiences, n: int) -> torch.Tensor:
    """OpenRLHF's prompt groups in rollout order: each row's position in prompt order // n_samples_per_prompt."""
    return torch.div(torch.cat([torch.as_tensor(list(e.index), dtype=torch.long) for e in experiences]), n,
                     rounding_mode="floor")


def tag_groups(experiences, n: int) -> None:
    """``info[GROUP_KEY]`` = the rows' prompt groups (``index // n``), ``info[GROUP_SIZE_KEY]`` = ``n``."""
    for experience, ids in zip(experiences, group_index(experiences, n).split([len(e.index) for e in experiences])):
        experience.info[GROUP_KEY], experience.info[GROUP_SIZE_KEY] = ids, torch.full_like(ids, n)


def _as_ids(value: Any) -> torch.Tensor:
    # after the buffer's re-batch a per-row 0-dim tensor comes back as a list of them
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).long()
    return torch.stack([torch.as_tensor(v) for v in value]).reshape(-1).long()


def group_dataloader(dataloader_cls):
    """``ppo_actor.DataLoader``: whole prompt groups per micro-batch when the replay buffer's rows carry them."""

    def DataLoader(dataset, *args, **kwargs):
        items = getattr(dataset, "items", None)
        if args or not items or getattr(dataset, "dynamic_batch", False) or GROUP_KEY not in (items[0].info or {}):
            return dataloader_cls(dataset, *args, **kwargs)
        sampler = GroupBatchSampler(
            [int(_as_ids(item.info[GROUP_KEY])[0]) for item in items],
            [int(_as_ids(item.info[GROUP_SIZE_KEY])[0]) for item in items],
            kwargs.pop("batch_size", 1), kwargs.pop("shuffle", False), kwargs.pop("drop_last", False),
            incomplete_hint="OpenRLHF split it across ranks (set --rollout.micro_batch_size to a multiple of "
            "--rollout.n_samples_per_prompt so each experience, and each rank, holds whole groups)",
            batch_size_key="--train.micro_batch_size", group_size_key="--rollout.n_samples_per_prompt")
        return dataloader_cls(dataset, batch_sampler=sampler, **kwargs)

    DataLoader.__wrapped__ = dataloader_cls
    return DataLoader


def pop_index(experience, need: bool):
    """Remove the group keys from ``experience.info``; with ``need``: the rows' group ids, every group whole."""
    info = experience.info if experience.info is not None else {}
    ids, sizes = info.pop(GROUP_KEY, None), info.pop(GROUP_SIZE_KEY, None)
    if not need:
        return None
    if ids is None or sizes is None:
        raise MissingInputError(
            "the experience carries no prompt groups (info['stablerl_group']): the stablerl patch of "
            "RemoteExperienceMaker.compute_advantages_and_returns writes them; is the stablerl setup hook active "
            "in the driver?")
    ids = _as_ids(ids)
    check_whole_groups(ids, _as_ids(sizes), why="rows were reordered after the stablerl DataLoader, e.g. by "
                       "dynamic batching")
    return ids.to(experience.action_mask.device)
