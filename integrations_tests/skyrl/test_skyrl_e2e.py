"""SkyRL's real trainer end to end on CPU with a stablerl loss and a stablerl estimator, a checkpoint and a resume.

``python -m stablerl.adapters.skyrl.main``'s ``main`` (``e2e/launch.py``) in a local Ray cluster: SkyRL's
``RayPPOTrainer`` (as ``StableRayPPOTrainer``), its real FSDP policy worker (FSDP2 over gloo through the CPU shim,
``e2e/skyrl_cpu.py``) running ``PolicyWorkerBase._forward_backward_micro`` with the registered stablerl loss, SkyRL's
checkpointing and resume; a canned generator stands in for vLLM (``e2e/skyrl_e2e.py``). Run 1 trains one step
(``gmpo`` with ``stablerl_grpo``, 16 responses in 4 micro-batches of one mini-batch) and saves ``global_step_1``;
run 2 resumes from it and trains step 2. Run 3 trains one step with the inputs SkyRL's own loss and estimator calls
do not pass: ``pacs`` (prompt groups and scores carried to the update micro-batches), ``optimal_token_baseline``
(the old-log-prob pass's sum_pi_squared), the ``gtpo_entropy_filter`` batch filter (that pass's entropy) and the
``grpo_lambda`` reward shaper (``correct`` from the environment's metrics, SkyRL's ``env_metrics``). About
5 minutes on 2 cores.
"""

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("skyrl")
sys.path.insert(0, str(Path(__file__).parent / "e2e"))

import skyrl_harness as harness  # noqa: E402

#: run 3: a loss, an estimator and a filter reading inputs that only the adapter's providers feed
READS = {"trainer.algorithm.policy_loss_type": "pacs", "trainer.algorithm.advantage_estimator": "optimal_token_baseline",
         "trainer.algorithm.stablerl_batch_filter": "gtpo_entropy_filter",
         "trainer.algorithm.stablerl_reward_shaper": "grpo_lambda", "trainer.max_training_steps": 1,
         "trainer.ckpt_interval": -1}
SELECT = {"trainer.algorithm.policy_loss_type": "gmpo", "trainer.algorithm.advantage_estimator": "stablerl_grpo",
          "trainer.algorithm.stablerl_params.clip_ratio_high": 0.3}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import torch

    from skyrl_e2e import make_assets

    root = tmp_path_factory.mktemp("skyrl_e2e")
    make_assets(root)
    first = harness.launch(harness.overrides(root, **SELECT, **{"trainer.max_training_steps": 1}))
    second = harness.launch(harness.overrides(root, **SELECT, **{"trainer.max_training_steps": 2}))
    states = {}
    for step in (1, 2):
        path = root / "ckpt" / f"global_step_{step}" / "stablerl_state.pt"
        states[step] = torch.load(path, weights_only=False) if path.exists() else None
    return root, first, second, states


def test_first_run_trains_with_the_stablerl_loss_and_estimator(runs):
    _, (rc, out, metrics), _, states = runs
    assert rc == 0, out[-4000:]
    assert "stablerl/skyrl: policy loss 'gmpo' runs with:" in out
    assert "clip_ratio_high = 0.3" in out and "stablerl key: trainer.algorithm.stablerl_params.clip_ratio_high=0.3" in out
    assert "stablerl/skyrl: advantage estimator 'grpo' runs with:" in out
    assert len(metrics) == 1, out[-4000:]
    step = metrics[0]
    # the loss ran in SkyRL's worker: its metrics come back through SkyRL's loss_metrics, and it has a gradient
    assert "loss_metrics/stablerl/pg_clipfrac" in step and "loss_metrics/stablerl/ppo_kl" in step
    assert math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0
    # first update of the epoch: ratio 1, group-normalised advantages sum to 0 per group -> loss 0, nothing clipped
    assert abs(step["policy_loss"]) < 1e-5 and step["loss_metrics/stablerl/pg_clipfrac"] == 0.0
    assert states[1] is not None and states[1]["step"] == 1 and states[1]["holds"] == "driver"


def test_resume_restores_the_stablerl_state(runs):
    _, _, (rc, out, metrics), states = runs
    assert rc == 0, out[-4000:]
    assert "Resuming from global_step: 1" in out
    assert len(metrics) == 1 and math.isfinite(metrics[0]["grad_norm"]) and metrics[0]["grad_norm"] > 0
    # the advantage step counter continued from the checkpoint (1 + 1), not from 0
    assert states[2] is not None and states[2]["step"] == 2


@pytest.fixture(scope="module")
def reads(tmp_path_factory):
    from skyrl_e2e import make_assets

    root = tmp_path_factory.mktemp("skyrl_e2e_reads")
    make_assets(root)
    return harness.launch(harness.overrides(root, **READS))


def test_old_pass_statistics_and_loss_rows_in_the_real_trainer(reads):
    rc, out, metrics = reads
    assert rc == 0, out[-4000:]
    for line in ("policy loss 'pacs' runs with:", "advantage estimator 'optimal_token_baseline' runs with:"):
        assert f"stablerl/skyrl: {line}" in out
    assert len(metrics) == 1, out[-4000:]
    step = metrics[0]
    # pacs ran in SkyRL's worker on the carried groups / scores (its metrics come back through SkyRL's), with a
    # gradient; first update: ratio 1, so psi = 0 and PACS' group-balanced BCE is log 2 (the weights average to 1)
    assert "loss_metrics/stablerl/pacs/score_mean" in step and "loss_metrics/stablerl/pacs/psi_abs_mean" in step
    assert math.isfinite(step["grad_norm"]) and step["grad_norm"] > 0
    assert abs(step["policy_loss"] - math.log(2)) < 1e-5
