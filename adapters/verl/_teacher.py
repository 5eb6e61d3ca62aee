"""The teacher's log-probs in verl: verl 0.9.1's own teacher loop (``distillation.enabled=true``,
``distillation.teacher_models.*.model_path``), whose inference servers score every rollout sequence and write
``teacher_logprobs`` / ``teacher_ids`` (``[B, prompt + response, K]``, vLLM's prompt-logprobs layout: position ``i``
holds the log-prob of token ``i``; ``K = 1`` for verl's sampled-token loss modes (k1, k2, k3, low_var_kl), ``K = topk`` for
``forward_kl_topk``) into the batch. The adapter reads the response part back as ``teacher_log_prob`` ``[B, R]``.

verl's reference policy worker cannot be the teacher: verl 0.9.1 builds it from the actor's own model config
(``engine_workers.py``: ``ref_config.model_config = deepcopy(model_config)``)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from stablerl.params import StableRLError

# on-policy distillation: verl's own teacher loop scores the rollout (its ref worker is the actor's checkpoint)
TEACHER_AT_ADVANTAGE = (
    "verl's teacher loop: distillation.enabled=true, distillation.teacher_models.teacher_model.model_path=<teacher "
    "with the actor's tokenizer>, distillation.distillation_loss.loss_mode=k3 (or another sampled-token mode: the teacher "
    "scores the sampled tokens) and distillation.distillation_loss.distillation_loss_coef=0 with use_task_rewards=true "
    "(verl's own distillation loss term off; keep it to add it), under the legacy trainer (trainer.use_v1=false: v1's _compute_advantage "
    "fetches only uid, response_mask, rm_scores, rollout_log_probs, old_log_probs, ref_log_prob, values)"
)


def teacher_log_prob(data: Any) -> Optional[torch.Tensor]:
    """``[B, R]`` teacher log-probs of the response tokens of verl's ``DataProto`` (None: no teacher loop ran)."""
    batch = data.batch
    keys = set(batch.keys())
    if "teacher_logprobs" not in keys:
        return None
    logprobs, mask = batch["teacher_logprobs"], batch["response_mask"]
    R = mask.shape[-1]
    if logprobs.dim() == 2:
        logprobs = logprobs.unsqueeze(-1)
    if logprobs.dim() != 3 or logprobs.shape[1] < R:
        raise StableRLError(f"verl's teacher_logprobs has shape {tuple(logprobs.shape)}; expected [B, prompt + "
                            f"response, K] with a response of {R} tokens (a teacher with another tokenizer?)")
    logprobs = logprobs[:, -R:, :]
    if logprobs.shape[-1] == 1:
        return logprobs[..., 0].float() * mask.to(torch.float32)
    # top-k mode: the sampled token's log-prob, where the teacher's top-k holds it
    if "teacher_ids" not in keys or "responses" not in keys:
        raise StableRLError("verl's teacher_logprobs holds the teacher's top-k, but the batch has no teacher_ids / "
                            "responses to find the sampled token among them")
    ids = batch["teacher_ids"][:, -R:, :]
    hit = ids == batch["responses"].unsqueeze(-1).to(ids.dtype)
    valid = mask.bool()
    if not bool(hit.any(-1)[valid].all()):
        raise StableRLError("on-policy distillation needs the teacher's log-prob of every sampled token, but verl's "
                            "teacher returned its top-k (distillation.distillation_loss.loss_mode=forward_kl_topk), "
                            "which misses some sampled tokens: use a sampled-token loss_mode (k3, k2, low_var_kl; k1 only with "
                            "use_policy_gradient=true), whose teacher scores the sampled tokens")
    picked = torch.where(hit, logprobs.float(), torch.zeros((), dtype=torch.float32)).sum(-1)
    return picked * mask.to(torch.float32)


__all__ = ["teacher_log_prob"]
