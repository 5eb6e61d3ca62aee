"""OpenRLHF's column of the cross-framework parity matrix (see integrations_tests/parity/parity_matrix.py).

The shared batch goes through the OpenRLHF adapter's real code: the policy loss that
``stablerl.adapters.openrlhf`` builds from OpenRLHF args (``build_policy_loss``, what the patched
``ActorPPOTrainer`` uses; declared inputs OpenRLHF's loss call lacks are handed over with ``feed``,
as its ``training_step`` patch does) and the patched
``RemoteExperienceMaker.compute_advantages_and_returns`` (rollouts as two experiences of different
padded widths, no KL). Hyper-parameters go where an OpenRLHF user sets them: the clip flags
(``--actor.eps_clip_low_high``, ``--actor.dual_clip``, as if given on the command line) and
``--actor.stablerl_params`` / ``--algo.advantage.stablerl_params`` for the rest
(``parity_matrix.SETTINGS``: all of them, or none). ``--reward.clip_range`` keeps OpenRLHF's default (-10, 10).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (nox -s openrlhf installs it)")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parity"))

import parity_matrix as M  # noqa: E402
from orlhf_helpers import make_args, make_maker  # noqa: E402

import stablerl  # noqa: E402
import stablerl.adapters.openrlhf as adapter  # noqa: E402
from stablerl.adapters.openrlhf import Selection  # noqa: E402
from stablerl.adapters.openrlhf._inputs import SUM_PI_SQUARED_KEY  # noqa: E402

FRAMEWORK = "openrlhf"
ALGORITHMS = M.matrix_algorithms()
CLIP_FLAGS = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")
results = M.Results.fixture(FRAMEWORK)


def _loss_fn(name, mode, params):
    from stablerl.adapters.openrlhf._loss import build_policy_loss
    from stablerl.adapters.openrlhf.train_ppo_ray import explicit_clip_flags

    spec = stablerl.get_spec(M.POLICY_LOSS, name)
    params = dict(params)
    clip = {k: params.pop(k) for k in CLIP_FLAGS if k in params}
    argv = []  # the clip flags given on the command line
    if "clip_ratio_low" in clip or "clip_ratio_high" in clip:
        argv.append("--actor.eps_clip_low_high")
    if clip.get("clip_ratio_c") is not None:
        argv.append("--actor.dual_clip")
    rollout = "rollout_log_prob" in spec.requires
    args = make_args(
        policy_loss_type=M.selection_name(FRAMEWORK, spec),
        eps=(clip.get("clip_ratio_low", 0.2), clip.get("clip_ratio_high", 0.2)),
        dual_clip=clip.get("clip_ratio_c"),
        loss_agg_mode=mode,
        # OpenRLHF passes rollout (vLLM) log-probs only with its IS correction on
        is_level="token" if rollout else "off",
    )
    selection = Selection(policy_loss=name, policy_loss_params=params,
                          openrlhf_clip=explicit_clip_flags(args, argv)).validate()  # as the wrapper CLI reads them
    return build_policy_loss(args, selection), rollout


def _through_policy_loss(name, b, mode, params):
    loss_fn, rollout = _loss_fn(name, mode, params)
    mask = b["response_mask"]
    # what training_step hands over
    loss_fn.feed({k: b[k] for k in ("entropy", "token_ids", "scores", "index", "old_entropy", "versions",
                                     "policy_version")})
    leaf = b["log_prob"].clone().requires_grad_(True)
    loss = loss_fn(
        leaf, b["old_log_prob"], b["advantages"], action_mask=mask,
        rollout_log_probs=b["rollout_log_prob"] if rollout else None,
        dp_size=1, batch_num_tokens=mask.sum().float(), global_batch_size=torch.tensor(float(mask.shape[0])),
    )[0]
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad


def _experiences(b, split, with_sum_pi_squared=False, old_entropy=False, teacher=False):
    """The rollout as OpenRLHF's trainer hands it over: experiences cut to their own padded width."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    from stablerl.adapters.openrlhf._inputs import OLD_ENTROPY_KEY

    out = []
    for rows in (slice(0, split), slice(split, None)):
        mask = b["response_mask"][rows].bool()
        width = int(mask.sum(-1).max())
        lengths = mask.sum(-1)
        # the old-log-prob pass: its log-probs, and its sum_pi_squared / entropy where the adapter asked for them
        # (_inputs.py: sum_pi_squared for optimal_token_baseline, entropy for empg)
        info = {SUM_PI_SQUARED_KEY: b["sum_pi_squared"][rows, :width].clone()} if with_sum_pi_squared else {}
        if old_entropy:
            info[OLD_ENTROPY_KEY] = b["entropy"][rows][:, :width].clone()
        out.append(Experience(action_mask=mask[:, :width], rewards=b["scores"][rows].clone(), kl=None,
                              action_log_probs=b["old_log_prob"][rows, :width].clone(),
                              index=list(range(b["scores"].numel()))[rows], response_length=lengths.float(), info=info))
        if teacher:  # the reference model loading the teacher, with --algo.kl.use_loss (on_policy_distillation)
            out[-1].base_action_log_probs = b["teacher_log_prob"][rows, :width].clone()
    return out


def _through_experience_maker(name, b, params):
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    from stablerl.adapters.openrlhf.train_ppo_ray import explicit_advantage_flags

    adapter.instrument(now=True)  # patches OpenRLHF now (the setup hook does it in workers)
    params = dict(params)
    argv = ["--algo.advantage.no_std_norm"] if params.pop(M.NO_STD_KNOB, False) else []
    flag = M.selection_name(FRAMEWORK, stablerl.get_spec(M.ADVANTAGE_ESTIMATOR, name))  # --algo.advantage.estimator
    selection = Selection(advantage_estimator=adapter.resolve(stablerl.ADVANTAGE_ESTIMATOR, flag),
                          advantage_params=params)
    assert selection.advantage_estimator == name
    args = make_args(estimator=flag, n_samples=b["group_size"], stablerl=selection)
    args.algo.advantage.no_std_norm = bool(argv)
    # the advantage flags the user gave, as the wrapper CLI reads them (--reward.clip_range: not given)
    selection.openrlhf_advantage, selection.reward_clip_range = explicit_advantage_flags(args, argv)
    selection.validate()
    experiences = RemoteExperienceMaker.compute_advantages_and_returns(
        make_maker(args, flag, kl_coef=0.0),
        _experiences(b, split=5, with_sum_pi_squared="sum_pi_squared" in selection.old_pass_stats(),
                     old_entropy="entropy" in M.advantage_inputs(name, b),
                     teacher="teacher_log_prob" in M.advantage_inputs(name, b)))
    T = b["response_mask"].shape[1]
    adv = torch.cat([torch.nn.functional.pad(e.advantages, (0, T - e.advantages.shape[1])) for e in experiences])
    return adv * b["response_mask"]


@pytest.mark.parametrize("kind, name", ALGORITHMS, ids=[f"{k}:{n}" for k, n in ALGORITHMS])
def test_parity_matrix(results, kind, name):
    M.check_case(results, kind, name, _through_policy_loss, _through_experience_maker)
