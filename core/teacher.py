"""On-policy distillation's start-up check, framework-free: a teacher must have the student's vocabulary (every
adapter that loads a teacher asks this before its first step)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from .params import StableRLError


def check_same_vocabulary(setting: str, student_size: Optional[int], teacher_size: Optional[int],
                          student_vocab: Optional[Mapping[str, Any]] = None,
                          teacher_vocab: Optional[Mapping[str, Any]] = None) -> None:
    """Refuse a teacher whose vocabulary differs from the student's: the sizes (LM heads or configs' ``vocab_size``;
    None: unknown, not compared) and, where both are given, the tokenizers' token -> id maps. ``setting``: what the
    user set to name the teacher (said in the error)."""
    if student_size is not None and teacher_size is not None and int(student_size) != int(teacher_size):
        raise StableRLError(f"{setting}: the teacher's vocabulary has {teacher_size} tokens and the student's "
                            f"{student_size}: on-policy distillation needs a teacher with the student's tokenizer")
    if student_vocab is not None and teacher_vocab is not None and dict(student_vocab) != dict(teacher_vocab):
        differ = sorted(set(dict(student_vocab).items()) ^ set(dict(teacher_vocab).items()))[:3]
        raise StableRLError(f"{setting}: the teacher's tokenizer maps tokens to other ids than the student's (e.g. "
                            f"{differ}): on-policy distillation needs the student's tokenizer")


def check_same_vocabulary_of(setting: str, student_path: str, teacher_path: str) -> None:
    """:func:`check_same_vocabulary` of two Hugging Face checkpoints (folders or hub names): their configs'
    ``vocab_size`` and, where both have a tokenizer, the token -> id maps (transformers imported here)."""
    from transformers import AutoConfig, AutoTokenizer

    check_same_vocabulary(setting, *(getattr(AutoConfig.from_pretrained(p, trust_remote_code=True), "vocab_size", None)
                                     for p in (student_path, teacher_path)))
    try:
        vocabs = [AutoTokenizer.from_pretrained(p, trust_remote_code=True).get_vocab()
                  for p in (student_path, teacher_path)]
    except (OSError, ValueError):  # a checkpoint without a tokenizer: the vocabulary sizes were checked
        return
    check_same_vocabulary(setting, None, None, *vocabs)


__all__ = ["check_same_vocabulary", "check_same_vocabulary_of"]
