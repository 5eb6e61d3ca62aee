"""The teacher of on-policy distillation in TRL: a frozen second model loaded from ``stablerl_teacher_model`` (a path
with the student's tokenizer), prepared like TRL prepares its ``ref_model`` (dropout off, TRL's fused LM head at the
sampling temperature, ``accelerator.prepare_model(evaluation_mode=True)`` / DeepSpeed / FSDP), whose log-probs of the
student's sampled tokens are one extra no-grad forward per generation batch, only when a selected estimator reads
``teacher_log_prob``.

Why not TRL's ``ref_model``: TRL 1.16 builds it from the policy's own checkpoint (``get_config_model_id(model.config)``)
and only when ``beta != 0``, and then adds ``beta * KL(policy || ref)`` to the loss; it cannot be pointed at another
checkpoint. The teacher is a model of its own, so TRL's KL-to-reference (``beta``) stays what it is, kept separately.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from stablerl.params import StableRLError

KEY = "stablerl_teacher_model"


def _vocab(tokenizer: Any) -> Optional[dict]:
    getter = getattr(tokenizer, "get_vocab", None)
    return getter() if callable(getter) else None


def check_same_vocabulary(student: Any, teacher: Any, student_tokenizer: Any = None, teacher_path: str = "") -> None:
    """Refuse a teacher whose vocabulary differs from the student's (core's check): the LM heads' sizes, and the
    tokenizers' token -> id maps where the teacher's folder has a tokenizer (the student's is TRL's processing_class)."""
    from stablerl.teacher import check_same_vocabulary as check

    setting = f"{KEY}={teacher_path!r}"
    check(setting, student.get_output_embeddings().weight.shape[0], teacher.get_output_embeddings().weight.shape[0])
    if student_tokenizer is None or not teacher_path:
        return
    try:
        from transformers import AutoTokenizer

        teacher_tokenizer = AutoTokenizer.from_pretrained(teacher_path)
    except (OSError, ValueError):  # the teacher's folder has no tokenizer: the LM-head sizes were checked
        return
    check(setting, None, None, _vocab(getattr(student_tokenizer, "tokenizer", student_tokenizer)),
          _vocab(teacher_tokenizer))


class Teacher:
    """The frozen teacher of one trainer (built at start-up, after TRL's own models)."""

    def __init__(self, trainer: Any, path: str):
        from trl.trainer import grpo_trainer as g

        args = trainer.args
        kwargs = dict(args.model_init_kwargs or {})
        kwargs.setdefault("dtype", trainer.model.dtype)
        kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        if args.distributed_state.distributed_type in ["MULTI_GPU", "DEEPSPEED"]:
            kwargs["device_map"] = None
        model = g.create_model_from_path(path, **kwargs)
        student = trainer.accelerator.unwrap_model(trainer.model)
        student = student.get_base_model() if hasattr(student, "get_base_model") else student
        check_same_vocabulary(student, model, getattr(trainer, "processing_class", None), path)
        if args.disable_dropout:
            g.disable_dropout_in_model(model)
        model.requires_grad_(False)
        model.eval()
        g.add_fused_lm_head(model, temperature=trainer.temperature, cast_lm_head_to_fp32=args.cast_lm_head_to_fp32)
        if trainer.is_deepspeed_enabled:
            model = g.prepare_deepspeed(model, trainer.accelerator)
        elif trainer.is_fsdp_enabled:
            model = g.prepare_fsdp(model, trainer.accelerator)
        else:
            model = trainer.accelerator.prepare_model(model, evaluation_mode=True)
        self.trainer, self.model, self.path = trainer, model, path

    def log_probs(self, out: dict, mode: str) -> torch.Tensor:
        """``[n, T]`` teacher log-probs of this process's completion tokens (TRL's temperature): one no-grad forward
        through TRL's own ``_get_per_token_logps_and_entropies``, as TRL scores its ``ref_model``."""
        from ._config import TRL_GRPOTrainer

        if any(k in out for k in ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes")):
            raise StableRLError("on-policy distillation in TRL scores text-only batches; this batch has images")
        t = self.trainer
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        bs = t.args.per_device_train_batch_size if mode == "train" else t.args.per_device_eval_batch_size
        with torch.no_grad():
            logps = TRL_GRPOTrainer._get_per_token_logps_and_entropies(
                t, self.model, ids, attention, out["completion_ids"].size(1), batch_size=bs)[0]
        return logps.detach()


def setup(trainer: Any, reads_teacher: bool) -> Optional[Teacher]:
    """The trainer's teacher when a selected algorithm reads ``teacher_log_prob`` (else None; a teacher path given
    without such an algorithm is refused: it would load a model nothing reads)."""
    path = getattr(trainer.args, KEY, None)
    if reads_teacher and not path:
        raise StableRLError(f"the selected advantage estimator reads teacher_log_prob: set {KEY}=<path of the teacher, "
                            "a checkpoint with the student's tokenizer> (TRL's ref_model is the policy's own checkpoint)")
    if path and not reads_teacher:
        raise StableRLError(f"{KEY}={path!r} is set, but no selected algorithm reads teacher_log_prob (select "
                            "advantage_estimator='on_policy_distillation')")
    return Teacher(trainer, path) if path else None


__all__ = ["KEY", "Teacher", "check_same_vocabulary", "setup"]
