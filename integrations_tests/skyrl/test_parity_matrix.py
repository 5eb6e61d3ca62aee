"""SkyRL's column of the cross-framework parity matrix (see integrations_tests/parity/parity_matrix.py).

The shared batch goes through the SkyRL adapter's real code: a config built by SkyRL's own parser with the stablerl
keys (``config_class``), the policy loss SkyRL's ``PolicyLossRegistry`` returns for the selection name, fed the
advantages and loss mask the entry point's trainer makes (``StableRayPPOTrainer._normalize_advantages``: SkyRL's
pre-scaling, then the take-over) and called once on the whole batch as ``_forward_backward_micro`` calls it (the sum over
micro-batches is test_skyrl_loss.py's);
estimators through SkyRL's ``ppo_utils.compute_advantages_and_returns`` (its registry) with the trainer's batch as
the adapter's pending record (old log-probs). Hyper-parameters go where a SkyRL user sets them: SkyRL's own keys for
the clip ratios, SAPO's taus and grpo_norm_by_std, ``trainer.algorithm.stablerl_params`` /
``stablerl_advantage_params`` for the rest.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("skyrl", reason="SkyRL is not installed (nox -s skyrl installs it)")

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parity"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import parity_matrix as M  # noqa: E402
import skyrl_helpers as H  # noqa: E402

import stablerl  # noqa: E402
import stablerl.adapters.skyrl as adapter  # noqa: E402

FRAMEWORK = "skyrl"
ALGORITHMS = M.matrix_algorithms()
#: stablerl hyper-parameter -> SkyRL's own key for it
OWN_KEYS = {"clip_ratio_low": "eps_clip_low", "clip_ratio_high": "eps_clip_high", "clip_ratio_c": "clip_ratio_c",
            "tau_pos": "sapo.tau_pos", "tau_neg": "sapo.tau_neg"}
results = M.Results.fixture(FRAMEWORK)


@pytest.fixture(scope="module", autouse=True)
def _registered():
    adapter.instrument()
    yield
    adapter.uninstrument()


def _value(v) -> str:
    if isinstance(v, str) and (not v or v.replace(".", "", 1).isdigit()):
        return f"'{v}'"  # a string that reads as a number or null (pacs' reward_method="1", task_estimator="")
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _through_policy_loss(name, b, mode, params):
    spec = stablerl.get_spec(M.POLICY_LOSS, name)
    args = [f"trainer.algorithm.policy_loss_type={M.selection_name(FRAMEWORK, spec)}",
            f"trainer.algorithm.loss_reduction={H.MODES[mode]}", "trainer.algorithm.stablerl_reduction=true"]
    for key, value in params.items():
        own = OWN_KEYS.get(key)
        args.append(f"trainer.algorithm.{own}={_value(value)}" if own and value is not None
                    else f"trainer.algorithm.stablerl_params.{key}={_value(value)}")
    return H.worker_loss(H.make_config(*args), b, rollout="rollout_log_prob" in spec.requires)


def _through_estimator(name, b, params):
    from skyrl.backends.skyrl_train.utils import ppo_utils

    spec = stablerl.get_spec(M.ADVANTAGE_ESTIMATOR, name)
    params = dict(params)
    args = [f"trainer.algorithm.advantage_estimator={M.selection_name(FRAMEWORK, spec)}"]
    if params.pop(M.NO_STD_KNOB, False):
        args.append("trainer.algorithm.grpo_norm_by_std=false")
    for key, value in params.items():
        args.append(f"trainer.algorithm.grpo_norm_by_std={_value(value)}" if key == "norm_adv_by_std_in_grpo"
                    else f"trainer.algorithm.stablerl_advantage_params.{key}={_value(value)}")
    algorithm = H.make_config(*args).trainer.algorithm
    # the trainer's batch (StableRayPPOTrainer sets it): the old-log-prob pass's log-probs, entropy and sum_pi_squared
    # (its fwd_logprobs_values_reward), the reference model's (the teacher's) log-probs
    host = {"action_log_probs": b["old_log_prob"], "stablerl_old_entropy": b["entropy"],
            "stablerl_sum_pi_squared": b["sum_pi_squared"], "base_action_log_probs": b["teacher_log_prob"]}
    state = adapter.SkyRLAdapter()
    state.pending = host
    try:
        adv, _ = ppo_utils.compute_advantages_and_returns(
            token_level_rewards=b["token_level_rewards"], response_mask=b["response_mask"],
            index=np.array([str(int(i)) for i in b["index"]]), adv_estimator=algorithm.advantage_estimator,
            config=algorithm, values=None, gamma=algorithm.gamma, lambd=algorithm.lambd,
            grpo_norm_by_std=algorithm.grpo_norm_by_std)
    finally:
        state.pending = None
    return adv * b["response_mask"]


@pytest.mark.parametrize("kind, name", ALGORITHMS, ids=[f"{k}:{n}" for k, n in ALGORITHMS])
def test_parity_matrix(results, kind, name):
    M.check_case(results, kind, name, _through_policy_loss, _through_estimator)
