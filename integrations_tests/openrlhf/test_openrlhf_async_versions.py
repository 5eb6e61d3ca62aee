"""Policy versions in OpenRLHF 0.11.2's asynchronous trainer (``--train.async_enable``, adapters/openrlhf/_versions.py):
the adapter's patches of the real ``SamplesGenerator._generate_vllm`` (generator actor) and
``BasePPOTrainer.train_step`` / ``broadcast_to_vllm`` (training actor), driven in one process in the order
OpenRLHF's queue of size 1 runs them (the generator one batch ahead), with a local stand-in of the named Ray actor
that counts the weight syncs (the real one runs in test_openrlhf_e2e.py). Ray calls and the model actors are
stand-ins; the stamps then go through OpenRLHF's replay-buffer split / re-batch to the loss's inputs."""

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (nox -s openrlhf installs it)")

from types import SimpleNamespace

import torch

import stablerl.adapters.openrlhf as adapter
from orlhf_helpers import make_args
from stablerl.adapters.openrlhf import Selection
from stablerl.adapters.openrlhf import _versions
from stablerl.params import MissingInputError

N = 2  # samples per prompt
PROMPTS = 2  # per batch


class LocalCount:
    """The weight-sync count in this process (the stand-in of WeightSyncCounter's named Ray actor)."""

    def __init__(self):
        self.value = 0

    def current(self):
        return self.value

    def advance(self):
        self.value += 1
        return self.value


class ActorGroup:
    """The policy actors' group: records the experiences appended and the broadcasts."""

    def __init__(self):
        self.appended, self.broadcasts = [], 0

    def async_run_method_batch(self, method_name, experience):
        assert method_name == "append"
        self.appended.append(experience)
        return []

    def async_run_method(self, method_name, **kwargs):
        assert method_name == "broadcast_to_vllm"
        self.broadcasts += 1
        return []


def _response(prompt, label, k):
    tokens = [3, 4, 5, 6 + k, 7]
    return {"observation_tokens": tokens, "action_ranges": [(3, 5)], "reward": float(k), "scores": float(k),
            "rollout_log_probs": [0.0] + [-0.5] * 4, "prompt": prompt, "label": label}


def _setup(monkeypatch, async_enable=True, loss="a3po"):
    import openrlhf.trainer.ppo_trainer as ppo_trainer
    import openrlhf.trainer.ppo_utils.samples_generator as samples_generator
    from openrlhf.trainer.ppo_utils.experience import Experience

    adapter.instrument(now=True)
    count = LocalCount()
    monkeypatch.setattr(_versions, "_counter", count)
    args = make_args(policy_loss_type=loss, is_level="token", stablerl=Selection(policy_loss=loss))
    args.train.async_enable = async_enable
    args.critic = SimpleNamespace(freezing_steps=-1)
    args.vllm.enable_sleep = False
    # the generator actor's SamplesGenerator: a "vLLM engine" answering each prompt with N responses
    monkeypatch.setattr(samples_generator, "ray", SimpleNamespace(wait=lambda refs, num_returns, timeout: (refs[:1],
                                                                                                        refs[1:]),
                                                                  get=lambda ref: ref))
    generator = samples_generator.SamplesGenerator.__new__(samples_generator.SamplesGenerator)
    generator.args, generator.strategy = args, SimpleNamespace(args=args)
    generator._dispatch_prompts_to_vllm = lambda prompts, labels, images=None, **kw: [
        [_response(p, lab, k) for k in range(N)] for p, lab in zip(prompts, labels)]
    # the training actor's BasePPOTrainer: OpenRLHF's train_step / broadcast_to_vllm with stand-in model actors
    monkeypatch.setattr(ppo_trainer, "ray", SimpleNamespace(get=lambda refs: refs))
    trainer = ppo_trainer.BasePPOTrainer.__new__(ppo_trainer.BasePPOTrainer)
    trainer.args, trainer.strategy = args, SimpleNamespace(args=args)
    trainer.experience_maker = SimpleNamespace(
        make_experience_batch=lambda samples: [Experience.concat_experiences(samples, 0)])
    trainer.tokenizer = SimpleNamespace(decode=lambda seq, skip_special_tokens=True: ["a sample"])
    trainer.actor_model_group, trainer.critic_model_group, trainer.vllm_engines = ActorGroup(), None, []
    trainer.ppo_train = lambda global_step: {}
    return SimpleNamespace(count=count, generator=generator, trainer=trainer, args=args)


def _generate(run, batch):
    prompts = [(None, [f"copy {batch}{i} :" for i in range(PROMPTS)], [str(i) for i in range(PROMPTS)],
                [None] * PROMPTS)]
    experiences, consumed, _ = run.generator._generate_vllm(dataloader_iter=iter(prompts), num_prompts=PROMPTS,
                                                            dynamic_filtering=False)
    assert consumed == PROMPTS and len(experiences) == PROMPTS * N
    return experiences


def _loss_inputs(experience, async_enable=True):
    """What training_step's loss gets: the experience through OpenRLHF's replay-buffer split and re-batch."""
    from openrlhf.trainer.ppo_utils.experience import make_experience_batch, split_experience_batch

    rows = split_experience_batch(experience)
    batch = make_experience_batch(rows[::-1])  # a shuffle
    return _versions.take_stamps(batch, True, async_enable), batch


