"""Losses that take prompt groups (pacs, gvpo, gtpo) in OpenRLHF 0.11.2: the adapter carries the groups
from the advantage step through the real NaiveReplayBuffer (split / unpad / re-batch) and ppo_train's
DataLoader into ActorPPOTrainer.training_step, whole per micro-batch; the loss equals the Python API's
on the same rows with the true groups. Tiny dense Qwen3 on CPU, DeepSpeed replaced by a plain step."""

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (nox -s openrlhf installs it)")

from types import SimpleNamespace

import torch

import stablerl
import stablerl.adapters.openrlhf as adapter
from orlhf_helpers import make_args, make_maker
from stablerl import frameworks
from stablerl.adapters.openrlhf import Selection
from stablerl.adapters.openrlhf._groups import GROUP_KEY, GROUP_SIZE_KEY
from stablerl.params import StableRLError
from test_openrlhf_loss_inputs import VOCAB, _spy, _trainer

N = 3  # responses per prompt
PROMPTS = 4
ROLLOUT_MICRO = 6  # rows per experience (two whole groups)


def _experiences(seed=0):
    """Two experiences of six rows each (rollout order = prompt order, index = row position), 0/1 rewards mixed
    within every group."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    g = torch.Generator().manual_seed(seed)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    out = []
    for start in range(0, PROMPTS * N, ROLLOUT_MICRO):
        B, T, P = ROLLOUT_MICRO, 10, 3
        lengths = torch.randint(P + 2, T + 1, (B,), generator=g)
        attention = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
        seqs = torch.randint(2, VOCAB, (B, T), generator=g) * attention
        action = torch.zeros(B, T - 1, dtype=torch.bool)
        for row, n in enumerate(lengths.tolist()):
            action[row, P - 1:n - 1] = True
        out.append(Experience(
            sequences=seqs, attention_mask=attention, action_mask=action,
            action_log_probs=(-torch.rand(B, T - 1, generator=g) - 0.5) * action, kl=torch.zeros(B, T - 1),
            rewards=rewards[start:start + B].clone(), response_length=(lengths - P).float(),
            truncated=torch.zeros(B, dtype=torch.bool), total_length=lengths.float(),
            index=list(range(start, start + B)), info={},
        ))
    return out


def _buffer(monkeypatch, experiences, micro=ROLLOUT_MICRO):
    from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # only names the target device
    buffer = NaiveReplayBuffer(micro, cpu_offload=False)
    for e in experiences:
        buffer.append(e)
    return buffer


def _advantages(loss, experiences):
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    args = make_args(estimator="group_norm", n_samples=N, stablerl=Selection(policy_loss=loss))
    return RemoteExperienceMaker.compute_advantages_and_returns(make_maker(args, "group_norm"), experiences)


#: the tiny near-uniform model's entropy (~4 nats) is above GTPO's 0.7 filter, which would zero every advantage
PARAMS = {"gtpo": {"ent_threshold": 10.0}}


def _run(monkeypatch, loss, seed=0, native_dataloader=False):
    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    trainer, _ = _trainer(monkeypatch, loss, packing=False, params=PARAMS.get(loss))
    trainer.args.rollout.n_samples_per_prompt = N
    experiences = _advantages(loss, _experiences(seed))
    # the rows as the advantage step left them, before the buffer: the reference's inputs
    originals = {_key(e.sequences[i], e.attention_mask[i]): (
        e.action_log_probs[i].clone(), e.advantages[i].clone(), e.action_mask[i].clone(), e.index[i] // N,
        e.rewards[i].clone())
        for e in experiences for i in range(len(e.sequences))}
    buffer = _buffer(monkeypatch, experiences)
    loader_cls = ppo_actor.DataLoader.__wrapped__ if native_dataloader else ppo_actor.DataLoader
    torch.manual_seed(seed)
    loader = loader_cls(buffer, batch_size=buffer.sample_batch_size, shuffle=True, drop_last=True,
                        pin_memory=False, collate_fn=buffer.collate_fn)
    calls = _spy(monkeypatch)
    statuses, batches = [], []
    for batch in loader:
        batches.append([_key(s, m) for s, m in zip(batch.sequences, batch.attention_mask)])
        n_tokens = float(batch.action_mask.sum())
        statuses.append(trainer.training_step(batch, 0.0, 0, dict(dp_size=1, batch_num_tokens=n_tokens,
                                                                     global_batch_size=float(len(batch.sequences)))))
    return calls, statuses, originals, batches


def _key(sequence, attention_mask) -> tuple:
    """A row's identity after the buffer's shuffle: its tokens (random, so distinct)."""
    return tuple(sequence[attention_mask.bool()].tolist())


@pytest.mark.parametrize("loss", ["pacs", "gvpo", "gtpo", "rebel"])
def test_group_loss_sees_whole_groups_and_equals_the_python_api(monkeypatch, loss):
    assert frameworks.reach(frameworks.get_framework("openrlhf"), stablerl.get_spec(stablerl.POLICY_LOSS, loss))[0] \
        == "partial"
    calls, statuses, originals, batches = _run(monkeypatch, loss)
    assert len(calls) == PROMPTS * N // ROLLOUT_MICRO
    seen = []
    for call, keys in zip(calls, batches):
        index = call["index"]
        groups, counts = torch.unique(index, return_counts=True)
        assert counts.tolist() == [N] * len(groups)  # whole groups in every loss call
        seen += groups.tolist()
        # each row's group is its own prompt's
        truth = torch.tensor([originals[k][3] for k in keys])
        assert torch.equal(index.cpu(), truth)
        # the single-process Python API on the same rows, taken from before the buffer, sorted by group
        order = torch.argsort(truth, stable=True)
        width = call["log_prob"].shape[1]
        pick = [originals[keys[i]] for i in order.tolist()]
        ref_kwargs = dict(
            log_prob=call["log_prob"][order].detach(),
            old_log_prob=torch.stack([o[0][:width] for o in pick]).to(call["log_prob"].dtype),
            advantages=torch.stack([o[1][:width] for o in pick]).to(call["log_prob"].dtype),
            response_mask=torch.stack([o[2][:width] for o in pick]),
            index=truth[order], loss_agg_mode=call["loss_agg_mode"], ctx=call["ctx"],
        )
        if "scores" in call:
            ref_kwargs["scores"] = torch.stack([o[4] for o in pick])
        for extra in ("entropy", "token_ids"):
            if extra in call:
                ref_kwargs[extra] = call[extra][order]
        from stablerl.api import compute_policy_loss

        ref, _ = compute_policy_loss(loss, **ref_kwargs, **PARAMS.get(loss, {}))
        torch.testing.assert_close(call["__loss__"], ref.detach(), rtol=1e-6, atol=1e-7)
        assert float(ref.detach().abs()) > 0
    assert sorted(seen) == list(range(PROMPTS))  # every group once per epoch
    for status in statuses:  # the carried keys never reach OpenRLHF's metrics
        assert GROUP_KEY not in status["metrics"] and GROUP_SIZE_KEY not in status["metrics"]


def test_openrlhfs_own_row_shuffle_is_refused_by_name(monkeypatch):
    """Without the adapter's DataLoader, OpenRLHF's row shuffle splits groups: the step says so."""
    with pytest.raises(StableRLError, match=r"prompt groups \[.*\] are split across micro-batches"):
        _run(monkeypatch, "pacs", native_dataloader=True)


def test_micro_batch_not_a_multiple_of_the_group_is_refused(monkeypatch):
    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    adapter.instrument(now=True)
    buffer = _buffer(monkeypatch, _advantages("pacs", _experiences()), micro=4)
    loader = ppo_actor.DataLoader(buffer, batch_size=4, shuffle=True, drop_last=True, collate_fn=buffer.collate_fn)
    with pytest.raises(StableRLError, match=r"--train.micro_batch_size=4 is not a multiple of "
                                            r"--rollout.n_samples_per_prompt=3"):
        next(iter(loader))


def test_group_split_across_ranks_is_refused(monkeypatch):
    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    adapter.instrument(now=True)
    experiences = _advantages("pacs", _experiences())
    first = experiences[0]
    keep = slice(0, 4)  # rows 0..3: group 1 has one of its three responses on this rank
    for name in ("sequences", "attention_mask", "action_mask", "action_log_probs", "advantages", "returns",
                 "rewards", "response_length", "truncated", "total_length"):
        setattr(first, name, getattr(first, name)[keep])
    first.index = first.index[keep]
    first.info = {k: v[keep] for k, v in first.info.items()}
    buffer = _buffer(monkeypatch, [first])
    loader = ppo_actor.DataLoader(buffer, batch_size=3, shuffle=False, drop_last=True, collate_fn=buffer.collate_fn)
    with pytest.raises(StableRLError, match=r"prompt group 1 has 1 of its 3 responses.*--rollout.micro_batch_size"):
        next(iter(loader))


def test_other_losses_keep_openrlhfs_rows_and_dataloader(monkeypatch):
    """No group keys for a loss without index (steer): OpenRLHF's own DataLoader and row shuffle."""
    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    adapter.instrument(now=True)
    experiences = _advantages("steer", _experiences())
    assert all(GROUP_KEY not in e.info for e in experiences)
    buffer = _buffer(monkeypatch, experiences)
    loader = ppo_actor.DataLoader(buffer, batch_size=6, shuffle=True, drop_last=True, collate_fn=buffer.collate_fn)
    assert loader.batch_sampler.__class__.__name__ == "BatchSampler"


def test_batching_that_cannot_keep_groups_is_refused_before_ray():
    from stablerl.adapters.openrlhf.train_ppo_ray import check_group_batching

    args = SimpleNamespace(rollout=SimpleNamespace(n_samples_per_prompt=4, micro_batch_size=8),
                           train=SimpleNamespace(dynamic_batch_enable=False, micro_batch_size=8))
    check_group_batching("pacs", args)  # multiples of the group: fine
    args.train.micro_batch_size, args.train.dynamic_batch_enable = 6, True
    with pytest.raises(StableRLError, match=r"'pacs' takes prompt groups.*dynamic_batch_enable partitions rows by "
                                            r"length.*--train.micro_batch_size=6 is not a multiple"):
        check_group_batching("pacs", args)
