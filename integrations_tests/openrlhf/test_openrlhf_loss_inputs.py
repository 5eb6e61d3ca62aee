"""Declared loss inputs OpenRLHF 0.11.2's loss call does not pass (entropy, token_ids, scores), fed by
the adapter's training_step / Actor.forward patches, through the real ActorPPOTrainer.training_step and
Actor.forward (tiny dense Qwen3 on CPU, DeepSpeed replaced by a plain backward and SGD step), after
OpenRLHF's replay-buffer split / unpad / shuffle / re-batch. Padded and packed layouts."""

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (nox -s openrlhf installs it)")

from types import SimpleNamespace

import torch

import stablerl
import stablerl.adapters.openrlhf as adapter
from orlhf_helpers import make_args, ppo_trainer
from stablerl import frameworks
from stablerl.adapters.openrlhf import Selection

VOCAB = 64
LENGTHS = (9, 6, 12, 4, 10, 7)  # prompt + response tokens of the six samples
PROMPT = (3, 2, 4, 2, 3, 4)
REWARDS = (1.0, 0.0, 0.5, 1.0, -0.25, 0.0)
ORDER = [4, 1, 5, 0]  # the training micro-batch: rows shuffled
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


def _batch(packing, infos=None):
    """Six single-sample experiences -> OpenRLHF's split / unpad / re-batch of four shuffled rows (``infos``: each
    sample's ``info``)."""
    from openrlhf.trainer.ppo_utils.experience import (Experience, make_experience_batch,
                                                       remove_padding_in_sequences, split_experience_batch)

    g = torch.Generator().manual_seed(1)
    singles, responses = [], []
    for n, p, r in zip(LENGTHS, PROMPT, REWARDS):
        seq = torch.randint(2, VOCAB, (1, n), generator=g)
        action = torch.zeros(n - 1, dtype=torch.long)
        action[p - 1:] = 1
        singles.append(Experience(
            sequences=seq, attention_mask=torch.ones(1, n, dtype=torch.long), action_mask=action.unsqueeze(0),
            action_log_probs=-torch.rand(1, n - 1, generator=g) * action, advantages=torch.randn(1, 1, generator=g)
            * action, rewards=torch.tensor([r]), response_length=torch.tensor([n - p]), truncated=torch.tensor([False]),
            total_length=torch.tensor([float(n)]), info=dict(infos[len(singles)]) if infos else {},
        ))
        responses.append(seq[0, p:])
    items = []
    for e in (Experience.concat_experiences(singles[:3], 0), Experience.concat_experiences(singles[3:], 0)):
        items += split_experience_batch(e)
    items = remove_padding_in_sequences(items)
    return make_experience_batch([items[i] for i in ORDER], packing), [responses[i] for i in ORDER]


def _reference_entropy(model, batch):
    """Per-token entropy of the temperature-scaled policy at the positions that predict the actions."""
    mask = batch.attention_mask
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        logits = model(batch.sequences, attention_mask=mask, position_ids=position_ids).logits.double() / TEMPERATURE
    entropy = torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)
    return entropy[:, :-1][:, -batch.action_mask.shape[1]:]


def _trainer(monkeypatch, loss, packing, params=None, entropy_coef=None, is_level="off"):
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from openrlhf.models import Actor

    adapter.instrument(now=True)
    if packing:
        from test_openrlhf_routing_replay import _torch_bert_padding

        _torch_bert_padding(monkeypatch)
    monkeypatch.setattr(ppo_actor, "NaiveReplayBuffer", lambda *a, **k: SimpleNamespace())
    monkeypatch.setattr(ppo_actor, "torch_dist_barrier_and_cuda_sync", lambda: None)
    args = make_args(policy_loss_type=loss, stablerl=Selection(policy_loss=loss, policy_loss_params=params or {}),
                     is_level=is_level)
    args.ds = SimpleNamespace(packing_samples=packing, ring_attn_size=1, tensor_parallel_size=1)
    args.actor.entropy_coef = entropy_coef
    model = _tiny_dense()
    actor = Actor(model)
    actor.packing_samples, actor.temperature = packing, TEMPERATURE
    trainer = ppo_trainer(ppo_actor, args, actor, torch.optim.SGD(actor.parameters(), lr=0.0))
    return trainer, model


