"""Declared inputs of a stablerl policy loss at OpenRLHF 0.11.2's loss call site.

``ActorPPOTrainer.training_step`` calls its loss with the log-probs, old log-probs, advantages, the
mask and the rollout log-probs only. For a stablerl loss that declares more, the adapter's existing
``training_step`` and ``Actor.forward`` patches read them and hand them to the loss through core's
scoped channel (:func:`stablerl.frameworks.loss_inputs`, open for the whole ``training_step``; the
same one verl's adapter uses); nothing is computed for a loss that does not declare them:

* ``token_ids``: ``experience.sequences[:, -A:]`` (``A`` = the ``action_mask`` width), the tokens
  whose log-probs ``Actor.forward`` returns (it takes ``log_probs[:, :-1][:, -A:]``, the log-prob of
  ``sequences[t + 1]`` at position ``t``);
* ``scores``: ``experience.rewards`` ``[B]``, the per-response reward OpenRLHF's advantage step used
  (after its length penalties, before the baseline); an episode field, it survives the replay
  buffer's split, shuffle and re-batch with its row;
* ``entropy``: the training forward's own per-token entropy: ``Actor.forward`` is called with
  ``return_entropy=True`` (OpenRLHF's ``compute_entropy`` on the same temperature-scaled logits as
  the log-probs, gathered and re-padded like them under ``--ds.packing_samples``), sliced
  ``[:, -A:]`` as OpenRLHF slices it for ``--actor.entropy_coef``. Detached (the stablerl losses
  use it as a weight); when OpenRLHF did not ask for it itself, ``output.entropy`` is detached too,
  so the softmax is not kept for backward;
* ``index``: the rows' prompt groups, carried through the replay buffer in ``experience.info`` and kept
  whole per micro-batch by the adapter's DataLoader (``._groups``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from stablerl.frameworks import loss_inputs, pending_loss_inputs

#: Inputs this module feeds (with ``rollout_log_prob``, which OpenRLHF passes itself).
FED_INPUTS = ("entropy", "token_ids", "scores", "index")


def wanted(loss_fn) -> frozenset:
    """The inputs ``loss_fn`` declares that this module feeds (empty for OpenRLHF's own PolicyLoss)."""
    return frozenset(getattr(loss_fn, "fed_inputs", ()))


@contextlib.contextmanager
def step_inputs(trainer, experience) -> Iterator[Optional[dict]]:
    """Around ``training_step``: the micro-batch's inputs, handed to the loss (None: the loss declares none);
    a stablerl loss also writes its metrics into ``experience.info`` (OpenRLHF's logged status)."""
    from ._groups import pop_index

    loss_fn = getattr(trainer, "actor_loss_fn", None)
    index = pop_index(experience, "index" in wanted(loss_fn))  # the group keys never reach OpenRLHF's metrics
    if getattr(loss_fn, "stablerl_name", None) is None:
        yield None
        return
    loss_fn.metrics_sink = experience.info
    try:
        with _fed(loss_fn, experience, index) as inputs:
            yield inputs
    finally:
        loss_fn.metrics_sink = None


@contextlib.contextmanager
def _fed(loss_fn, experience, index) -> Iterator[Optional[dict]]:
    need = wanted(loss_fn)
    if not need:
        yield None
        return
    from stablerl.params import MissingInputError

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
    with loss_inputs(loss_fn.stablerl_name, inputs):
        yield inputs


def train_forward(forward, actor, *args, **kwargs):
    """``Actor.forward`` in training: with ``return_entropy=True`` when the loss declares ``entropy``."""
    inputs = pending_loss_inputs()
    if inputs is None or "entropy" not in inputs or not kwargs.get("return_output"):
        return forward(actor, *args, **kwargs)
    openrlhf_wants_it = bool(kwargs.get("return_entropy"))
    kwargs["return_entropy"] = True
    log_probs, output = forward(actor, *args, **kwargs)
    width = log_probs.shape[1]
    entropy = output.entropy.detach()
    if not openrlhf_wants_it:
        output.entropy = entropy  # frees the softmax graph: OpenRLHF has no entropy term this step
    inputs["entropy"] = entropy[:, -width:]
    return log_probs, output


__all__ = ["FED_INPUTS", "wanted", "step_inputs", "train_forward"]
