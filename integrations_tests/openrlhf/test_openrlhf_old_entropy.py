"""The old-log-prob pass's entropy in OpenRLHF 0.11.2: ``old_entropy`` for ``erc``, ``entropy`` for the batch
filters ``gtpo_entropy_filter`` / ``d3s`` at the advantage step, through OpenRLHF's real code on CPU.

The old-log-prob pass runs OpenRLHF's BaseModelActor.execute_batch -> PolicyModelActor.forward (the by-value
class Ray builds) -> Actor.forward, called by the real RemoteExperienceMaker.make_experience (Ray replaced by a
pickle round trip, which keeps tensor attributes as Ray does with zero-copy off); then the real
compute_advantages_and_returns (OpenRLHF's group_norm + the stablerl filter), OpenRLHF's replay-buffer split /
unpad / shuffle / re-batch, and the real ActorPPOTrainer.training_step (DeepSpeed replaced by plain SGD).
Tiny dense Qwen3, temperature 0.7, padded and packed layouts.
"""

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (nox -s openrlhf installs it)")

from types import SimpleNamespace

import torch

import stablerl
import stablerl.adapters.openrlhf as adapter
from orlhf_helpers import PickleGroup, actor_pipeline, make_args, through_replay_buffer
from stablerl.adapters.openrlhf import Selection
from stablerl.adapters.openrlhf import _inputs

VOCAB = 64
LENGTHS = (9, 6, 12, 4, 10, 7)  # prompt + response tokens of the six samples (two prompts x three)
PROMPT = (3, 2, 4, 2, 3, 4)
INDEX = (0, 3, 1, 4, 2, 5)  # OpenRLHF's position in prompt order (// 3 = the prompt group)
REWARDS = (1.0, 0.0, 0.5, 1.0, -0.25, 0.0)
ORDER = [4, 1, 5, 0]  # the training micro-batch: rows of both rollout batches, shuffled
TEMPERATURE = 0.7


def _tiny_dense(seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model = Qwen3ForCausalLM(cfg).float()
    model.config.use_cache = False
    return model


def _samples():
    """Two rollout batches of three samples, as SamplesGenerator + split_rollout_samples build them."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    g = torch.Generator().manual_seed(1)
    singles = []
    for i, (n, p) in enumerate(zip(LENGTHS, PROMPT)):
        action = torch.zeros(n - 1, dtype=torch.long)
        action[p - 1:] = 1
        singles.append(Experience(
            sequences=torch.randint(2, VOCAB, (1, n), generator=g), attention_mask=torch.ones(1, n, dtype=torch.long),
            action_mask=action.unsqueeze(0).bool(), prompts=[f"p{i}"], labels=[""], images=[None],
            mm_train_inputs=[None], index=[INDEX[i]], rewards=torch.tensor([REWARDS[i]]),
            response_length=torch.tensor([float(n - p)]), truncated=torch.tensor([False]),
            total_length=torch.tensor([float(n)]), info={},
        ))
    return [Experience.concat_experiences(singles[:3], 0), Experience.concat_experiences(singles[3:], 0)]


def _reference_entropy(model, sequences, attention_mask, width):
    """Per-token entropy of the temperature-scaled policy at the positions that predict the actions (float64)."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    with torch.no_grad():
        logits = model(sequences, attention_mask=attention_mask, position_ids=position_ids).logits.double()
    logits = logits / TEMPERATURE
    entropy = torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)
    return entropy[:, :-1][:, -width:]


_Group = PickleGroup  # RayActorGroup stand-in (orlhf_helpers); test_openrlhf_otb imports it from here


def _setup(monkeypatch, selection, packing):
    args = make_args(policy_loss_type=selection.policy_loss or "ppo", estimator="group_norm", n_samples=3,
                     stablerl=selection)
    return actor_pipeline(monkeypatch, args, _tiny_dense(), packing, TEMPERATURE)