def _spy(monkeypatch):
    calls = []
    real = stablerl.compute_policy_loss

    def spy(name, **kwargs):
        calls.append(dict(kwargs))
        spec = stablerl.get_spec(stablerl.POLICY_LOSS, name)
        undeclared = [k for k in ("entropy", "token_ids", "scores") if k not in spec.requires]
        loss, metrics = real(name, **{k: v for k, v in kwargs.items() if k not in undeclared})
        calls[-1]["__loss__"] = loss.detach()
        return loss, metrics

    monkeypatch.setattr(stablerl, "compute_policy_loss", spy)
    return calls


def _step(trainer, batch):
    n_tokens = float(batch.action_mask.sum())
    return trainer.training_step(batch, 0.0, 0, dict(dp_size=1, batch_num_tokens=n_tokens,
                                                        global_batch_size=float(len(ORDER))))


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("entropy_coef", [None, 0.01])
def test_steer_gets_the_training_forwards_entropy(monkeypatch, packing, entropy_coef):
    from stablerl.frameworks import pending_loss_inputs

    trainer, model = _trainer(monkeypatch, "steer", packing, entropy_coef=entropy_coef)
    assert trainer.actor_loss_fn.fed_inputs == {"entropy"}
    batch, _ = _batch(packing)
    calls = _spy(monkeypatch)
    status = _step(trainer, batch)
    assert len(calls) == 1 and set(calls[0]) >= {"entropy", "log_prob"} and "token_ids" not in calls[0]
    mask = batch.action_mask.bool()
    fed = calls[0]["entropy"]
    assert fed.shape == mask.shape and not fed.requires_grad
    expected = _reference_entropy(model, batch)
    torch.testing.assert_close(fed.double()[mask], expected[mask], rtol=1e-5, atol=1e-5)
    assert 3.0 < float(expected[mask].mean()) < float(torch.log(torch.tensor(float(VOCAB))))  # near-uniform tiny model
    # the loss value is steer's with that entropy, and the entropy matters
    kw = {k: v for k, v in calls[0].items() if not k.startswith("__") and k != "entropy"}
    from stablerl.api import compute_policy_loss as real

    value, _ = real("steer", entropy=expected.to(fed.dtype), **kw)
    torch.testing.assert_close(calls[0]["__loss__"], value.detach(), rtol=1e-5, atol=1e-6)
    flat, _ = real("steer", entropy=torch.full_like(fed, float(expected[mask].mean())), **kw)
    assert abs(float(flat.detach()) - float(value.detach())) > 1e-4
    # OpenRLHF's own entropy term keeps working (and only then is it logged)
    assert ("entropy_loss" in status["metrics"]) == (entropy_coef is not None)
    # nothing left behind for the next call
    assert pending_loss_inputs() is None and trainer.actor_loss_fn._fed is None


@pytest.mark.parametrize("packing", [False, True])
def test_token_ids_and_scores_are_the_rows_own(monkeypatch, packing):
    """A loss declaring token_ids and scores (steer's declaration widened on the instance) gets each
    row's response tokens at its action positions and its reward, in the shuffled micro-batch order."""
    trainer, _ = _trainer(monkeypatch, "steer", packing)
    monkeypatch.setattr(trainer.actor_loss_fn, "fed_inputs", frozenset({"entropy", "token_ids", "scores"}))
    batch, responses = _batch(packing)
    calls = _spy(monkeypatch)
    _step(trainer, batch)
    fed = calls[0]
    mask = batch.action_mask.bool()
    assert fed["token_ids"].dtype == torch.long and fed["token_ids"].shape == mask.shape
    for row, response in enumerate(responses):
        assert torch.equal(fed["token_ids"][row][mask[row]], response)
    assert torch.equal(fed["scores"], torch.tensor([REWARDS[i] for i in ORDER]))


