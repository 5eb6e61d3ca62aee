"""The loss step's record and the old-log-prob pass's statistics in OpenRLHF 0.11.2 (docs/openrlhf.md, "Loss inputs").

``training_step`` builds one :class:`~stablerl.steps.BatchRecord` per micro-batch (host: the ``Experience``) and hands
it to the loss through core's scoped channel (:func:`stablerl.frameworks.loss_inputs`, open for the whole step);
``StablePolicyLoss`` reads the inputs its loss declares from it (the adapter's providers): ``token_ids``,
``scores``, ``index`` (``_groups``), ``versions`` / ``policy_version`` (the asynchronous trainer's stamps:
``_versions``), ``entropy`` (the training forward's, which
the ``Actor.forward`` patch asks OpenRLHF's forward for and puts into ``record.produced``) and ``old_entropy``.

The old-log-prob pass's ``entropy`` / ``sum_pi_squared`` (computed only when a selected algorithm declares them:
``PolicyWorker.old_pass_stats``) are produced in the actor worker and consumed in the trainer process and, for
``old_entropy``, in the actor workers again: they ride back on the CPU log-prob tensor (:data:`OLD_PASS_STATS`'
attributes, as routing replay's routes), ``make_experience`` moves them into ``experience.info`` (the field the
replay buffer splits row by row), the advantage step reads them and drops what no loss reads, and
``training_step`` takes ``old_entropy`` out of ``info`` into its record.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from stablerl.frameworks import loss_inputs, pending_loss_inputs
from stablerl.ops import sum_pi_squared
from stablerl.params import MissingInputError, StableRLError
from stablerl.steps import BatchRecord

from ._groups import pop_index
from ._versions import take_stamps

#: statistic -> (attribute of the CPU log-prob tensor, ``Experience.info`` key: [B, A], per row after the buffer's
#: split); the two fields that carry the old-log-prob pass's statistics between the processes
OLD_PASS_STATS = {"entropy": ("stablerl_old_entropy", "stablerl_old_entropy"),
                  "sum_pi_squared": ("stablerl_sum_pi_squared", "stablerl_sum_pi_squared"),
                  # sampling-mask replay's log M (._sampling_mask), consumed by make_experience
                  "log_kept_mass": ("stablerl_log_kept_mass", "stablerl_log_kept_mass")}
#: attribute of the CPU log-prob tensor: where the old pass took the kept set from ("engine" masks or the "rule")
KEPT_SET_SOURCE = "stablerl_kept_set_source"
OLD_ENTROPY_KEY, SUM_PI_SQUARED_KEY = OLD_PASS_STATS["entropy"][1], OLD_PASS_STATS["sum_pi_squared"][1]


@contextlib.contextmanager
def step_inputs(adapter, trainer, experience) -> Iterator[Optional[BatchRecord]]:
    """Around ``training_step``: the micro-batch's record, handed to a stablerl loss (None for OpenRLHF's own); the
    inputs its loss declares are read now (a missing one raises before the step), the training forward's entropy
    when that forward ran. The loss writes its metrics into ``experience.info`` (OpenRLHF's logged status)."""
    loss_fn = getattr(trainer, "actor_loss_fn", None)
    spec = getattr(loss_fn, "stablerl_spec", None)  # None for OpenRLHF's own PolicyLoss
    need = set(spec.requires) if spec is not None else set()
    index = pop_index(experience, "index" in need)  # the group keys never reach OpenRLHF's metrics
    old_entropy = (experience.info or {}).pop(OLD_ENTROPY_KEY, None)  # nor the old-pass entropy
    # nor the policy-version stamps of the asynchronous trainer (._versions)
    async_enable = bool(getattr(getattr(getattr(trainer, "args", None), "train", None), "async_enable", False))
    stamps = take_stamps(experience, bool(need & {"versions", "policy_version"}), async_enable)
    if spec is None:
        yield None
        return
    record = BatchRecord(adapter, response_mask=experience.action_mask, index=index, host=experience,
                         scores=None if experience.rewards is None else experience.rewards.reshape(-1))
    record.produced.update(stamps)
    if old_entropy is not None:
        record.produced["old_entropy"] = _to_width(old_entropy, experience.action_mask)
    if "entropy" in loss_fn.fed_inputs:
        record.produced["entropy"] = None  # asked for: train_forward computes it in the training forward
    record.declared(spec, skip=loss_fn.CALL_INPUTS | {"entropy"}, optional=False)
    with loss_inputs(loss_fn.stablerl_name, record):
        yield record


def train_forward(forward, actor, *args, **kwargs):
    """``Actor.forward`` in training: with ``return_entropy=True`` when the loss declares ``entropy``."""
    record = pending_loss_inputs()
    if record is None or "entropy" not in record.produced or not kwargs.get("return_output"):
        return forward(actor, *args, **kwargs)
    log_probs, output = forward(actor, *args, **{**kwargs, "return_entropy": True})
    entropy = output.entropy.detach()
    if not kwargs.get("return_entropy"):
        output.entropy = entropy  # frees the softmax graph: OpenRLHF has no entropy term this step
    record.produced["entropy"] = entropy[:, -log_probs.shape[1]:]
    return log_probs, output


_NO_OLD_ENTROPY = (
    "{where} carries no old-log-prob {what} (info['{key}']): the stablerl patches of "
    "ActorPPOTrainer.__init__ / Actor.forward (actor workers) and RemoteExperienceMaker.make_experience (driver) put "
    "it there. Is the stablerl setup hook active in every Ray worker (python -m "
    "stablerl.adapters.openrlhf.train_ppo_ray), and RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=0 in the workers (Ray's "
    "zero-copy tensor serializer drops the {what} carried on the log-prob tensor; the wrapper and add_setup_hook "
    "set 0)?"
)


def missing_stat(stat: str, where: str) -> MissingInputError:
    return MissingInputError(_NO_OLD_ENTROPY.format(where=where, what=stat, key=OLD_PASS_STATS[stat][1]))


def _unpacked(values, sequences, attention_mask, ring_attn_group):
    """A packed ``[1, nnz_local]`` per-position tensor (``--ds.packing_samples``) back to ``[batch, seqlen]``, by
    OpenRLHF's own ``gather_and_pad_tensor`` with the indices and ring padding ``unpad_and_slice_tensor`` used."""
    from openrlhf.models.ring_attn_utils import gather_and_pad_tensor

    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    pad_len = 0
    if ring_attn_group is not None:
        size = torch.distributed.get_world_size(group=ring_attn_group)
        pad_len = (size - indices.numel() % size) % size
    return gather_and_pad_tensor(values, ring_attn_group, pad_len, indices, *sequences.shape)


def old_pass_forward(forward, worker, actor, *args, **kwargs):
    """The old-log-prob ``Actor.forward`` of an armed actor (``worker.old_pass_stats``): also ``return_output=True``
    (and ``return_entropy`` when the entropy is wanted); the action tokens' entropy / ``sum_pi_squared`` (of the
    temperature-scaled logits OpenRLHF's forward computed the log-probs from; masked like the log-probs) ride back
    on the CPU log-prob tensor. Otherwise ``forward`` as is."""
    wanted = sorted(worker.old_pass_stats) if worker is not None else []
    if not wanted or kwargs.get("return_output"):
        return forward(actor, *args, **kwargs)
    action_mask = kwargs.get("action_mask", args[1] if len(args) > 1 else None)
    if action_mask is None:
        raise StableRLError("the old-log-prob pass got no action_mask: OpenRLHF's PolicyModelActor.forward passes one")
    log_probs, output = forward(actor, *args, **{**kwargs, "return_output": True,
                                                 "return_entropy": "entropy" in wanted})
    width, mask = log_probs.shape[1], action_mask.to(log_probs.dtype)
    out = log_probs.cpu()  # PolicyModelActor.forward's .to("cpu") then keeps this tensor and its attributes
    if "entropy" in wanted:
        setattr(out, OLD_PASS_STATS["entropy"][0], (output.entropy[:, -width:].detach() * mask).cpu())
    if "sum_pi_squared" in wanted:  # output.logits: fp32, already divided by OpenRLHF's temperature
        per_position = sum_pi_squared(output["logits"].detach())
        if actor.packing_samples:
            sequences = kwargs.get("sequences", args[0] if args else None)
            attention_mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
            per_position = _unpacked(per_position, sequences, attention_mask, kwargs.get("ring_attn_group"))
        setattr(out, OLD_PASS_STATS["sum_pi_squared"][0], (per_position[:, :-1][:, -width:] * mask).cpu())
    if "log_kept_mass" in wanted:
        from ._sampling_mask import MASK_ATTR, old_pass_log_kept_mass

        sequences = kwargs.get("sequences", args[0] if args else None)
        attention_mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        log_mass = old_pass_log_kept_mass(output["logits"].detach(), sequences, attention_mask, action_mask,
                                          worker.sampling_rule, bool(actor.packing_samples),
                                          kwargs.get("ring_attn_group"))
        setattr(out, OLD_PASS_STATS["log_kept_mass"][0], (log_mass * mask).cpu())
        setattr(out, KEPT_SET_SOURCE, "engine" if getattr(action_mask, MASK_ATTR, None) is not None else "rule")
    return out


def attach_old_pass_stats(samples_list, stats) -> None:
    """In the experience maker: each statistic of ``stats`` from the old log-probs into ``experience.info``."""
    for i, samples in enumerate(samples_list):
        for stat in sorted(stats):
            attribute, key = OLD_PASS_STATS[stat]
            value = getattr(samples.action_log_probs, attribute, None)
            if value is None:
                raise missing_stat(stat, f"the actor's old-log-prob pass (experience {i})")
            delattr(samples.action_log_probs, attribute)
            if value.shape != samples.action_mask.shape:
                raise StableRLError(f"old-log-prob {stat} of shape {tuple(value.shape)} for an action mask of shape "
                                    f"{tuple(samples.action_mask.shape)} (experience {i})")
            samples.info[key] = value


def drop_old_pass_stats(experiences, stats=("entropy", "sum_pi_squared")) -> None:
    """After the advantage step, the statistics no loss reads: not carried through the replay buffer."""
    for experience in experiences:
        for stat in stats:
            (experience.info or {}).pop(OLD_PASS_STATS[stat][1], None)


def _to_width(value, action_mask):
    """The rows' entropy ([B, A'] tensor, or per-row tensors after the buffer's re-batch) as ``[B, A]`` for the
    micro-batch's ``action_mask``: the buffer unpads each row from the right, so a row's first tokens align."""
    rows = list(value) if not isinstance(value, torch.Tensor) else list(value.unbind(0))
    n, width = action_mask.shape
    if len(rows) != n:
        raise StableRLError(f"old-log-prob entropy for {len(rows)} rows in a micro-batch of {n}")
    out = torch.zeros(n, width, dtype=rows[0].dtype if rows else torch.float32, device=action_mask.device)
    for i, row in enumerate(rows):
        k = min(width, row.shape[-1])
        out[i, :k] = row.reshape(-1)[:k].to(out.device, out.dtype)
    return out * action_mask.to(out.dtype)


def padded(tensors, width: int, dtype=None):
    """``[b_i, t_i]`` tensors (one per experience) right-padded with 0 to ``width`` and stacked: ``[N, width]``."""
    return torch.cat([torch.nn.functional.pad(t if dtype is None else t.to(dtype), (0, width - t.shape[1]))
                      for t in tensors])


def padded_old_pass_stat(experiences, width: int, stat: str = "entropy"):
    """The old-log-prob pass's ``stat`` (``entropy`` / ``sum_pi_squared``) of every experience as one ``[N, width]``
    batch (advantage step)."""
    rows = []
    for i, experience in enumerate(experiences):
        value = (experience.info or {}).get(OLD_PASS_STATS[stat][1])
        if value is None:
            raise missing_stat(stat, f"experience {i} at compute_advantages_and_returns")
        rows.append(_to_width(value, padded([experience.action_mask], width, torch.float32)))
    return torch.cat(rows)


def from_info(what: str, experiences) -> torch.Tensor:
    """The reward function's per-response ``what`` of every experience (its ``extra_logs``, which OpenRLHF copies into
    ``experience.info``), as one ``[N]`` tensor."""
    values = []
    for e in experiences:
        v = (e.info or {}).get(what)
        if v is None:
            raise MissingInputError(
                f"stablerl needs {what!r} per response, but OpenRLHF's experience.info has no {what!r}: return "
                f"{{'rewards': ..., 'scores': ..., 'extra_logs': {{'{what}': ...}}}} from your --reward.remote_url "
                "reward function or agent (OpenRLHF copies extra_logs into experience.info, one value per response)")
        v = torch.as_tensor(v).reshape(-1)
        if v.numel() != len(e.index):
            raise StableRLError(f"experience.info[{what!r}] has {v.numel()} values for {len(e.index)} responses")
        values.append(v)
    return torch.cat(values)
