"""stablerl estimators inside OpenRLHF 0.11.2's real RemoteExperienceMaker.compute_advantages_and_returns."""

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (nox -s openrlhf installs it)")

import torch

import stablerl
import stablerl.adapters.openrlhf as adapter
from orlhf_helpers import clone, make_args, make_experiences, make_maker
from stablerl.adapters.openrlhf import Selection

from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

ORIGINAL = RemoteExperienceMaker.compute_advantages_and_returns


def _openrlhf(estimator, exps, kl_coef=0.01, clip_range=(-10.0, 10.0)):
    args = make_args(estimator=estimator, clip_range=clip_range)
    return ORIGINAL(make_maker(args, estimator, kl_coef), exps)


def _stable(name, exps, params=None, kl_coef=0.01, clip_range=(-10.0, 10.0), given_clip_range=None, framework=None):
    """``given_clip_range``: --reward.clip_range as given on the command line (None: not given, so
    OpenRLHF's default ``clip_range`` is not applied to a stablerl estimator)."""
    adapter.instrument(now=True)
    assert RemoteExperienceMaker.compute_advantages_and_returns is not ORIGINAL
    sel = Selection(advantage_estimator=adapter.resolve(stablerl.ADVANTAGE_ESTIMATOR, name),
                    advantage_params=params or {}, reward_clip_range=given_clip_range,
                    openrlhf_advantage=framework or {})
    args = make_args(estimator=name, clip_range=clip_range, stablerl=sel)
    return RemoteExperienceMaker.compute_advantages_and_returns(make_maker(args, name, kl_coef), exps)