def _a3po_step(monkeypatch, packing, clip, infos=None, async_enable=False):
    """One training_step of a3po (vLLM log-probs: OpenRLHF's old ones plus noise), recording each backward's
    gradients: (trainer, model, batch, loss calls, gradients, status)."""
    trainer, model = _trainer(monkeypatch, "a3po", packing, params=clip, is_level="token")
    trainer.args.train.async_enable = async_enable
    batch, _ = _batch(packing, infos=infos)
    g = torch.Generator().manual_seed(7)
    batch.rollout_log_probs = (batch.action_log_probs + 0.3 * torch.randn(batch.action_log_probs.shape, generator=g)
                               ) * batch.action_mask
    calls = _spy(monkeypatch)
    grads = []
    trainer.strategy.backward = lambda loss, *a: (model.zero_grad(), loss.backward(),
                                                  grads.append([q.grad.clone() for q in model.parameters()]))
    return trainer, model, batch, calls, grads, _step(trainer, batch)


@pytest.mark.parametrize("packing", [False, True])
def test_a3po_gets_one_version_per_batch_through_training_step(monkeypatch, packing):
    """A-3PO in OpenRLHF's synchronous trainer: every generated token of the batch version 0, the policy 1, so
    alpha = 0 and the proximal policy is vLLM's (behaviour weight 1): through the real training_step the loss and
    gradient equal vanilla PPO's clip of exp(lp - lp_rollout), whatever OpenRLHF's old log-probs are."""
    clip = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0)
    trainer, model, batch, calls, grads, status = _a3po_step(monkeypatch, packing, clip)
    assert trainer.actor_loss_fn.fed_inputs == {"versions", "policy_version"}
    fed = calls[0]
    mask = batch.action_mask.bool()
    assert torch.equal(fed["versions"], torch.where(mask, 0, -1)) and fed["policy_version"] == 1
    assert float(status["metrics"]["stablerl/a3po/alpha_mean"]) == 0.0
    assert float(status["metrics"]["stablerl/behave_imp_weight"]) == pytest.approx(1.0)
    # the same forward's log-probs, vanilla PPO against the rollout log-probs: loss and gradient
    lp = fed["log_prob"]
    kw = dict(advantages=fed["advantages"], response_mask=fed["response_mask"], ctx=fed["ctx"],
              loss_agg_mode=fed["loss_agg_mode"])
    model.zero_grad()
    from stablerl.api import compute_policy_loss as real

    _, reference = _trainer(monkeypatch, "vanilla", packing, params=clip)  # same seed: the same weights
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))
    log_probs = trainer.actor(batch.sequences, batch.action_mask, attention_mask=batch.attention_mask)
    vanilla, _ = real("vanilla", log_prob=log_probs, old_log_prob=batch.rollout_log_probs, **kw, **clip)
    torch.testing.assert_close(calls[0]["__loss__"], vanilla.detach(), rtol=1e-6, atol=1e-8)
    model.zero_grad()
    vanilla.backward()
    for got, q in zip(grads[0], model.parameters()):
        torch.testing.assert_close(got, q.grad, rtol=1e-5, atol=1e-7)
    # and OpenRLHF's own old log-probs are not what it clips against (they differ from the rollout's)
    old, _ = real("vanilla", log_prob=lp.detach(), old_log_prob=batch.action_log_probs, **kw, **clip)
    assert abs(float(old) - float(vanilla)) > 1e-4


