"""Declared inputs of a stablerl policy loss beyond OpenRLHF 0.11.2's loss call, handed over through core's scoped
channel (:func:`stablerl.frameworks.loss_inputs`, open for the whole ``training_step``); nothing is computed for a
loss that does not declare them (docs/openrlhf.md, "Loss inputs"): ``token_ids`` (``sequences[:, -A:]``),
``scores`` (``experience.rewards``), ``index`` (``._groups``), ``versions`` / ``policy_version`` (one weight
version per batch: every generated token 0, the policy 1, a3po), ``entropy`` (the training forward's, asked of
``Actor.forward`` and detached) and ``old_entropy``: the old-log-prob pass's, also the ``entropy`` of estimators,
shapers and filters. That pass (on an actor marked :data:`WANTS_OLD_ENTROPY`) returns it on the CPU log-prob
tensor (:data:`ENTROPY_ON_LOG_PROBS`, as routing replay's routes), ``make_experience`` moves it into
``experience.info[OLD_ENTROPY_KEY]`` (split row by row by the replay buffer) and ``training_step`` pops it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from stablerl.frameworks import loss_inputs, pending_loss_inputs
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
            raise MissingInputError(_NO_OLD_ENTROPY.format(where="the micro-batch (experience.info)"))
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
    "{where} carries no old-log-prob entropy (info['" + OLD_ENTROPY_KEY + "']): the stablerl patches of "
    "ActorPPOTrainer.__init__ / Actor.forward (actor workers) and RemoteExperienceMaker.make_experience (driver) put "
    "it there. Is the stablerl setup hook active in every Ray worker (python -m "
    "stablerl.adapters.openrlhf.train_ppo_ray), and RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=0 in the workers (Ray's "
    "zero-copy tensor serializer drops the entropy carried on the log-prob tensor; the wrapper and add_setup_hook "
    "set 0)?"
)


def old_pass_forward(forward, actor, *args, **kwargs):
    """The old-log-prob ``Actor.forward`` of a marked actor: also ``return_entropy=True``; the action tokens'
    entropy (masked like the log-probs) rides back on the CPU log-prob tensor. Unmarked: ``forward`` as is."""
    if not actor.__dict__.get(WANTS_OLD_ENTROPY) or kwargs.get("return_output"):
        return forward(actor, *args, **kwargs)
    action_mask = kwargs.get("action_mask", args[1] if len(args) > 1 else None)
    if action_mask is None:
        raise StableRLError("the old-log-prob pass got no action_mask: OpenRLHF's PolicyModelActor.forward passes one")
    log_probs, output = forward(actor, *args, **{**kwargs, "return_output": True, "return_entropy": True})
    entropy = output.entropy[:, -log_probs.shape[1]:].detach() * action_mask.to(output.entropy.dtype)
    out = log_probs.cpu()  # PolicyModelActor.forward's .to("cpu") then keeps this tensor and its attribute
    setattr(out, ENTROPY_ON_LOG_PROBS, entropy.cpu())
    return out


def attach_old_entropy(samples_list) -> None:
    """In the experience maker: the entropy from the old log-probs into ``experience.info[OLD_ENTROPY_KEY]``."""
    for i, samples in enumerate(samples_list):
        entropy = getattr(samples.action_log_probs, ENTROPY_ON_LOG_PROBS, None)
        if entropy is None:
            raise MissingInputError(_NO_OLD_ENTROPY.format(where=f"the actor's old-log-prob pass (experience {i})"))
        delattr(samples.action_log_probs, ENTROPY_ON_LOG_PROBS)
        if entropy.shape != samples.action_mask.shape:
            raise StableRLError(f"old-log-prob entropy of shape {tuple(entropy.shape)} for an action mask of shape "
                                f"{tuple(samples.action_mask.shape)} (experience {i})")
        samples.info[OLD_ENTROPY_KEY] = entropy


def drop_old_entropy(experiences) -> None:
    """After the advantage step, when no loss reads it: not carried through the replay buffer."""
    for experience in experiences:
        (experience.info or {}).pop(OLD_ENTROPY_KEY, None)


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


def padded_old_entropy(experiences, width: int):
    """The old-log-prob pass's entropy of every experience as one ``[N, width]`` batch (advantage step)."""
    rows = []
    for i, experience in enumerate(experiences):
        entropy = (experience.info or {}).get(OLD_ENTROPY_KEY)
        if entropy is None:
            raise MissingInputError(_NO_OLD_ENTROPY.format(where=f"experience {i} at compute_advantages_and_returns"))
        rows.append(_to_width(entropy, padded([experience.action_mask], width, torch.float32)))
    return torch.cat(rows)


__all__ = ["FED_INPUTS", "OLD_ENTROPY_KEY", "step_inputs", "train_forward", "old_pass_forward",
           "attach_old_entropy", "drop_old_entropy", "padded", "padded_old_entropy"]