def _count_entropy_calls(monkeypatch):
    import openrlhf.models.actor as actor_module

    calls = []
    real = actor_module.compute_entropy

    def counting(logits):
        calls.append(tuple(logits.shape))
        return real(logits)

    monkeypatch.setattr(actor_module, "compute_entropy", counting)
    return calls


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_erc_and_gtpo_filter_get_the_old_pass_entropy(monkeypatch, packing):
    run = _setup(monkeypatch, Selection(policy_loss="erc", batch_filter="gtpo_entropy_filter"), packing)
    assert "entropy" in adapter.OpenRLHFAdapter().worker(run.actor).old_pass_stats
    entropy_calls = _count_entropy_calls(monkeypatch)
    samples_list = _samples()
    references = [_reference_entropy(run.model, s.sequences, s.attention_mask, s.action_mask.shape[1]) for s in
                  samples_list]

    # old-log-prob pass: the entropy rides back on the log-probs and lands in experience.info, per token
    experiences = run.maker.make_experience(samples_list)
    assert len(entropy_calls) == 2  # one entropy per rollout batch, in the old-log-prob pass
    for e, ref in zip(experiences, references):
        fed = e.info[_inputs.OLD_ENTROPY_KEY]
        mask = e.action_mask.bool()
        assert fed.shape == mask.shape and not hasattr(e.action_log_probs, _inputs.OLD_PASS_STATS["entropy"][0])
        torch.testing.assert_close(fed.double()[mask], ref[mask], rtol=1e-5, atol=1e-5)
        assert torch.all(fed[~mask] == 0)
        assert 3.0 < float(ref[mask].mean()) < float(torch.log(torch.tensor(float(VOCAB))))  # near-uniform

    # advantage step: OpenRLHF's group_norm, then the filter, which gets that entropy as [N, T_max]
    seen = {}
    real_filter = stablerl.filter_batch

    def spy(name, **kwargs):
        seen.update(kwargs)
        return real_filter(name, **kwargs)

    monkeypatch.setattr(stablerl.api, "filter_batch", spy)  # what the advantage step calls
    width = max(s.action_mask.shape[1] for s in samples_list)
    expected = torch.cat([torch.nn.functional.pad(r * s.action_mask, (0, width - r.shape[1]))
                          for r, s in zip(references, samples_list)])
    full_mask = torch.cat([torch.nn.functional.pad(s.action_mask.double(), (0, width - s.action_mask.shape[1]))
                           for s in samples_list])
    row_h = (expected * full_mask).sum(-1) / full_mask.sum(-1)
    # gtpo's threshold between the rows' mean entropies (the tiny model is near uniform): half are dropped
    threshold = float(row_h.sort().values[2:4].mean())
    run.maker.strategy.args.stablerl.batch_filter_params["ent_threshold"] = threshold
    experiences = run.maker.compute_advantages_and_returns(experiences)
    torch.testing.assert_close(seen["entropy"].double(), expected, rtol=1e-5, atol=1e-5)
    adv = torch.cat([torch.nn.functional.pad(e.advantages, (0, width - e.advantages.shape[1])) for e in experiences])
    dropped = row_h > threshold
    assert 0 < int(dropped.sum()) < len(row_h)
    assert torch.all(adv[dropped] == 0) and torch.all(adv[~dropped].abs().sum(-1) > 0)

    # replay buffer, then the update: erc gets the rows' own old-pass entropy in the shuffled order
    batch = through_replay_buffer(experiences, ORDER, packing)
    calls = []
    real_loss = stablerl.compute_policy_loss

    def loss_spy(name, **kwargs):
        calls.append(kwargs)
        return real_loss(name, **kwargs)

    monkeypatch.setattr(stablerl, "compute_policy_loss", loss_spy)
    status = run.trainer.training_step(batch, 0.0, 0, dict(dp_size=1, batch_num_tokens=float(batch.action_mask.sum()),
                                                           global_batch_size=float(len(ORDER))))
    mask = batch.action_mask.bool()
    by_prompt = {p: ref[row][s.action_mask[row].bool()] for s, ref in zip(samples_list, references)
                 for row, p in enumerate(s.prompts)}
    assert calls[0]["old_entropy"].shape == mask.shape
    for row, prompt in enumerate(batch.prompts):
        torch.testing.assert_close(calls[0]["old_entropy"][row][mask[row]].double(), by_prompt[prompt],
                                   rtol=1e-5, atol=1e-5)
    # unchanged weights: the training forward's entropy equals the old pass's, every token keeps its gradient
    torch.testing.assert_close(calls[0]["entropy"][mask], calls[0]["old_entropy"][mask], rtol=1e-4, atol=1e-5)
    assert float(status["metrics"]["stablerl/erc/entropy_frac"]) == pytest.approx(1.0)
    assert not any(k.startswith("stablerl_old_entropy") for k in status["metrics"])  # not logged as a metric