@pytest.mark.parametrize("packing", [False, True])
def test_a3po_version_is_constant_over_the_optimizer_steps_of_one_rollout_batch(monkeypatch, packing):
    """OpenRLHF's synchronous trainer may train one rollout batch over several optimizer steps (--train.batch_size
    below the rollout batch, --train.max_epochs > 1). AReaL's convention (the version counts weight syncs to the
    rollout engine, constant over the ppo_n_minibatches optimizer steps of one batch; its proximal policy is
    recomputed once per training step, i.e. the behaviour policy in a synchronous trainer): every step of the batch
    gets versions 0 / policy_version 1, so alpha = 0 at every step and each loss is vanilla PPO's clip of
    exp(lp - lp_rollout) on that step's forward."""
    from stablerl.api import compute_policy_loss as real

    clip = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0)
    trainer, model = _trainer(monkeypatch, "a3po", packing, params=clip, is_level="token")
    batch, _ = _batch(packing)
    g = torch.Generator().manual_seed(7)
    batch.rollout_log_probs = (batch.action_log_probs + 0.3 * torch.randn(batch.action_log_probs.shape, generator=g)
                               ) * batch.action_mask
    calls = _spy(monkeypatch)
    statuses = [_step(trainer, batch) for _ in range(3)]  # three optimizer steps on the same rollout batch
    mask = batch.action_mask.bool()
    assert len(calls) == 3
    for fed, status in zip(calls, statuses):
        assert torch.equal(fed["versions"], torch.where(mask, 0, -1)) and fed["policy_version"] == 1
        assert float(status["metrics"]["stablerl/a3po/alpha_mean"]) == 0.0
        kw = dict(advantages=fed["advantages"], response_mask=fed["response_mask"], ctx=fed["ctx"],
                  loss_agg_mode=fed["loss_agg_mode"])
        vanilla, _ = real("vanilla", log_prob=fed["log_prob"].detach(), old_log_prob=batch.rollout_log_probs, **kw,
                          **clip)
        torch.testing.assert_close(fed["__loss__"], vanilla, rtol=1e-6, atol=1e-8)


GENERATED = (3, 2, 3, 2, 2, 3)  # the weight syncs before each sample's generation (asynchronous trainer)
POLICY = 4  # the round trains version 4: it starts from the weights of 3 syncs


def _a3po_reference(lp, rollout, advantages, mask, alpha, n_tokens, clip_low, clip_high, cap):
    """A-3PO written out from the paper (arXiv 2512.06547) and AReaL's decoupled loss, independently of stablerl:
    lp_prox = lp_b + alpha (sg(lp) - lp_b); w = exp(lp_prox - lp_b), rejected outside (0, cap]; r = exp(lp - lp_prox);
    loss = sum(m * w * max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))) / tokens (OpenRLHF's token-mean)."""
    prox = rollout + alpha * (lp.detach() - rollout)
    w = torch.exp(prox - rollout)
    keep = (w <= cap).to(lp.dtype)
    r = torch.exp(lp - prox)
    per_token = torch.maximum(-advantages * r, -advantages * torch.clamp(r, 1 - clip_low, 1 + clip_high))
    return (per_token * (w * keep).detach() * mask).sum() / n_tokens


