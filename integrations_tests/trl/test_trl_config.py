"""GRPOConfig: stablerl names and hyper-parameters validated at config time, settable through TRL's
CLI/YAML parser; the version guard."""

import types

import pytest

import trl_helpers as H  # noqa: F401,I001  (offline environment, skips without TRL)

import stablerl
from stablerl.adapters.trl import GRPOConfig, UnsupportedTRLVersionError, check_trl, resolve_loss_type

CPU = dict(output_dir="/tmp/stablerl-trl-config-test", use_cpu=True, bf16=False, report_to="none")


def test_unknown_loss_type_fails_at_config_time_with_nearest_match():
    with pytest.raises(stablerl.UnknownNameError, match=r"'m2p0' \(did you mean 'm2po'\?\)") as e:
        GRPOConfig(loss_type="m2p0", **CPU)
    assert "dapo" in str(e.value) and "trl's own: " in str(e.value)


def test_unknown_estimator_and_hyper_parameter_fail_at_config_time():
    with pytest.raises(stablerl.UnknownNameError, match="did you mean 'qae'"):
        GRPOConfig(advantage_estimator="qea", **CPU)
    with pytest.raises(stablerl.UnknownNameError, match="clip_ratio_high"):
        GRPOConfig(loss_type="vanilla", stablerl_loss_params={"clip_ratio_hihg": 0.3}, **CPU)
    with pytest.raises(stablerl.StableRLError, match="clip_ratio_low"):
        GRPOConfig(loss_type="vanilla", stablerl_loss_params={"clip_ratio_low": -1.0}, **CPU)
    with pytest.raises(stablerl.StableRLError, match="JSON"):
        GRPOConfig(loss_type="vanilla", stablerl_loss_params="{not json", **CPU)
    with pytest.raises(stablerl.UnknownNameError, match="stablerl_loss_agg_mode"):
        GRPOConfig(loss_type="vanilla", stablerl_loss_agg_mode="token_mean", **CPU)


def test_builtin_names_stay_trl_and_prefix_selects_stablerl():
    assert resolve_loss_type("dapo") is None
    assert resolve_loss_type("cispo") is None  # TRL's cispo (absolute cap)
    assert resolve_loss_type("stablerl_cispo") == "cispo"
    assert resolve_loss_type("vanilla") == "vanilla"
    with pytest.raises(stablerl.StableRLError, match="stablerl_cispo"):
        GRPOConfig(loss_type="cispo", stablerl_loss_params={"clip_ratio_high": 4.0}, **CPU)
    with pytest.raises(stablerl.UnknownNameError):
        resolve_loss_type("stablerl_dapo")


def test_inputs_trl_cannot_feed_are_refused_at_config_time():
    with pytest.raises(stablerl.MissingInputError, match="hidden_states: TRL's forward in _compute_loss"):
        GRPOConfig(loss_type="capo", **CPU)
    # turn ids are optional (the loss mask's runs of trained tokens): turn_ppo is accepted
    assert GRPOConfig(loss_type="turn_ppo", **CPU).loss_type == "turn_ppo"


def test_estimator_refuses_normalize_then_sum():
    with pytest.raises(stablerl.StableRLError, match="multi_objective_aggregation='normalize_then_sum' has no effect"):
        GRPOConfig(advantage_estimator="grpo", multi_objective_aggregation="normalize_then_sum", **CPU)


def test_trl_parser_cli_and_yaml(tmp_path):
    from trl import TrlParser

    parser = TrlParser((GRPOConfig,))
    (args,) = parser.parse_args_and_config(
        args=["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false", "--loss_type", "m2po",
              "--advantage_estimator", "qae", "--stablerl_loss_params", '{"m2_threshold": 0.05}',
              "--stablerl_advantage_params", '{"quantile_k": 0.6}', "--stablerl_loss_agg_mode", "seq-mean-token-mean"]
    )
    assert (args.loss_type, args.advantage_estimator) == ("m2po", "qae")
    assert args.stablerl_loss_params == {"m2_threshold": 0.05}
    assert args.stablerl_advantage_params == {"quantile_k": 0.6}
    assert args.stablerl_loss_agg_mode == "seq-mean-token-mean"

    config = tmp_path / "grpo.yaml"
    config.write_text(
        f"output_dir: {tmp_path}\nuse_cpu: true\nbf16: false\nloss_type: gspo\n"
        "stablerl_loss_params:\n  clip_ratio_low: 0.0003\n  clip_ratio_high: 0.0004\nadvantage_estimator: rloo\n"
    )
    (args,) = parser.parse_args_and_config(args=["--config", str(config)])
    assert args.loss_type == "gspo" and args.advantage_estimator == "rloo"
    assert args.stablerl_loss_params == {"clip_ratio_low": 0.0003, "clip_ratio_high": 0.0004}


