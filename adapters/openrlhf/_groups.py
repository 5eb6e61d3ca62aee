"""Prompt groups through OpenRLHF 0.11.2's replay buffer, for stablerl policy losses that take ``index``.

OpenRLHF keeps no prompt groups at the loss: ``split_experience_batch`` sets ``Experience.index`` to
None and ``ActorPPOTrainer.ppo_train``'s DataLoader shuffles single rows across micro-batches. For a
stablerl loss that declares ``index`` (pacs, gvpo, gtpo: statistics over a prompt's whole group) the
adapter carries the group through and keeps groups whole; nothing here runs for any other loss:

* at ``compute_advantages_and_returns`` (:func:`tag_groups`): each experience gets
  ``info[GROUP_KEY]`` = ``index // n_samples_per_prompt`` (OpenRLHF's own grouping at its advantage
  step) and ``info[GROUP_SIZE_KEY]`` = ``n``, per row: ``info`` is the one field the buffer's
  split / re-batch carries row by row;
* ``ppo_train``'s DataLoader (:func:`group_dataloader`, ``ppo_actor.DataLoader`` replaced): when the
  buffer's rows carry groups, a batch sampler shuffles whole groups (OpenRLHF shuffles rows), keeps
  them contiguous, and cuts micro-batches of ``--train.micro_batch_size`` rows; a micro-batch size that
  is not a multiple of the group size, or a group split across ranks, is refused by name;
* ``training_step`` (:func:`pop_index`, from ``._inputs.step_inputs``): the two info keys are removed
  (OpenRLHF would log them as metrics) and the group ids are handed to the loss as ``index`` after
  checking every group in the micro-batch is whole.

Dynamic batching (``--train.dynamic_batch_enable``) partitions rows by length and is refused with these
losses (``Selection.validate``).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

#: per-row prompt group id and group size, in ``Experience.info`` between the advantage step and the loss
GROUP_KEY = "stablerl_group"
GROUP_SIZE_KEY = "stablerl_group_size"
MICRO_BATCH_FLAG = "--train.micro_batch_size"


def wants_groups(policy_loss) -> bool:
    """Whether the selected stablerl policy loss (a name, or None for OpenRLHF's own) takes ``index``."""
    if policy_loss is None:
        return False
    import stablerl

    return "index" in stablerl.get_spec(stablerl.POLICY_LOSS, policy_loss).requires


def tag_groups(experiences, n: int) -> None:
    """``info[GROUP_KEY]`` = the rows' prompt groups (``index // n``), ``info[GROUP_SIZE_KEY]`` = ``n``."""
    for experience in experiences:
        index = torch.as_tensor(list(experience.index), dtype=torch.long)
        experience.info[GROUP_KEY] = torch.div(index, n, rounding_mode="floor")
        experience.info[GROUP_SIZE_KEY] = torch.full_like(index, n)


def _as_ids(value: Any) -> torch.Tensor:
    # after the buffer's re-batch a per-row 0-dim tensor comes back as a list of them
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).long()
    return torch.stack([torch.as_tensor(v) for v in value]).reshape(-1).long()


def _group_order(items, shuffle: bool, batch_size: int) -> list[int]:
    """Buffer positions with each group contiguous, groups in random (``shuffle``) or first-seen order."""
    from stablerl.params import StableRLError

    groups: dict[int, list[int]] = {}
    sizes: dict[int, int] = {}
    for position, item in enumerate(items):
        gid = int(_as_ids(item.info[GROUP_KEY])[0])
        groups.setdefault(gid, []).append(position)
        sizes[gid] = int(_as_ids(item.info[GROUP_SIZE_KEY])[0])
    for gid, rows in groups.items():
        if len(rows) != sizes[gid]:
            raise StableRLError(
                f"prompt group {gid} has {len(rows)} of its {sizes[gid]} responses in this actor's replay buffer: "
                "OpenRLHF split it across ranks (set --rollout.micro_batch_size to a multiple of "
                "--rollout.n_samples_per_prompt so each experience, and each rank, holds whole groups)"
            )
        if batch_size % sizes[gid]:
            raise StableRLError(
                f"{MICRO_BATCH_FLAG}={batch_size} is not a multiple of --rollout.n_samples_per_prompt="
                f"{sizes[gid]}: the selected stablerl policy loss takes prompt groups (index) and needs whole "
                "groups in every micro-batch"
            )
    keys = list(groups)
    if shuffle:  # the default generator, as the RandomSampler OpenRLHF's DataLoader would use
        keys = [keys[i] for i in torch.randperm(len(keys)).tolist()]
    return [position for key in keys for position in groups[key]]


class GroupBatchSampler:
    """Micro-batches of ``batch_size`` buffer rows made of whole prompt groups (a fresh order each epoch)."""

    def __init__(self, items, batch_size: int, shuffle: bool, drop_last: bool) -> None:
        self.items, self.batch_size, self.shuffle, self.drop_last = items, int(batch_size), shuffle, drop_last

    def __iter__(self) -> Iterator[list[int]]:
        order = _group_order(self.items, self.shuffle, self.batch_size)
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            if len(batch) == self.batch_size or not self.drop_last:
                yield batch

    def __len__(self) -> int:
        full, rest = divmod(len(self.items), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)


def carries_groups(dataset) -> bool:
    items = getattr(dataset, "items", None)
    return bool(items) and not getattr(dataset, "dynamic_batch", False) and GROUP_KEY in (items[0].info or {})


def group_dataloader(dataloader_cls):
    """``ppo_actor.DataLoader``: unchanged unless the replay buffer's rows carry prompt groups."""

    def DataLoader(dataset, *args, **kwargs):
        if args or not carries_groups(dataset):
            return dataloader_cls(dataset, *args, **kwargs)
        sampler = GroupBatchSampler(dataset.items, kwargs.pop("batch_size", 1), bool(kwargs.pop("shuffle", False)),
                                    bool(kwargs.pop("drop_last", False)))
        return dataloader_cls(dataset, batch_sampler=sampler, **kwargs)

    DataLoader.__wrapped__ = dataloader_cls
    return DataLoader


def pop_index(experience, need: bool):
    """Remove the group keys from ``experience.info``; with ``need``: the rows' group ids, every group whole."""
    from stablerl.params import MissingInputError, StableRLError

    info = experience.info if experience.info is not None else {}
    ids, sizes = info.pop(GROUP_KEY, None), info.pop(GROUP_SIZE_KEY, None)
    if not need:
        return None
    if ids is None or sizes is None:
        raise MissingInputError(
            "the experience carries no prompt groups (info['stablerl_group']): the stablerl patch of "
            "RemoteExperienceMaker.compute_advantages_and_returns writes them; is the stablerl setup hook active "
            "in the driver?"
        )
    ids, sizes = _as_ids(ids), _as_ids(sizes)
    unique, counts = torch.unique(ids, return_counts=True)
    want = torch.stack([sizes[ids == g][0] for g in unique])
    partial = unique[counts != want].tolist()
    if partial:
        raise StableRLError(
            f"prompt groups {partial} are split across micro-batches: the selected stablerl policy loss needs "
            f"whole groups per loss call (rows were reordered after the stablerl DataLoader, e.g. by dynamic batching)"
        )
    return ids.to(experience.action_mask.device)


__all__ = ["GROUP_KEY", "GROUP_SIZE_KEY", "wants_groups", "tag_groups", "GroupBatchSampler", "group_dataloader",
           "pop_index", "carries_groups"]