@pytest.mark.parametrize("packing", [False, True])
def test_a3po_on_a_batch_mixing_two_policy_versions_matches_the_formula(monkeypatch, packing):
    """OpenRLHF's asynchronous trainer (--train.async_enable): the micro-batch mixes samples generated after 3 and
    after 2 weight syncs (the adapter's stamps, carried row by row through the replay buffer's split / shuffle /
    re-batch), trained by the round of version 4. Through the real training_step the loss gets each row's version on
    its action tokens and alpha is 0 for the rows of 3 syncs (the weights the round starts from) and (4-1-2)/(4-2) =
    1/2 for the others; loss and gradient equal A-3PO written out independently, and differ from alpha = 0."""
    from stablerl.adapters.openrlhf._versions import POLICY_VERSION_KEY, VERSION_KEY

    clip = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)
    trainer, model, batch, calls, grads, status = _a3po_step(
        monkeypatch, packing, clip, async_enable=True,
        infos=[{VERSION_KEY: torch.tensor([v]), POLICY_VERSION_KEY: torch.tensor([POLICY])} for v in GENERATED])
    fed, mask = calls[0], batch.action_mask.bool()
    rows = torch.tensor([GENERATED[i] for i in ORDER])  # the shuffled micro-batch's rows
    assert sorted(set(rows.tolist())) == [2, 3]  # both versions in this micro-batch
    assert torch.equal(fed["versions"], torch.where(mask, rows.unsqueeze(1), -1)) and fed["policy_version"] == POLICY
    assert not any(key.startswith("stablerl_") for key in status["metrics"])  # the stamps are never logged
    alpha = torch.where(mask, torch.where(rows == 2, 0.5, 0.0).unsqueeze(1), 0.0).double()
    assert float(status["metrics"]["stablerl/a3po/alpha_mean"]) == pytest.approx(float(alpha[mask].mean()))
    assert 0 < float(alpha[mask].mean()) < 0.5
    n_tokens = float(mask.sum())
    model.zero_grad()
    lp = trainer.actor(batch.sequences, batch.action_mask, attention_mask=batch.attention_mask)  # lr 0: same weights
    kw = dict(advantages=batch.advantages.to(lp.dtype), mask=mask.to(lp.dtype), n_tokens=n_tokens, clip_low=0.2,
              clip_high=0.28, cap=5.0)
    expected = _a3po_reference(lp, batch.rollout_log_probs.to(lp.dtype), alpha=alpha.to(lp.dtype), **kw)
    torch.testing.assert_close(calls[0]["__loss__"], expected.detach(), rtol=1e-5, atol=1e-7)
    expected.backward()
    for got, q in zip(grads[0], model.parameters()):
        torch.testing.assert_close(got, q.grad, rtol=1e-4, atol=1e-6)
    # alpha matters: the same batch read as on-policy (alpha 0 everywhere) gives another loss
    on_policy = _a3po_reference(lp.detach(), batch.rollout_log_probs.to(lp.dtype), alpha=torch.zeros_like(alpha).to(
        lp.dtype), **kw)
    assert abs(float(on_policy) - float(expected)) > 1e-4


def test_a3po_under_the_async_trainer_needs_the_stamps(monkeypatch):
    """--train.async_enable without the generator's stamps (the setup hook missing in a Ray worker): the step
    raises, naming the keys, instead of giving every token the synchronous trainer's constant version."""
    trainer, _ = _trainer(monkeypatch, "a3po", False, is_level="token")
    trainer.args.train.async_enable = True
    batch, _ = _batch(False)
    batch.rollout_log_probs = batch.action_log_probs.clone()
    with pytest.raises(stablerl.MissingInputError, match=r"--train.async_enable: the micro-batch carries no "
                                                         r"policy-version stamps \(info \['stablerl_version', "
                                                         r"'stablerl_policy_version'\]\)"):
        _step(trainer, batch)


def test_a3po_builds_under_the_async_trainer_and_is_refused_with_partial_rollout():
    from stablerl.adapters.openrlhf._loss import build_policy_loss

    args = make_args(policy_loss_type="a3po", is_level="token")
    args.train.async_enable = True
    assert build_policy_loss(args, Selection(policy_loss="a3po")).fed_inputs == {"versions", "policy_version"}
    args.train.partial_rollout_enable = True
    with pytest.raises(stablerl.MissingInputError, match=r"policy loss 'a3po' needs \['versions', 'policy_version'\]: "
                                                         r"with --train.partial_rollout_enable OpenRLHF syncs the weights "
                                                         r"in the middle of a generation"):
        build_policy_loss(args, Selection(policy_loss="a3po"))


