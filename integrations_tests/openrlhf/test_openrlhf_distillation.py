"""On-policy distillation in OpenRLHF 0.11.2: the reference model loads the teacher (--algo.advantage.
stablerl_teacher_model, vocabulary checked) and its log-probs feed on_policy_distillation inside the real
RemoteExperienceMaker.compute_advantages_and_returns, from base_action_log_probs (--algo.kl.use_loss) or read back
exactly from OpenRLHF's k1 kl; OpenRLHF's KL reward to the reference (now the teacher) is left out."""

from types import SimpleNamespace

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (nox -s openrlhf installs it)")

import torch

import stablerl
import stablerl.adapters.openrlhf as adapter
from orlhf_helpers import make_args, make_experiences, make_maker
from stablerl.adapters.openrlhf import Selection
from stablerl.params import MissingInputError, StableRLError

from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker


def _experiences(seed=0, use_loss=True):
    """OpenRLHF experiences with the old pass's log-probs and the reference's (the teacher's), as make_experience
    leaves them: base_action_log_probs with --algo.kl.use_loss (kl zero), else k1 kl = old - ref and no base."""
    exps = make_experiences(seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    teachers = []
    for e in exps:
        mask = e.action_mask
        old = -torch.rand(mask.shape, generator=g) * 2 - 0.05
        teacher = -torch.rand(mask.shape, generator=g) * 2 - 0.05
        e.action_log_probs = old * mask
        if use_loss:
            e.base_action_log_probs, e.kl = teacher * mask, torch.zeros(mask.shape)
        else:
            e.base_action_log_probs, e.kl = None, (old - teacher) * mask
        teachers.append(teacher * mask)
    return exps, teachers


def _run(exps, kl_estimator="k1", kl_coef=0.05, params=None):
    adapter.instrument(now=True)
    sel = Selection(advantage_estimator=adapter.resolve(stablerl.ADVANTAGE_ESTIMATOR, "on_policy_distillation"),
                    advantage_params=params or {})
    args = make_args(estimator="on_policy_distillation", stablerl=sel)
    args.algo.kl.estimator = kl_estimator
    return RemoteExperienceMaker.compute_advantages_and_returns(make_maker(args, "on_policy_distillation", kl_coef),
                                                                exps)


@pytest.mark.parametrize("use_loss", [True, False])
def test_the_reference_s_log_probs_feed_the_distillation_advantage(use_loss):
    exps, teachers = _experiences(use_loss=use_loss)
    olds = [e.action_log_probs.clone() for e in exps]
    out = _run(exps, params={"kl_coef": 0.5})
    for e, old, teacher in zip(out, olds, teachers):
        mask = e.action_mask.float()
        # per token, and no KL reward to the reference (the teacher) on top: OpenRLHF's would add
        # cumsum_reversed(-0.05 * kl), which is nonzero here under k1
        torch.testing.assert_close(e.advantages, 0.5 * (teacher - old) * mask, rtol=1e-6, atol=1e-6)


def test_kl_of_another_estimator_or_clamped_is_refused():
    exps, _ = _experiences(use_loss=False)
    with pytest.raises(MissingInputError, match="k1"):
        _run(exps, kl_estimator="k3")
    exps, _ = _experiences(use_loss=False)
    exps[0].kl[0, 0] = 10.0  # OpenRLHF clamps kl to [-10, 10]: the teacher's log-prob is lost there
    exps[0].action_mask[0, 0] = True
    with pytest.raises(StableRLError, match="clamp"):
        _run(exps)
    exps, _ = _experiences(use_loss=False)
    for e in exps:
        e.kl = None  # no reference model ran
    with pytest.raises(MissingInputError, match="stablerl_teacher_model"):
        _run(exps)


def _model_dir(path, vocab_size):
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1).save_pretrained(path)
    return str(path)


def test_the_reference_group_loads_the_teacher_with_the_same_vocabulary(tmp_path):
    adapter.instrument(now=True)
    from openrlhf.trainer.ray import launcher

    calls = []
    handle = SimpleNamespace(init_model_from_pretrained=SimpleNamespace(remote=lambda *a, **k: calls.append(a)))
    student, teacher = _model_dir(tmp_path / "student", 64), _model_dir(tmp_path / "teacher", 64)
    strategy = SimpleNamespace(args=make_args())
    strategy.args.algo.advantage.stablerl_teacher_model = teacher

    def group(actor_type):
        g = launcher.RayActorGroup.__new__(launcher.RayActorGroup)
        g.ray_actor_type, g._actor_handlers = actor_type, [handle]
        return g

    group(launcher.ReferenceModelActor).async_init_model_from_pretrained(strategy, student)
    assert calls[-1] == (strategy, teacher)
    # another group (the policy, the reward model) keeps its checkpoint
    group(object).async_init_model_from_pretrained(strategy, student)
    assert calls[-1] == (strategy, student)
    # no teacher set: the reference keeps the actor's checkpoint (OpenRLHF's behaviour)
    strategy.args.algo.advantage.stablerl_teacher_model = None
    group(launcher.ReferenceModelActor).async_init_model_from_pretrained(strategy, student)
    assert calls[-1] == (strategy, student)
    # a teacher with another vocabulary is refused before any model loads
    strategy.args.algo.advantage.stablerl_teacher_model = _model_dir(tmp_path / "other", 80)
    n = len(calls)
    with pytest.raises(StableRLError, match="vocabulary has 80 tokens and the student.s 64"):
        group(launcher.ReferenceModelActor).async_init_model_from_pretrained(strategy, student)
    assert len(calls) == n


def test_the_wrapper_cli_has_the_teacher_flag():
    from stablerl.adapters.openrlhf import train_ppo_ray
    from stablerl.adapters.openrlhf._flags import TEACHER_FLAG

    flags = [flag for flag, _ in train_ppo_ray._stablerl_flags(stablerl.ADVANTAGE_ESTIMATOR)]
    assert TEACHER_FLAG in flags
    spec = stablerl.get_spec(stablerl.ADVANTAGE_ESTIMATOR, "on_policy_distillation")
    from stablerl.frameworks import get_framework, reach

    state, _ = reach(get_framework("openrlhf"), spec)
    assert state == "partial"
