"""stablerl reward shapers and batch filters inside OpenRLHF 0.11.2's real compute_advantages_and_returns,
OpenRLHF's real PolicyLoss / loss normalisers, and the wrapper CLI / env-var route."""

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (nox -s openrlhf installs it)")

from types import SimpleNamespace

import torch

import stablerl
import stablerl.adapters.openrlhf as adapter
from orlhf_helpers import clone, make_args, make_experiences, make_maker
from stablerl.adapters.openrlhf import Selection

from openrlhf.models.loss import PolicyLoss  # the real OpenRLHF code
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.utils.loss_utils import get_loss_batch_info

ORIGINAL = RemoteExperienceMaker.compute_advantages_and_returns
N = 4


def _flagged(exps, name, seed):
    """A per-response bool in experience.info, as OpenRLHF stores the reward function's extra_logs."""
    g = torch.Generator().manual_seed(seed)
    for e in exps:
        e.info[name] = torch.rand(len(e.index), generator=g) < 0.5
    return exps


def _penalised_args(estimator, stablerl_sel=None):
    """DAPO overlong penalty on: responses longer than 6 - 4 tokens lose min(len - 2, 4) / 4."""
    args = make_args(estimator=estimator, stablerl=stablerl_sel)
    args.rollout.max_new_tokens = 6
    args.reward.overlong_buffer_len = 4
    args.reward.overlong_penalty_factor = 1.0
    return args


def _run(args, estimator, exps, kl_coef=0.01):
    adapter.instrument(now=True)
    return RemoteExperienceMaker.compute_advantages_and_returns(make_maker(args, estimator, kl_coef), exps)


def _index(exps):
    return torch.tensor([i for e in exps for i in e.index]) // N


def _cat(exps, attr):
    T = max(e.action_mask.shape[1] for e in exps)
    pad = torch.nn.functional.pad
    return torch.cat([pad(getattr(e, attr).double(), (0, T - e.action_mask.shape[1])) for e in exps])


