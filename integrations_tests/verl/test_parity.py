"""Parity with verl's built-ins on random padded batches, float64: loss value AND gradient.

Both sides are called the way verl calls them: by keyword, through verl's own registries
(``get_policy_loss_fn`` / ``get_adv_estimator_fn``), with a real ``FSDPActorConfig``.
"""

from __future__ import annotations

import pytest
import torch

import stablerl

SEEDS = (0, 1, 2)
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# verl divides seq-mean-token-mean / GMPO's sequence means by (L_i + 1e-8), stablerl by max(L_i, 1).
# With verl's bool response_mask, L_i is an integer tensor and L_i + 1e-8 rounds to L_i in float32,
# so the two agree exactly (measured: 0 relative difference); everything is compared at 1e-12.


def _need(kind, name):
    if name not in stablerl.get_registry().names(kind):
        pytest.skip(f"stablerl {kind} {name!r} not present yet")


def _same_settings(config):
    """The config a stablerl loss needs to run with exactly the values verl's built-in reads: every
    verl key the stablerl loss also takes, pinned as a stablerl key (``policy_loss.stablerl_params``).
    Without it a verl key left at verl's default gives way to the paper's default (one precedence
    rule; test_ppo_loss.py checks that)."""
    import dataclasses

    from stablerl.adapters.verl import StablePolicyLossConfig
    from stablerl.frameworks import get_framework

    pinned = {}
    for name, key in get_framework("verl").hyperparameter_keys["policy_loss"].items():
        owner = config.policy_loss if key.key.startswith("actor_rollout_ref.actor.policy_loss.") else config
        value = getattr(owner, name, None)
        if value is None and name in ("clip_ratio_low", "clip_ratio_high"):
            value = config.clip_ratio
        if value is not None:
            pinned[name] = value
    return dataclasses.replace(config, policy_loss=StablePolicyLossConfig(
        loss_mode=config.policy_loss.loss_mode, stablerl_params=pinned))


