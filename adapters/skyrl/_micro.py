"""What a stablerl algorithm reads from SkyRL's policy worker beyond SkyRL's own call arguments.

- :func:`update_inputs`, around ``PolicyWorkerBase._forward_backward_micro`` (entered from ``_routing.arm``):
  :attr:`SkyRLAdapter.micro` is the micro-batch's :class:`~stablerl.steps.BatchRecord` (host: its ``Experience``), and
  a forward hook puts the update forward's own ``output["entropy"]``, sliced as SkyRL slices its log-probs, into it.
- :func:`old_pass`, around the old-log-prob ``_forward_micro_batch``, only when a selected algorithm reads them (core's
  ``AlgorithmSelection.old_pass_stats``): that model call gets ``return_output=True`` (``compute_entropy=True``) and
  the entropy / ``sum_pi_squared`` of the logits SkyRL divided by its temperature ride back per sample.
- :func:`arm`: SkyRL's ``batch_to_experience`` keeps a fixed set of fields; the trainer's per-row loss inputs
  (:data:`ROW_INPUTS`) go into ``experience.info``.
"""

from __future__ import annotations

import contextlib

from stablerl.ops import sum_pi_squared
from stablerl.params import StableRLError
from stablerl.steps import BatchRecord

#: old-pass statistic -> its key in SkyRL's batch (and in the per-sample outputs of the policy's ``forward``)
OLD_PASS = {"entropy": "stablerl_old_entropy", "sum_pi_squared": "stablerl_sum_pi_squared"}
#: the per-row loss inputs the trainer puts into the batch (``_trainer``), per micro-batch in ``experience.info``
ROW_INPUTS = ("stablerl_old_entropy", "stablerl_index", "stablerl_group_size", "stablerl_scores")


@contextlib.contextmanager
def update_inputs(worker, experience):
    """Around one ``_forward_backward_micro``: the micro-batch's record."""
    from stablerl.adapter import get_adapter

    from ._names import NAME

    adapter, num_actions = get_adapter(NAME), experience.num_actions
    record = BatchRecord(adapter=adapter, response_mask=experience.action_mask, host=experience)

    def hook(module, args, out):
        output = out[1] if isinstance(out, tuple) and len(out) == 2 else None
        entropy = output.get("entropy") if hasattr(output, "get") else None
        if entropy is not None:
            record.produced["entropy"] = entropy[:, -num_actions - 1: -1].detach()

    handle = worker.model.register_forward_hook(hook)
    adapter.micro = record
    try:
        yield record
    finally:
        handle.remove()
        adapter.micro = None


@contextlib.contextmanager
def old_pass(worker, micro_batch):
    """Around one old-log-prob ``_forward_micro_batch``: the statistics ``worker._stablerl_old`` asks for (the
    ``forward`` wrapper, ``_routing.arm``) appended there, ``[rows, response_length]`` on the CPU."""
    recorded = getattr(worker, "_stablerl_old", None) or {}
    wanted = [stat for stat, key in OLD_PASS.items() if key in recorded]
    if not wanted:
        yield
        return
    if getattr(worker.model, "sequence_parallel_size", 1) > 1:
        raise StableRLError(f"the old-log-prob pass's {'/'.join(wanted)} (a selected stablerl algorithm reads it): "
                            "Ulysses sequence parallelism is not supported yet")
    mask = micro_batch["attention_mask"].bool()

    def pre(module, args, kwargs):
        return args, {**kwargs, "return_output": True, "compute_entropy": "entropy" in wanted,
                      "entropy_requires_grad": False}

    def post(module, args, kwargs, out):
        log_probs, output = out
        for stat in wanted:
            value = output["entropy"] if stat == "entropy" else sum_pi_squared(output["logits"].float())
            if value.shape != mask.shape:  # packed (remove_microbatch_padding): back to the batch layout
                value = value.new_zeros(mask.shape).masked_scatter(mask.to(value.device), value.reshape(-1))
            recorded[OLD_PASS[stat]].append(value[:, -log_probs.shape[1] - 1: -1].detach().float().cpu())
        return log_probs

    handles = (worker.model.register_forward_pre_hook(pre, with_kwargs=True),
               worker.model.register_forward_hook(post, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def arm(ledger) -> None:
    """``BaseBatchIterator.batch_to_experience``: :data:`ROW_INPUTS` into ``experience.info``."""
    from skyrl.backends.skyrl_train.workers.worker_utils import BaseBatchIterator

    original = BaseBatchIterator.batch_to_experience

    def batch_to_experience(batch):
        experience = original(batch)
        experience.info.update({key: batch[key] for key in ROW_INPUTS if batch.get(key) is not None})
        return experience

    ledger.set_attr("BaseBatchIterator.batch_to_experience", BaseBatchIterator, "batch_to_experience",
                    staticmethod(batch_to_experience))