def test_version_guard_names_the_supported_range(monkeypatch):
    import trl

    fake = types.SimpleNamespace(__version__="1.17.0", GRPOTrainer=trl.GRPOTrainer)
    monkeypatch.delenv("STABLERL_TRL_SKIP_VERSION_CHECK", raising=False)
    with pytest.raises(UnsupportedTRLVersionError, match=r"trl>=1\.16,<1\.17.*found trl 1\.17\.0"):
        check_trl(fake)
    fake.__version__ = "1.15.2"
    with pytest.raises(UnsupportedTRLVersionError, match="1.15.2"):
        check_trl(fake)
    monkeypatch.setenv("STABLERL_TRL_SKIP_VERSION_CHECK", "1")
    with pytest.warns(RuntimeWarning, match="supports trl>=1.16"):
        check_trl(fake)

    class Drifted(trl.GRPOTrainer):  # a private signature changed: always an error
        def _calculate_rewards(self, inputs, prompts):
            pass

    fake = types.SimpleNamespace(__version__="1.16.0", GRPOTrainer=Drifted)
    with pytest.raises(UnsupportedTRLVersionError, match="_calculate_rewards"):
        check_trl(fake)
    check_trl(trl)  # the installed one passes


def test_one_precedence_rule_for_loss_hyperparameters():
    """stablerl_loss_params > TRL's epsilon/epsilon_high when set > the paper's defaults."""
    from stablerl.adapters.trl.trainer import loss_settings
    from stablerl.frameworks import FROM_FRAMEWORK_KEY, FROM_PAPER_DEFAULT, FROM_STABLERL_KEY, as_params

    def effective(**kw):
        return {s.name: (s.value, s.source) for s in loss_settings(GRPOConfig(**CPU, **kw), kw["loss_type"])}

    gspo = effective(loss_type="gspo")  # TRL's epsilon at its default 0.2: GSPO's own bounds
    assert gspo == {"clip_ratio_low": (3e-4, FROM_PAPER_DEFAULT), "clip_ratio_high": (4e-4, FROM_PAPER_DEFAULT)}
    user = effective(loss_type="vanilla", epsilon=0.1, epsilon_high=0.3)
    assert user["clip_ratio_low"] == (0.1, FROM_FRAMEWORK_KEY) and user["clip_ratio_high"] == (0.3, FROM_FRAMEWORK_KEY)
    forced = effective(loss_type="vanilla", epsilon=0.1, stablerl_loss_params={"clip_ratio_low": 0.2})
    assert forced["clip_ratio_low"] == (0.2, FROM_STABLERL_KEY) and forced["clip_ratio_c"] == (3.0, FROM_PAPER_DEFAULT)
    assert as_params(loss_settings(GRPOConfig(**CPU, loss_type="gspo"), "gspo")) == {}


def test_scale_rewards_is_honoured_or_refused():
    from stablerl.adapters.trl.trainer import advantage_settings
    from stablerl.frameworks import as_params

    off = GRPOConfig(advantage_estimator="grpo", scale_rewards="none", **CPU)
    assert as_params(advantage_settings(off, "grpo")) == {"norm_adv_by_std_in_grpo": False}
    assert as_params(advantage_settings(GRPOConfig(advantage_estimator="grpo", **CPU), "grpo")) == {}
    with pytest.raises(stablerl.StableRLError, match="scale_rewards='batch'.*'grpo'"):
        GRPOConfig(advantage_estimator="grpo", scale_rewards="batch", **CPU)
    with pytest.raises(stablerl.StableRLError, match="scale_rewards='none' has no effect.*'rloo'"):
        GRPOConfig(advantage_estimator="rloo", scale_rewards="none", **CPU)
    # reinforce_ada's paper default (False) is not replaced by TRL's default scale_rewards='group'
    ada = advantage_settings(GRPOConfig(advantage_estimator="rloo", **CPU), "reinforce_ada")
    assert {s.name: s.value for s in ada}["norm_adv_by_std_in_grpo"] is False


def test_effective_settings_are_printed_at_trainer_start(tmp_path, capsys):
    from stablerl import frameworks
    from stablerl.adapters.trl import GRPOTrainer

    frameworks._LOGGED.clear()
    args = GRPOConfig(**H.base_kwargs(tmp_path, loss_type="gspo", advantage_estimator="qae",
                                      stablerl_advantage_params={"quantile_k": 0.6}))
    GRPOTrainer(model=H.tiny_model(0), reward_funcs=H.binary_digit_reward, args=args,
                train_dataset=H.build_dataset(8), processing_class=H.TOKENIZER)
    err = capsys.readouterr().err
    assert "stablerl/trl: policy loss 'gspo' runs with:" in err
    assert "clip_ratio_low  = 0.0003  (paper default: stablerl_loss_params={\"clip_ratio_low\": <value>})" in err
    assert "quantile_k" in err and "(stablerl key: stablerl_advantage_params={\"quantile_k\": 0.6})" in err