def test_no_entropy_reader_costs_nothing(monkeypatch):
    """Neither the loss nor a filter reads the old-pass entropy: the pass computes none and nothing is carried."""
    run = _setup(monkeypatch, Selection(policy_loss="steer", batch_filter="dynamic_sampling"), False)
    assert adapter.OpenRLHFAdapter().worker(run.actor) is None  # neither statistic asked of the old-log-prob pass
    entropy_calls = _count_entropy_calls(monkeypatch)
    experiences = run.maker.compute_advantages_and_returns(run.maker.make_experience(_samples()))
    assert entropy_calls == [] and all(_inputs.OLD_ENTROPY_KEY not in e.info for e in experiences)


def test_filter_only_entropy_is_not_sent_to_the_actors(monkeypatch):
    """Only the advantage step reads it (d3s, a constant schedule): dropped before the replay buffer."""
    run = _setup(monkeypatch, Selection(batch_filter="d3s", batch_filter_params={"n_final": 0.5, "k_final": 0.2}),
                 False)
    experiences = run.maker.make_experience(_samples())
    assert all(e.info[_inputs.OLD_ENTROPY_KEY].shape == e.action_mask.shape for e in experiences)
    experiences = run.maker.compute_advantages_and_returns(experiences)
    assert all(_inputs.OLD_ENTROPY_KEY not in e.info for e in experiences)
    kept = sum(int(e.action_mask.sum()) for e in experiences)
    total = sum(int(s.action_mask.sum()) for s in _samples())
    assert 0 < kept < total  # d3s kept the top-|A|H tokens of the kept samples
    # its default N/K schedule needs the run's total steps, which OpenRLHF's advantage step does not know
    run.maker.strategy.args.stablerl.batch_filter_params.clear()
    with pytest.raises(stablerl.StableRLError, match="d3s schedules N and K linearly"):
        run.maker.compute_advantages_and_returns(run.maker.make_experience(_samples()))


def test_lost_entropy_says_why(monkeypatch):
    """Ray's zero-copy serializer drops tensor attributes: the experience maker says so, by name."""
    run = _setup(monkeypatch, Selection(policy_loss="erc"), False)
    monkeypatch.setattr(PickleGroup, "async_run_method_batch", lambda self, method_name, **kw: [
        [t.clone() for t in self.worker.execute_batch(method_name, kw, 0, len(kw["sequences"]))]])
    with pytest.raises(stablerl.MissingInputError, match="RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=0"):
        run.maker.make_experience(_samples())
    batch = SimpleNamespace(info={}, action_mask=torch.ones(1, 2, dtype=torch.bool), sequences=torch.ones(1, 3),
                            rewards=None)
    with pytest.raises(stablerl.MissingInputError, match="carries no old-log-prob entropy"):
        with _inputs.step_inputs(adapter.OpenRLHFAdapter(), run.trainer, batch):
            pass


def test_cli_and_env_route_switch_zero_copy_off(monkeypatch, capsys):
    from orlhf_helpers import dry_run

    base = ["--actor.model_name_or_path", "Qwen/Qwen3-0.6B", "--rollout.n_samples_per_prompt", "4"]
    monkeypatch.setenv("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")
    args, init = dry_run(monkeypatch, base + ["--algo.advantage.estimator", "group_norm",
                                              "--actor.policy_loss_type", "erc"])
    assert args.stablerl.policy_loss == "erc"
    env_vars = init["runtime_env"].get("env_vars", {})
    assert env_vars.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS") == "0", env_vars
    monkeypatch.setenv(adapter.ENV_BATCH_FILTER, "gtpo_entropy_filter")
    env = adapter.add_setup_hook({"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}})
    assert env["env_vars"]["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] == "0"
    assert "the old-log-prob pass's entropy sets RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=0" in capsys.readouterr().err
    monkeypatch.setenv(adapter.ENV_BATCH_FILTER, "dynamic_sampling")
    env = adapter.add_setup_hook({"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}})
    assert env["env_vars"]["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] == "1"  # nothing rides on tensors: left alone
