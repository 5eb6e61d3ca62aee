"""The teacher of on-policy distillation in OpenRLHF: the reference model loads ``--algo.advantage.stablerl_teacher_model``
instead of the actor's checkpoint, and its log-probs of the sampled tokens feed ``teacher_log_prob``.

OpenRLHF 0.11.2 builds its reference model (when ``--algo.kl.init_coef > 0``) from ``--actor.model_name_or_path``
(``train()``: ``ref_model.async_init_model_from_pretrained(strategy, args.actor.model_name_or_path)``): the adapter
wraps ``RayActorGroup.async_init_model_from_pretrained`` in the driver and, for the reference group, hands the teacher's
path instead, after checking that the teacher has the actor's vocabulary (configs' ``vocab_size`` and the tokenizers'
token -> id maps). The reference's log-probs reach the experiences as ``base_action_log_probs`` (with
``--algo.kl.use_loss``) or inside ``kl`` (``k1``: ``log pi_old - log pi_ref``, clamped by OpenRLHF to [-10, 10]);
:func:`teacher_log_probs` reads them back exactly, or refuses.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from stablerl.params import MissingInputError, StableRLError
from stablerl.teacher import check_same_vocabulary_of

from ._flags import TEACHER_FLAG

_KL_CLAMP = 10.0  # openrlhf.models.utils.compute_approx_kl clamps every estimator's value to [-10, 10]


def teacher_path(args: Any) -> Optional[str]:
    """``--algo.advantage.stablerl_teacher_model`` of OpenRLHF ``args`` (None: unset)."""
    advantage = getattr(getattr(args, "algo", None), "advantage", None)
    return getattr(advantage, "stablerl_teacher_model", None) if advantage is not None else None


def patch_launcher_module(module, ledger, adapter) -> None:
    """``RayActorGroup.async_init_model_from_pretrained``: the reference group loads the teacher (see the module
    docstring)."""

    @ledger.around(module.RayActorGroup, "async_init_model_from_pretrained")
    def async_init_model_from_pretrained(original, self, *args, **kwargs):
        teacher = teacher_path(getattr(args[0], "args", None)) if args else None
        if teacher and getattr(self, "ray_actor_type", None) is module.ReferenceModelActor and len(args) >= 2:
            check_same_vocabulary_of(f"{TEACHER_FLAG} {teacher}", args[1], teacher)
            print(f"stablerl/openrlhf: the reference model loads the teacher {teacher} ({TEACHER_FLAG}) instead of "
                  f"{args[1]}; OpenRLHF's KL to the reference is now a KL to the teacher", flush=True)
            args = (args[0], teacher, *args[2:])
        return original(self, *args, **kwargs)


def teacher_log_probs(experiences: list, width: int, mask: torch.Tensor, estimator: str) -> torch.Tensor:
    """``[N, width]`` teacher log-probs of the sampled tokens from the experiences: ``base_action_log_probs``, else
    ``action_log_probs - kl`` (``kl`` is exactly ``log pi_old - log pi_ref`` for ``k1`` inside OpenRLHF's clamp)."""
    from ._inputs import padded

    if all(e.base_action_log_probs is not None for e in experiences):
        return padded([e.base_action_log_probs for e in experiences], width, torch.float32) * mask
    how = (f"set {TEACHER_FLAG} PATH and --algo.kl.init_coef > 0 (OpenRLHF builds its reference model only then), "
           "with --algo.kl.use_loss or --algo.kl.estimator k1")
    if any(e.kl is None or e.action_log_probs is None for e in experiences):
        raise MissingInputError(f"on-policy distillation needs the teacher's log-probs, but OpenRLHF ran no reference "
                                f"model: {how}")
    if estimator != "k1":
        raise MissingInputError(f"on-policy distillation reads the teacher's log-probs from OpenRLHF's kl, which is "
                                f"log pi_old - log pi_ref only for --algo.kl.estimator k1 (got {estimator!r}): {how}")
    kl = padded([e.kl for e in experiences], width, torch.float32)
    if bool(((kl.abs() >= _KL_CLAMP) & mask.bool()).any()):
        raise StableRLError("on-policy distillation: a token's |log pi_old - log pi_teacher| reached OpenRLHF's KL clamp "
                            f"({_KL_CLAMP}), so its teacher log-prob cannot be read back exactly from kl: add "
                            "--algo.kl.use_loss (the experiences then keep the reference's log-probs)")
    old = padded([e.action_log_probs for e in experiences], width, torch.float32)
    return (old - kl) * mask


__all__ = ["patch_launcher_module", "teacher_log_probs", "teacher_path"]
