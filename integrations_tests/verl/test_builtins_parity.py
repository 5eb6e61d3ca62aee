"""Parity of stablerl's copies of verl 0.9.1 built-ins with verl's own functions (issue 16).

Policy losses ``gpg``, ``dppo_tv``, ``dppo_kl``, ``dro`` and estimators ``reinforce_plus_plus``,
``reinforce_plus_plus_baseline``, ``gpg``, ``remax``: random padded float64 batches, loss value AND
gradient, both sides called the way verl calls them (its registries, a real ``FSDPActorConfig``). verl
owns these names, so stablerl's are reached as ``stablerl_<name>``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_parity import MODES, SEEDS, _assert_parity, _loss_and_grad, _with_info
from conftest import _rewards_batch

import stablerl
from stablerl.ops import scores_on_last_token


def _info(cfg):
    return _with_info(cfg, dp_size=2, batch_num_tokens=40, global_batch_size=11, loss_scale_factor=None)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
def test_gpg_loss(adapter, core_algos, padded_batch, actor_config, seed, mode):
    b = padded_batch(seed=seed, noise=0.5, token_adv=seed == 2)
    cfg = _info(actor_config(loss_agg_mode=mode))
    ref = _loss_and_grad(core_algos, "gpg", b, cfg, b["is_weights"])
    ours = _loss_and_grad(core_algos, "stablerl_gpg", b, cfg, b["is_weights"])
    _assert_parity(ours, ref, metrics=())


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("is_w", [False, True])
def test_dppo(adapter, core_algos, padded_batch, actor_config, seed, name, is_w):
    b = padded_batch(seed=seed, noise=0.6, token_adv=seed == 1)
    w = b["is_weights"] if is_w else None
    for low, high, c in ((0.2, 0.2, 3.0), (0.05, 0.1, 1.2)):
        cfg = _info(actor_config(loss_agg_mode="token-mean", clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c))
        ref = _loss_and_grad(core_algos, name, b, cfg, w)
        ours = _loss_and_grad(core_algos, "stablerl_" + name, b, cfg, w)
        _assert_parity(ours, ref)
        assert ref[2]["actor/pg_clipfrac"] < 1
        if c == 1.2:  # the tight region excluded some tokens; the truncation was exercised
            assert ref[2]["actor/pg_clipfrac"] > 0 and ref[2]["actor/pg_clipfrac_lower"] > 0


def test_dppo_defaults_are_verls_effective_ones(adapter, core_algos, padded_batch, actor_config):
    """Left at verl's defaults (clip_ratio 0.2, clip_ratio_c 3.0), stablerl_dppo_tv equals verl's dppo_tv."""
    b = padded_batch(seed=4, noise=0.6)
    cfg = _info(actor_config(loss_agg_mode="token-mean"))
    lp = b["log_prob"].detach().clone().requires_grad_(True)
    ours = core_algos.get_policy_loss_fn("stablerl_dppo_tv")(
        old_log_prob=b["old_log_prob"], log_prob=lp, advantages=b["advantages"], response_mask=b["response_mask"],
        loss_agg_mode="token-mean", config=cfg)
    ref = _loss_and_grad(core_algos, "dppo_tv", b, cfg)
    torch.testing.assert_close(ours[0].detach(), ref[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta", [0.1, 2.0])
def test_dro(adapter, core_algos, padded_batch, actor_config, seed, beta):
    from verl.workers.config import PolicyLossConfig

    b = padded_batch(seed=seed, noise=0.5)
    cfg = _info(actor_config(loss_agg_mode="seq-mean-token-mean",
                             policy_loss=PolicyLossConfig(loss_mode="dro", dro_beta=beta)))
    ref = _loss_and_grad(core_algos, "dro", b, cfg, b["is_weights"])
    ours = _loss_and_grad(core_algos, "stablerl_dro", b, cfg, b["is_weights"])
    _assert_parity(ours, ref, metrics=("actor/ppo_kl",))


def test_dro_reads_verls_dro_beta(adapter, core_algos, padded_batch, actor_config):
    """policy_loss.dro_beta (verl's own key) reaches stablerl_dro without pinning."""
    from verl.workers.config import PolicyLossConfig

    b = padded_batch(seed=3, noise=0.5)
    cfg = _info(actor_config(policy_loss=PolicyLossConfig(loss_mode="dro", dro_beta=3.0)))
    lp = b["log_prob"].detach().clone().requires_grad_(True)
    ours = core_algos.get_policy_loss_fn("stablerl_dro")(
        old_log_prob=b["old_log_prob"], log_prob=lp, advantages=b["advantages"], response_mask=b["response_mask"],
        loss_agg_mode="token-mean", config=cfg)
    ref = _loss_and_grad(core_algos, "dro", b, cfg)
    torch.testing.assert_close(ours[0].detach(), ref[0], rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- estimators

# verl's masked_mean divides by (n + 1e-8) where stablerl divides by n: identical in float32 (n >= 1 is
# exact there), ~1e-10 relative in float64; verl's GPG alpha is a float32 tensor (int / int tensor)
WHITEN_TOL = dict(rtol=1e-8, atol=1e-9)


def _multi_turn(rewards, mask, seed):
    """Token rewards inside the response and a masked observation span (multi-turn traces)."""
    g = torch.Generator().manual_seed(100 + seed)
    rewards = rewards + 0.3 * torch.randn(rewards.shape, generator=g, dtype=rewards.dtype) * mask
    mask = mask.clone()
    mask[:, 1] = 0  # an observation token in every row
    return rewards, mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("multi_turn", [False, True])
def test_reinforce_plus_plus(adapter, core_algos, rewards_batch, seed, gamma, multi_turn):
    from omegaconf import OmegaConf

    rewards, mask, index = rewards_batch(seed=seed, T=7)
    if multi_turn:
        rewards, mask = _multi_turn(rewards, mask, seed)
    cfg = OmegaConf.create({"gamma": gamma, "norm_adv_by_std_in_grpo": True})
    ref = core_algos.get_adv_estimator_fn("reinforce_plus_plus")(
        token_level_rewards=rewards, response_mask=mask, index=index, config=cfg)
    ours = core_algos.get_adv_estimator_fn("stablerl_reinforce_plus_plus")(
        token_level_rewards=rewards, response_mask=mask, index=index, config=cfg)
    torch.testing.assert_close(ours[0], ref[0], **WHITEN_TOL)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-12, atol=1e-12)
    assert ref[0].abs().max() > 0.5


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_baseline(adapter, core_algos, rewards_batch, seed):
    from omegaconf import OmegaConf

    rewards, mask, index = rewards_batch(seed=seed)
    cfg = OmegaConf.create({"norm_adv_by_std_in_grpo": True})
    ref = core_algos.get_adv_estimator_fn("reinforce_plus_plus_baseline")(
        token_level_rewards=rewards.clone(), response_mask=mask, index=index, config=cfg)
    ours = core_algos.get_adv_estimator_fn("stablerl_reinforce_plus_plus_baseline")(
        token_level_rewards=rewards, response_mask=mask, index=index, config=cfg)
    torch.testing.assert_close(ours[0], ref[0], **WHITEN_TOL)
    torch.testing.assert_close(ours[1], ref[1], **WHITEN_TOL)
    assert ref[0].abs().max() > 0.5


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("f_norm", [1.0, 2.5])
def test_gpg_estimator(adapter, core_algos, rewards_batch, seed, f_norm):
    from omegaconf import OmegaConf

    rewards, mask, index = rewards_batch(seed=seed)
    rewards[0] = 0.0  # a zero score: alpha = B / #non-zero != 1
    ref = core_algos.compute_gpg_outcome_advantage(rewards.clone(), mask, index, f_norm=f_norm)
    ours = core_algos.get_adv_estimator_fn("stablerl_gpg")(
        token_level_rewards=rewards, response_mask=mask, index=index,
        config=OmegaConf.create({"f_norm": f_norm, "norm_adv_by_std_in_grpo": True}))
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-7, atol=1e-9)
    assert ref[0].abs().max() > 0.1


