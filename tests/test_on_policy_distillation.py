"""On-policy distillation (plugins/on_policy_distillation.py): the reverse-KL advantage, the generalized JSD loss
against formula-literal references (value and gradient, float64), degenerate and bf16 inputs, refusals of a teacher
with another vocabulary (hypothesis), and a tiny student that converges toward a fixed random teacher."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stablerl
from stablerl import compute_advantage, compute_policy_loss
from stablerl.params import StableRLError

EXAMPLES = settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def _mask(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    return (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(-1)).double()


def _jsd_reference(ps: torch.Tensor, pt: torch.Tensor, beta: float) -> torch.Tensor:
    """Eq. 1 of arXiv 2306.13649 in TRL's convention, from probabilities, element by element (no logaddexp)."""
    if beta == 0.0:
        return (pt * torch.log(pt / ps)).sum(-1)
    if beta == 1.0:
        return (ps * torch.log(ps / pt)).sum(-1)
    m = beta * pt + (1 - beta) * ps
    return beta * (pt * torch.log(pt / m)).sum(-1) + (1 - beta) * (ps * torch.log(ps / m)).sum(-1)


def _loss(student_lp, teacher_lp, mask, **params):
    B, T = mask.shape
    lp = torch.zeros(B, T, dtype=student_lp.dtype, requires_grad=True)
    return compute_policy_loss("generalized_jsd", log_prob=lp, old_log_prob=lp.detach(),
                               advantages=torch.zeros(B, T, dtype=student_lp.dtype), response_mask=mask,
                               student_topk_log_prob=student_lp, teacher_topk_log_prob=teacher_lp, **params)


# ----------------------------------------------------------------------------- the estimator


def test_advantage_is_the_negative_reverse_kl_estimate_per_token():
    B, T = 4, 6
    g = torch.Generator().manual_seed(1)
    mask = _mask(B, T)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    teacher = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    rewards = torch.zeros(B, T, dtype=torch.float64)
    index = torch.tensor([0, 0, 1, 1])
    adv, ret = compute_advantage("on_policy_distillation", token_level_rewards=rewards, response_mask=mask,
                                 index=index, old_log_prob=old, teacher_log_prob=teacher)
    torch.testing.assert_close(adv, (teacher - old) * mask, rtol=0, atol=0)
    torch.testing.assert_close(ret, adv)
    # a hand-computed token: teacher -0.5, student -2.0 -> the student under-weights it: A = +1.5
    old[0, 0], teacher[0, 0] = -2.0, -0.5
    adv, _ = compute_advantage("on_policy_distillation", token_level_rewards=rewards, response_mask=mask, index=index,
                               old_log_prob=old, teacher_log_prob=teacher, kl_coef=0.5)
    assert adv[0, 0].item() == pytest.approx(0.75)


def test_task_advantage_is_added_with_the_coefficient():
    B, T = 4, 5
    mask = _mask(B, T, seed=3)
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64)
    teacher = -torch.rand(B, T, generator=g, dtype=torch.float64)
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=torch.float64)
    rewards = torch.zeros(B, T, dtype=torch.float64)
    rewards[torch.arange(B), mask.sum(-1).long() - 1] = scores
    index = torch.tensor([0, 0, 1, 1])
    grpo, _ = compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask, index=index)
    both, _ = compute_advantage("on_policy_distillation", token_level_rewards=rewards, response_mask=mask, index=index,
                                old_log_prob=old, teacher_log_prob=teacher, kl_coef=0.1, task_estimator="grpo")
    torch.testing.assert_close(both, grpo + 0.1 * (teacher - old) * mask)
    # group 1 has equal rewards: GRPO gives 0 there, the distillation term does not
    assert bool((grpo[2:] == 0).all()) and bool((both[2:][mask[2:].bool()] != 0).all())


