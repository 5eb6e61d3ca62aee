"""verl's real worker-side loss path ``verl.workers.utils.losses.ppo_loss`` runs stablerl losses,
and stablerl hyper-parameters reach them through ``StablePolicyLossConfig``."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

import stablerl


def _nt(xs):
    return torch.nested.as_nested_tensor(xs, layout=torch.jagged)


def _worker_batch(seed=0, dp_size=1, extra_tokens=0, extra_seqs=0, is_weights=False):
    """What an engine worker hands to ppo_loss: jagged tensors + global batch info."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(seed)
    P, R = [3, 2, 4, 1], [4, 3, 5, 2]
    fields = {
        "prompts": _nt([torch.arange(n) + 1 for n in P]),
        "responses": _nt([torch.arange(n) + 1 for n in R]),
        "response_mask": _nt([torch.ones(n) for n in R]),
        "old_log_probs": _nt([torch.randn(n, generator=g) * 0.3 - 1 for n in R]),
        "advantages": _nt([torch.full((n,), a) for n, a in zip(R, [1.0, -0.5, 0.7, -1.2])]),
    }
    if is_weights:
        fields["rollout_is_weights"] = _nt([0.5 + torch.rand(n, generator=g) for n in R])
    data = TensorDict(fields, batch_size=[len(R)])
    tu.assign_non_tensor(
        data, dp_size=dp_size, batch_num_tokens=sum(R) + extra_tokens, global_batch_size=len(R) + extra_seqs
    )
    leaves = [(torch.randn(p + r, generator=g) * 0.3 - 1).requires_grad_(True) for p, r in zip(P, R)]
    return data, leaves


def _run_ppo_loss(cfg, data, leaves):
    from verl.workers.utils.losses import ppo_loss

    loss, metrics = ppo_loss(cfg, {"log_probs": _nt(leaves)}, data)
    grads = torch.autograd.grad(loss, leaves)
    values = {k: float(v.aggregate()) if hasattr(v, "aggregate") else float(v) for k, v in metrics.items()}
    return loss.detach(), torch.cat(grads), values


def test_stablerl_vanilla_equals_verl_vanilla_through_ppo_loss(adapter, actor_config):
    from verl.workers.config import PolicyLossConfig

    for kw in ({}, {"dp_size": 2, "extra_tokens": 9, "extra_seqs": 3, "is_weights": True}):
        for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
            data, leaves = _worker_batch(**kw)
            common = dict(loss_agg_mode=mode, clip_ratio_low=0.1, clip_ratio_high=0.15, clip_ratio_c=2.0)
            ref = _run_ppo_loss(actor_config(policy_loss=PolicyLossConfig(loss_mode="vanilla"), **common), data, leaves)
            ours = _run_ppo_loss(
                actor_config(policy_loss=adapter.StablePolicyLossConfig(loss_mode="stablerl_vanilla"), **common),
                data,
                leaves,
            )
            torch.testing.assert_close(ours[0], ref[0], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(ours[1], ref[1], rtol=1e-6, atol=1e-7)
            assert ref[1].abs().sum() > 0
            for k in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/pg_loss"):
                assert ours[2][k] == pytest.approx(ref[2][k], rel=1e-6, abs=1e-7), k
            assert ours[2]["actor/pg_clipfrac"] > 0  # the clip bounds were active


@pytest.fixture
def spy(core_algos):
    """A loss registered in verl that records what ppo_loss passes to policy losses."""
    seen = {}

    def spy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                 rollout_is_weights=None, **kw):
        seen.update(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                    response_mask=response_mask, loss_agg_mode=loss_agg_mode, config=config,
                    rollout_is_weights=rollout_is_weights, info=dict(config.global_batch_info))
        return (log_prob * response_mask).sum() * 0, {}

    core_algos.register_policy_loss("_stablerl_test_spy")(spy_loss)
    yield seen
    core_algos.POLICY_LOSS_REGISTRY.pop("_stablerl_test_spy", None)