@pytest.mark.parametrize("seed", SEEDS)
def test_remax(adapter, core_algos, rewards_batch, seed):
    rewards, mask, index = rewards_batch(seed=seed)
    baselines = torch.randn(rewards.shape[0], generator=torch.Generator().manual_seed(seed), dtype=rewards.dtype)
    ref = core_algos.compute_remax_outcome_advantage(rewards, baselines, mask)
    ours = stablerl.compute_advantage("remax", token_level_rewards=rewards, response_mask=mask, index=index,
                                      reward_baselines=baselines)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-12, atol=1e-12)


def test_remax_without_baselines_says_why(adapter):
    rewards = torch.zeros(2, 3)
    with pytest.raises(stablerl.MissingInputError, match="reward_baselines"):
        stablerl.compute_advantage("remax", token_level_rewards=rewards, response_mask=torch.ones(2, 3),
                                   index=np.array(["a", "a"], dtype=object))


# ----------------------------------------------------------------------------- rollout corrections


@pytest.mark.parametrize("option", ["token_k2", "token_k3", "seq_sum_k2", "seq_sum_k3", "seq_mean_k2", "seq_mean_k3",
                                    "seq_max_k2", "seq_max_k3"])
@pytest.mark.parametrize("seed", SEEDS)
def test_kl_rs_keeps_what_verls_rejection_keeps(adapter, padded_batch, option, seed):
    """stablerl's kl_rs weights are verl's modified response mask (1 kept, 0 rejected) for the same option and
    threshold (verl then drops the rejected tokens from the mask; stablerl weights them 0)."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

    from stablerl.contracts import PolicyLossBatch

    b = padded_batch(seed=seed, noise=0.5)
    g = torch.Generator().manual_seed(seed)
    rollout = b["old_log_prob"] + 0.3 * torch.randn(b["old_log_prob"].shape, generator=g, dtype=torch.float64)
    mask = b["response_mask"]
    level, estimator = option.rsplit("_", 1)
    spec = stablerl.get_spec("rollout_correction", "kl_rs")
    batch = PolicyLossBatch(log_prob=b["log_prob"].detach(), old_log_prob=b["old_log_prob"], advantages=b["advantages"],
                            response_mask=mask.to(torch.float64), rollout_log_prob=rollout)
    kept = []
    for threshold in (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.065, 0.08, 0.1, 0.15, 0.3, 1.0):
        ref_mask, _ = compute_rollout_rejection_mask(b["old_log_prob"] - rollout, mask.to(torch.float64), option,
                                                     threshold)
        w, _ = spec.fn(batch, spec.params(estimator=estimator, level=level, threshold=threshold), stablerl.Context())
        torch.testing.assert_close(w, ref_mask.to(w.dtype), rtol=0, atol=0)
        kept.append(float(ref_mask.sum() / mask.sum()))
    assert any(0 < k < 1 for k in kept), f"{option}: no threshold rejected some tokens and kept others ({kept})"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("zero_tail", [True, False])
def test_optimal_token_baseline(adapter, core_algos, rewards_batch, seed, zero_tail):
    rewards, mask, index = rewards_batch(seed=seed, T=7)
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 2 - 0.05
    spp = torch.rand(mask.shape, generator=g, dtype=torch.float64) * 0.9 + 0.05
    ref = core_algos.compute_optimal_token_baseline_advantage(rewards, mask, index, old_log_probs=old,
                                                             sum_pi_squared=spp, handle_zero_tail=zero_tail)
    ours = stablerl.compute_advantage("optimal_token_baseline", token_level_rewards=rewards, response_mask=mask,
                                      index=index, old_log_prob=old, sum_pi_squared=spp, handle_zero_tail=zero_tail)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-12, atol=1e-12)
    assert ref[0].abs().max() > 0.1


def test_optimal_token_baseline_through_verls_compute_advantage(adapter, core_algos, rewards_batch):
    """stablerl_optimal_token_baseline at verl's real call site takes old_log_probs and sum_pi_squared from the
    batch (legacy trainer with actor.calculate_sum_pi_squared=True) and gives verl's numbers."""
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    rewards, mask, index = rewards_batch(seed=1, T=7)
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(mask.shape, generator=g) * 2 - 0.05
    spp = torch.rand(mask.shape, generator=g) * 0.9 + 0.05

    def run(name, with_spp=True):
        tensors = {"token_level_rewards": rewards.float(), "response_mask": mask.float(), "old_log_probs": old}
        if with_spp:
            tensors["sum_pi_squared"] = spp
        data = DataProto.from_dict(tensors=tensors, non_tensors={"uid": index})
        config = OmegaConf.create({"_target_": "verl.trainer.config.AlgoConfig", "gamma": 1.0, "lam": 1.0,
                                   "adv_estimator": name, "norm_adv_by_std_in_grpo": True, "use_kl_in_reward": False})
        return compute_advantage(data, name, config=config).batch["advantages"]

    torch.testing.assert_close(run("stablerl_optimal_token_baseline"), run("optimal_token_baseline"),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(stablerl.MissingInputError, match="calculate_sum_pi_squared"):
        run("stablerl_optimal_token_baseline", with_spp=False)


def _gdpo_inputs(seed, T=7):
    """Contiguous padded responses (verl's GDPO places each component on the last token from the attention
    mask) and two reward components on different scales; groups of 4, 3, 1 and 4 (one constant component)."""
    rewards, mask, index = _rewards_batch(seed=seed, T=T)
    g = torch.Generator().manual_seed(200 + seed)
    B = mask.shape[0]
    acc = torch.randint(0, 2, (B,), generator=g).to(torch.float32)
    fmt = (torch.rand(B, generator=g) * 5).to(torch.float32)
    fmt[index == "d"] = 0.25  # a group whose second component has no spread
    return rewards, mask, index, {"acc": acc.numpy(), "fmt": fmt.numpy()}


def _verl_gdpo_batch(mask, prompt_len=3):
    B = mask.shape[0]
    attn = torch.cat([torch.ones(B, prompt_len, dtype=torch.long), mask.long()], 1)
    return {"prompts": torch.zeros(B, prompt_len, dtype=torch.long), "attention_mask": attn}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("weights", [None, [1.0, 0.5]])
@pytest.mark.parametrize("std", [True, False])
def test_gdpo(adapter, core_algos, seed, weights, std):
    rewards, mask, index, comps = _gdpo_inputs(seed)
    cfg = {"gdpo_reward_keys": ["acc", "fmt"], "gdpo_reward_weights": weights}
    ref, ref_ret = core_algos.compute_gdpo_outcome_advantage(
        rewards, mask, index, norm_adv_by_std_in_grpo=std, config=cfg, non_tensor_batch=comps,
        batch=_verl_gdpo_batch(mask))
    extras = {"reward_components": {k: torch.as_tensor(v) for k, v in comps.items()}}
    if weights is not None:
        extras["reward_weights"] = weights
    ours, ours_ret = stablerl.compute_advantage("gdpo", token_level_rewards=rewards, response_mask=mask, index=index,
                                                norm_adv_by_std_in_grpo=std, extras=extras)
    # verl normalises its float32 components in float32
    torch.testing.assert_close(ours, ref.to(ours.dtype), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours_ret, ref_ret.to(ours.dtype), rtol=1e-5, atol=1e-6)
    assert ref.abs().max() > 0.5
    # not GRPO on the summed reward: the decoupling changes the numbers
    summed = stablerl.compute_advantage("grpo", token_level_rewards=scores_on_last_token(
        torch.as_tensor(comps["acc"] + comps["fmt"]).double(), mask), response_mask=mask, index=index)[0]
    assert not torch.allclose(summed, ours, atol=1e-3)


def test_gdpo_without_components_is_verls_fallback(adapter, core_algos, rewards_batch):
    """No gdpo_reward_keys: verl normalises token_level_rewards as the one component; so does stablerl."""
    rewards, mask, index = rewards_batch(seed=2, T=6)
    ref, _ = core_algos.compute_gdpo_outcome_advantage(rewards, mask, index)
    ours, _ = stablerl.compute_advantage("gdpo", token_level_rewards=rewards, response_mask=mask, index=index)
    # verl's group of one divides by float32(1 + 1e-6) (its std is a float32 0-dim tensor): ~6e-8 relative
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
    assert ref.abs().max() > 0.5


def test_gdpo_through_verls_compute_advantage(adapter, core_algos):
    """stablerl_gdpo at verl's real call site reads verl's own algorithm.gdpo_reward_keys / gdpo_reward_weights
    (the reward function's extra fields in the non-tensor batch) and gives verl's gdpo's numbers."""
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    rewards, mask, index, comps = _gdpo_inputs(seed=1)

    def run(name, keys=("acc", "fmt")):
        tensors = {"token_level_rewards": rewards.float(), "response_mask": mask.float(), **_verl_gdpo_batch(mask)}
        data = DataProto.from_dict(tensors=tensors, non_tensors={"uid": index, **comps})
        config = OmegaConf.create({"_target_": "verl.trainer.config.AlgoConfig", "gamma": 1.0, "lam": 1.0,
                                   "adv_estimator": name, "norm_adv_by_std_in_grpo": True, "use_kl_in_reward": False,
                                   "gdpo_reward_keys": list(keys), "gdpo_reward_weights": [2.0, 0.5]})
        return compute_advantage(data, name, config=config).batch["advantages"]

    torch.testing.assert_close(run("stablerl_gdpo"), run("gdpo"), rtol=1e-5, atol=1e-6)
    with pytest.raises(stablerl.MissingInputError, match=r"gdpo_reward_keys names \['typo'\]"):
        run("stablerl_gdpo", keys=("acc", "typo"))


def _tir_inputs(seed, T=9):
    """Multi-turn traces: response tokens, then a masked observation span of varying position and length, then
    more response tokens; groups of 4, 3, 1 and 4; one response without any valid token."""
    rewards, mask, index = _rewards_batch(seed=seed, T=T)
    g = torch.Generator().manual_seed(300 + seed)
    rewards = rewards + 0.2 * torch.randn(rewards.shape, generator=g, dtype=rewards.dtype)
    mask = mask.clone()
    for i in range(mask.shape[0]):
        start = int(torch.randint(1, T - 2, (1,), generator=g))
        mask[i, start:start + int(torch.randint(1, 3, (1,), generator=g))] = 0
    mask[int(np.flatnonzero(index == "a")[0])] = 0  # an empty response in a group of four
    rewards = rewards * (mask.sum(-1, keepdim=True) > 0)
    old = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 2 - 0.05
    spp = torch.rand(mask.shape, generator=g, dtype=torch.float64) * 0.9 + 0.05
    return rewards, mask, index, old, spp


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("zero_tail", [True, False])
def test_tir_optimal_token_baseline(adapter, core_algos, seed, zero_tail):
    rewards, mask, index, old, spp = _tir_inputs(seed)
    ref = core_algos.compute_multi_turn_optimal_token_baseline_advantage(
        rewards, mask, index, old_log_probs=old, sum_pi_squared=spp, handle_zero_tail=zero_tail)
    ours = stablerl.compute_advantage("tir_optimal_token_baseline", token_level_rewards=rewards, response_mask=mask,
                                      index=index, old_log_prob=old, sum_pi_squared=spp, handle_zero_tail=zero_tail)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-12, atol=1e-12)
    # returns: verl leaves them unmasked inside observation spans; on response tokens they are equal
    torch.testing.assert_close(ours[1], ref[1] * mask, rtol=1e-12, atol=1e-12)
    assert ref[0].abs().max() > 0.1
    # the packing matters: the plain optimal_token_baseline gives other numbers on these traces
    plain = stablerl.compute_advantage("optimal_token_baseline", token_level_rewards=rewards, response_mask=mask,
                                       index=index, old_log_prob=old, sum_pi_squared=spp, handle_zero_tail=zero_tail)
    assert not torch.allclose(plain[0], ours[0], atol=1e-6)


