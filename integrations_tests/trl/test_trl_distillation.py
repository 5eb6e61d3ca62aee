"""On-policy distillation in real TRL 1.16 on CPU: stablerl's generalized_jsd against TRL's own distillation losses
(DistillationTrainer's chunked divergence, GKDTrainer.generalized_jsd_loss) where the forms coincide (the full
vocabulary, k = V), and the teacher's log-probs fed by the adapter (stablerl_teacher_model) to
advantage_estimator='on_policy_distillation' in GRPOTrainer, with the teacher's vocabulary checked at start-up."""

import pytest
import torch

import trl_helpers as H  # noqa: I001

import stablerl
from stablerl.adapters.trl import GRPOConfig, GRPOTrainer
from stablerl.params import StableRLError


def _ours(student_logits, teacher_logits, mask, beta, temperature=1.0):
    B, T, _ = student_logits.shape
    lp = torch.zeros(B, T, dtype=student_logits.dtype, requires_grad=True)
    loss, _ = stablerl.compute_policy_loss(
        "generalized_jsd", log_prob=lp, old_log_prob=lp.detach(), advantages=torch.zeros(B, T, dtype=lp.dtype),
        response_mask=mask, student_topk_log_prob=(student_logits / temperature).log_softmax(-1),
        teacher_topk_log_prob=(teacher_logits / temperature).log_softmax(-1), beta=beta)
    return loss


@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 1.0])
def test_generalized_jsd_matches_trls_distillation_trainer_loss(beta):
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    B, T, H_s, H_t, V = 3, 5, 6, 4, 11
    g = torch.Generator().manual_seed(0)
    h_s = torch.randn(B, T, H_s, generator=g, dtype=torch.float64, requires_grad=True)
    h_t = torch.randn(B, T, H_t, generator=g, dtype=torch.float64)
    w_s, w_t = torch.randn(V, H_s, generator=g, dtype=torch.float64), torch.randn(V, H_t, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[1, 3:] = 0
    mask[2, 1:] = 0
    temperature = 0.7
    trl_loss, _, n = _chunked_divergence_loss(h_s, h_t, w_s, w_t, mask, beta, temperature=temperature)
    (trl_grad,) = torch.autograd.grad(trl_loss, h_s)
    h = h_s.detach().clone().requires_grad_(True)
    loss = _ours(h @ w_s.T, h_t @ w_t.T, mask, beta, temperature)
    (grad,) = torch.autograd.grad(loss, h)
    print(f"beta={beta}: TRL {trl_loss.item():.12f}, stablerl {loss.item():.12f}, n={int(n)}")
    # TRL's chunked kernel computes in float32 whatever the input dtype: float32 agreement
    torch.testing.assert_close(loss, trl_loss.to(loss.dtype), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(grad, trl_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9, 1.0])
def test_generalized_jsd_matches_trls_gkd_loss(beta):
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    B, T, V = 2, 6, 9
    g = torch.Generator().manual_seed(1)
    student = torch.randn(B, T, V, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, 4:] = -100
    mask = (labels != -100).double()
    ref = GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta)  # batchmean over valid tokens
    (ref_grad,) = torch.autograd.grad(ref, student)
    s = student.detach().clone().requires_grad_(True)
    loss = _ours(s, teacher, mask, beta)
    (grad,) = torch.autograd.grad(loss, s)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-8, atol=1e-12)


# ----------------------------------------------------------------------------- the teacher's log-probs in GRPOTrainer


@pytest.fixture
def teacher_dir(tmp_path):
    path = tmp_path / "teacher"
    H.tiny_model(seed=7).save_pretrained(path)
    H.TOKENIZER.save_pretrained(path)
    return str(path)


def test_the_adapter_feeds_the_teachers_log_probs_to_the_estimator(tmp_path, monkeypatch, teacher_dir):
    args = GRPOConfig(**H.base_kwargs(tmp_path / "out", advantage_estimator="on_policy_distillation",
                                      stablerl_teacher_model=teacher_dir, temperature=0.8, max_steps=4))
    trainer, batches, calls = H.train_recording_estimator(monkeypatch, GRPOTrainer, args)
    assert trainer._stablerl_teacher is not None
    teacher = H.tiny_model(seed=7).eval()  # the same weights, an independent plain forward
    checked = 0
    for (snapshot, out), kw in zip(batches, calls):
        mask = kw["response_mask"].bool()
        ids = out["completion_ids"].unsqueeze(-1)
        want_teacher = H.completion_log_softmax(teacher, out, 0.8).gather(-1, ids).squeeze(-1)
        want_old = H.completion_log_softmax(snapshot, out, 0.8).gather(-1, ids).squeeze(-1)
        torch.testing.assert_close(kw["teacher_log_prob"][mask].double(), want_teacher[mask], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kw["old_log_prob"][mask].double(), want_old[mask], rtol=1e-4, atol=1e-4)
        # TRL's advantages are stablerl's: log pi_T - log pi_old on every trained token
        adv = out["advantages"]
        torch.testing.assert_close(adv[mask].double(), (want_teacher - want_old)[mask], rtol=1e-3, atol=1e-4)
        checked += int(mask.sum())
    assert checked > 0