def test_estimator_degenerate_inputs():
    mask = torch.zeros(3, 4, dtype=torch.float64)
    mask[0, :2] = 1  # one row with two tokens, two empty rows, a group of one
    old = torch.full((3, 4), -1.0, dtype=torch.float64)
    teacher = torch.full((3, 4), -0.25, dtype=torch.float64)
    adv, _ = compute_advantage("on_policy_distillation", token_level_rewards=torch.zeros(3, 4, dtype=torch.float64),
                               response_mask=mask, index=torch.tensor([0, 1, 2]), old_log_prob=old,
                               teacher_log_prob=teacher)
    assert adv.tolist() == [[0.75, 0.75, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    # NaN on padding is ignored; bf16 inputs give the fp32 result within bf16 precision
    teacher[1:, :] = float("nan")
    adv16, _ = compute_advantage("on_policy_distillation", token_level_rewards=torch.zeros(3, 4), response_mask=mask,
                                 index=torch.tensor([0, 1, 2]), old_log_prob=old.bfloat16(),
                                 teacher_log_prob=teacher.bfloat16())
    assert adv16.tolist() == [[0.75, 0.75, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]


@EXAMPLES
@given(extra=st.integers(1, 5), axis=st.sampled_from([0, 1]))
def test_estimator_refuses_a_teacher_tensor_of_another_layout(extra, axis):
    B, T = 3, 4
    shape = [B, T]
    shape[axis] += extra
    with pytest.raises(StableRLError, match="teacher_log_prob"):
        compute_advantage("on_policy_distillation", token_level_rewards=torch.zeros(B, T), response_mask=torch.ones(B, T),
                          index=torch.arange(B), old_log_prob=-torch.ones(B, T), teacher_log_prob=-torch.ones(*shape))


@EXAMPLES
@given(bad=st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.5]))
def test_estimator_refuses_non_log_probabilities_on_valid_tokens(bad):
    teacher = -torch.ones(2, 3)
    teacher[1, 1] = bad
    with pytest.raises(StableRLError, match="teacher_log_prob"):
        compute_advantage("on_policy_distillation", token_level_rewards=torch.zeros(2, 3), response_mask=torch.ones(2, 3),
                          index=torch.arange(2), old_log_prob=-torch.ones(2, 3), teacher_log_prob=teacher)


def test_estimator_params_are_checked():
    for bad, match in (({"kl_coef": 0.0}, "kl_coef"), ({"task_estimator": "grpoo"}, "grpo"),
                       ({"task_estimator": "on_policy_distillation"}, "itself")):
        with pytest.raises(StableRLError, match=match):
            compute_advantage("on_policy_distillation", token_level_rewards=torch.zeros(2, 3),
                              response_mask=torch.ones(2, 3), index=torch.arange(2), old_log_prob=-torch.ones(2, 3),
                              teacher_log_prob=-torch.ones(2, 3), **bad)


# ----------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_full_vocabulary_loss_and_gradient_match_the_reference(beta):
    B, T, V = 3, 5, 7
    g = torch.Generator().manual_seed(4)
    mask = _mask(B, T, seed=5)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(B, T, V, generator=g, dtype=torch.float64).log_softmax(-1)
    loss, metrics = _loss(logits.log_softmax(-1), teacher, mask, beta=beta)
    (grad,) = torch.autograd.grad(loss, logits)
    ref_logits = logits.detach().clone().requires_grad_(True)
    per_token = _jsd_reference(ref_logits.softmax(-1), teacher.exp(), beta)
    ref = (per_token * mask).sum() / mask.sum()  # token-mean (TRL: sum / num_items_in_batch)
    (ref_grad,) = torch.autograd.grad(ref, ref_logits)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    assert metrics["distillation/jsd"] == pytest.approx(ref.item(), rel=1e-6)  # metrics: float32
    assert metrics["distillation/teacher_mass"] == pytest.approx(1.0)


def test_gradcheck_topk_bucket_and_renormalize():
    B, T, V, k = 2, 3, 9, 4
    g = torch.Generator().manual_seed(6)
    mask = _mask(B, T, seed=7)
    teacher_full = torch.randn(B, T, V, generator=g, dtype=torch.float64).log_softmax(-1)
    ids = teacher_full.topk(k, -1).indices
    teacher = teacher_full.gather(-1, ids)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    for tail in ("bucket", "renormalize"):
        for beta in (0.0, 0.5, 1.0):
            def f(x):
                return _loss(x.log_softmax(-1).gather(-1, ids), teacher, mask, beta=beta, tail=tail)[0]
            assert torch.autograd.gradcheck(f, (logits,))
    # the bucket form is the divergence of the two distributions coarsened to {top-k ids, rest}
    s = logits.detach().log_softmax(-1).gather(-1, ids).exp()
    t = teacher.exp()
    ps = torch.cat([s, 1 - s.sum(-1, keepdim=True)], -1)
    pt = torch.cat([t, 1 - t.sum(-1, keepdim=True)], -1)
    for beta in (0.0, 0.5, 1.0):
        ref = (_jsd_reference(ps, pt, beta) * mask).sum() / mask.sum()
        got, _ = _loss(s.log(), teacher, mask, beta=beta)
        torch.testing.assert_close(got, ref)
        renorm = (_jsd_reference(s / s.sum(-1, keepdim=True), t / t.sum(-1, keepdim=True), beta) * mask).sum() / mask.sum()
        torch.testing.assert_close(_loss(s.log(), teacher, mask, beta=beta, tail="renormalize")[0], renorm)
        # coarsening never increases the divergence: bucket <= full vocabulary
        full = (_jsd_reference(logits.detach().softmax(-1), teacher_full.exp(), beta) * mask).sum() / mask.sum()
        assert got.item() <= full.item() + 1e-12


def test_loss_is_zero_when_student_equals_teacher_and_the_task_loss_is_added():
    B, T, V = 2, 4, 5
    g = torch.Generator().manual_seed(8)
    mask = _mask(B, T, seed=9)
    lp = torch.randn(B, T, V, generator=g, dtype=torch.float64).log_softmax(-1)
    for beta in (0.0, 0.5, 1.0):
        loss, _ = _loss(lp, lp, mask, beta=beta)
        assert abs(loss.item()) < 1e-14
    # with task_loss="vanilla": vanilla's loss + distillation_coef * jsd
    log_prob = -torch.rand(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    student = torch.randn(B, T, V, generator=g, dtype=torch.float64).log_softmax(-1)
    kw = dict(log_prob=log_prob, old_log_prob=log_prob - 0.01, advantages=adv, response_mask=mask)
    vanilla, _ = compute_policy_loss("vanilla", **kw)
    jsd, _ = _loss(student, lp, mask, beta=0.5)
    both, metrics = compute_policy_loss("generalized_jsd", **kw, student_topk_log_prob=student, teacher_topk_log_prob=lp,
                                        beta=0.5, task_loss="vanilla", distillation_coef=0.2)
    torch.testing.assert_close(both, vanilla + 0.2 * jsd)
    assert "pg_clipfrac" in metrics and "distillation/jsd" in metrics


def test_loss_degenerate_and_bf16_inputs():
    B, T, V = 3, 4, 6
    g = torch.Generator().manual_seed(10)
    student = torch.randn(B, T, V, generator=g).log_softmax(-1).requires_grad_(True)
    teacher = torch.randn(B, T, V, generator=g).log_softmax(-1)
    # all masked: zero loss, zero gradient, even with garbage on padding
    garbage = teacher.clone()
    garbage[0, 0, 0] = float("nan")
    loss, _ = _loss(student, garbage, torch.zeros(B, T))
    loss.backward()
    assert loss.item() == 0.0 and bool((student.grad == 0).all())
    # one valid token: the loss is that token's divergence
    one = torch.zeros(B, T)
    one[1, 2] = 1
    loss, _ = _loss(student.detach(), teacher, one, beta=0.0)
    ref = _jsd_reference(student.detach()[1, 2].double().exp(), teacher[1, 2].double().exp(), 0.0)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    # bf16 inputs: computed in fp32, close to the fp32 loss
    mask = _mask(B, T).float()
    l32, _ = _loss(student.detach(), teacher, mask, beta=0.5)
    s16 = student.detach().bfloat16().requires_grad_(True)
    l16, _ = _loss(s16, teacher.bfloat16(), mask, beta=0.5)
    l16.backward()
    assert l16.dtype == torch.float32 and bool(torch.isfinite(s16.grad.float()).all())
    assert l16.item() == pytest.approx(l32.item(), rel=0.05, abs=1e-3)


@EXAMPLES
@given(k_student=st.integers(1, 8), k_teacher=st.integers(1, 8))
def test_loss_refuses_top_k_of_another_vocabulary(k_student, k_teacher):
    B, T = 2, 3
    student = torch.full((B, T, k_student), -math.log(8.0))
    teacher = torch.full((B, T, k_teacher), -math.log(8.0))
    if k_student == k_teacher:
        loss, _ = _loss(student, teacher, torch.ones(B, T))
        assert abs(loss.item()) < 1e-6
        return
    with pytest.raises(StableRLError, match="teacher_topk_log_prob k = "):
        _loss(student, teacher, torch.ones(B, T))


@EXAMPLES
@given(shape=st.sampled_from([(2, 3), (3, 3, 4), (2, 4, 4), (2, 3, 4, 1)]),
       key=st.sampled_from(["student_topk_log_prob", "teacher_topk_log_prob"]))
def test_loss_refuses_bad_layouts(shape, key):
    good = torch.full((2, 3, 4), -math.log(4.0))
    inputs = {"student_topk_log_prob": good, "teacher_topk_log_prob": good, key: torch.full(shape, -1.0)}
    with pytest.raises(StableRLError, match=key):
        _loss(inputs["student_topk_log_prob"], inputs["teacher_topk_log_prob"], torch.ones(2, 3))


@EXAMPLES
@given(bad=st.sampled_from([float("nan"), float("inf"), 1.0]), key=st.sampled_from(["student", "teacher"]))
def test_loss_refuses_non_log_probabilities(bad, key):
    values = {"student": torch.full((2, 3, 4), -math.log(4.0)), "teacher": torch.full((2, 3, 4), -math.log(4.0))}
    values[key][1, 2, 0] = bad
    with pytest.raises(StableRLError, match=f"{key}_topk_log_prob"):
        _loss(values["student"], values["teacher"], torch.ones(2, 3))


def test_loss_params_are_checked():
    good = torch.full((2, 3, 4), -math.log(4.0))
    for bad, match in (({"beta": 1.5}, "beta"), ({"tail": "drop"}, "tail"), ({"distillation_coef": -1.0}, "distillation_coef"),
                       ({"task_loss": "generalized_jsd"}, "itself"), ({"task_loss": "vanila"}, "vanilla")):
        with pytest.raises(StableRLError, match=match):
            _loss(good, good, torch.ones(2, 3), **bad)


# ----------------------------------------------------------------------------- a tiny student converges


class Bigram(torch.nn.Module):
    """A bigram language model: next-token logits from the previous token (V states)."""

    def __init__(self, V: int, seed: int, scale: float = 1.0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(scale * torch.randn(V, V, generator=g, dtype=torch.float64))

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        return self.table[prev].log_softmax(-1)


def _sample(model: Bigram, B: int, T: int, g: torch.Generator):
    prev = torch.zeros(B, dtype=torch.long)
    states, tokens = [], []
    with torch.no_grad():
        for _ in range(T):
            tok = torch.multinomial(model(prev).exp(), 1, generator=g).squeeze(-1)
            states.append(prev)
            tokens.append(tok)
            prev = tok
    return torch.stack(states, 1), torch.stack(tokens, 1)


def _kl(student: Bigram, teacher: Bigram) -> float:
    """Mean over the V states of KL(p_student(.|s) || p_teacher(.|s)): the exact reverse KL, no sampling."""
    states = torch.arange(student.table.shape[0])
    with torch.no_grad():
        s, t = student(states), teacher(states)
        return float((s.exp() * (s - t)).sum(-1).mean())


def _train(form: str, steps: int, lr: float = 0.1, V: int = 12, B: int = 64, T: int = 6):
    teacher, student = Bigram(V, seed=0, scale=2.0), Bigram(V, seed=1, scale=2.0)
    opt = torch.optim.Adam(student.parameters(), lr=lr)
    g = torch.Generator().manual_seed(2)
    before = _kl(student, teacher)
    mask = torch.ones(B, T, dtype=torch.float64)
    index = torch.arange(B) // 8
    for _ in range(steps):
        states, tokens = _sample(student, B, T, g)  # the student samples (on-policy)
        with torch.no_grad():
            teacher_lp = teacher(states)
            teacher_tok = teacher_lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # the teacher scores its tokens
        student_lp = student(states)
        log_prob = student_lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        if form == "estimator":
            adv, _ = compute_advantage("on_policy_distillation", token_level_rewards=torch.zeros(B, T,
                                       dtype=torch.float64), response_mask=mask, index=index,
                                       old_log_prob=log_prob.detach(), teacher_log_prob=teacher_tok)
            loss, _ = compute_policy_loss("vanilla", log_prob=log_prob, old_log_prob=log_prob.detach(), advantages=adv,
                                          response_mask=mask)
        else:
            loss, _ = compute_policy_loss("generalized_jsd", log_prob=log_prob, old_log_prob=log_prob.detach(),
                                          advantages=torch.zeros(B, T, dtype=torch.float64), response_mask=mask,
                                          student_topk_log_prob=student_lp, teacher_topk_log_prob=teacher_lp,
                                          beta=float(form.split("=")[1]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return before, _kl(student, teacher)


@pytest.mark.parametrize("form, steps", [("estimator", 80), ("jsd beta=1.0", 60), ("jsd beta=0.0", 60),
                                         ("jsd beta=0.5", 60)])
def test_a_tiny_student_converges_toward_a_fixed_random_teacher(form, steps):
    before, after = _train(form, steps)
    print(f"{form}: KL(student || teacher) {before:.4f} -> {after:.4f} in {steps} steps")
    assert before > 1.0
    assert after < 0.1 * before


def test_the_teacher_vocabulary_check():
    from stablerl.teacher import check_same_vocabulary

    check_same_vocabulary("k=t", 10, 10, {"a": 0, "b": 1}, {"b": 1, "a": 0})
    check_same_vocabulary("k=t", None, 12)  # an unknown size is not compared
    with pytest.raises(StableRLError, match="k=t: the teacher's vocabulary has 12 tokens and the student's 10"):
        check_same_vocabulary("k=t", 10, 12)
    with pytest.raises(StableRLError, match=r"other ids.*\('a', 1\)"):
        check_same_vocabulary("k=t", 2, 2, {"a": 0, "b": 1}, {"a": 1, "b": 0})