def test_tir_optimal_token_baseline_through_verls_compute_advantage(adapter, core_algos):
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    rewards, mask, index, old, spp = _tir_inputs(seed=2)

    def run(name):
        tensors = {"token_level_rewards": rewards.float(), "response_mask": mask.float(), "old_log_probs": old.float(),
                   "sum_pi_squared": spp.float()}
        data = DataProto.from_dict(tensors=tensors, non_tensors={"uid": index})
        config = OmegaConf.create({"_target_": "verl.trainer.config.AlgoConfig", "gamma": 1.0, "lam": 1.0,
                                   "adv_estimator": name, "norm_adv_by_std_in_grpo": True, "use_kl_in_reward": False})
        return compute_advantage(data, name, config=config).batch["advantages"]

    torch.testing.assert_close(run("stablerl_tir_optimal_token_baseline"), run("tir_optimal_token_baseline"),
                               rtol=1e-6, atol=1e-6)


def test_gdpo_with_a_reward_shaper_is_refused_when_components_are_given(adapter, core_algos):
    """A shaper changes the summed reward, which gdpo does not read when it has components: refused, not dropped."""
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    rewards, mask, index, comps = _gdpo_inputs(seed=3)
    tensors = {"token_level_rewards": rewards.float(), "response_mask": mask.float(), **_verl_gdpo_batch(mask)}

    def config(**extra):
        return OmegaConf.create({"_target_": "verl.trainer.config.AlgoConfig", "gamma": 1.0, "lam": 1.0,
                                 "adv_estimator": "stablerl_gdpo", "norm_adv_by_std_in_grpo": True,
                                 "use_kl_in_reward": False, "stablerl_reward_shaper": "redit", **extra})

    with pytest.raises(stablerl.StableRLError, match="shaping would be lost"):
        compute_advantage(DataProto.from_dict(tensors=dict(tensors), non_tensors={"uid": index, **comps}),
                          "stablerl_gdpo", config=config(gdpo_reward_keys=["acc", "fmt"]))
    # without components gdpo normalises the (shaped) outcome score: allowed
    out = compute_advantage(DataProto.from_dict(tensors=dict(tensors), non_tensors={"uid": index}),
                            "stablerl_gdpo", config=config())
    assert torch.isfinite(out.batch["advantages"]).all()
