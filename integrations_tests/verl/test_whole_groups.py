"""Whole prompt groups for the stablerl losses that take ``index`` (gtpo, pacs, gvpo, rebel) in verl 0.9.1
(adapters/verl/_groups.py): the start-up refusal of verl settings that split groups (at ``validate_config``, each
key named), the group-aware ``RayPPOTrainer._balance_batch`` on a real ``DataProto``, and the refusal of a split
group at verl's loss call site (``ppo_loss``). The whole run is in test_main_ppo_e2e.py (gtpo at verl's default balance_batch)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

import stablerl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_declared_inputs import _batch, _config, _through_verl  # noqa: E402


def _full_config(loss_mode="pacs", **over):
    """The keys of verl's full config that decide whether prompt groups stay whole (verl's defaults but a micro-batch
    and the legacy trainer unless ``over`` says otherwise)."""
    from omegaconf import OmegaConf

    cfg = {
        "trainer": {"use_v1": False, "n_gpus_per_node": 2, "nnodes": 1, "balance_batch": True},
        "data": {"train_batch_size": 8},
        "actor_rollout_ref": {
            "rollout": {"n": 4},
            "actor": {"strategy": "fsdp", "ulysses_sequence_parallel_size": 1, "use_dynamic_bsz": False,
                      "shuffle": False, "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 8,
                      "policy_loss": {"loss_mode": loss_mode}},
        },
    }
    for key, value in over.items():
        node = cfg
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    return OmegaConf.create(cfg)


@pytest.fixture
def groups(adapter):
    from stablerl.adapters.verl import _groups

    return _groups


def test_group_losses_are_partial_in_verl_with_the_keys(adapter):
    from stablerl.frameworks import get_framework, reach, reach_conditions

    verl = get_framework("verl")
    for name in ("gtpo", "pacs", "gvpo", "rebel"):
        spec = stablerl.get_spec("policy_loss", name)
        assert reach(verl, spec)[0] == "partial", name
        why = " ".join(reach_conditions(verl, spec))
        assert "index: the legacy trainer (trainer.use_v1=false)" in why, why
        assert "ppo_micro_batch_size_per_gpu a multiple of" in why, why


def test_settings_that_keep_groups_whole_pass_and_other_losses_are_not_checked(groups):
    assert groups.check_config(_full_config()) == "pacs"
    assert groups.check_config(_full_config(**{"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4})) == "pacs"
    # a loss without index (and verl's own) is not concerned, whatever the batching
    bad = {"trainer.use_v1": True, "actor_rollout_ref.actor.use_dynamic_bsz": True}
    assert groups.check_config(_full_config("m2po", **bad)) is None
    assert groups.check_config(_full_config("vanilla", **bad)) is None


def test_verl_defaults_are_refused_with_every_key_to_change(groups):
    # verl's defaults: the v1 trainer, and here a micro-batch that is not a multiple of rollout.n
    with pytest.raises(stablerl.StableRLError) as e:
        groups.check_config(_full_config("gtpo", **{"trainer.use_v1": True,
                                                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 6}))
    msg = str(e.value)
    assert "stablerl policy loss 'gtpo' takes prompt groups (index)" in msg
    assert "trainer.use_v1=true" in msg and "set trainer.use_v1=false" in msg
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6 is not a multiple of actor_rollout_ref.rollout.n=4" in msg


@pytest.mark.parametrize("over, says", [
    ({"actor_rollout_ref.actor.use_dynamic_bsz": True}, "actor_rollout_ref.actor.use_dynamic_bsz=true cuts micro-batches"),
    ({"actor_rollout_ref.actor.shuffle": True}, "actor_rollout_ref.actor.shuffle=true shuffles single rows"),
    ({"data.train_batch_size": 7}, "data.train_batch_size=7 prompts is not a multiple of the 2 data-parallel ranks"),
    ({"actor_rollout_ref.actor.ppo_mini_batch_size": 3},
     "actor_rollout_ref.actor.ppo_mini_batch_size=3 prompts is not a multiple of the 2 data-parallel ranks"),
    ({"actor_rollout_ref.rollout.n": 1, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1},
     "actor_rollout_ref.rollout.n=1: a prompt group needs at least 2"),
], ids=["dynamic_bsz", "shuffle", "train_batch", "mini_batch", "n1"])
def test_each_setting_that_splits_groups_is_refused_naming_its_key(groups, over, says):
    with pytest.raises(stablerl.StableRLError, match="takes prompt groups") as e:
        groups.check_config(_full_config("rebel", **over))
    assert says in str(e.value)


def test_the_refusal_runs_where_verl_validates_its_config(groups):
    """verl's main_ppo calls ``verl.utils.config.validate_config`` in the driver, before Ray starts: the adapter's wrap
    of it refuses there (and after verl's own checks)."""
    import verl.utils.config as verl_config

    assert getattr(verl_config.validate_config, groups.LEDGER.mark, False)
    seen = []
    wrapped = groups._wrap_validate_config(lambda config, *a, **k: seen.append(config))
    cfg = _full_config("gvpo", **{"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2})
    with pytest.raises(stablerl.StableRLError, match="ppo_micro_batch_size_per_gpu=2 is not a multiple"):
        wrapped(cfg, use_reference_policy=False, use_critic=False)
    assert seen == []  # refused before verl's own validation
    ok = _full_config("gvpo")
    wrapped(ok, use_reference_policy=False, use_critic=False)
    assert seen == [ok]


def _trainer(groups, cfg, dp_size):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    calls = []

    class Trainer:
        config = cfg
        actor_rollout_wg = None

        def _get_dp_size(self, wg, role):
            return dp_size

    Trainer._balance_batch = groups._wrap_balance_batch(
        lambda self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False: calls.append(batch))
    assert getattr(RayPPOTrainer._balance_batch, "__wrapped__", None) is not None  # the adapter's wrap is on verl's
    return Trainer(), calls


def _data_proto(uids, lengths):
    from verl import DataProto

    T = max(lengths)
    mask = (torch.arange(T).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    return DataProto.from_dict(tensors={"attention_mask": mask, "row": torch.arange(len(uids))},
                               non_tensors={"uid": np.array(uids, dtype=object)})


def test_balance_batch_deals_out_whole_groups_over_the_dp_ranks(groups):
    # 4 prompts x 4 responses, one long group: verl's row balancing would split groups over the 2 ranks
    uids = [u for u in "abcd" for _ in range(4)]
    lengths = [9, 9, 9, 9, 2, 3, 2, 3, 4, 4, 4, 4, 1, 2, 1, 2]
    trainer, calls = _trainer(groups, _full_config(), dp_size=2)
    batch, metrics = _data_proto(uids, lengths), {}
    trainer._balance_batch(batch, metrics=metrics)
    assert calls == []  # verl's row balancing did not run
    rows = batch.batch["row"].tolist()
    order = [uids[i] for i in rows]
    for rank in (order[:8], order[8:]):  # verl hands each rank an equal contiguous chunk
        assert all(rank.count(u) == 4 for u in set(rank))  # whole groups
        assert all(rank[i] == rank[i + 1] for i in (0, 1, 2, 4, 5, 6))  # each group contiguous
    assert {frozenset(order[:8]), frozenset(order[8:])} == {frozenset("ad"), frozenset("bc")}  # balanced tokens
    assert list(batch.non_tensor_batch["uid"]) == order  # the reorder moved every field
    assert "global_seqlen/min" in metrics and "global_seqlen/max" in metrics


def test_balance_batch_is_verls_own_for_other_losses_and_refuses_an_uneven_deal(groups):
    trainer, calls = _trainer(groups, _full_config("m2po"), dp_size=2)
    batch = _data_proto(list("aabb"), [1, 2, 3, 4])
    trainer._balance_batch(batch, metrics={})
    assert calls == [batch]
    trainer, calls = _trainer(groups, _full_config(), dp_size=2)
    with pytest.raises(stablerl.StableRLError, match=r"3 prompt groups .* over 2 data-parallel ranks "
                       r"\(trainer.balance_batch=true\)"):
        trainer._balance_batch(_data_proto(list("aabbcc"), [1] * 6), metrics={})


@pytest.fixture
def declared(adapter):
    from stablerl.adapters.verl import _inputs

    _inputs.instrument()
    _inputs.verl_adapter().state.loss.clear()
    yield _inputs
    _inputs.verl_adapter().state.loss.clear()


def test_a_loss_call_with_whole_groups_logs_their_number(adapter, declared):
    data, model_output, leaves, _ = _batch(seed=3, labels=True)  # two groups of 3 (rollout_n=3)
    _, _, metrics = _through_verl(_config(adapter, "pacs"), data, model_output, leaves)
    assert metrics["actor/stablerl/prompt_groups"] == 2.0


@pytest.mark.parametrize("name", ["pacs", "gtpo", "gvpo", "rebel"])
def test_a_split_group_is_refused_at_the_loss_call(adapter, declared, name):
    # rollout_n=4 but each uid has 3 rows here: verl split the groups somewhere before the loss
    data, model_output, leaves, _ = _batch(seed=3, labels=True)
    with pytest.raises(stablerl.StableRLError, match=rf"stablerl loss '{name}': prompt groups \[0, 1\] are split "
                       r"across micro-batches.*holds 6 rows; verl keeps groups whole with the legacy trainer"):
        _through_verl(_config(adapter, name, rollout_n=4), data, model_output, leaves)
    assert declared.current() is None
    # a loss that takes no groups is not checked
    _through_verl(_config(adapter, "steer", rollout_n=4, clip_ratio_low=0.2), data, model_output, leaves)