def test_loss_called_without_the_patch_says_so():
    from stablerl.adapters.openrlhf import StablePolicyLoss

    loss = StablePolicyLoss(policy_loss_type="steer")
    lp = -torch.rand(2, 3, dtype=torch.float64)
    with pytest.raises(stablerl.MissingInputError, match=r"needs \['entropy'\].*actor_loss_fn.feed"):
        loss(lp, lp, torch.ones_like(lp), action_mask=torch.ones(2, 3, dtype=torch.bool))
    loss.feed({"entropy": torch.ones_like(lp)})
    out = loss(lp, lp, torch.ones_like(lp), action_mask=torch.ones(2, 3, dtype=torch.bool))
    assert out[0].shape == () and loss._fed is None  # one call per feed
    with pytest.raises(stablerl.MissingInputError):
        loss(lp, lp, torch.ones_like(lp), action_mask=torch.ones(2, 3, dtype=torch.bool))


def test_entropic_state_persists_across_calls():
    """EntroPIC's controller integral lives in ctx.state: the loss object keeps it across calls."""
    from stablerl.adapters.openrlhf import StablePolicyLoss

    loss = StablePolicyLoss(policy_loss_type="entropic")
    assert loss.fed_inputs == {"entropy"}
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 5, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.bool)
    integrals = []
    for _ in range(3):
        loss.feed({"entropy": torch.full_like(lp, 0.6)})
        loss(lp, lp, torch.randn(3, 5, generator=g, dtype=torch.float64), action_mask=mask)
        integrals.append(loss.last_metrics["entropic/integral"])
    assert loss.stablerl_state.slot(stablerl.POLICY_LOSS, "entropic")["entropic"]["updates"] == 3
    assert integrals[0] != 0 and integrals[1] == pytest.approx(2 * integrals[0]) and integrals[2] == pytest.approx(
        3 * integrals[0])


def test_entropic_integral_counts_one_error_per_optimizer_step_under_gradient_accumulation():
    """OpenRLHF's normalisers (its own iter_grad_accum_global_norm) are the step's tokens and non-empty sequences
    divided by gas, DeepSpeed scaling each micro-batch's loss by 1 / gas. The Context gets the real counts: EntroPIC's
    integral adds (H - target) * rows-in-call / rows-in-step, so one optimizer step adds one error even when a batch
    filter masked rows out (weights 8/16 + 8/16; the raw normalisers gave 8/5 each), and the loss is OpenRLHF's."""
    from openrlhf.utils.loss_utils import iter_grad_accum_global_norm

    from stablerl.adapters.openrlhf import StablePolicyLoss

    target = 0.2
    g = torch.Generator().manual_seed(1)
    masks = [torch.ones(8, 5, dtype=torch.bool), torch.zeros(8, 5, dtype=torch.bool)]
    masks[1][:2, :3] = True  # the filter kept 2 of the second micro-batch's 8 rows
    entropies = (1.7, 3.1)
    loss = StablePolicyLoss(policy_loss_type="entropic", clip_to_params=False,
                            stablerl_params={"target_entropy": target}, grad_accum=2, step_rows=16)
    window = list(iter_grad_accum_global_norm(iter(masks), SimpleNamespace(), 2, lambda m: m))
    assert [float(info["global_batch_size"]) for _, info in window] == [5.0, 5.0]  # (8 + 2) / gas
    before = 0.0
    for (mask, info), entropy in zip(window, entropies):
        lp = -torch.rand(8, 5, generator=g, dtype=torch.float64)
        old = lp + 0.05 * torch.randn(8, 5, generator=g, dtype=torch.float64)
        adv = torch.randn(8, 5, generator=g, dtype=torch.float64)
        loss.feed({"entropy": torch.full_like(lp, entropy)})
        value = loss(lp, old, adv, action_mask=mask, **info)[0]
        # OpenRLHF's loss: the micro-batch's token sum over (step tokens / gas), dp_size 1; the integral here is
        # the one before this call (alpha uses it), continued by the loss's own state
        state = {"entropic": {"integral": before, "alpha": 0.0, "updates": 0}}
        ref, _ = stablerl.compute_policy_loss(
            "entropic", log_prob=lp, old_log_prob=old, advantages=adv, response_mask=mask, entropy=torch.full_like(
                lp, entropy), target_entropy=target, ctx=stablerl.Context(token_count=info["batch_num_tokens"],
                                                                          row_count=8.0, state=state))
        torch.testing.assert_close(value, ref, rtol=1e-12, atol=0)
        before = loss.last_metrics["entropic/integral"]
    assert before == pytest.approx(0.5 * (entropies[0] - target) + 0.5 * (entropies[1] - target), rel=1e-6)  # a float32 metric


