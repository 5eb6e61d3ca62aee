"""The update micro-batch's record for a stablerl loss in SkyRL's policy worker: around ``PolicyWorkerBase.
_forward_backward_micro`` (private in SkyRL 0.3, ``(self, experience, microbatch_weight, loss_fn=None,
loss_fn_config=None)``; the routing-replay wrapper, ``_routing.arm``, enters :func:`update_inputs`) so that, while it runs, :attr:`SkyRLAdapter.micro` is a
:class:`~stablerl.steps.BatchRecord` on its ``Experience`` (``token_ids``: the response tokens) and a forward hook
on the worker's model puts the training forward's ``output["entropy"]`` (SkyRL computes it in every update forward,
``compute_entropy=True``) into ``record.produced``, sliced as SkyRL slices its log-probs and detached: no second
forward. The loss (``_loss``) reads its declared inputs from that record."""

from __future__ import annotations

import contextlib

from stablerl.steps import BatchRecord


def _entropy_hook(record, num_actions):
    def hook(module, args, out):
        output = out[1] if isinstance(out, tuple) and len(out) == 2 else None
        entropy = output.get("entropy") if hasattr(output, "get") else None
        if entropy is not None:
            record.produced["entropy"] = entropy[:, -num_actions - 1: -1].detach()
    return hook


@contextlib.contextmanager
def update_inputs(worker, experience):
    """Around one ``_forward_backward_micro`` (the routing-replay wrapper's, ``_routing.arm``)."""
    from stablerl.adapter import get_adapter

    from ._names import NAME

    adapter = get_adapter(NAME)
    record = BatchRecord(adapter=adapter, response_mask=experience.action_mask, host=experience)
    handle = worker.model.register_forward_hook(_entropy_hook(record, experience.num_actions))
    adapter.micro = record
    try:
        yield record
    finally:
        handle.remove()
        adapter.micro = None
