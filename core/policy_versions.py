"""Policy versions: which weights generated each token, and which weights are being trained.

A-3PO (arXiv 2512.06547) and every loss that declares ``versions`` / ``policy_version`` read them in one
convention, AReaL's (its engine's version is the number of weight updates published so far):

* ``versions[b, t]``: the version of the weights that generated token ``t`` of response ``b`` (a negative value:
  not generated, e.g. a prompt or padding token);
* ``policy_version``: the version of the weights the training forward runs with (updates applied so far).

So a token of the current weights has ``versions == policy_version`` (on-policy), one update stale
``policy_version - 1`` (A-3PO's proximal version), and so on. A token can never come from weights newer than the
ones being trained: :func:`check_policy_versions` refuses that (a framework's counter is off, or the two inputs
count different things) instead of letting A-3PO's alpha clamp it silently to 0.

Each adapter's provider reads the counter its framework keeps (TRL: ``state.global_step`` at generation and now;
verl / OpenRLHF's synchronous trainers: one version per batch) or, where a framework keeps none, counts weight
syncs itself (OpenRLHF's asynchronous trainer: each sample stamped with the syncs before its generation, each round
with the syncs before it + 1); this module checks what they give, and holds :class:`WeightSyncCounter`, the count a framework whose
generator and trainer are different Ray actors (OpenRLHF's ``--train.async_enable``) shares between them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .params import StableRLError

__all__ = ["check_policy_versions", "as_policy_version", "WeightSyncCounter"]


def as_policy_version(policy_version: Any) -> int:
    """``policy_version`` as a Python int (an int, a numpy integer or a one-element integer tensor), else an error."""
    value = policy_version
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise StableRLError(f"policy_version must be an integer (the version of the weights being trained), got a "
                                f"{value.dtype} tensor of shape {tuple(value.shape)}")
        value = int(value.reshape(()).item())
    elif isinstance(value, bool) or not hasattr(value, "__index__"):
        raise StableRLError(f"policy_version must be an integer (the version of the weights being trained), got "
                            f"{type(policy_version).__name__} {policy_version!r}")
    value = int(value.__index__()) if not isinstance(value, int) else value
    if value < 0:
        raise StableRLError(f"policy_version must be >= 0 (the number of weight updates applied), got {value}")
    return value


def check_policy_versions(versions: Optional[torch.Tensor], policy_version: Any,
                          response_mask: Optional[torch.Tensor] = None) -> Optional[int]:
    """Check the two inputs given (either may be None) and return ``policy_version`` as an int (None when absent).

    ``versions``: integer values (a floating tensor must hold whole, finite numbers); on the tokens where
    ``response_mask`` is nonzero (all tokens without a mask) none may exceed ``policy_version``."""
    current = None if policy_version is None else as_policy_version(policy_version)
    if versions is None:
        return current
    if not isinstance(versions, torch.Tensor):
        raise StableRLError(f"versions must be a [B, T] integer tensor of policy versions, got {type(versions).__name__}")
    if versions.dtype == torch.bool or versions.is_complex():
        raise StableRLError(f"versions must hold integer policy versions, got dtype {versions.dtype}")
    if versions.numel() == 0:
        return current
    if versions.dtype.is_floating_point:
        if not bool(torch.isfinite(versions).all()):
            raise StableRLError("versions has non-finite values (NaN or inf); policy versions are whole numbers "
                                "(negative: not generated)")
        if not bool((versions == versions.round()).all()):
            raise StableRLError("versions has fractional values; policy versions are whole numbers (the number of "
                                "weight updates before the token was generated; negative: not generated)")
    if current is None:
        return None
    trained = versions if response_mask is None else versions[response_mask.to(versions.device) != 0]
    if trained.numel() == 0:
        return current
    newest = int(trained.max())
    if newest > current:
        raise StableRLError(
            f"versions has a trained token of policy version {newest}, newer than policy_version={current} (the "
            "weights being trained): no token can come from weights newer than the current policy's. The framework's "
            "version counter and the generation stamps disagree (both must count weight updates, AReaL's convention: "
            "see stablerl.policy_versions)")
    return current


class _Count:
    """The state of a :class:`WeightSyncCounter`: one integer, in a named Ray actor."""

    def __init__(self) -> None:
        self.value = 0

    def get(self) -> int:
        return self.value

    def increment(self) -> int:
        self.value += 1
        return self.value


class WeightSyncCounter:
    """The number of weight syncs to the rollout engines so far (AReaL's weight version), shared by the processes
    of one Ray job: a named Ray actor (no CPU reserved), created by the first process that asks for it and found by
    name by the others (Ray's ``get_if_exists``; a job's actors share its namespace, so two jobs never share one).
    The process that syncs the weights calls :meth:`advance` once per sync, before the engines may generate again;
    the generator reads :meth:`current` before it generates, the trainer before it trains. Ray is imported when
    the counter is first used."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._actor = None

    def _handle(self):
        if self._actor is None:
            import ray

            remote = ray.remote(num_cpus=0)(_Count)
            self._actor = remote.options(name=self.name, get_if_exists=True).remote()
        return self._actor

    def current(self) -> int:
        """The syncs completed so far (0 before the first)."""
        import ray

        return int(ray.get(self._handle().get.remote()))

    def advance(self) -> int:
        """Count one more sync; the new count."""
        import ray

        return int(ray.get(self._handle().increment.remote()))