def _assert_same(ours, ref):
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o.advantages, r.advantages, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(o.returns, r.returns, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(o.rewards, r.rewards)
        assert torch.equal(o.action_mask, r.action_mask)


# ----------------------------------------------------------------------------- reward shapers


@pytest.mark.parametrize("estimator,stable_estimator", [("group_norm", None), ("grpo", "grpo")])
def test_shaper_sees_length_penalised_rewards_and_the_estimator_the_shaped_ones(estimator, stable_estimator):
    exps = _flagged(make_experiences(seed=11, kl_scale=0.2), "flawed", 1)
    adv_params = {"epsilon": 1e-9} if stable_estimator else {}
    sel = Selection(reward_shaper="fapo", reward_shaper_params={"flawed_reward_penalty": 0.5},
                    advantage_estimator=stable_estimator, advantage_params=adv_params)
    out = _run(_penalised_args(estimator, sel), estimator, clone(exps))

    # independent: OpenRLHF's overlong penalty by hand, then stablerl.shape_rewards on the same inputs
    raw = torch.cat([e.rewards for e in exps])
    lens = torch.cat([e.response_length for e in exps])
    penalised = raw - (lens - 2).clamp(min=0, max=4) / 4
    assert int((penalised != raw).sum()) >= 3  # the penalty really applies (once)
    flawed = torch.cat([e.info["flawed"] for e in exps])
    shaped, metrics = stablerl.shape_rewards("fapo", scores=penalised, index=_index(exps), flawed=flawed,
                                             flawed_reward_penalty=0.5)
    assert not torch.allclose(shaped, penalised)
    torch.testing.assert_close(torch.cat([e.rewards for e in out]), shaped)

    # the advantages are the estimator's on the shaped rewards (penalty not applied a second time)
    ref_in = clone(exps)
    for e, r in zip(ref_in, shaped.split([len(e.index) for e in ref_in])):
        e.rewards = r.clone()
    plain = make_args(estimator=estimator, stablerl=Selection(advantage_estimator=stable_estimator,
                                                              advantage_params=adv_params))
    if stable_estimator is None:
        ref = ORIGINAL(make_maker(plain, estimator, 0.01), ref_in)
    else:
        ref = _run(plain, estimator, ref_in)
    _assert_same(out, ref)
    for key, value in metrics.items():
        assert float(out[0].info[f"stablerl/{key}"][0]) == pytest.approx(value)
    assert float(_cat(out, "advantages").abs().sum()) > 0


def test_grpo_lambda_gets_lengths_from_the_action_mask():
    exps = _flagged(make_experiences(seed=12), "correct", 2)
    sel = Selection(reward_shaper="grpo_lambda")
    out = _run(make_args(estimator="dr_grpo", stablerl=sel), "dr_grpo", clone(exps))
    lengths = torch.cat([e.action_mask.sum(-1) for e in exps]).float()
    shaped, _ = stablerl.shape_rewards("grpo_lambda", scores=torch.cat([e.rewards for e in exps]), index=_index(exps),
                                       correct=torch.cat([e.info["correct"] for e in exps]), lengths=lengths)
    torch.testing.assert_close(torch.cat([e.rewards for e in out]), shaped)


def test_redit_noise_comes_from_the_seeded_generator():
    adapter.OpenRLHFAdapter().driver_state.clear()
    exps = make_experiences(seed=13)
    sel = Selection(reward_shaper="redit", reward_shaper_params={"scale": 0.1})
    args = make_args(estimator="group_norm", stablerl=sel)
    args.train.seed = 7
    out = _run(args, "group_norm", clone(exps))
    shaped, _ = stablerl.shape_rewards("redit", scores=torch.cat([e.rewards for e in exps]), index=_index(exps),
                                       ctx=stablerl.Context(generator=torch.Generator().manual_seed(7)), scale=0.1)
    torch.testing.assert_close(torch.cat([e.rewards for e in out]), shaped)
    adapter.OpenRLHFAdapter().driver_state.clear()


def test_missing_reward_function_value_says_where_it_comes_from():
    exps = make_experiences(seed=14)
    with pytest.raises(stablerl.MissingInputError, match=r"'flawed'.*extra_logs.*experience\.info"):
        _run(make_args(estimator="group_norm", stablerl=Selection(reward_shaper="fapo")), "group_norm", exps)


# ----------------------------------------------------------------------------- batch filters


def _loss_and_grad(token_level, new, old, adv, mask, loss_type="ppo"):
    from stablerl.adapters.openrlhf import StablePolicyLoss

    x = new.clone().requires_grad_(True)
    info = get_loss_batch_info(SimpleNamespace(), mask)  # OpenRLHF's normalisers from the mask
    cls = PolicyLoss if loss_type == "ppo" else StablePolicyLoss
    loss = cls(token_level_loss=token_level, policy_loss_type=loss_type)(x, old, adv, action_mask=mask, **info)[0]
    (grad,) = torch.autograd.grad(loss, x)
    return loss, grad


@pytest.mark.parametrize("estimator,stable_estimator", [("group_norm", None), ("stablerl_rloo", "rloo")])
def test_dynamic_sampling_drops_equal_reward_groups_from_the_loss(estimator, stable_estimator):
    exps = make_experiences(seed=15, kl_scale=0.3)  # group 0 has four equal rewards
    base = Selection(advantage_estimator=stable_estimator)
    kept_ref = _run(make_args(estimator=estimator, stablerl=base), estimator, clone(exps))
    sel = Selection(advantage_estimator=stable_estimator, batch_filter="dynamic_sampling")
    out = _run(make_args(estimator=estimator, stablerl=sel), estimator, clone(exps))

    idx = _index(exps)
    dropped = idx == 0
    res = stablerl.filter_batch("dynamic_sampling", advantages=_cat(kept_ref, "advantages"),
                                response_mask=_cat(kept_ref, "action_mask"), index=idx,
                                scores=torch.cat([e.rewards for e in exps]))
    assert sorted(res.rows.tolist()) == torch.nonzero(~dropped).reshape(-1).tolist()
    mask, adv = _cat(out, "action_mask"), _cat(out, "advantages")
    mask_ref, adv_ref = _cat(kept_ref, "action_mask"), _cat(kept_ref, "advantages")
    assert float(adv_ref[dropped].abs().sum()) > 0  # KL makes them non-zero without the filter
    assert float(mask[dropped].sum()) == 0 and float(adv[dropped].abs().sum()) == 0
    assert float(_cat(out, "returns")[dropped].abs().sum()) == 0
    assert torch.equal(mask[~dropped], mask_ref[~dropped]) and torch.equal(adv[~dropped], adv_ref[~dropped])
    assert out[0].action_mask.dtype == exps[0].action_mask.dtype
    assert float(out[0].info["stablerl/filter/kept_row_frac"][0]) == pytest.approx(8 / 12)
    assert float(out[0].info["stablerl/dynamic_sampling/kept_group_frac"][0]) == pytest.approx(2 / 3)

    # OpenRLHF's loss (and a stablerl one) over the whole batch (dropped rows masked) == over the kept rows only
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(mask.shape, generator=g, dtype=torch.float64) - 0.05
    new = old + 0.3 * torch.randn(mask.shape, generator=g, dtype=torch.float64)
    for token_level, loss_type in ((True, "ppo"), (False, "ppo"), (True, "cispo")):
        loss, grad = _loss_and_grad(token_level, new, old, adv, mask, loss_type)
        keep = ~dropped
        loss_k, grad_k = _loss_and_grad(token_level, new[keep], old[keep], adv[keep], mask[keep], loss_type)
        torch.testing.assert_close(loss, loss_k, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad[keep], grad_k, rtol=1e-12, atol=1e-14)
        assert float(grad[dropped].abs().sum()) == 0
        full, _ = _loss_and_grad(token_level, new, old, adv_ref, mask_ref, loss_type)
        assert abs(float(full.detach()) - float(loss.detach())) > 1e-6  # unfiltered, the dropped rows count


def test_dynamic_sampling_reads_the_reward_functions_scores_when_present():
    """OpenRLHF's experience.scores (what its own dynamic filtering reads) decide, not the rewards:
    group 0 has equal rewards but varied scores (kept), group 1 equal scores (dropped)."""
    exps = make_experiences(seed=16)
    for e in exps:
        position = torch.tensor(e.index)
        e.scores = torch.where(position // N == 1, torch.full_like(position, 2), position % 2).float()
    sel = Selection(batch_filter="dynamic_sampling")
    out = _run(make_args(estimator="group_norm", stablerl=sel), "group_norm", clone(exps))
    empty = _cat(out, "action_mask").sum(-1) == 0
    idx = _index(exps)
    assert torch.equal(empty, idx == 1)
    assert float(torch.cat([e.rewards for e in exps])[idx == 0].std()) == 0  # rewards alone would drop group 0


def test_simpletir_masks_void_turn_rows():
    exps = _flagged(make_experiences(seed=17), "void_turn", 3)
    sel = Selection(batch_filter="simpletir")
    out = _run(make_args(estimator="group_norm", stablerl=sel), "group_norm", clone(exps))
    void = torch.cat([e.info["void_turn"] for e in exps])
    assert 0 < int(void.sum()) < 12
    mask = _cat(out, "action_mask")
    assert float(mask[void].sum()) == 0 and torch.equal(mask[~void], _cat(exps, "action_mask")[~void])


def test_repeated_rows_are_refused(monkeypatch):
    exps = make_experiences(seed=18)
    real = stablerl.filter_batch

    def resampling(name, **kw):
        res = real(name, **kw)
        res.rows = torch.cat([res.rows, res.rows[:1]])
        res.response_mask = torch.cat([res.response_mask, res.response_mask[:1]])
        return res

    monkeypatch.setattr(stablerl.api, "filter_batch", resampling)  # what the advantage step calls
    with pytest.raises(stablerl.StableRLError, match="repeated rows"):
        _run(make_args(estimator="group_norm", stablerl=Selection(batch_filter="dynamic_sampling")), "group_norm", exps)


def test_shuffle_r1_without_resampling_keeps_its_pairs():
    exps = make_experiences(seed=19)
    sel = Selection(batch_filter="shuffle_r1", batch_filter_params={"shuffle": False})
    out = _run(make_args(estimator="group_norm", stablerl=sel), "group_norm", clone(exps))
    rows = torch.nonzero(_cat(out, "action_mask").sum(-1) > 0).reshape(-1)
    assert rows.numel() == 6  # one (max, min) pair of each group of four


def test_no_extension_is_the_plain_path():
    exps = make_experiences(seed=20, kl_scale=0.2)
    out = _run(make_args(estimator="group_norm", stablerl=Selection()), "group_norm", clone(exps))
    ref = ORIGINAL(make_maker(make_args(estimator="group_norm"), "group_norm", 0.01), clone(exps))
    _assert_same(out, ref)
    assert not any(k.startswith("stablerl/") for k in out[0].info)


# ----------------------------------------------------------------------------- selection, CLI, env route


def test_selection_validation_and_static_refusals():
    with pytest.raises(stablerl.UnknownNameError, match="did you mean 'fapo'"):
        adapter.resolve(stablerl.REWARD_SHAPER, "fap")
    # per-token entropy: the old-log-prob pass's (test_openrlhf_old_entropy)
    assert adapter.resolve(stablerl.BATCH_FILTER, "gtpo_entropy_filter") == "gtpo_entropy_filter"
    with pytest.raises(stablerl.UnknownNameError, match="keep_singletons"):
        Selection(batch_filter="dynamic_sampling", batch_filter_params={"keep_singleton": False}).validate()
    with pytest.raises(stablerl.StableRLError, match="stablerl_reward_shaper_params given"):
        Selection(reward_shaper_params={"scale": 0.1}).validate()
    assert {"d3s", "gtpo_entropy_filter"} <= set(adapter.openrlhf_choices(stablerl.BATCH_FILTER))
    assert adapter.openrlhf_choices(stablerl.REWARD_SHAPER) == ["fapo", "grpo_lambda", "redit"]


def test_env_route(monkeypatch):
    monkeypatch.setenv(adapter.ENV_REWARD_SHAPER, "redit")
    monkeypatch.setenv(adapter.ENV_REWARD_SHAPER_PARAMS, "scale=0.2")
    monkeypatch.setenv(adapter.ENV_BATCH_FILTER, "dynamic_sampling")
    sel = adapter.selection_from_args(make_args(estimator="group_norm"))
    assert (sel.reward_shaper, sel.reward_shaper_params) == ("redit", {"scale": 0.2})
    assert sel.batch_filter == "dynamic_sampling"
    env = adapter.add_setup_hook({})
    assert env["env_vars"][adapter.ENV_REWARD_SHAPER] == "redit"
    assert env["env_vars"][adapter.ENV_BATCH_FILTER] == "dynamic_sampling"
    monkeypatch.setenv(adapter.ENV_REWARD_SHAPER_PARAMS, "scal=0.2")
    with pytest.raises(stablerl.UnknownNameError, match="did you mean 'scale'"):
        adapter.add_setup_hook({})  # in the driver, before Ray starts
    monkeypatch.setenv(adapter.ENV_REWARD_SHAPER_PARAMS, "scale=0.2")
    monkeypatch.setenv(adapter.ENV_BATCH_FILTER, "d3s")  # reads the old-log-prob pass's entropy
    assert adapter.add_setup_hook({})["env_vars"]["RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"] == "0"
    monkeypatch.setenv(adapter.ENV_BATCH_FILTER_PARAMS, "scop=batch")
    with pytest.raises(stablerl.UnknownNameError, match="did you mean 'scope'"):
        adapter.add_setup_hook({})


BASE = ["--actor.model_name_or_path", "Qwen/Qwen3-0.6B", "--rollout.n_samples_per_prompt", "4"]


def test_cli_attaches_shaper_and_filter(monkeypatch):
    from orlhf_helpers import dry_run

    args, _ = dry_run(monkeypatch, BASE + [
        "--algo.advantage.estimator", "group_norm",
        "--algo.advantage.stablerl_reward_shaper", "redit",
        "--algo.advantage.stablerl_reward_shaper_params", "scale=0.05",
        "--algo.advantage.stablerl_batch_filter", "dynamic_sampling",
        "--algo.advantage.stablerl_batch_filter_params", '{"keep_singletons": false}',
    ])
    sel = args.stablerl
    assert sel.advantage_estimator is None
    assert (sel.reward_shaper, sel.reward_shaper_params) == ("redit", {"scale": 0.05})
    assert (sel.batch_filter, sel.batch_filter_params) == ("dynamic_sampling", {"keep_singletons": False})


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--algo.advantage.stablerl_reward_shaper", "fap"], ["'fap'", "did you mean 'fapo'"]),
        (["--algo.advantage.stablerl_batch_filter", "dynamic_samplin"], ["did you mean 'dynamic_sampling'"]),
        (["--algo.advantage.stablerl_batch_filter", "d3s", "--algo.advantage.stablerl_batch_filter_params",
          "k_inti=0.3"], ["did you mean 'k_init'"]),
        (["--algo.advantage.stablerl_reward_shaper", "redit", "--algo.advantage.stablerl_reward_shaper_params",
          "scael=0.1"], ["did you mean 'scale'"]),
        (["--algo.advantage.stablerl_batch_filter_params", "keep_singletons=false"],
         ["--algo.advantage.stablerl_batch_filter_params given, but no --algo.advantage.stablerl_batch_filter"]),
    ],
)
def test_cli_errors(capsys, argv, expected):
    from stablerl.adapters.openrlhf import train_ppo_ray as wrapper

    with pytest.raises(SystemExit) as e:
        wrapper.main(BASE + ["--algo.advantage.estimator", "group_norm"] + argv)
    assert e.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    for piece in expected:
        assert piece in err, (piece, err[-600:])