@pytest.mark.parametrize(
    "name, param, default_value, value",
    [("m2po", "m2_threshold", 0.04, 0.001), ("cpgd", "policy_drift_coef", 0.01, 0.5)],
)
def test_stablerl_loss_and_hyperparameter_through_ppo_loss(adapter, actor_config, spy, name, param, default_value, value):
    if name not in stablerl.get_registry().names("policy_loss"):
        pytest.skip(f"plugin {name} not present yet")
    PLC = adapter.StablePolicyLossConfig
    data, leaves = _worker_batch(seed=3, dp_size=2, extra_tokens=5, extra_seqs=2, is_weights=True)

    default = _run_ppo_loss(actor_config(policy_loss=PLC(loss_mode=name)), data, leaves)
    changed = _run_ppo_loss(actor_config(policy_loss=PLC(loss_mode=name, **{param: value})), data, leaves)
    explicit_default = _run_ppo_loss(actor_config(policy_loss=PLC(loss_mode=name, **{param: default_value})), data, leaves)
    assert abs(float(changed[0]) - float(default[0])) > 1e-4  # the hyper-parameter reached the loss
    torch.testing.assert_close(explicit_default[0], default[0], rtol=0, atol=0)  # None = algorithm default
    assert set(changed[2]) == set(default[2]) and all(k.startswith("actor/") for k in changed[2])

    # the value equals stablerl's framework-free API on exactly what verl passed to the loss
    _run_ppo_loss(actor_config(policy_loss=PLC(loss_mode="_stablerl_test_spy")), data, leaves)
    s = spy
    assert s["response_mask"].dtype == torch.bool and s["rollout_is_weights"] is not None
    assert s["info"] == {"dp_size": 2, "batch_num_tokens": 19, "global_batch_size": 6, "loss_scale_factor": None}
    params = {param: value}  # verl's actor keys are at verl's defaults: the paper's clip bounds apply
    expected, _ = stablerl.compute_policy_loss(
        name,
        log_prob=s["log_prob"].detach(),
        old_log_prob=s["old_log_prob"],
        advantages=s["advantages"],
        response_mask=s["response_mask"],
        is_weights=s["rollout_is_weights"],
        ctx=stablerl.Context(token_count=19, seq_count=6, dp_size=2),
        **params,
    )
    assert float(changed[0]) == pytest.approx(float(expected), rel=1e-6, abs=1e-7)


def test_bad_hyperparameter_value_fails_with_its_name(adapter, caplog):
    if "m2po" not in stablerl.get_registry().names("policy_loss"):
        pytest.skip("plugin m2po not present yet")
    PLC = adapter.StablePolicyLossConfig
    # fails where verl builds the actor config (driver and workers, before any rollout), naming it
    with pytest.raises(stablerl.StableRLError, match="m2_threshold"):
        PLC(loss_mode="m2po", m2_threshold=-1.0)
    with pytest.raises(stablerl.StableRLError, match="variant"):
        PLC(loss_mode="stablerl_m2po", variant="nope")
    PLC(loss_mode="vanilla", m2_threshold=-1.0)  # a verl loss: stablerl keys are not its business
    with caplog.at_level("WARNING", logger="stablerl.adapters.verl"):
        PLC(loss_mode="stablerl_vanilla", m2_threshold=0.1)  # a key of another algorithm
    assert "m2_threshold" in caplog.text and "ignored" in caplog.text


def test_policy_loss_config_fields(adapter):
    from verl.base_config import BaseConfig
    from verl.workers.config import PolicyLossConfig

    PLC = adapter.StablePolicyLossConfig
    assert issubclass(PLC, PolicyLossConfig) and PLC.__module__ == "stablerl.adapters.verl"
    names = {f.name for f in dataclasses.fields(PLC)}
    verl_names = {f.name for f in dataclasses.fields(PolicyLossConfig)}
    from stablerl.adapters.verl._translate import ACTOR_KEYS

    registered = set(adapter.VERL_NAMES["policy_loss"].values())
    assert {"vanilla", "m2po"} <= registered or "m2po" not in stablerl.get_registry().names("policy_loss")
    for spec in stablerl.list_algorithms("policy_loss"):
        for p in spec.params.field_names():
            if p in ACTOR_KEYS:
                assert p in names  # a stablerl key under policy_loss, above the actor's key (one precedence rule)
            elif spec.name in registered and p not in verl_names:
                assert p in names, (spec.name, p)
    # only what can run in verl: losses verl cannot feed (entropy, rollout log-probs...) add no keys
    owners = adapter.registration_report()["policy_loss_config_fields"]
    # the trainer-hook selection keys are the one exception: owned by the hook kind, not by a loss
    assert {k for k, algos in owners.items() if algos == ["(trainer hook)"]} == {"stablerl_trainer_hook",
                                                                              "stablerl_trainer_hook_params"}
    assert {k for k, algos in owners.items() if algos == ["(entropy controller)"]} == {
        "stablerl_entropy_controller", "stablerl_entropy_controller_params"}  # likewise the controller's keys
    assert all(set(algos) <= registered for k, algos in owners.items()
               if not k.startswith(("stablerl_trainer_hook", "stablerl_entropy_controller")))
    assert set(owners) == names - verl_names
    cfg = PLC(loss_mode="x")
    assert all(getattr(cfg, n) is None for n in names - verl_names)
    assert cfg.loss_mode == "x" and cfg.clip_cov_ratio == 0.0002  # verl's fields untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.loss_mode = "y"  # verl's BaseConfig semantics kept
    assert isinstance(cfg, BaseConfig) and cfg.get("loss_mode") == "x"
    again = pickle.loads(pickle.dumps(cfg))  # Ray ships configs by pickle
    assert type(again) is PLC and again == cfg


