"""The example third-party plugin (examples/plugin-template) is usable from verl and TRL by name alone.

Runs in the verl and TRL environments after ``pip install ./examples/plugin-template``; every test
skips, with the reason, where the plugin, the framework or the adapter is absent.
"""

import os

for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_k, _v)

import pytest  # noqa: E402

import stablerl  # noqa: E402

LOSS, ESTIMATOR = "example_reinforce", "example_mean_baseline"


@pytest.fixture(scope="module")
def example_plugin():
    pytest.importorskip("stablerl_example", reason="stablerl-example-plugin is not installed "
                        "(pip install ./examples/plugin-template)")
    names = {s.name for s in stablerl.list_algorithms()}
    assert {LOSS, ESTIMATOR} <= names, f"installed but not registered; failures: {stablerl.get_registry().failures}"


def test_verl_resolves_the_example_loss_and_estimator(example_plugin):
    pytest.importorskip("verl", reason="verl is not installed in this environment")
    import verl  # noqa: F401  - loads stablerl's verl.plugins entry point, which registers every name

    from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn

    assert callable(get_policy_loss_fn(LOSS))
    assert callable(get_adv_estimator_fn(ESTIMATOR))
    adapter = pytest.importorskip("stablerl.adapters.verl")
    assert adapter.VERL_NAMES["policy_loss"].get(LOSS) == LOSS
    assert adapter.VERL_NAMES["advantage_estimator"].get(ESTIMATOR) == ESTIMATOR


def test_trl_config_accepts_the_example_loss_and_estimator(example_plugin, tmp_path):
    pytest.importorskip("trl", reason="TRL is not installed in this environment")
    trl_adapter = pytest.importorskip("stablerl.adapters.trl")
    try:
        GRPOConfig = trl_adapter.GRPOConfig
    except (ImportError, AttributeError) as e:
        pytest.skip(f"stablerl.adapters.trl.GRPOConfig unavailable: {e}")
    args = GRPOConfig(
        loss_type=LOSS, advantage_estimator=ESTIMATOR, stablerl_loss_params={"is_cap": 3.0},
        output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none",
    )
    assert args.loss_type == LOSS
    assert trl_adapter.resolve_loss_type(LOSS) == LOSS
    with pytest.raises(stablerl.StableRLError, match="is_cap"):
        GRPOConfig(loss_type=LOSS, stablerl_loss_params={"is_cap": -1.0},
                   output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
