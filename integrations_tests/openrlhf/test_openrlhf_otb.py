"""``optimal_token_baseline`` / ``tir_optimal_token_baseline`` in OpenRLHF 0.11.2: ``old_log_prob`` is OpenRLHF's
``experience.action_log_probs`` and ``sum_pi_squared`` comes from the same old-log-prob pass (the adapter has
``Actor.forward`` compute it from its temperature-scaled logits), through OpenRLHF's real make_experience /
compute_advantages_and_returns on CPU (set-up of test_openrlhf_old_entropy.py: tiny dense Qwen3, temperature 0.7,
padded and packed layouts). Reference: ``stablerl.compute_advantage`` on log-probs and ``sum_v softmax(z / T)^2``
computed here from the model's logits in float64."""

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (nox -s openrlhf installs it)")

import torch

import stablerl
import stablerl.adapters.openrlhf as adapter
from stablerl.adapters.openrlhf import Selection
from stablerl.adapters.openrlhf import _inputs
from test_openrlhf_old_entropy import INDEX, REWARDS, TEMPERATURE, VOCAB, _count_entropy_calls, _samples, _setup


def _reference(model, samples):
    """Old log-probs of the actions and ``sum_pi_squared`` of the temperature-scaled policy (float64), ``[b, A]``."""
    mask = samples.attention_mask
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        logits = model(samples.sequences, attention_mask=mask, position_ids=position_ids).logits.double()
    logp = (logits / TEMPERATURE).log_softmax(-1)[:, :-1]
    width = samples.action_mask.shape[1]
    action_logp = logp.gather(-1, samples.sequences[:, 1:].unsqueeze(-1)).squeeze(-1)[:, -width:]
    spp = logp.exp().pow(2).sum(-1)[:, -width:]
    valid = samples.action_mask.double()
    return action_logp * valid, spp * valid


def _padded(rows, width):
    return torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1])) for r in rows])


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_otb_gets_old_log_probs_and_sum_pi_squared(monkeypatch, packing, name):
    run = _setup(monkeypatch, Selection(advantage_estimator=name), packing)
    assert "sum_pi_squared" in adapter.OpenRLHFAdapter().worker(run.actor).old_pass_stats
    assert "entropy" not in adapter.OpenRLHFAdapter().worker(run.actor).old_pass_stats  # asked for sum_pi_squared only
    entropy_calls = _count_entropy_calls(monkeypatch)
    samples_list = _samples()
    references = [_reference(run.model, s) for s in samples_list]

    experiences = run.maker.make_experience(samples_list)
    assert entropy_calls == []
    for e, (ref_logp, ref_spp) in zip(experiences, references):
        mask = e.action_mask.bool()
        fed = e.info[_inputs.SUM_PI_SQUARED_KEY]
        assert fed.shape == mask.shape and not hasattr(e.action_log_probs, _inputs.OLD_PASS_STATS["sum_pi_squared"][0])
        torch.testing.assert_close(fed.double(), ref_spp, rtol=1e-5, atol=1e-7)
        assert torch.all(fed[~mask] == 0) and torch.all(fed[mask] > 1.0 / VOCAB)  # sum pi^2 >= 1/V
        torch.testing.assert_close(e.action_log_probs.double(), ref_logp, rtol=1e-5, atol=1e-5)

    width = max(s.action_mask.shape[1] for s in samples_list)
    mask = _padded([s.action_mask.double() for s in samples_list], width)
    last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(REWARDS)), last] = torch.tensor(REWARDS, dtype=torch.float64)
    kwargs = dict(token_level_rewards=rewards, response_mask=mask, index=[i // 3 for i in INDEX])
    expected, _ = stablerl.compute_advantage(
        name, old_log_prob=_padded([r[0] for r in references], width),
        sum_pi_squared=_padded([r[1] for r in references], width), **kwargs)
    group_norm, _ = stablerl.compute_advantage("grpo", **kwargs)
    assert (expected - group_norm).abs().max() > 0.1  # a per-token baseline, not GRPO's

    experiences = run.maker.compute_advantages_and_returns(experiences)
    adv = _padded([e.advantages for e in experiences], width)
    torch.testing.assert_close(adv.double(), expected, rtol=1e-5, atol=1e-6)
    assert all(_inputs.SUM_PI_SQUARED_KEY not in e.info for e in experiences)  # not carried to the actors


def test_lost_sum_pi_squared_says_why(monkeypatch):
    """Ray's zero-copy serializer drops tensor attributes: the experience maker names sum_pi_squared."""
    from test_openrlhf_old_entropy import _Group

    run = _setup(monkeypatch, Selection(advantage_estimator="optimal_token_baseline"), False)
    monkeypatch.setattr(_Group, "async_run_method_batch", lambda self, method_name, **kw: [
        [t.clone() for t in self.worker.execute_batch(method_name, kw, 0, len(kw["sequences"]))]])
    with pytest.raises(stablerl.MissingInputError, match=r"no old-log-prob sum_pi_squared .*ZERO_COPY"):
        run.maker.make_experience(_samples())


def test_the_zero_copy_switch_names_sum_pi_squared(monkeypatch, capsys):
    import stablerl.adapters.openrlhf as adapter

    monkeypatch.setenv(adapter.ENV_ADVANTAGE, "optimal_token_baseline")
    env = adapter.add_setup_hook({"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}})
    assert env["env_vars"]["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] == "0"
    assert "the old-log-prob pass's sum_pi_squared sets" in capsys.readouterr().err