def test_hydra_target_route_builds_the_actor_config(adapter):
    """What the trainer does with ``actor_rollout_ref.actor`` (``omega_conf_to_dataclass`` with ``_target_``)."""
    from omegaconf import OmegaConf, open_dict
    from verl.utils.config import omega_conf_to_dataclass

    if "m2po" not in stablerl.get_registry().names("policy_loss"):
        pytest.skip("plugin m2po not present yet")
    base = {
        "_target_": "verl.workers.config.FSDPActorConfig",
        "strategy": "fsdp",
        "rollout_n": 1,
        "ppo_micro_batch_size_per_gpu": 2,
        "policy_loss": {"_target_": "stablerl.adapters.verl.StablePolicyLossConfig", "loss_mode": "m2po"},
    }
    conf = OmegaConf.create(base)
    OmegaConf.set_struct(conf, True)
    with open_dict(conf):  # what `+actor_rollout_ref.actor.policy_loss.m2_threshold=0.05` does
        conf.policy_loss.m2_threshold = 0.05
    actor = omega_conf_to_dataclass(conf)
    assert type(actor.policy_loss) is adapter.StablePolicyLossConfig
    assert actor.policy_loss.m2_threshold == 0.05 and actor.policy_loss.loss_mode == "m2po"

    bad = OmegaConf.create(base)
    bad.policy_loss.m2_treshold = 0.05  # typo: rejected by the dataclass
    with pytest.raises(Exception, match="m2_treshold"):
        omega_conf_to_dataclass(bad)


def _gspo_loss(adapter, actor_config, data, leaves, policy_loss=None, **actor):
    PLC = adapter.StablePolicyLossConfig
    cfg = actor_config(policy_loss=policy_loss or PLC(loss_mode="stablerl_gspo"), **actor)
    return _run_ppo_loss(cfg, data, leaves)


def _gspo_expected(spy_data, **params):
    s = spy_data
    return stablerl.compute_policy_loss(
        "gspo", log_prob=s["log_prob"].detach(), old_log_prob=s["old_log_prob"], advantages=s["advantages"],
        response_mask=s["response_mask"], ctx=stablerl.Context(token_count=19, seq_count=6, dp_size=2), **params,
    )[0]