def test_what_openrlhf_can_and_cannot_feed():
    kind = stablerl.POLICY_LOSS
    for name in ("steer", "entropic"):
        assert adapter.resolve(kind, name) == name
        assert name in adapter.openrlhf_choices(kind)
        lines = frameworks.config_lines(stablerl.get_spec(kind, name))["openrlhf"]
        assert f"  --actor.policy_loss_type {name}" in lines
    assert frameworks.get_framework("openrlhf").feedable[kind] == {"rollout_log_prob", "entropy", "token_ids", "scores",
                                                                   "index", "old_entropy", "versions", "policy_version",
                                                                   "sampling_mask"}
    # prompt groups through the replay buffer (test_openrlhf_group_losses); erc: the old-log-prob pass's entropy
    # (test_openrlhf_old_entropy); a3po: one weight version per batch (above)
    for name in ("pacs", "gvpo", "gtpo", "erc", "turn_ppo", "a3po"):  # turn_ppo: turns are the action mask's runs
        assert adapter.resolve(kind, name) == name and name in adapter.openrlhf_choices(kind)
    for name, reason in (("rspo", "no router log-probs"), ("capo", "not the last hidden states")):
        with pytest.raises(stablerl.MissingInputError, match=reason):
            adapter.resolve(kind, name)
        assert name not in adapter.openrlhf_choices(kind)


def test_delta_l_and_rollout_corrections_by_stablerl_params():
    """--actor.stablerl_params loss_agg_mode=delta_l / rollout_correction=tis reach compute_policy_loss; with a
    stablerl correction OpenRLHF's own IS weights are not applied on top; without rollout log-probs: refused."""
    from orlhf_helpers import loss_batch

    from stablerl.adapters.openrlhf import StablePolicyLoss
    from stablerl.api import compute_policy_loss

    b = loss_batch()
    common = dict(log_prob=b.new, old_log_prob=b.old, advantages=b.adv, response_mask=b.mask)
    n_tokens = b.mask.sum().double()

    def run(loss, **kw):
        return loss(b.new, b.old, b.adv, action_mask=b.mask, dp_size=1, batch_num_tokens=n_tokens, **kw)[0]

    loss = StablePolicyLoss(policy_loss_type="vanilla", clip_to_params=False,  # the paper's clip, as the wrapper
                            stablerl_params={"loss_agg_mode": "delta_l", "loss_agg_params": {"alpha": 0.5}})
    ref, _ = compute_policy_loss("vanilla", **common, loss_agg_mode="delta_l", loss_agg_params={"alpha": 0.5},
                                 ctx=stablerl.Context(token_count=n_tokens))
    token_mean, _ = compute_policy_loss("vanilla", **common, ctx=stablerl.Context(token_count=n_tokens))
    torch.testing.assert_close(run(loss), ref, rtol=1e-6, atol=0)
    assert abs(float(ref) - float(token_mean)) > 1e-4  # the aggregation matters

    loss = StablePolicyLoss(policy_loss_type="vanilla", is_correction_level="token", clip_to_params=False,
                            stablerl_params={"rollout_correction": "tis", "rollout_correction_params": {"threshold": 1.5}})
    ref, _ = compute_policy_loss("vanilla", **common, rollout_log_prob=b.rollout, rollout_correction="tis",
                                 rollout_correction_params={"threshold": 1.5}, ctx=stablerl.Context(token_count=n_tokens))
    torch.testing.assert_close(run(loss, rollout_log_probs=b.rollout), ref, rtol=1e-6, atol=0)
    with pytest.raises(stablerl.MissingInputError, match=r"rollout_correction='tis' needs rollout log-probs: set "
                                                         r"--algo.advantage.is_correction_level"):
        StablePolicyLoss(policy_loss_type="vanilla", stablerl_params={"rollout_correction": "tis"})
    with pytest.raises(stablerl.UnknownNameError, match=r"'tiss'.*did you mean 'tis'"):
        StablePolicyLoss(policy_loss_type="vanilla", is_correction_level="token",
                         stablerl_params={"rollout_correction": "tiss"})
    with pytest.raises(stablerl.StableRLError, match=r"loss_agg_mode.*'delta_ll'"):
        Selection(policy_loss="vanilla", policy_loss_params={"loss_agg_mode": "delta_ll"}).validate()


