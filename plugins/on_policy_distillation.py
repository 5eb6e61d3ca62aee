"""On-policy distillation: the student samples, a frozen teacher scores the student's own tokens, and the student
is trained toward the teacher. Two forms, both on the student's samples:

* estimator ``on_policy_distillation`` (Thinking Machines, "On-Policy Distillation", K. Lu et al., 2025; verl PR
  #4897's policy-gradient update, ``distillation_loss.use_policy_gradient=true``): the sampled token's negative
  reverse-KL estimate as a per-token advantage (no discounting), optionally added to a task estimator's advantage::

      A_t = A_task_t + kl_coef * (log pi_T(y_t) - log pi_old(y_t))

* policy loss ``generalized_jsd`` (GKD, Agarwal et al., arXiv 2306.13649, Eq. 1; TRL's ``DistillationTrainer`` /
  ``GKDTrainer``, whose ``beta`` convention it keeps): per token, the generalized Jensen-Shannon divergence between
  the teacher's and the student's next-token distributions on the teacher's top-k ids (k = V: the full vocabulary)::

      m = beta p_T + (1 - beta) p_S,   l_t = beta KL(p_T || m) + (1 - beta) KL(p_S || m)
      beta = 0: KL(p_T || p_S) (forward),   beta = 1: KL(p_S || p_T) (reverse)

  optionally added to a task policy loss: ``l_t = l_task_t + distillation_coef * jsd_t``.

Defaults: estimator ``kl_coef=1.0``, ``task_estimator=""`` (pure distillation: the advantage is the reverse-KL term
alone, as in the blog post; ``"grpo"`` adds GRPO's task advantage, as verl's ``use_task_rewards=true``). Loss
``beta=1.0`` (TRL DistillationConfig's default), ``tail="bucket"``, ``task_loss=""``, ``distillation_coef=1.0``.

On the top-k support the two distributions are made complete with one tail bucket each (``tail="bucket"``: the mass
outside the teacher's top-k, ``1 - sum_k p``), so the divergence is the exact divergence of the two distributions
coarsened to {top-k ids, rest} (a lower bound of the full-vocabulary one, equal to it at k = V); ``"renormalize"``
renormalises both over the top-k ids instead. Log-probabilities come from the provider already tempered (TRL applies
its ``temperature`` to the logits before the softmax).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stablerl import ADVANTAGE_ESTIMATOR, EXPERIMENTAL, POLICY_LOSS, Params, get_spec, hookimpl
from stablerl.params import StableRLError, build_params, check

_TAILS = ("bucket", "renormalize")


# ----------------------------------------------------------------------------- the estimator


@dataclass
class OnPolicyDistillationParams(Params):
    """``kl_coef`` scales the reverse-KL advantage; ``task_estimator`` names a registered estimator whose advantage
    (with its default hyper-parameters) is added ("" : none)."""

    kl_coef: float = 1.0
    task_estimator: str = ""

    def validate(self) -> None:
        check(math.isfinite(self.kl_coef) and self.kl_coef > 0, f"kl_coef must be finite and > 0, got {self.kl_coef}")
        check(self.task_estimator != "on_policy_distillation", "task_estimator cannot be on_policy_distillation itself")
        if self.task_estimator:
            get_spec(ADVANTAGE_ESTIMATOR, self.task_estimator)  # an unknown name raises, naming the nearest


def teacher_tokens(value, shape, key: str, mask: torch.Tensor) -> torch.Tensor:
    """A ``[B, T]`` per-token log-prob input, checked: its shape (a teacher with another vocabulary or tokenizer
    yields another layout), finite and <= 0 on valid tokens; 0 on padding."""
    if not isinstance(value, torch.Tensor):
        raise StableRLError(f"{key} must be a [B, T] tensor of log-probabilities, got {type(value).__name__}")
    if tuple(value.shape) != tuple(shape):
        raise StableRLError(f"{key} has shape {tuple(value.shape)}, expected {tuple(shape)} (the student's [B, T]): "
                            "the teacher must score the student's own tokens with the same tokenizer")
    valid = mask.bool()
    zero = torch.zeros((), dtype=value.dtype, device=value.device)
    clean = torch.where(valid, value, zero)
    if not bool(torch.isfinite(clean).all()):
        raise StableRLError(f"{key} has non-finite values (NaN or inf) on tokens where response_mask is 1 (a teacher "
                            "that gives a student token probability 0: check that both share the vocabulary)")
    if bool((clean > 1e-4).any()):
        raise StableRLError(f"{key} has values > 0: it must hold log-probabilities")
    return clean


def distillation_advantage(b, p: OnPolicyDistillationParams, ctx):
    rewards, mask = b.token_level_rewards, b.response_mask
    if b.old_log_prob is None:
        raise StableRLError("on_policy_distillation needs old_log_prob (the student's sampling log-probs)")
    teacher = teacher_tokens(b.extras.get("teacher_log_prob"), rewards.shape, "teacher_log_prob", mask)
    student = teacher_tokens(b.old_log_prob, rewards.shape, "old_log_prob", mask)
    # -(log pi_S - log pi_T): the negative per-token reverse-KL estimate, per token (no discounting)
    advantages = p.kl_coef * (teacher.to(rewards.dtype) - student.to(rewards.dtype)) * mask
    if p.task_estimator:
        spec = get_spec(ADVANTAGE_ESTIMATOR, p.task_estimator)
        task, _ = spec.fn(b, build_params(spec, {}), ctx)
        advantages = advantages + task * mask
    return advantages, advantages


# ----------------------------------------------------------------------------- the loss


@dataclass
class GeneralizedJSDParams(Params):
    """TRL's ``beta`` (0 forward KL, 1 reverse KL, between: generalized JSD); ``tail`` completes the top-k support;
    ``task_loss`` names a registered per-token policy loss added with weight 1 ("" : none)."""

    beta: float = 1.0
    tail: str = "bucket"
    task_loss: str = ""
    distillation_coef: float = 1.0

    def validate(self) -> None:
        check(0.0 <= self.beta <= 1.0, f"beta must be in [0, 1], got {self.beta}")
        check(self.tail in _TAILS, f"tail must be one of {list(_TAILS)}, got {self.tail!r}")
        check(math.isfinite(self.distillation_coef) and self.distillation_coef > 0,
              f"distillation_coef must be finite and > 0, got {self.distillation_coef}")
        check(self.task_loss != "generalized_jsd", "task_loss cannot be generalized_jsd itself")
        if self.task_loss:
            spec = get_spec(POLICY_LOSS, self.task_loss)
            check(spec.output == "per_token", f"task_loss {self.task_loss!r} returns a {spec.output}; it must return a "
                  "per-token loss to be added to the distillation term")


def generalized_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """``[..., K]`` complete log-distributions -> ``[...]`` generalized JSD (TRL's beta convention)."""
    if beta == 0.0:
        return (teacher.exp() * (teacher - student)).sum(-1)
    if beta == 1.0:
        return (student.exp() * (student - teacher)).sum(-1)
    log_m = torch.logaddexp(student + math.log1p(-beta), teacher + math.log(beta))
    return beta * (teacher.exp() * (teacher - log_m)).sum(-1) + (1 - beta) * (student.exp() * (student - log_m)).sum(-1)


def complete(log_p: torch.Tensor, tail: str) -> torch.Tensor:
    """``[..., k]`` log-probs of k ids -> a complete log-distribution: ``[..., k + 1]`` with the rest's mass as one
    bucket, or ``[..., k]`` renormalised."""
    if tail == "renormalize":
        return torch.log_softmax(log_p, -1)
    covered = torch.logsumexp(log_p, -1, keepdim=True).clamp(max=0.0)
    tiny = torch.finfo(log_p.dtype).tiny
    rest = torch.log(torch.clamp(-torch.expm1(covered), min=tiny))  # log(1 - sum p); the clamp: k = V (rest = 0)
    return torch.cat([log_p, rest], -1)


def topk_inputs(b) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's (with gradient) and the teacher's top-k log-probs, ``[B, T, k]``, checked and cleaned."""
    B, T = b.log_prob.shape
    out = []
    for key in ("student_topk_log_prob", "teacher_topk_log_prob"):
        value = b.extras.get(key)
        if not isinstance(value, torch.Tensor) or value.dim() != 3 or tuple(value.shape[:2]) != (B, T):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise StableRLError(f"generalized_jsd: {key} must be a [B, T, k] tensor with [B, T] = {(B, T)}, got {got}")
        out.append(value)
    student, teacher = out
    if student.shape[-1] != teacher.shape[-1]:
        raise StableRLError(f"generalized_jsd: student_topk_log_prob has k = {student.shape[-1]} and "
                            f"teacher_topk_log_prob k = {teacher.shape[-1]}: the student's log-probs must be read at "
                            "the teacher's top-k ids (a teacher with another vocabulary gives other ids)")
    valid = b.bool_mask.unsqueeze(-1)
    # rounding of low-precision log-softmax outputs may put the sum over k ids a little above 1
    slack = max(1e-3, student.shape[-1] * max(torch.finfo(student.dtype).eps, torch.finfo(teacher.dtype).eps))
    dtype = torch.promote_types(torch.promote_types(student.dtype, teacher.dtype), torch.float32)
    # padding: the uniform distribution over the k ids (finite, and no tail), whatever the framework left there
    uniform = torch.full((), -math.log(max(student.shape[-1], 1)), dtype=dtype, device=student.device)
    student, teacher = (torch.where(valid, t.to(dtype), uniform) for t in (student, teacher))
    for key, t in (("student_topk_log_prob", student), ("teacher_topk_log_prob", teacher)):
        if not bool(torch.isfinite(t.detach()).all()):
            raise StableRLError(f"generalized_jsd: {key} has non-finite values (NaN or inf) on valid tokens")
        if bool((torch.logsumexp(t.detach(), -1) > slack).any()):
            raise StableRLError(f"generalized_jsd: {key} sums to more than 1 over the top-k ids: it must hold "
                                "log-probabilities of distinct ids")
    return student, teacher


def generalized_jsd_loss(b, p: GeneralizedJSDParams, ctx):
    student, teacher = topk_inputs(b)
    s, t = complete(student, p.tail), complete(teacher.detach(), p.tail)
    jsd = generalized_jsd(s, t, p.beta) * b.response_mask
    valid = b.bool_mask
    n = valid.sum().clamp(min=1)
    metrics = {
        "distillation/jsd": (jsd.detach() * valid).sum() / n,
        "distillation/teacher_mass": (teacher.detach().exp().sum(-1) * valid).sum() / n,
        "distillation/student_mass": (student.detach().exp().sum(-1) * valid).sum() / n,
    }
    loss = p.distillation_coef * jsd
    if p.task_loss:
        spec = get_spec(POLICY_LOSS, p.task_loss)
        task, task_metrics = spec.fn(b, build_params(spec, {}), ctx)
        loss = loss + task
        metrics.update(task_metrics)
    return loss, metrics


@hookimpl
def register_advantage_estimators(register):
    register(
        name="on_policy_distillation",
        fn=distillation_advantage,
        params=OnPolicyDistillationParams,
        paper="2306.13649",
        title="On-policy distillation: the sampled token's reverse KL to a frozen teacher as a per-token advantage",
        formula="A_t = A_task_t + kl_coef (log pi_teacher(y_t) - log pi_old(y_t))",
        status=EXPERIMENTAL,
        requires=("old_log_prob", "teacher_log_prob"),
        reference="checked against the formula only (Thinking Machines' blog post gives no reference code; verl "
        "0.9.1's distillation with use_policy_gradient=true and loss_mode=k1 uses -(log pi_S - log pi_T) as advantage "
        "too, with the update forward's log-probs instead of the old-log-prob pass's)",
        notes="Thinking Machines, 'On-Policy Distillation' (2025): per-token advantage -(log pi_S - log pi_T), "
        "discount 0, with the student's sampling log-probs (old_log_prob); the arXiv id is GKD's (on-policy "
        "distillation of language models). The teacher's log-probs come from the framework's frozen second model "
        "pointed at a teacher checkpoint with the same tokenizer (see docs). task_estimator runs with its own "
        "default hyper-parameters. Equal rewards and group-of-one give the distillation term, not zero (by design).",
    )


@hookimpl
def register_policy_losses(register):
    register(
        name="generalized_jsd",
        fn=generalized_jsd_loss,
        params=GeneralizedJSDParams,
        paper="2306.13649",
        title="Generalized JSD to a frozen teacher on the teacher's top-k ids (GKD; TRL's DistillationTrainer loss)",
        formula="l_t = beta KL(p_T||m) + (1-beta) KL(p_S||m), m = beta p_T + (1-beta) p_S; beta 0: KL(p_T||p_S), "
        "1: KL(p_S||p_T)",
        status=EXPERIMENTAL,
        requires=("student_topk_log_prob", "teacher_topk_log_prob"),
        # the last five: the task loss's, when task_loss names a PPO-style loss (vanilla, ...)
        metrics=("distillation/jsd", "distillation/teacher_mass", "distillation/student_mass", "pg_clipfrac",
                 "pg_clipfrac_lower", "ppo_kl", "clip_high", "clip_low"),
        reference="TRL 1.16 DistillationTrainer._chunked_divergence_loss and GKDTrainer.generalized_jsd_loss "
        "(full vocabulary, k = V): same value and gradient (integrations_tests/trl/test_trl_distillation.py)",
        notes="The student's top-k log-probs carry the gradient (log_prob is read only by task_loss). tail='bucket' "
        "adds the mass outside the teacher's top-k as one bucket to both distributions (exact at k = V; below, the "
        "divergence of the coarsened distributions); tail='renormalize' renormalises both over the top-k ids. "
        "Per-token output: core's loss_agg_mode (token-mean = TRL's sum / num_items_in_batch). Status experimental: "
        "TRL's reference covers the full vocabulary only, not the top-k form. No framework feeds the top-k inputs "
        "yet (they need the training forward's logits at the teacher's ids).",
    )