@pytest.mark.parametrize("module_name", ["openrlhf.trainer.ray.ppo_actor", "openrlhf.trainer.ray.ppo_critic"])
def test_a_step_with_every_row_dropped_trains_on_nothing_instead_of_nan(module_name):
    """OpenRLHF divides by the step's token / sequence counts: 0 for a step whose rows the filter all
    dropped. With a filter selected the patched normalisers give loss 0 and gradient 0, not NaN."""
    import importlib

    adapter.instrument(now=True)
    module = importlib.import_module(module_name)
    empty = torch.zeros(3, 5)
    filtering = SimpleNamespace(args=make_args(stablerl=Selection(batch_filter="dynamic_sampling")))
    plain = SimpleNamespace(args=make_args(stablerl=Selection()))
    assert float(get_loss_batch_info(plain, empty)["batch_num_tokens"]) == 0  # OpenRLHF's own: 0
    assert float(module.get_loss_batch_info(plain, empty)["batch_num_tokens"]) == 0  # no filter: untouched
    info = module.get_loss_batch_info(filtering, empty)
    assert float(info["batch_num_tokens"]) == 1 and float(info["global_batch_size"]) == 1
    g = torch.Generator().manual_seed(1)
    x = (-torch.rand(3, 5, generator=g)).requires_grad_(True)
    for token_level in (True, False):
        old, adv = -torch.rand(3, 5, generator=g), torch.randn(3, 5, generator=g)
        loss = PolicyLoss(token_level_loss=token_level)(x, old, adv, action_mask=empty, **info)[0]
        (grad,) = torch.autograd.grad(loss, x)
        assert float(loss.detach()) == 0 and float(grad.abs().sum()) == 0
    # the optimizer-step window: an empty window gets 1, a non-empty one keeps OpenRLHF's counts (/ gas)
    masks = [torch.zeros(2, 4), torch.zeros(2, 4), torch.ones(2, 4), torch.tensor([[1.0, 1, 0, 0], [0, 0, 0, 0]])]
    got = list(module.iter_grad_accum_global_norm(iter(masks), filtering, 2, lambda m: m))
    assert [float(i["batch_num_tokens"]) for _, i in got] == [1.0, 1.0, 5.0, 5.0]
    assert [float(i["global_batch_size"]) for _, i in got] == [1.0, 1.0, 1.5, 1.5]
    ref = list(module.iter_grad_accum_global_norm(iter(masks), plain, 2, lambda m: m))
    assert [float(i["batch_num_tokens"]) for _, i in ref] == [0.0, 0.0, 5.0, 5.0]