def _assert_same(ours, ref):
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o.advantages, r.advantages, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(o.returns, r.returns, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(o.info["return"], r.info["return"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(o.info["group_reward_std"], r.info["group_reward_std"])
        assert o.kl is None and r.kl is None


@pytest.mark.parametrize(
    "ours,params,theirs",
    [
        # OpenRLHF group_norm: (r - mean) / (std + 1e-9), unbiased std; stablerl grpo's default epsilon is 1e-6 (verl's)
        ("grpo", {"epsilon": 1e-9}, "group_norm"),
        ("stablerl_rloo", {}, "rloo"),  # r - (sum - r) / (n - 1)
        ("stablerl_dr_grpo", {}, "dr_grpo"),  # r - mean
    ],
)
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_group_estimators_equal_openrlhf(ours, params, theirs, kl_coef):
    """Same advantages and returns through the whole method: length penalties, baseline, reward clip,
    KL folded in after the baseline, cumulative returns, info['return']."""
    exps = make_experiences(seed=1, kl_scale=0.3)
    ref = _openrlhf(theirs, clone(exps), kl_coef)
    out = _stable(ours, clone(exps), params, kl_coef)
    _assert_same(out, ref)
    assert float(ref[0].advantages.abs().sum()) > 0


def test_reward_clip_range_is_kept():
    exps = make_experiences(seed=2)
    for e in exps:
        e.rewards = e.rewards * 40  # shaped rewards beyond +-3
    ref = _openrlhf("dr_grpo", clone(exps), 0.02, clip_range=(-3.0, 3.0))
    out = _stable("stablerl_dr_grpo", clone(exps), None, 0.02, clip_range=(-3.0, 3.0), given_clip_range=(-3.0, 3.0))
    _assert_same(out, ref)
    assert float(torch.cat([r.advantages.flatten() for r in ref]).abs().max()) > 3.0  # KL on top of the clip


def test_openrlhf_default_clip_range_does_not_cut_a_stablerl_estimator():
    """OpenRLHF's default --reward.clip_range (-10, 10) is not applied to a stablerl estimator's advantages
    unless given on the command line: they stay as verl and TRL compute them (one behaviour everywhere)."""
    exps = make_experiences(seed=2)
    for e in exps:
        e.rewards = e.rewards * 40  # baseline-shaped rewards beyond +-10
    out = _stable("stablerl_dr_grpo", clone(exps), None, 0.0)
    assert float(torch.cat([e.advantages.flatten() for e in out]).abs().max()) > 10.0
    ref = _openrlhf("dr_grpo", clone(exps), 0.0)  # OpenRLHF's own estimator keeps its default clamp
    assert float(torch.cat([e.advantages.flatten() for e in ref]).abs().max()) <= 10.0
    clipped = _stable("stablerl_dr_grpo", clone(exps), None, 0.0, given_clip_range=(-10.0, 10.0))
    _assert_same(clipped, ref)


def test_no_std_norm_is_honoured_or_refused():
    exps = make_experiences(seed=1, kl_scale=0.0)
    off = _stable("grpo", clone(exps), {"epsilon": 1e-9}, 0.0, framework={"norm_adv_by_std_in_grpo": False})
    ref = _openrlhf("dr_grpo", clone(exps), 0.0)  # r - mean: group_norm without the std
    _assert_same(off, ref)
    with pytest.raises(stablerl.StableRLError, match="no_std_norm.*no effect.*'rloo'"):
        Selection(advantage_estimator="rloo", openrlhf_advantage={"norm_adv_by_std_in_grpo": False}).validate()


def test_grpo_default_epsilon_differs_from_group_norm():
    """The epsilon convention: stablerl grpo (1e-6, verl's) is not group_norm (1e-9) unless set."""
    exps = make_experiences(seed=4)
    for e in exps:
        e.rewards = e.rewards * 1e-5  # a tiny std makes the epsilon matter
    ref = _openrlhf("group_norm", clone(exps), 0.0)
    out = _stable("grpo", clone(exps), None, 0.0)
    assert not torch.allclose(out[0].advantages, ref[0].advantages, rtol=1e-3)


def test_qae_is_stablerls_and_builtins_delegate():
    exps = make_experiences(seed=3, kl_scale=0.0)
    out = _stable("qae", clone(exps), {"quantile_k": 0.4}, kl_coef=0.0)
    # independent: stablerl.compute_advantage on the same groups (prompt position // n)
    idx = torch.tensor([i for e in exps for i in e.index])
    T = max(e.action_mask.shape[1] for e in exps)
    rewards, masks = [], []
    for e in exps:
        m = torch.nn.functional.pad(e.action_mask.float(), (0, T - e.action_mask.shape[1]))
        last = m.shape[1] - 1 - m.long().fliplr().argmax(1)
        r = torch.zeros_like(m)
        r[torch.arange(len(last)), last] = e.rewards
        rewards.append(r)
        masks.append(m)
    adv, _ = stablerl.compute_advantage("qae", token_level_rewards=torch.cat(rewards), response_mask=torch.cat(masks),
                                        index=idx // 4, quantile_k=0.4)
    got = torch.cat([torch.nn.functional.pad(e.advantages, (0, T - e.advantages.shape[1])) for e in out])
    torch.testing.assert_close(got, adv)
    # an OpenRLHF name goes to OpenRLHF's own method, untouched
    ref = _openrlhf("reinforce_baseline", clone(exps))
    adapter.instrument(now=True)
    via_patch = RemoteExperienceMaker.compute_advantages_and_returns(
        make_maker(make_args(estimator="reinforce_baseline"), "reinforce_baseline", 0.01), clone(exps)
    )
    for o, r in zip(via_patch, ref):
        assert torch.equal(o.advantages, r.advantages)


def test_unknown_hyper_parameter_names_the_valid_ones():
    exps = make_experiences(seed=5)
    with pytest.raises(stablerl.UnknownNameError, match="quantile_k"):
        _stable("qae", exps, {"quantile": 0.4})


def test_gdpo_reads_the_reward_components_named_on_the_command_line():
    """--algo.advantage.stablerl_reward_components acc fmt (+ weights): the reward function's extra_logs, which
    OpenRLHF copies into experience.info, reach gdpo as reward_components in rollout order; the advantages are
    the Python API's on the same rows (kl_coef 0, no clip)."""
    exps = make_experiences(seed=21)
    g = torch.Generator().manual_seed(5)
    for e in exps:
        e.info["acc"] = torch.randint(0, 2, (len(e.index),), generator=g).float()
        e.info["fmt"] = torch.rand(len(e.index), generator=g) * 3
    sel = Selection(advantage_estimator="gdpo", reward_components=("acc", "fmt"), reward_weights=(1.0, 0.5)).validate()
    args = make_args(estimator="gdpo", stablerl=sel)
    adapter.instrument(now=True)
    out = RemoteExperienceMaker.compute_advantages_and_returns(make_maker(args, "gdpo", 0.0), clone(exps))
    T = max(e.action_mask.shape[1] for e in exps)
    pad = torch.nn.functional.pad
    mask = torch.cat([pad(e.action_mask.float(), (0, T - e.action_mask.shape[1])) for e in exps])
    index = torch.tensor([i for e in exps for i in e.index]) // 4
    comps = {k: torch.cat([e.info[k] for e in exps]) for k in ("acc", "fmt")}
    expected, _ = stablerl.compute_advantage("gdpo", token_level_rewards=torch.zeros_like(mask), response_mask=mask,
                                             index=index, extras={"reward_components": comps,
                                                                  "reward_weights": [1.0, 0.5]})
    got = torch.cat([pad(e.advantages, (0, T - e.advantages.shape[1])) for e in out])
    torch.testing.assert_close(got, expected.to(got.dtype), rtol=1e-5, atol=1e-6)
    assert got.abs().max() > 0.5
    # the rewards themselves are not what gdpo normalised here
    plain = RemoteExperienceMaker.compute_advantages_and_returns(
        make_maker(make_args(estimator="gdpo", stablerl=Selection(advantage_estimator="gdpo")), "gdpo", 0.0),
        clone(exps))
    assert not torch.allclose(torch.cat([pad(e.advantages, (0, T - e.advantages.shape[1])) for e in plain]), got)
    with pytest.raises(stablerl.MissingInputError, match=r"'typo'.*extra_logs"):
        RemoteExperienceMaker.compute_advantages_and_returns(
            make_maker(make_args(estimator="gdpo", stablerl=Selection(advantage_estimator="gdpo",
                                                                      reward_components=("acc", "typo"))),
                       "gdpo", 0.0), clone(exps))
    with pytest.raises(stablerl.StableRLError, match="has 1 values for 2"):
        Selection(advantage_estimator="gdpo", reward_components=("acc", "fmt"), reward_weights=(1.0,)).validate()


def test_reward_component_flags_reach_the_selection(monkeypatch):
    from orlhf_helpers import dry_run

    args, _ = dry_run(monkeypatch, [
        "--actor.model_name_or_path", "Qwen/Qwen3-0.6B", "--rollout.n_samples_per_prompt", "4",
        "--algo.advantage.estimator", "gdpo", "--algo.advantage.stablerl_params", "form=trl",
        "--algo.advantage.stablerl_reward_components", "acc", "fmt",
        "--algo.advantage.stablerl_reward_weights", "1", "0.5",
    ])
    sel = args.stablerl
    assert (sel.advantage_estimator, sel.advantage_params) == ("gdpo", {"form": "trl"})
    assert sel.reward_components == ("acc", "fmt") and sel.reward_weights == (1.0, 0.5)


def test_gdpo_components_with_a_reward_shaper_are_refused():
    with pytest.raises(stablerl.StableRLError, match="shaping would be lost"):
        Selection(advantage_estimator="gdpo", reward_components=("acc",), reward_shaper="redit").validate()
    Selection(advantage_estimator="gdpo", reward_shaper="redit").validate()  # no components: the outcome score