def test_the_generator_runs_a_version_ahead_and_the_loss_gets_each_rows_stamp(monkeypatch):
    """Queue of size 1: batch A generated before any sync, B while A trains (still no sync), C after A's sync.
    A trains at version 1 (lag 0: alpha 0), B at 2 (lag 1: alpha 1/2), C at 3 (lag 1)."""
    run = _setup(monkeypatch)
    a, b = _generate(run, 0), _generate(run, 1)
    assert all(int(e.info[_versions.VERSION_KEY]) == 0 for e in a + b)
    statuses = []
    status, step = run.trainer.train_step(a, 0)
    statuses.append(status)
    assert run.count.value == 1 and run.trainer.actor_model_group.broadcasts == 1 and step == 1
    c = _generate(run, 2)
    assert all(int(e.info[_versions.VERSION_KEY]) == 1 for e in c)
    for batch in (b, c):
        status, step = run.trainer.train_step(batch, step)
        statuses.append(status)
    assert run.count.value == 3
    assert [s["stablerl/policy_version"] for s in statuses] == [1.0, 2.0, 3.0]
    assert [s["stablerl/version_lag_mean"] for s in statuses] == [0.0, 1.0, 1.0]
    assert [s["stablerl/version_lag_max"] for s in statuses] == [0.0, 1.0, 1.0]
    for (experience,), policy, generated in zip(run.trainer.actor_model_group.appended, (1, 2, 3), (0, 0, 1)):
        fed, batch = _loss_inputs(experience)
        mask = batch.action_mask.bool()
        assert fed["policy_version"] == policy
        assert torch.equal(fed["versions"], torch.where(mask, generated, -1))
        assert not any(k.startswith("stablerl_") for k in batch.info)  # taken out: never logged


def test_a_batch_mixing_versions_keeps_each_samples_stamp(monkeypatch):
    """Samples the generator generated at different syncs (its buffer under --rollout.vllm_generate_batch_size) keep
    their own stamps in one round."""
    run = _setup(monkeypatch)
    old = _generate(run, 0)
    run.trainer.broadcast_to_vllm()  # e.g. the sync at resume
    new = _generate(run, 1)
    status, _ = run.trainer.train_step(old[:2] + new[:2], 0)
    assert status["stablerl/policy_version"] == 2.0
    assert status["stablerl/version_lag_mean"] == 0.5 and status["stablerl/version_lag_max"] == 1.0
    fed, batch = _loss_inputs(run.trainer.actor_model_group.appended[0][0])
    rows = torch.tensor([1, 1, 0, 0])  # reversed by the shuffle
    assert fed["policy_version"] == 2
    assert torch.equal(fed["versions"], torch.where(batch.action_mask.bool(), rows.unsqueeze(1), -1))


def test_a_sync_without_an_actor_update_is_no_new_version(monkeypatch):
    """--critic.freezing_steps: OpenRLHF trains only the critic in the first rounds but still syncs the (unchanged)
    weights; those syncs are not counted."""
    run = _setup(monkeypatch)
    run.args.critic.freezing_steps = 1
    for step in (0, 1, 2):
        run.trainer.train_step(_generate(run, step), step)
    assert run.trainer.actor_model_group.broadcasts == 3 and run.count.value == 1  # only round 2 updated the actor


@pytest.mark.parametrize("async_enable, loss", [(False, "a3po"), (True, "decoupled_ppo"), (True, None)])
def test_nothing_is_stamped_or_counted_unless_an_async_loss_reads_versions(monkeypatch, async_enable, loss):
    run = _setup(monkeypatch, async_enable=async_enable, loss=loss)
    batch = _generate(run, 0)
    status, _ = run.trainer.train_step(batch, 0)
    assert run.count.value == 0 and not any(k.startswith("stablerl") for k in status)
    assert not any(k.startswith("stablerl_") for e in batch for k in e.info)


def test_a_sample_without_a_stamp_stops_the_round(monkeypatch):
    """A generator without the stablerl patch (setup hook missing there): the round raises before training."""
    run = _setup(monkeypatch)
    batch = _generate(run, 0)
    del batch[1].info[_versions.VERSION_KEY]
    with pytest.raises(MissingInputError, match=r"1 of 4 rollout samples carry no policy-version stamp "
                                                 r"\(info\['stablerl_version'\]\)"):
        run.trainer.train_step(batch, 0)
    assert run.trainer.actor_model_group.appended == []


def test_the_weight_sync_count_is_one_named_actor_per_job_reserving_no_cpu():
    """stablerl.policy_versions.WeightSyncCounter on a real local Ray with one CPU: a task (holding that CPU) finds
    the count the driver created by name and advances it, so the actor reserves no CPU; a handle created later sees
    every sync."""
    import ray

    from stablerl.policy_versions import WeightSyncCounter

    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        driver = WeightSyncCounter("stablerl_test_syncs")
        assert driver.current() == 0 and driver.advance() == 1 and driver.advance() == 2

        @ray.remote(num_cpus=1)
        def sync_elsewhere():
            counter = WeightSyncCounter("stablerl_test_syncs")
            return counter.current(), counter.advance()

        assert ray.get(sync_elsewhere.remote(), timeout=120) == (2, 3)
        assert driver.current() == 3 and WeightSyncCounter("stablerl_test_syncs").current() == 3
        assert WeightSyncCounter("stablerl_other_syncs").current() == 0  # another name, another count
    finally:
        ray.shutdown()