def test_describe_names_the_openrlhf_flags():
    from stablerl import frameworks

    lines = frameworks.config_lines(stablerl.get_spec(stablerl.REWARD_SHAPER, "fapo"))["openrlhf"]
    assert lines[1:] == ["  --algo.advantage.stablerl_reward_shaper fapo",
                         "  --algo.advantage.stablerl_reward_shaper_params flawed_reward_penalty=<value>"]
    assert "  --algo.advantage.stablerl_batch_filter dynamic_sampling" in frameworks.config_lines(
        stablerl.get_spec(stablerl.BATCH_FILTER, "dynamic_sampling"))["openrlhf"]
    d3s = frameworks.config_lines(stablerl.get_spec(stablerl.BATCH_FILTER, "d3s"))["openrlhf"]
    assert "  --algo.advantage.stablerl_batch_filter d3s" in d3s
    assert "  (entropy: the adapter has OpenRLHF's old-log-prob pass return it; no flag needed)" in d3s
    assert any("set n_init == n_final and k_init == k_final" in line for line in d3s)  # the schedule needs total steps
    for kind in (stablerl.REWARD_SHAPER, stablerl.BATCH_FILTER):  # one source: describe and the wrapper agree
        runnable = [s.name for s in stablerl.list_algorithms(kind) if "openrlhf" in frameworks.selectable_in(s)]
        assert runnable == adapter.openrlhf_choices(kind)