def _loss_and_grad(core_algos, verl_name, batch, config, is_weights=None):
    if getattr(core_algos.get_policy_loss_fn(verl_name), "_stablerl_verl", None):
        config = _same_settings(config)
    lp = batch["log_prob"].detach().clone().requires_grad_(True)
    loss, metrics = core_algos.get_policy_loss_fn(verl_name)(
        old_log_prob=batch["old_log_prob"],
        log_prob=lp,
        advantages=batch["advantages"],
        response_mask=batch["response_mask"],
        loss_agg_mode=config.loss_agg_mode,
        config=config,
        rollout_is_weights=is_weights,
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def _assert_parity(ours, ref, rtol=1e-12, atol=1e-12, metrics=("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")):
    torch.testing.assert_close(ours[0], ref[0], rtol=rtol, atol=atol)
    torch.testing.assert_close(ours[1], ref[1], rtol=rtol, atol=atol)
    assert ref[1].abs().sum() > 0  # a non-trivial gradient was compared
    for k in metrics:
        assert ours[2][k] == pytest.approx(float(ref[2][k]), rel=1e-6, abs=1e-9), k


def _with_info(cfg, **info):
    cfg.global_batch_info.clear()
    cfg.global_batch_info.update(info)
    return cfg


# ----------------------------------------------------------------------------- policy losses


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("is_w", [False, True])
def test_vanilla_dual_clip(adapter, core_algos, padded_batch, actor_config, seed, is_w):
    b = padded_batch(seed=seed, noise=0.8)
    for low, high, c in ((0.2, 0.28, 3.0), (0.1, 0.1, 1.5)):
        cfg = actor_config(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)
        w = b["is_weights"] if is_w else None
        ref = _loss_and_grad(core_algos, "vanilla", b, cfg, w)
        ours = _loss_and_grad(core_algos, "stablerl_vanilla", b, cfg, w)
        _assert_parity(ours, ref)
        assert ref[2]["actor/pg_clipfrac_lower"] > 0 or c == 3.0  # the dual clip was exercised


def test_vanilla_clip_ratio_fallback(adapter, core_algos, padded_batch, actor_config):
    # actor.clip_ratio_low/high = null falls back to actor.clip_ratio, as in verl
    b = padded_batch(seed=5)
    cfg = actor_config(clip_ratio=0.05, clip_ratio_low=None, clip_ratio_high=None)
    _assert_parity(_loss_and_grad(core_algos, "stablerl_vanilla", b, cfg), _loss_and_grad(core_algos, "vanilla", b, cfg))


@pytest.mark.parametrize("mode", MODES + ("token-sum",))
@pytest.mark.parametrize("seed", SEEDS)
def test_vanilla_aggregation_modes_dp2(adapter, core_algos, padded_batch, actor_config, mode, seed):
    """global_batch_info as a DP=2 worker sees it: global token / sequence counts, dp_size factor."""
    b = padded_batch(seed=seed)
    local_tokens = int(b["response_mask"].sum())
    for scale in (None, 32):
        cfg = _with_info(
            actor_config(loss_agg_mode=mode, clip_ratio_high=0.28, loss_scale_factor=scale),
            dp_size=2, batch_num_tokens=2 * local_tokens + 7, global_batch_size=13, loss_scale_factor=scale,
        )
        ref = _loss_and_grad(core_algos, "vanilla", b, cfg, b["is_weights"])
        ours = _loss_and_grad(core_algos, "stablerl_vanilla", b, cfg, b["is_weights"])
        _assert_parity(ours, ref)


@pytest.mark.parametrize("mode", MODES)
def test_vanilla_aggregation_modes_without_global_info(adapter, core_algos, padded_batch, actor_config, mode):
    """Direct calls without global_batch_info use verl's local fallbacks (the all-masked row does not count)."""
    b = padded_batch(seed=7)
    assert (b["response_mask"].sum(-1) == 0).any()
    cfg = actor_config(loss_agg_mode=mode)
    _assert_parity(
        _loss_and_grad(core_algos, "stablerl_vanilla", b, cfg), _loss_and_grad(core_algos, "vanilla", b, cfg)
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
def test_gspo(adapter, core_algos, padded_batch, actor_config, seed, mode):
    _need("policy_loss", "gspo")
    b = padded_batch(seed=seed, noise=0.02, token_adv=seed == 2)  # sequence ratios near the tight bounds
    cfg = _with_info(
        actor_config(loss_agg_mode=mode, clip_ratio_low=1e-3, clip_ratio_high=2e-3, loss_scale_factor=16),
        dp_size=2, batch_num_tokens=40, global_batch_size=11, loss_scale_factor=16,
    )
    ref = _loss_and_grad(core_algos, "gspo", b, cfg, b["is_weights"])
    ours = _loss_and_grad(core_algos, "stablerl_gspo", b, cfg, b["is_weights"])
    _assert_parity(ours, ref, metrics=("actor/pg_clipfrac", "actor/ppo_kl"))
    assert ref[2]["actor/pg_clipfrac"] > 0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("is_w", [False, True])
def test_gmpo_equals_geo_mean(adapter, core_algos, padded_batch, actor_config, seed, is_w):
    """verl's geo_mean divides by the local B (torch.mean): equal to ours when global_batch_size = B."""
    _need("policy_loss", "gmpo")
    b = padded_batch(seed=seed, noise=0.5)
    B = b["response_mask"].shape[0]
    cfg = _with_info(actor_config(clip_ratio_low=0.4, clip_ratio_high=0.3), dp_size=1, batch_num_tokens=None,
                     global_batch_size=B, loss_scale_factor=None)
    w = b["is_weights"] if is_w else None
    ref = _loss_and_grad(core_algos, "geo_mean", b, cfg, w)
    ours = _loss_and_grad(core_algos, "gmpo", b, cfg, w)
    _assert_parity(ours, ref)
    assert ref[2]["actor/pg_clipfrac"] > 0 and ref[2]["actor/pg_clipfrac_lower"] > 0
    assert core_algos.get_policy_loss_fn("stablerl_gmpo") is core_algos.get_policy_loss_fn("gmpo")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
def test_cispo(adapter, core_algos, padded_batch, actor_config, seed, mode):
    _need("policy_loss", "cispo")
    b = padded_batch(seed=seed, noise=0.4)
    cfg = _with_info(
        actor_config(loss_agg_mode=mode, clip_ratio_low=10.0, clip_ratio_high=0.2, loss_scale_factor=16),
        dp_size=2, batch_num_tokens=40, global_batch_size=11, loss_scale_factor=16,
    )
    ref = _loss_and_grad(core_algos, "cispo", b, cfg, b["is_weights"])
    ours = _loss_and_grad(core_algos, "stablerl_cispo", b, cfg, b["is_weights"])
    _assert_parity(ours, ref, metrics=("actor/ppo_kl", "actor/pg_clipfrac_lower"))
    assert ref[2]["actor/pg_clipfrac"] > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_sapo_reads_verl_actor_temperatures(adapter, core_algos, padded_batch, actor_config, seed):
    _need("policy_loss", "sapo")
    b = padded_batch(seed=seed, noise=0.5, token_adv=True)
    for tau_pos, tau_neg in ((1.0, 1.05), (0.5, 2.0)):
        cfg = _with_info(actor_config(loss_agg_mode="token-mean", tau_pos=tau_pos, tau_neg=tau_neg),
                         dp_size=2, batch_num_tokens=40, global_batch_size=11, loss_scale_factor=None)
        ref = _loss_and_grad(core_algos, "sapo", b, cfg, b["is_weights"])
        ours = _loss_and_grad(core_algos, "stablerl_sapo", b, cfg, b["is_weights"])
        _assert_parity(ours, ref, metrics=("actor/ppo_kl",))


# ----------------------------------------------------------------------------- estimators


def _est(core_algos, verl_name, rewards, mask, index, config=None):
    return core_algos.get_adv_estimator_fn(verl_name)(
        token_level_rewards=rewards, response_mask=mask, index=index, config=config
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [True, False])
def test_grpo(adapter, core_algos, rewards_batch, seed, norm):
    from omegaconf import OmegaConf

    rewards, mask, index = rewards_batch(seed=seed)
    ref = core_algos.compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    ours = _est(core_algos, "stablerl_grpo", rewards, mask, index, OmegaConf.create({"norm_adv_by_std_in_grpo": norm}))
    # verl divides a group of one by the float32 constant (1.0 + 1e-6) = 1.00000095: 4.6e-8 relative in float64
    torch.testing.assert_close(ours[0], ref[0], rtol=5e-8, atol=1e-12)
    torch.testing.assert_close(ours[1], ref[1], rtol=5e-8, atol=1e-12)
    multi = torch.tensor([list(index).count(u) > 1 for u in index])
    torch.testing.assert_close(ours[0][multi], ref[0][multi], rtol=1e-12, atol=1e-12)
    assert ref[0].abs().max() > 0.1


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["rloo", "opo"])
def test_rloo_opo(adapter, core_algos, rewards_batch, seed, name):
    from omegaconf import OmegaConf

    _need("advantage_estimator", name)
    rewards, mask, index = rewards_batch(seed=seed)
    cfg = OmegaConf.create({"norm_adv_by_std_in_grpo": True})
    ref = _est(core_algos, name, rewards, mask, index, cfg)
    ours = _est(core_algos, "stablerl_" + name, rewards, mask, index, cfg)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-12, atol=1e-12)
    assert ref[0].abs().max() > 0.1


@pytest.mark.parametrize("mode", MODES)
def test_dp2_without_global_counts_fails_like_verl(adapter, core_algos, padded_batch, actor_config, mode):
    b = padded_batch(seed=1)
    cfg = _with_info(actor_config(loss_agg_mode=mode, loss_scale_factor=16), dp_size=2, batch_num_tokens=None,
                     global_batch_size=None, loss_scale_factor=16)
    with pytest.raises(ValueError):
        _loss_and_grad(core_algos, "vanilla", b, cfg)
    with pytest.raises(stablerl.StableRLError):  # a ValueError too
        _loss_and_grad(core_algos, "stablerl_vanilla", b, cfg)
