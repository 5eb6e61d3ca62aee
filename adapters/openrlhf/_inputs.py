"""Declared inputs of a stablerl policy loss beyond OpenRLHF 0.11.2's loss call, handed over through core's scoped
channel (:func:`stablerl.frameworks.loss_inputs`, open for the whole ``training_step``); nothing is computed for a
loss that does not declare them (docs/openrlhf.md, "Loss inputs"): ``token_ids`` (``sequences[:, -A:]``),
``scores`` (``experience.rewards``), ``index`` (``._groups``), ``versions`` / ``policy_version`` (one weight
version per batch: every generated token 0, the policy 1, a3po), ``entropy`` (the training forward's, asked of
``Actor.forward`` and detached) and ``old_entropy``: the old-log-prob pass's, also the ``entropy`` of estimators,
shapers and filters. That pass (on an actor marked :data:`WANTS_OLD_ENTROPY`) returns it on the CPU log-prob
tensor (:data:`ENTROPY_ON_LOG_PROBS`, as routing replay's routes), ``make_experience`` moves it into
``experience.info[OLD_ENTROPY_KEY]`` (split row by row by the replay buffer) and ``training_step`` pops it.
The same route carries the old pass's ``sum_pi_squared`` (actor marked :data:`WANTS_SUM_PI_SQUARED`, info key
:data:`SUM_PI_SQUARED_KEY`) to the estimators that declare it; it is dropped after the advantage step.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from stablerl.frameworks import loss_inputs, pending_loss_inputs
from stablerl.ops import sum_pi_squared
from stablerl.params import MissingInputError, StableRLError

from ._groups import pop_index

#: Inputs this module feeds (with ``rollout_log_prob``, which OpenRLHF passes itself).
FED_INPUTS = ("entropy", "token_ids", "scores", "index", "old_entropy", "versions", "policy_version")

#: ``Experience.info`` key of the old-log-prob pass's per-token entropy ([B, A]; per row after the buffer's split)
OLD_ENTROPY_KEY = "stablerl_old_entropy"
#: attribute of the old-log-prob tensor that carries the entropy from the actor worker to the experience maker
ENTROPY_ON_LOG_PROBS = "stablerl_old_entropy"
#: attribute of the policy ``Actor`` (set in ActorPPOTrainer.__init__): its old-log-prob pass also returns entropy
WANTS_OLD_ENTROPY = "_stablerl_old_entropy"
#: the same for the old pass's per-token sum over the vocabulary of pi(v)^2 (``sum_pi_squared``, OTB estimators)
SUM_PI_SQUARED_KEY = "stablerl_sum_pi_squared"
SUM_PI_SQUARED_ON_LOG_PROBS = "stablerl_sum_pi_squared"
WANTS_SUM_PI_SQUARED = "_stablerl_old_sum_pi_squared"
#: statistic -> (actor mark, attribute of the CPU log-prob tensor, Experience.info key)
OLD_PASS_STATS = {
    "entropy": (WANTS_OLD_ENTROPY, ENTROPY_ON_LOG_PROBS, OLD_ENTROPY_KEY),
    "sum_pi_squared": (WANTS_SUM_PI_SQUARED, SUM_PI_SQUARED_ON_LOG_PROBS, SUM_PI_SQUARED_KEY),
}


def arm_old_pass(actor, stats) -> None:
    """Mark the policy ``Actor``: its old-log-prob pass also returns each statistic of ``stats``."""
    for name in stats:
        setattr(actor, OLD_PASS_STATS[name][0], True)


@contextlib.contextmanager
def step_inputs(trainer, experience) -> Iterator[Optional[dict]]:
    """Around ``training_step``: the micro-batch's inputs the loss declares, handed to it (None: it declares none);
    a stablerl loss also writes its metrics into ``experience.info`` (OpenRLHF's logged status)."""
    loss_fn = getattr(trainer, "actor_loss_fn", None)
    need = frozenset(getattr(loss_fn, "fed_inputs", ()))  # empty for OpenRLHF's own PolicyLoss
    index = pop_index(experience, "index" in need)  # the group keys never reach OpenRLHF's metrics
    old_entropy = (experience.info or {}).pop(OLD_ENTROPY_KEY, None)  # nor the old-pass entropy
    if getattr(loss_fn, "stablerl_name", None) is None:
        yield None
        return
    inputs: dict = {}
    width = experience.action_mask.shape[1]
    if "token_ids" in need:
        inputs["token_ids"] = experience.sequences[:, -width:]
    if "scores" in need:
        if experience.rewards is None:
            raise MissingInputError("the experience has no rewards (OpenRLHF's per-response reward) to pass as scores")
        inputs["scores"] = experience.rewards.reshape(-1)
    if "index" in need:
        inputs["index"] = index
    if "entropy" in need:
        inputs["entropy"] = None  # asked for: train_forward computes it in the training forward
    if "versions" in need:  # one weight version per batch (synchronous trainer): relative, batch 0, policy 1
        inputs["versions"] = torch.where(experience.action_mask.bool(), 0, -1)
    if "policy_version" in need:
        inputs["policy_version"] = 1
    if "old_entropy" in need:
        if old_entropy is None:
            raise _missing("entropy", "the micro-batch (experience.info)")
        inputs["old_entropy"] = _to_width(old_entropy, experience.action_mask)
    loss_fn.metrics_sink = experience.info
    try:
        with loss_inputs(loss_fn.stablerl_name, inputs) if need else contextlib.nullcontext():
            yield inputs if need else None
    finally:
        loss_fn.metrics_sink = None


def train_forward(forward, actor, *args, **kwargs):
    """``Actor.forward`` in training: with ``return_entropy=True`` when the loss declares ``entropy``."""
    inputs = pending_loss_inputs()
    if inputs is None or "entropy" not in inputs or not kwargs.get("return_output"):
        return forward(actor, *args, **kwargs)
    log_probs, output = forward(actor, *args, **{**kwargs, "return_entropy": True})
    entropy = output.entropy.detach()
    if not kwargs.get("return_entropy"):
        output.entropy = entropy  # frees the softmax graph: OpenRLHF has no entropy term this step
    inputs["entropy"] = entropy[:, -log_probs.shape[1]:]
    return log_probs, output


_NO_OLD_ENTROPY = (
    "{where} carries no old-log-prob {what} (info['{key}']): the stablerl patches of "
    "ActorPPOTrainer.__init__ / Actor.forward (actor workers) and RemoteExperienceMaker.make_experience (driver) put "
    "it there. Is the stablerl setup hook active in every Ray worker (python -m "
    "stablerl.adapters.openrlhf.train_ppo_ray), and RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=0 in the workers (Ray's "
    "zero-copy tensor serializer drops the {what} carried on the log-prob tensor; the wrapper and add_setup_hook "
    "set 0)?"
)


def _missing(stat: str, where: str) -> MissingInputError:
    return MissingInputError(_NO_OLD_ENTROPY.format(where=where, what=stat, key=OLD_PASS_STATS[stat][2]))


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


def old_pass_forward(forward, actor, *args, **kwargs):
    """The old-log-prob ``Actor.forward`` of a marked actor: also ``return_output=True`` (and ``return_entropy``
    when the entropy is wanted); the action tokens' entropy / ``sum_pi_squared`` (of the temperature-scaled logits
    OpenRLHF's forward computed the log-probs from; masked like the log-probs) ride back on the CPU log-prob tensor.
    Unmarked: ``forward`` as is."""
    wanted = [name for name, (mark, _, _) in OLD_PASS_STATS.items() if actor.__dict__.get(mark)]
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
        setattr(out, ENTROPY_ON_LOG_PROBS, (output.entropy[:, -width:].detach() * mask).cpu())
    if "sum_pi_squared" in wanted:  # output.logits: fp32, already divided by OpenRLHF's temperature
        per_position = sum_pi_squared(output["logits"].detach())
        if actor.packing_samples:
            sequences = kwargs.get("sequences", args[0] if args else None)
            attention_mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
            per_position = _unpacked(per_position, sequences, attention_mask, kwargs.get("ring_attn_group"))
        setattr(out, SUM_PI_SQUARED_ON_LOG_PROBS, (per_position[:, :-1][:, -width:] * mask).cpu())
    return out


def attach_old_pass_stats(samples_list, stats) -> None:
    """In the experience maker: each statistic of ``stats`` from the old log-probs into ``experience.info``."""
    for i, samples in enumerate(samples_list):
        for stat in sorted(stats):
            _, attribute, key = OLD_PASS_STATS[stat]
            value = getattr(samples.action_log_probs, attribute, None)
            if value is None:
                raise _missing(stat, f"the actor's old-log-prob pass (experience {i})")
            delattr(samples.action_log_probs, attribute)
            if value.shape != samples.action_mask.shape:
                raise StableRLError(f"old-log-prob {stat} of shape {tuple(value.shape)} for an action mask of shape "
                                    f"{tuple(samples.action_mask.shape)} (experience {i})")
            samples.info[key] = value


def drop_old_pass_stats(experiences, stats=("entropy", "sum_pi_squared")) -> None:
    """After the advantage step, the statistics no loss reads: not carried through the replay buffer."""
    for experience in experiences:
        for stat in stats:
            (experience.info or {}).pop(OLD_PASS_STATS[stat][2], None)


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
        value = (experience.info or {}).get(OLD_PASS_STATS[stat][2])
        if value is None:
            raise _missing(stat, f"experience {i} at compute_advantages_and_returns")
        rows.append(_to_width(value, padded([experience.action_mask], width, torch.float32)))
    return torch.cat(rows)


__all__ = ["FED_INPUTS", "OLD_ENTROPY_KEY", "SUM_PI_SQUARED_KEY", "OLD_PASS_STATS", "arm_old_pass", "step_inputs",
           "train_forward", "old_pass_forward", "attach_old_pass_stats", "drop_old_pass_stats", "padded",
           "padded_old_pass_stat"]
