"""erc's ``old_entropy`` in real TRL 1.16 training on CPU: the entropy of TRL's old-log-prob pass where TRL
runs one (here num_iterations=2), the current policy's where TRL skips it (its old log-probs are then the
current ones too), and no entropy computed in the old pass for a loss that does not declare it."""

import copy

import pytest
import torch

import trl_helpers as H  # noqa: I001

import stablerl
from stablerl.adapters.trl import GRPOConfig, GRPOTrainer


def _completion_entropy(model, inp, temperature):
    """Per-token entropy of the completion positions under ``model`` (plain forward, independent of TRL)."""
    ids = torch.cat([inp["prompt_ids"], inp["completion_ids"]], dim=1)
    mask = torch.cat([inp["prompt_mask"], inp["completion_mask"]], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.double()
    T = inp["completion_ids"].size(1)
    logits = logits[:, -T - 1:-1] / temperature
    return torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)


def _spy(monkeypatch):
    calls = []
    real = stablerl.compute_policy_loss

    def spy(name, **kw):
        calls.append({key: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for key, v in kw.items()})
        return real(name, **kw)

    monkeypatch.setattr(stablerl, "compute_policy_loss", spy)
    return calls


def test_erc_gets_the_old_passs_entropy(tmp_path, monkeypatch):
    calls, seen, snapshots = _spy(monkeypatch), [], {}

    class Recording(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            snapshot = H.tiny_model()
            snapshot.load_state_dict(copy.deepcopy(self.model.state_dict()))
            snapshots[int(self.state.global_step)] = snapshot.eval()
            return super()._generate_and_score_completions(inputs)

        def _stablerl_policy_loss(self, inputs, logps, *args, **kwargs):
            seen.append((int(self.state.global_step), dict(inputs)))
            return super()._stablerl_policy_loss(inputs, logps, *args, **kwargs)

    # num_iterations=2, GA=2: TRL runs its old-log-prob pass; each generation is trained on twice
    args = GRPOConfig(**H.base_kwargs(tmp_path, loss_type="erc", max_steps=4, temperature=0.8))
    trainer, rec, _ = H.train(Recording, args)
    assert sorted(snapshots) == [0, 2] and len(calls) == len(seen) == 8
    moved = 0
    for (step, inp), kw in zip(seen, calls):
        mask = inp["completion_mask"].bool()
        assert inp["stablerl_old_entropy"].shape == mask.shape
        reference = _completion_entropy(snapshots[step - step % 2], inp, 0.8)
        torch.testing.assert_close(kw["old_entropy"][mask].double(), reference[mask], rtol=1e-4, atol=1e-5)
        gap = (kw["entropy"] - kw["old_entropy"])[mask].abs().max().item()
        if step % 2 == 0:  # first optimizer step of its generation: weights unchanged, entropy == old entropy
            assert gap < 1e-5, (step, gap)
        else:
            moved += gap > 1e-4
    assert moved >= 2  # after an update the current entropy differs from the old pass's
    assert all(0 < log["stablerl/erc/entropy_frac"] <= 1 for log in rec.logs)


def test_without_an_old_pass_old_entropy_is_the_current_one(tmp_path, monkeypatch):
    """num_iterations=1, GA=1: TRL skips its old-log-prob pass (old log-probs = current, ratio 1): so is the
    old entropy (every token keeps its gradient), and no old-pass entropy is computed or carried."""
    import trl.trainer.grpo_trainer as trl_grpo

    calls = _spy(monkeypatch)
    entropy_passes = []
    real = trl_grpo.GRPOTrainer._get_per_token_logps_and_entropies

    def counting(self, model, *a, **kw):
        entropy_passes.append((torch.is_grad_enabled(), bool(kw.get("compute_entropy"))))
        return real(self, model, *a, **kw)

    monkeypatch.setattr(trl_grpo.GRPOTrainer, "_get_per_token_logps_and_entropies", counting)
    args = GRPOConfig(**H.base_kwargs(tmp_path, loss_type="erc", num_iterations=1, gradient_accumulation_steps=1))
    trainer, rec, _ = H.train(GRPOTrainer, args)
    assert calls and all(torch.equal(kw["old_entropy"], kw["entropy"]) for kw in calls)
    assert all(log["stablerl/erc/entropy_frac"] == pytest.approx(1.0) for log in rec.logs)
    assert all(grad for grad, _ in entropy_passes)  # only training forwards: no old-log-prob pass ran


def test_losses_without_old_entropy_compute_none_in_the_old_pass(tmp_path, monkeypatch):
    import trl.trainer.grpo_trainer as trl_grpo

    no_grad_entropy = []
    real = trl_grpo.GRPOTrainer._get_per_token_logps_and_entropies

    def counting(self, model, *a, **kw):
        if not torch.is_grad_enabled():
            no_grad_entropy.append(bool(kw.get("compute_entropy")))
        return real(self, model, *a, **kw)

    monkeypatch.setattr(trl_grpo.GRPOTrainer, "_get_per_token_logps_and_entropies", counting)
    H.train(GRPOTrainer, GRPOConfig(**H.base_kwargs(tmp_path, loss_type="steer", max_steps=2)))
    assert no_grad_entropy and not any(no_grad_entropy)  # TRL's old passes ran, without entropies
    no_grad_entropy.clear()
    H.train(GRPOTrainer, GRPOConfig(**H.base_kwargs(tmp_path / "erc", loss_type="erc", max_steps=2)))
    assert no_grad_entropy.count(True) == 1  # erc: one old pass per generation, with entropies