# ----------------------------------------------------------------------------- top_entropy_quantile (issue 16)


@pytest.mark.parametrize("packing", [False, True])
def test_top_entropy_quantile_by_stablerl_params(monkeypatch, packing):
    """--actor.stablerl_params '{"top_entropy_quantile": 0.25}' on vanilla (which declares no entropy): the
    adapter asks OpenRLHF's training forward for the entropy, and the loss is vanilla's with every token's loss
    times TRL's top-25% entropy mask, over OpenRLHF's own denominator, through the real training_step."""
    from stablerl.api import compute_policy_loss as real
    from stablerl.ops import high_entropy_mask

    trainer, model = _trainer(monkeypatch, "vanilla", packing, params={"top_entropy_quantile": 0.25})
    assert trainer.actor_loss_fn.fed_inputs == {"entropy"}
    assert trainer.actor_loss_fn.call_options == {"top_entropy_quantile": 0.25}
    batch, _ = _batch(packing)
    calls = []

    def spy(name, **kwargs):
        calls.append(dict(kwargs))
        loss, metrics = real(name, **kwargs)
        calls[-1]["__loss__"] = loss.detach()
        return loss, metrics

    monkeypatch.setattr(stablerl, "compute_policy_loss", spy)
    _step(trainer, batch)
    assert len(calls) == 1 and calls[0]["top_entropy_quantile"] == 0.25
    mask = batch.action_mask.bool()
    fed = calls[0]["entropy"]
    expected = _reference_entropy(model, batch)
    torch.testing.assert_close(fed.double()[mask], expected[mask], rtol=1e-5, atol=1e-5)
    kw = {k: v for k, v in calls[0].items() if not k.startswith("__") and k not in ("entropy", "top_entropy_quantile")}
    assert kw.pop("is_weights") is None  # no OpenRLHF IS correction here
    keep = high_entropy_mask(fed, mask, 0.25)
    assert 0 < int(keep.sum()) < int(mask.sum())
    weighted, _ = real("vanilla", is_weights=keep.to(fed.dtype), **kw)
    torch.testing.assert_close(calls[0]["__loss__"], weighted.detach(), rtol=1e-6, atol=1e-7)
    unmasked, _ = real("vanilla", **kw)
    assert abs(float(unmasked) - float(weighted)) > 1e-6


def test_top_entropy_quantile_bad_value_is_refused_at_construction(monkeypatch):
    with pytest.raises(stablerl.StableRLError, match=r"top_entropy_quantile must be in \(0, 1\]"):
        _trainer(monkeypatch, "vanilla", False, params={"top_entropy_quantile": 0.0})