def test_paper_defaults_win_over_verl_defaults_and_startup_says_so(adapter, actor_config, spy, capsys, caplog):
    """One precedence rule: stablerl key > a verl key the user set > the paper default. verl's actor
    clip keys always exist at verl's defaults (0.2/0.2/3.0); they must not replace GSPO's 3e-4/4e-4."""
    from stablerl import frameworks

    frameworks._LOGGED.clear()
    data, leaves = _worker_batch(seed=5, dp_size=2, extra_tokens=5, extra_seqs=2)
    _run_ppo_loss(actor_config(policy_loss=adapter.StablePolicyLossConfig(loss_mode="_stablerl_test_spy")), data, leaves)
    paper = _gspo_expected(spy)
    verl_bounds = _gspo_expected(spy, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert abs(float(paper) - float(verl_bounds)) > 1e-4  # the two settings give different losses here

    with caplog.at_level("WARNING", logger="stablerl.adapters.verl"):
        default = _gspo_loss(adapter, actor_config, data, leaves)  # no clip key set anywhere
    assert float(default[0]) == pytest.approx(float(paper), rel=1e-6, abs=1e-7)
    table = capsys.readouterr().err  # the effective-settings table, printed once per process
    assert "stablerl/verl: policy loss 'gspo' runs with" in table and "clip_ratio_low  = 0.0003" in table
    assert "actor_rollout_ref.actor.clip_ratio_low=0.2 is verl's default, not applied" in caplog.text
    assert "+actor_rollout_ref.actor.policy_loss.clip_ratio_low=0.2" in caplog.text  # the exact key to set

    # a verl key the user set (a value other than verl's default) applies
    user = _gspo_loss(adapter, actor_config, data, leaves, clip_ratio_low=0.1, clip_ratio_high=0.3)
    assert float(user[0]) == pytest.approx(float(_gspo_expected(spy, clip_ratio_low=0.1, clip_ratio_high=0.3)), rel=1e-6)
    # a stablerl key beats the verl key, even at verl's default value
    PLC = adapter.StablePolicyLossConfig
    forced = _gspo_loss(adapter, actor_config, data, leaves, clip_ratio_low=0.1,
                        policy_loss=PLC(loss_mode="stablerl_gspo", clip_ratio_low=0.2, clip_ratio_high=0.2))
    assert float(forced[0]) == pytest.approx(float(verl_bounds), rel=1e-6, abs=1e-7)


def test_delta_l_and_rollout_correction_by_stablerl_params(adapter, actor_config, spy):
    """+actor_rollout_ref.actor.policy_loss.stablerl_params={loss_agg_mode:delta_l} / {rollout_correction:tis}
    reach compute_policy_loss through verl's real ppo_loss (verl's own loss_agg_mode list never sees delta_l);
    verl's rollout_is weights and stablerl's correction together are refused, naming verl's switch."""
    PLC = adapter.StablePolicyLossConfig
    data, leaves = _worker_batch(seed=5)
    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(7)
    R = [4, 3, 5, 2]
    data["rollout_log_probs"] = _nt([torch.randn(n, generator=g) * 0.3 - 1 for n in R])
    _run_ppo_loss(actor_config(policy_loss=PLC(loss_mode="_stablerl_test_spy")), data, leaves)
    s = dict(spy)
    rollout = tu.get(data, "rollout_log_probs").to_padded_tensor(0.0)[:, : s["log_prob"].shape[1]]
    common = dict(log_prob=s["log_prob"].detach(), old_log_prob=s["old_log_prob"], advantages=s["advantages"],
                  response_mask=s["response_mask"], ctx=stablerl.Context(token_count=14, seq_count=4, dp_size=1))

    delta = _run_ppo_loss(actor_config(policy_loss=PLC(
        loss_mode="stablerl_vanilla", stablerl_params={"loss_agg_mode": "delta_l", "loss_agg_params": {"alpha": 0.5}})),
        data, leaves)
    expected, _ = stablerl.compute_policy_loss("vanilla", loss_agg_mode="delta_l", loss_agg_params={"alpha": 0.5},
                                               **common)
    token_mean, _ = stablerl.compute_policy_loss("vanilla", **common)
    assert float(delta[0]) == pytest.approx(float(expected), rel=1e-6, abs=1e-7)
    assert abs(float(expected) - float(token_mean)) > 1e-4

    tis = _run_ppo_loss(actor_config(policy_loss=PLC(
        loss_mode="stablerl_vanilla", stablerl_params={"rollout_correction": "tis",
                                                        "rollout_correction_params": {"threshold": 1.5}})),
        data, leaves)
    expected, _ = stablerl.compute_policy_loss("vanilla", rollout_log_prob=rollout, rollout_correction="tis",
                                               rollout_correction_params={"threshold": 1.5}, **common)
    assert float(tis[0]) == pytest.approx(float(expected), rel=1e-6, abs=1e-7)
    assert abs(float(expected) - float(token_mean)) > 1e-5

    with_weights, _ = _worker_batch(seed=5, is_weights=True)
    with_weights["rollout_log_probs"] = data["rollout_log_probs"]
    with pytest.raises(stablerl.StableRLError, match=r"applied on top of the framework's own.*"
                                                     r"algorithm.rollout_correction.rollout_is"):
        _run_ppo_loss(actor_config(policy_loss=PLC(loss_mode="stablerl_vanilla",
                                                   stablerl_params={"rollout_correction": "tis"})), with_weights, leaves)
    with pytest.raises(stablerl.StableRLError, match=r"loss_agg_mode.*'delta_ll'"):
        PLC(loss_mode="stablerl_vanilla", stablerl_params={"loss_agg_mode": "delta_ll"})
