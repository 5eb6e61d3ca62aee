"""verl's trainer-side ``compute_advantage`` runs stablerl estimators, with ``+algorithm`` keys."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf, open_dict

import stablerl


def _data_proto(rewards, mask, index):
    from verl import DataProto

    return DataProto.from_dict(
        tensors={"token_level_rewards": rewards.float(), "response_mask": mask.float()},
        non_tensors={"uid": index},
    )


def _algorithm(**extra):
    """The ``algorithm`` DictConfig as the trainer passes it (struct; ``+algorithm.k=v`` opens it)."""
    conf = OmegaConf.create(
        {"_target_": "verl.trainer.config.AlgoConfig", "gamma": 1.0, "lam": 1.0, "adv_estimator": "qae",
         "norm_adv_by_std_in_grpo": True, "use_kl_in_reward": False}
    )
    OmegaConf.set_struct(conf, True)
    with open_dict(conf):
        for k, v in extra.items():
            conf[k] = v
    return conf


def _compute(name, data, config):
    from verl.trainer.ppo.ray_trainer import compute_advantage

    out = compute_advantage(data, name, config=config)
    return out.batch["advantages"], out.batch["returns"]


def test_qae_with_plus_algorithm_key(adapter, rewards_batch):
    if "qae" not in stablerl.get_registry().names("advantage_estimator"):
        pytest.skip("plugin qae not present yet")
    rewards, mask, index = rewards_batch(seed=1)
    rewards = (rewards > 0).float() * mask  # binary outcome rewards, where the quantile matters
    default_adv, default_ret = _compute("qae", _data_proto(rewards, mask, index), _algorithm())
    adv, _ = _compute("qae", _data_proto(rewards, mask, index), _algorithm(quantile_k=0.8))
    prefixed, _ = _compute("stablerl_qae", _data_proto(rewards, mask, index), _algorithm(quantile_k=0.8))

    expected, _ = stablerl.compute_advantage(
        "qae", token_level_rewards=rewards, response_mask=mask, index=index, quantile_k=0.8
    )
    expected_default, _ = stablerl.compute_advantage("qae", token_level_rewards=rewards, response_mask=mask, index=index)
    torch.testing.assert_close(adv, expected.float(), rtol=0, atol=0)
    torch.testing.assert_close(prefixed, adv, rtol=0, atol=0)
    torch.testing.assert_close(default_adv, expected_default.float(), rtol=0, atol=0)
    assert (adv - default_adv).abs().max() > 0.1  # quantile_k reached the estimator
    assert default_ret.shape == rewards.shape and adv.dtype == torch.float32


def test_norm_adv_by_std_in_grpo_is_read_from_algorithm(adapter, rewards_batch, core_algos):
    rewards, mask, index = rewards_batch(seed=2)
    on, _ = _compute("stablerl_grpo", _data_proto(rewards, mask, index), _algorithm())
    off, _ = _compute("stablerl_grpo", _data_proto(rewards, mask, index), _algorithm(norm_adv_by_std_in_grpo=False))
    ref_on, _ = core_algos.compute_grpo_outcome_advantage(rewards.float(), mask.float(), index, norm_adv_by_std_in_grpo=True)
    ref_off, _ = core_algos.compute_grpo_outcome_advantage(rewards.float(), mask.float(), index, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(on, ref_on, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(off, ref_off, rtol=1e-5, atol=1e-6)
    assert (on - off).abs().max() > 1e-3


def test_unknown_extra_key_is_ignored_but_bad_value_fails(adapter, rewards_batch):
    if "qae" not in stablerl.get_registry().names("advantage_estimator"):
        pytest.skip("plugin qae not present yet")
    rewards, mask, index = rewards_batch(seed=3)
    with pytest.raises(stablerl.StableRLError, match="quantile_k"):
        _compute("qae", _data_proto(rewards, mask, index), _algorithm(quantile_k=7.0))


def test_every_registered_estimator_runs_through_compute_advantage(adapter, rewards_batch):
    rewards, mask, index = rewards_batch(seed=4)
    for verl_name, name in adapter.VERL_NAMES["advantage_estimator"].items():
        try:
            expected, _ = stablerl.compute_advantage(
                name, token_level_rewards=rewards.float(), response_mask=mask, index=index
            )
        except stablerl.StableRLError as e:  # e.g. an estimator that rejects a group of one
            with pytest.raises(type(e)):
                _compute(verl_name, _data_proto(rewards, mask, index), _algorithm())
            continue
        adv, ret = _compute(verl_name, _data_proto(rewards, mask, index), _algorithm())
        torch.testing.assert_close(adv, expected.float(), rtol=0, atol=0, msg=verl_name)
        assert torch.isfinite(adv).all() and (adv * (1 - mask)).abs().max() == 0


def test_verl_default_norm_key_does_not_replace_the_paper_default(adapter, rewards_batch):
    """reinforce_ada's paper default is norm_adv_by_std_in_grpo=False; verl's algorithm key is always
    there at True. Under the one precedence rule the paper default wins (same as TRL and OpenRLHF),
    and a stablerl key (+algorithm.<name> cannot be used for verl's own key, so the verl key set to a
    value other than verl's default) still applies."""
    rewards, mask, index = rewards_batch(seed=2)
    # in-batch statistics (no adaptive sampler's per-prompt counts in a stock verl trainer)
    got, _ = _compute("reinforce_ada", _data_proto(rewards, mask, index), _algorithm(global_stat_est=False))
    rewards, mask = rewards.float(), mask.float()  # as verl's batch holds them
    paper, _ = stablerl.compute_advantage("reinforce_ada", token_level_rewards=rewards, response_mask=mask, index=index,
                                          global_stat_est=False)
    verl_default, _ = stablerl.compute_advantage("reinforce_ada", token_level_rewards=rewards, response_mask=mask,
                                                 index=index, global_stat_est=False, norm_adv_by_std_in_grpo=True)
    assert (paper - verl_default).abs().max() > 1e-3
    torch.testing.assert_close(got, paper.float(), rtol=0, atol=0)


def test_a_norm_key_the_estimator_does_not_take_is_refused(adapter, rewards_batch):
    """algorithm.norm_adv_by_std_in_grpo=False with an estimator that has no such hyper-parameter would
    change nothing while the user expects unnormalised advantages: refused, naming the key."""
    rewards, mask, index = rewards_batch(seed=2)
    rewards = (rewards > 0).float() * mask  # bnpo: rewards in [0, 1]
    assert "norm_adv_by_std_in_grpo" not in stablerl.get_spec("advantage_estimator", "bnpo").defaults()
    with pytest.raises(stablerl.StableRLError, match="algorithm.norm_adv_by_std_in_grpo=False has no effect.*'bnpo'"):
        _compute("bnpo", _data_proto(rewards, mask, index), _algorithm(norm_adv_by_std_in_grpo=False))
    _compute("bnpo", _data_proto(rewards, mask, index), _algorithm())  # verl's default: nothing to refuse
