"""verl's ``ray_trainer.compute_advantage`` wrapped by the adapter: declared estimator inputs from the
batch, ``+algorithm.stablerl_reward_shaper`` / ``stablerl_batch_filter``, clear errors, unpatch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf, open_dict

import stablerl


def _algorithm(**extra):
    """The ``algorithm`` DictConfig as the trainer passes it (struct; ``+algorithm.k=v`` opens it)."""
    conf = OmegaConf.create(
        {"_target_": "verl.trainer.config.AlgoConfig", "gamma": 1.0, "lam": 1.0, "adv_estimator": "grpo",
         "norm_adv_by_std_in_grpo": True, "use_kl_in_reward": False}
    )
    OmegaConf.set_struct(conf, True)
    with open_dict(conf):
        for k, v in extra.items():
            conf[k] = v
    return conf


def _data(rewards, mask, index, **tensors):
    from verl import DataProto

    return DataProto.from_dict(
        tensors={"token_level_rewards": rewards.float(), "response_mask": mask.float(), **tensors},
        non_tensors={"uid": index},
    )


def _compute(data, name, config):
    from verl.trainer.ppo.ray_trainer import compute_advantage

    return compute_advantage(data, name, config=config)


@pytest.fixture
def site(adapter):
    from stablerl.adapters.verl import _advantage

    assert _advantage.is_patched()
    _advantage.reset_state()
    yield _advantage
    _advantage.reset_state()


def _multi_turn(B=8, T=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, T + 1, (B,), generator=g)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    scores = (torch.rand(B, generator=g) > 0.5).float()
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = scores
    entropys = torch.rand(B, T, generator=g) * 2 * mask
    turn_ids = (torch.arange(T).unsqueeze(0) // 3).expand(B, T).clone() * mask.long()
    index = np.array(["p0"] * 4 + ["p1"] * 4, dtype=object)
    return rewards, mask, index, entropys, turn_ids


def test_empg_gets_entropies_and_turn_ids_from_the_batch(adapter, site):
    # registered without the batch-field opt-in: its entropy is the legacy trainer's old-log-prob pass's
    assert adapter.VERL_NAMES["advantage_estimator"].get("empg") == "empg"
    assert "empg" not in adapter.register_batch_field_estimators()
    rewards, mask, index, entropys, turn_ids = _multi_turn()
    out = _compute(_data(rewards, mask, index, entropys=entropys, turn_ids=turn_ids), "empg", _algorithm(k=2.0))
    expected, expected_ret = stablerl.compute_advantage(
        "empg", token_level_rewards=rewards, response_mask=mask, index=index, entropy=entropys, turn_ids=turn_ids,
        k=2.0,
    )
    torch.testing.assert_close(out.batch["advantages"], expected.float(), rtol=0, atol=1e-7)
    torch.testing.assert_close(out.batch["returns"], expected_ret.float(), rtol=0, atol=1e-7)
    default = _compute(_data(rewards, mask, index, entropys=entropys, turn_ids=turn_ids), "empg", _algorithm())
    assert (default.batch["advantages"] - out.batch["advantages"]).abs().max() > 1e-3  # k reached it
    # the v1 field name "entropy" works too
    alt = _compute(_data(rewards, mask, index, entropy=entropys, turn_ids=turn_ids), "empg", _algorithm(k=2.0))
    torch.testing.assert_close(alt.batch["advantages"], out.batch["advantages"], rtol=0, atol=0)


def test_batch_field_estimators_by_config_key(adapter, site, monkeypatch):
    from verl.trainer.ppo import core_algos

    for verl_name in ("gigpo", "stablerl_gigpo"):  # as in a fresh TaskRunner process
        if verl_name in core_algos.ADV_ESTIMATOR_REGISTRY:
            monkeypatch.delitem(core_algos.ADV_ESTIMATOR_REGISTRY, verl_name)
        if verl_name in adapter.VERL_NAMES["advantage_estimator"]:
            monkeypatch.delitem(adapter.VERL_NAMES["advantage_estimator"], verl_name)
    rewards, mask, index, _, _ = _multi_turn(seed=1)
    anchors, step_returns = torch.tensor([0, 1, 0, 2, 0, 0, 1, 1]), torch.linspace(0.1, 0.8, 8)
    data = _data(rewards, mask, index, anchor_ids=anchors, step_returns=step_returns)
    with pytest.raises(stablerl.StableRLError, match=r"not registered in verl.*stablerl_batch_field_estimators=true"):
        _compute(data, "gigpo", _algorithm())
    out = _compute(data, "gigpo", _algorithm(stablerl_batch_field_estimators=True))
    expected, _ = stablerl.compute_advantage(
        "gigpo", token_level_rewards=rewards, response_mask=mask, index=index, anchor_ids=anchors,
        step_returns=step_returns,
    )
    torch.testing.assert_close(out.batch["advantages"], expected.float(), rtol=0, atol=1e-6)
    assert out.batch["advantages"].abs().max() > 0.5
    assert "gigpo" in adapter.VERL_NAMES["advantage_estimator"]


def test_missing_declared_input_names_the_field(adapter, site):
    """No entropy in the batch (the v1 trainer, bypass mode): the error names the settings that give one."""
    rewards, mask, index, entropys, turn_ids = _multi_turn()
    with pytest.raises(stablerl.MissingInputError, match=r"'empg' needs 'entropy'.*legacy trainer's old-log-prob "
                       r"pass.*trainer\.use_v1=false.*bypass_mode=false"):
        _compute(_data(rewards, mask, index, turn_ids=turn_ids), "empg", _algorithm())
    # turn_ids is optional: without the field a step is a contiguous run of trained tokens (one per response here)
    out = _compute(_data(rewards, mask, index, entropys=entropys), "empg", _algorithm())
    expected, _ = stablerl.compute_advantage("empg", token_level_rewards=rewards, response_mask=mask, index=index,
                                             entropy=entropys)
    torch.testing.assert_close(out.batch["advantages"], expected.float(), rtol=0, atol=1e-7)


def test_redit_shaping_is_seeded_and_changes_advantages(adapter, site, rewards_batch):
    from verl.trainer.ppo import core_algos

    rewards, mask, index = rewards_batch(seed=2)
    rewards, mask = rewards.float(), mask.float()
    cfg = _algorithm(stablerl_reward_shaper="redit", stablerl_reward_shaper_params={"scale": 0.5}, stablerl_seed=3)
    first = _compute(_data(rewards, mask, index), "grpo", cfg)  # verl's built-in grpo, on shaped rewards
    second_step = _compute(_data(rewards, mask, index), "grpo", cfg)
    site.reset_state()  # a fresh process with the same seed
    again = _compute(_data(rewards, mask, index), "grpo", cfg)
    plain = _compute(_data(rewards, mask, index), "grpo", _algorithm())
    torch.testing.assert_close(again.batch["advantages"], first.batch["advantages"], rtol=0, atol=0)
    assert (second_step.batch["advantages"] - first.batch["advantages"]).abs().max() > 1e-3  # fresh noise per step
    assert (plain.batch["advantages"] - first.batch["advantages"]).abs().max() > 1e-2
    # shaped score = the shaper's output with the same seed, placed on the last valid token
    scores = (rewards * mask).sum(-1)
    shaped, _ = stablerl.shape_rewards(
        "redit", scores=scores, index=index, ctx=stablerl.Context(generator=torch.Generator().manual_seed(3)), scale=0.5
    )
    new = first.batch["token_level_rewards"]
    torch.testing.assert_close((new * mask).sum(-1), shaped.float(), rtol=0, atol=1e-6)
    lengths = mask.sum(-1).long()
    last = torch.zeros_like(mask, dtype=torch.bool)
    last[torch.arange(len(lengths))[lengths > 0], (lengths - 1)[lengths > 0]] = True
    assert torch.equal(new[~last], rewards[~last])
    expected, _ = core_algos.compute_grpo_outcome_advantage(new, mask, index)
    torch.testing.assert_close(first.batch["advantages"], expected, rtol=0, atol=0)
    # a stablerl estimator sees the same shaped rewards
    site.reset_state()
    qae = _compute(_data(rewards, mask, index), "qae", cfg)
    ref, _ = stablerl.compute_advantage("qae", token_level_rewards=new, response_mask=mask, index=index)
    torch.testing.assert_close(qae.batch["advantages"], ref.float(), rtol=0, atol=1e-7)


def test_dynamic_sampling_zeroes_all_equal_groups(adapter, site, rewards_batch):
    rewards, mask, index = rewards_batch(seed=4)
    cfg = _algorithm(stablerl_batch_filter="dynamic_sampling")
    plain = _compute(_data(rewards, mask, index), "qae", _algorithm())
    out = _compute(_data(rewards, mask, index), "qae", cfg)
    equal = torch.as_tensor(index == "d")  # the group with 4 equal rewards
    assert out.batch["advantages"].shape == plain.batch["advantages"].shape  # batch size unchanged
    assert out.batch["response_mask"][equal].sum() == 0 and out.batch["advantages"][equal].abs().sum() == 0
    assert out.batch["returns"][equal].abs().sum() == 0
    torch.testing.assert_close(out.batch["response_mask"][~equal], mask[~equal].float(), rtol=0, atol=0)
    torch.testing.assert_close(out.batch["advantages"][~equal], plain.batch["advantages"][~equal], rtol=0, atol=0)
    metrics = site.verl_adapter().state.metrics
    assert metrics["stablerl/filter/kept_row_frac"] == pytest.approx(8 / 12)
    assert metrics["stablerl/dynamic_sampling/num_kept_groups"] == 3  # a, b and the singleton c
    # with verl's built-in grpo too
    grpo = _compute(_data(rewards, mask, index), "grpo", cfg)
    assert grpo.batch["response_mask"][equal].sum() == 0 and grpo.batch["response_mask"][~equal].sum() > 0


def test_resampling_filter_and_bad_keys_are_refused(adapter, site, rewards_batch):
    rewards, mask, index = rewards_batch(seed=5)
    with pytest.raises(stablerl.StableRLError, match="resampling"):
        _compute(_data(rewards, mask, index), "qae", _algorithm(stablerl_batch_filter="shuffle_r1"))
    with pytest.raises(stablerl.StableRLError, match="redit"):
        _compute(_data(rewards, mask, index), "qae", _algorithm(stablerl_reward_shaper="redt"))
    with pytest.raises(stablerl.StableRLError, match="scale"):
        _compute(_data(rewards, mask, index), "qae",
                 _algorithm(stablerl_reward_shaper="redit", stablerl_reward_shaper_params={"scael": 0.1}))
    with pytest.raises(stablerl.StableRLError, match="select it on the stablerl policy-loss config"):
        _compute(_data(rewards, mask, index), "qae", _algorithm(stablerl_entropy_controller="aepo"))
    with pytest.raises(stablerl.StableRLError, match="stablerl_reward_shaper is not"):
        _compute(_data(rewards, mask, index), "qae", _algorithm(stablerl_reward_shaper_params={"scale": 0.1}))


def test_verl_estimators_without_stablerl_keys_are_untouched(adapter, site, rewards_batch):
    from verl.trainer.ppo import core_algos

    rewards, mask, index = rewards_batch(seed=6)
    out = _compute(_data(rewards, mask, index), "grpo", _algorithm())
    expected, _ = core_algos.compute_grpo_outcome_advantage(rewards.float(), mask.float(), index)
    torch.testing.assert_close(out.batch["advantages"], expected, rtol=0, atol=0)


def test_unpatch_restores_verl_function(adapter, site, monkeypatch):
    import sys
    import types

    import verl.trainer.ppo.ray_trainer as rt

    wrapper = rt.compute_advantage
    try:
        import verl.trainer.ppo.v1.utils as v1_utils
    except ImportError:  # the v1 trainer needs transfer_queue: a stand-in that bound the name on import
        v1_utils = types.ModuleType("verl.trainer.ppo.v1.utils")
        v1_utils.compute_advantage = wrapper
        monkeypatch.setitem(sys.modules, "verl.trainer.ppo.v1.utils", v1_utils)
    assert v1_utils.compute_advantage is wrapper  # the v1 trainer's bound name is wrapped too
    original = wrapper.__wrapped__
    try:
        adapter.unpatch_compute_advantage()
        assert rt.compute_advantage is original and v1_utils.compute_advantage is original
        assert not site.is_patched()
        adapter.unpatch_compute_advantage()  # twice is harmless
        assert rt.compute_advantage is original
    finally:
        assert adapter.patch_compute_advantage() == "patched"
        assert adapter.patch_compute_advantage() == "patched"  # idempotent: one wrapper
    assert rt.compute_advantage.__wrapped__ is original and v1_utils.compute_advantage is rt.compute_advantage
    report = adapter.registration_report()
    assert report["compute_advantage_patched"] is True


def test_shaper_inputs_from_reward_function_fields(adapter, site, rewards_batch):
    """``flawed`` comes from a non-tensor field (where the legacy trainer puts reward_extra_info)."""
    from verl import DataProto

    rewards, mask, index = rewards_batch(seed=7)
    mask = mask.float()
    rewards = (rewards > 0).float() * mask  # 0/1 outcomes
    flawed = np.array([i % 2 == 0 for i in range(len(index))])
    cfg = _algorithm(stablerl_reward_shaper="fapo", stablerl_reward_shaper_params={"flawed_reward_penalty": 0.5})
    data = DataProto.from_dict(
        tensors={"token_level_rewards": rewards, "response_mask": mask.float()},
        non_tensors={"uid": index, "flawed": flawed},
    )
    out = _compute(data, "qae", cfg)
    scores = rewards.sum(-1)
    shaped, _ = stablerl.shape_rewards("fapo", scores=scores, index=index, flawed=torch.as_tensor(flawed),
                                       flawed_reward_penalty=0.5)
    assert not torch.equal(shaped.float(), scores)  # the penalty applied somewhere
    torch.testing.assert_close((out.batch["token_level_rewards"] * mask).sum(-1), shaped.float(), rtol=0, atol=1e-6)
    with pytest.raises(stablerl.MissingInputError, match=r"'flawed'.*reward_extra_info"):
        _compute(_data(rewards, mask, index), "qae", cfg)


def test_gigpo_gets_anchor_ids_and_step_returns_from_the_batch(adapter, site):
    """An agent loop that writes one row per step with 'anchor_ids' and 'step_returns' (as verl-agent does) runs
    stablerl's gigpo at verl's call site, with the Python API's numbers; without the fields it says which."""
    adapter.register_batch_field_estimators()
    assert adapter.VERL_NAMES["advantage_estimator"].get("gigpo") == "gigpo"
    rewards, mask, index, _, _ = _multi_turn(seed=3)
    anchors = torch.tensor([0, 1, 0, 2, 0, 0, 1, 1])
    step_returns = torch.linspace(0.1, 0.8, 8)
    out = _compute(_data(rewards, mask, index, anchor_ids=anchors, step_returns=step_returns), "gigpo",
                   _algorithm(mode="mean_std_norm"))
    expected, _ = stablerl.compute_advantage("gigpo", token_level_rewards=rewards, response_mask=mask, index=index,
                                             anchor_ids=anchors, step_returns=step_returns, mode="mean_std_norm")
    torch.testing.assert_close(out.batch["advantages"], expected.float(), rtol=0, atol=1e-6)
    assert out.batch["advantages"].abs().max() > 0.5
    with pytest.raises(stablerl.MissingInputError, match=r"'anchor_ids'.*agent loop"):
        _compute(_data(rewards, mask, index, step_returns=step_returns), "gigpo", _algorithm())