def test_a_teacher_with_another_vocabulary_is_refused_at_start_up(tmp_path):
    from stablerl.tools.demo import build_model
    from transformers import PreTrainedTokenizerFast

    other = tmp_path / "other"
    model = build_model(H.TOKENIZER, seed=3, hidden_size=32, num_layers=2)
    model.resize_token_embeddings(len(H.TOKENIZER) + 5)
    model.save_pretrained(other)
    args = GRPOConfig(**H.base_kwargs(tmp_path / "out", advantage_estimator="on_policy_distillation",
                                      stablerl_teacher_model=str(other)))
    with pytest.raises(StableRLError, match="vocabulary has"):
        GRPOTrainer(model=H.tiny_model(), reward_funcs=H.copy_reward, args=args,
                    train_dataset=H.build_dataset(8, seed=0), processing_class=H.TOKENIZER)
    assert isinstance(PreTrainedTokenizerFast, type)


def test_teacher_key_and_estimator_go_together(tmp_path, teacher_dir):
    kw = dict(reward_funcs=H.copy_reward, train_dataset=H.build_dataset(8, seed=0), processing_class=H.TOKENIZER)
    with pytest.raises(StableRLError, match="stablerl_teacher_model=<path"):
        GRPOTrainer(model=H.tiny_model(), args=GRPOConfig(**H.base_kwargs(
            tmp_path / "a", advantage_estimator="on_policy_distillation")), **kw)
    with pytest.raises(StableRLError, match="no selected algorithm reads teacher_log_prob"):
        GRPOTrainer(model=H.tiny_model(), args=GRPOConfig(**H.base_kwargs(
            tmp_path / "b", stablerl_teacher_model=teacher_dir)), **kw)


def _student_kl(student, teacher, prompts, seed=0):
    """Mean over the student's own sampled completion tokens (4 new tokens, temperature 1, up to the first EOS) of the
    exact full-vocabulary reverse KL(student || teacher) at each position."""
    torch.manual_seed(seed)
    enc = H.TOKENIZER(prompts, return_tensors="pt", padding=True, padding_side="left")
    was_training = student.training
    student.eval()
    with torch.no_grad():
        seq = student.generate(**enc, do_sample=True, max_new_tokens=4, temperature=1.0, top_k=0, top_p=1.0)
        T = seq.shape[1] - enc["input_ids"].shape[1]
        attention = torch.cat([enc["attention_mask"], torch.ones(len(prompts), T, dtype=torch.long)], 1)
        s = student(input_ids=seq, attention_mask=attention).logits[:, -T - 1:-1].double().log_softmax(-1)
        t = teacher(input_ids=seq, attention_mask=attention).logits[:, -T - 1:-1].double().log_softmax(-1)
        eos = seq[:, -T:] == H.TOKENIZER.eos_token_id
        valid = (torch.cumsum(eos.long(), 1) - eos.long()) == 0  # up to and including the first EOS
    student.train(was_training)
    return float((s.exp() * (s - t)).sum(-1)[valid].mean())


def test_a_tiny_student_converges_toward_its_teacher_in_grpo_trainer(tmp_path):
    """The teacher: a tiny model built in code with a sharpened LM head (x20: a peaked, far-from-uniform policy);
    the student: another tiny model of the same architecture. 100 steps of on-policy distillation in TRL's real
    GRPOTrainer (pure distillation advantage, num_iterations=1)."""
    teacher = H.tiny_model(seed=7)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(20.0)
    teacher.save_pretrained(tmp_path / "teacher")
    H.TOKENIZER.save_pretrained(tmp_path / "teacher")
    teacher.eval()
    prompts = [row["prompt"] for row in H.build_dataset(32, seed=1)]
    student = H.tiny_model(seed=0)
    before = _student_kl(student, teacher, prompts)
    args = GRPOConfig(**H.base_kwargs(tmp_path / "out", advantage_estimator="on_policy_distillation",
                                      stablerl_teacher_model=str(tmp_path / "teacher"), temperature=1.0, max_steps=100,
                                      learning_rate=1e-2, num_iterations=1, gradient_accumulation_steps=1,
                                      logging_steps=100))
    trainer, _, _ = H.train(GRPOTrainer, args, model=student)
    after = _student_kl(trainer.model, teacher, prompts)
    print(f"TRL GRPOTrainer on-policy distillation: KL(student || teacher) {before:.3f} -> {after:.3f} in 100 steps")
    assert before > 1.0
    assert after < 0.5 * before
