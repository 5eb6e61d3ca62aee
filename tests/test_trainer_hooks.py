"""The trainer_hook kind (core) and its built-ins: sfpo, reinforce_ada_sampler; the adaptive_entropy controller.

SFPO is checked on a toy model with plain SGD, where the paper's unified form is exact:
theta_{s+1} = theta0 - lr [alpha sum_{k<K} g(theta_k) + g(theta~)].
"""

import math

import pytest
import torch

import stablerl
from stablerl import ParamsView, PromptStats, TrainerHook
from stablerl.frameworks import get_framework, reach
from stablerl.plugins.sfpo import entropy_zscore


def quadratic_setup(seed=0):
    torch.manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    target = torch.randn(5, dtype=torch.float64)
    opt = torch.optim.SGD([w], lr=0.1)
    return w, target, opt


def loss_grad(w, target):
    return 2 * (w.detach() - target) * torch.arange(1, 6, dtype=torch.float64)


def sgd_pass(w, target, opt):
    opt.zero_grad()
    loss = ((w - target) ** 2 * torch.arange(1, 6, dtype=torch.float64)).sum()
    loss.backward()
    opt.step()


def test_sfpo_schedule_equals_the_unified_form_under_sgd():
    K, alpha, lr = 3, 0.8, 0.1
    w, target, opt = quadratic_setup()
    hook = stablerl.make_trainer_hook("sfpo", inner_steps=K, alpha=alpha, zscore_window=0)
    view = ParamsView(parameters=lambda: [w], optimizer=opt)
    theta0 = w.detach().clone()
    # the unified form, written from the paper
    grads, theta = [], theta0.clone()
    for _ in range(K):
        grads.append(loss_grad(theta, target))
        theta = theta - lr * grads[-1]
    tilde = theta0 + alpha * (theta - theta0)
    expected = theta0 - lr * (alpha * sum(grads) + loss_grad(tilde, target))
    assert hook.passes_per_batch() == K + 1
    hook.before_batch(view)
    for k in range(K + 1):
        sgd_pass(w, target, opt)
        out = hook.after_pass(view, k, entropy=1.0)
        if k == K - 1:
            assert out["repositioned"] is True
            torch.testing.assert_close(w.detach(), tilde, rtol=1e-12, atol=1e-12)
            assert out["fast_drift"] == pytest.approx(float((theta - theta0).norm()), rel=1e-12)
            assert out["reposition_shift"] == pytest.approx((1 - alpha) * out["fast_drift"], rel=1e-9)
    torch.testing.assert_close(w.detach(), expected, rtol=1e-12, atol=1e-12)
    assert hook.batches == 1 and hook.entropy_history == [1.0]


def test_sfpo_alpha_one_is_plain_multi_epoch_and_zero_resets():
    w, target, opt = quadratic_setup()
    hook = stablerl.make_trainer_hook("sfpo", inner_steps=2, alpha=0.0, zscore_window=0)
    view = ParamsView(parameters=lambda: [w])
    theta0 = w.detach().clone()
    hook.before_batch(view)
    for k in range(2):
        sgd_pass(w, target, opt)
        hook.after_pass(view, k)
    assert torch.equal(w.detach(), theta0)  # alpha = 0: back to theta0 before the slow pass


def test_sfpo_zscore_stop_rule_matches_the_reference_formula():
    history = [1.0, 1.2, 0.9, 1.1, 2.0]
    recent = history[-4:]
    mu = sum(recent) / 4
    std = math.sqrt(sum((h - mu) ** 2 for h in recent) / 4) + 1e-9  # population std, as numpy's default
    assert entropy_zscore(history, 4) == pytest.approx((2.0 - mu) / std, rel=1e-12)
    assert entropy_zscore(history[:3], 4) is None
    hook = stablerl.make_trainer_hook("sfpo", inner_steps=1, alpha=0.5, zscore_window=3, zscore_threshold=1.0)
    w, target, opt = quadratic_setup()
    view = ParamsView(parameters=lambda: [w])
    stopped_at = None
    for s, h in enumerate([1.0, 1.0, 1.0, 1.01, 5.0, 0.1]):
        passes = hook.passes_per_batch()
        hook.before_batch(view)
        for k in range(passes):
            out = hook.after_pass(view, k, entropy=h)
        if hook.stopped and stopped_at is None:
            stopped_at = s
    # [1, 1, 1.01]: z = (1.01 - 1.00333) / 0.0047 = 1.41 >= 1 -> stops after batch 3 (index 3)
    assert stopped_at == 3
    assert hook.passes_per_batch() == 1 and out["alpha"] == 0.0 and out["active"] is False
    state = hook.state_dict()
    fresh = stablerl.make_trainer_hook("sfpo", inner_steps=1, alpha=0.5, zscore_window=3)
    fresh.load_state_dict(state)
    assert fresh.stopped and fresh.entropy_history == hook.entropy_history and fresh.passes_per_batch() == 1


def test_sfpo_errors():
    hook = stablerl.make_trainer_hook("sfpo")
    w, _, _ = quadratic_setup()
    view = ParamsView(parameters=lambda: [w])
    with pytest.raises(stablerl.StableRLError, match="before_batch"):
        hook.reposition(view)
    hook.before_batch(view)
    with pytest.raises(stablerl.StableRLError, match="pass_index 7"):
        hook.after_pass(view, 7)
    with pytest.raises(stablerl.StableRLError, match="finite"):
        hook.after_pass(view, 3, entropy=float("nan"))
    for bad, match in [({"alpha": 1.5}, "alpha"), ({"inner_steps": 0}, "inner_steps"), ({"zscore_window": -1}, "zscore_window"),
                       ({"alhpa": 0.5}, "alpha")]:
        with pytest.raises(stablerl.StableRLError, match=match):
            stablerl.make_trainer_hook("sfpo", **bad)


def test_make_trainer_hook_checks_the_class(monkeypatch):
    from stablerl.contracts import TRAINER_HOOK, AlgorithmSpec

    reg = stablerl.get_registry()
    spec = AlgorithmSpec(name="not_a_hook", kind=TRAINER_HOOK, fn=lambda p: object(), title="t")
    monkeypatch.setitem(reg.specs, (TRAINER_HOOK, "not_a_hook"), spec)
    with pytest.raises(stablerl.StableRLError, match="must build a stablerl TrainerHook"):
        stablerl.make_trainer_hook("not_a_hook")
    base = TrainerHook(None)  # the no-op defaults: one pass, no extra samples
    assert base.passes_per_batch() == 1 and base.samples_per_prompt(PromptStats(4, 1, 1)) == 0


@pytest.mark.parametrize("mode,stats,more", [
    ("balanced", PromptStats(drawn=8, positive=0, rounds=1), 8),
    ("balanced", PromptStats(drawn=8, positive=2, rounds=1), 0),  # >= 2 positives and >= 2 negatives (n = 4)
    ("balanced", PromptStats(drawn=8, positive=7, rounds=1), 8),  # 1 negative < n/2
    ("balanced", PromptStats(drawn=32, positive=0, rounds=4), 0),  # max_rounds reached
    ("positive_focused", PromptStats(drawn=8, positive=1, rounds=1), 0),
    ("positive_focused", PromptStats(drawn=8, positive=0, rounds=3), 8),
])
def test_reinforce_ada_sampler_rounds(mode, stats, more):
    sampler = stablerl.make_trainer_hook("reinforce_ada_sampler", mode=mode)
    assert sampler.samples_per_prompt(stats) == more


def test_reinforce_ada_sampler_keeps_a_balanced_subset():
    sampler = stablerl.make_trainer_hook("reinforce_ada_sampler")  # n = 4, threshold 0.7
    r = torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    assert sampler.keep(r).tolist() == [1, 4, 0, 2]
    assert sampler.keep(torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])).tolist() == [0, 2, 3, 1]  # one negative: top up
    assert sampler.keep(torch.tensor([0.0, 0.2])).tolist() == [0, 1]  # fewer than n: a smaller group
    with pytest.raises(stablerl.StableRLError, match="positive"):
        sampler.samples_per_prompt(PromptStats(drawn=2, positive=3, rounds=1))


def test_reach_of_trainer_hooks_and_reinforce_ada():
    verl, trl, openrlhf = (get_framework(n) for n in ("verl", "trl", "openrlhf"))
    sfpo = stablerl.get_spec("trainer_hook", "sfpo")
    sampler = stablerl.get_spec("trainer_hook", "reinforce_ada_sampler")
    assert reach(trl, sfpo) == ("selectable", "sfpo")
    assert reach(verl, sfpo) == ("partial", "sfpo")  # needs the stablerl policy-loss config target
    from stablerl.frameworks import reach_conditions as conditions

    assert any("StablePolicyLossConfig" in c for c in conditions(verl, sfpo))
    status, why = reach(verl, sampler)
    assert status == "refused" and "rollout.n" in why
    status, why = reach(openrlhf, sfpo)
    assert status == "refused" and "ppo_train" in why and "DeepSpeed" in why
    status, why = reach(trl, sampler)
    assert status == "refused" and "num_generations" in why
    ada = stablerl.get_spec("advantage_estimator", "reinforce_ada")
    for fw in (verl, trl, openrlhf):
        assert reach(fw, ada)[0] == "partial"
    from stablerl.frameworks import reach_conditions

    assert any("global_stat_est=False" in c for c in reach_conditions(trl, ada))


def test_adaptive_entropy_controller_steps_and_penalty():
    c = stablerl.make_controller("adaptive_entropy", entropy_coef=0.1, entropy_target=1.0, entropy_coef_delta=0.05,
                                 entropy_coef_max=0.2)
    H = torch.tensor([[0.5, 1.5, 9.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    term, _ = c.penalty(H, mask)
    assert float(term.detach()) == 0.0  # no entropy recorded yet: inactive
    assert c.step(entropy=0.8) == {"entropy_coef": pytest.approx(0.15), "active": True}
    term, metrics = c.penalty(H, mask)
    assert float(term.detach()) == pytest.approx(-0.15 * 1.0)  # -c * token-mean(0.5, 1.5)
    term.backward()
    torch.testing.assert_close(H.grad, torch.tensor([[-0.075, -0.075, 0.0]], dtype=torch.float64))
    c.step(entropy=0.9)
    assert c.coef == pytest.approx(0.2)  # capped at entropy_coef_max
    c.step(entropy=3.0)
    assert c.coef == pytest.approx(0.15) and c.applied_coef == 0.0
    restored = stablerl.make_controller("adaptive_entropy")
    restored.load_state_dict(c.state_dict())
    assert restored.coef == c.coef and restored.last_entropy == 3.0
    with pytest.raises(stablerl.StableRLError, match="entropy_coef_min"):
        stablerl.make_controller("adaptive_entropy", entropy_coef_min=2.0)


# ----------------------------------------------------------------------------- conformance of trainer hooks


class _Broken(TrainerHook):
    def __init__(self, params):
        super().__init__(params)
        self.seen = []

    def after_pass(self, view, pass_index, **stats):
        self.seen.append(stats.get("entropy"))
        return {}

    def state_dict(self):
        return {"seen": list(self.seen)}

    def load_state_dict(self, state):
        self.seen = list(state["seen"])


class _BadPasses(_Broken):
    def passes_per_batch(self):
        return 0


class _Random(_Broken):
    def before_batch(self, view):
        with torch.no_grad():
            for w in view.parameters():
                w.add_(torch.rand(()))  # unseeded: two runs differ


class _Forgets(_Broken):
    def load_state_dict(self, state):
        self.seen = []


class _Live(_Broken):
    def state_dict(self):
        return {"seen": self.seen}  # the live list: an earlier snapshot changes


@pytest.mark.parametrize("cls,prop", [(_BadPasses, "output"), (_Random, "deterministic"), (_Forgets, "state_round_trip"),
                                      (_Live, "state_snapshot")])
def test_trainer_hook_conformance_catches_broken_hooks(monkeypatch, cls, prop):
    from stablerl.contracts import TRAINER_HOOK, AlgorithmSpec
    from stablerl.testing import ConformanceError, check_trainer_hook

    reg = stablerl.get_registry()
    spec = AlgorithmSpec(name="broken_hook", kind=TRAINER_HOOK, fn=cls, paper="2500.00000", title="t", formula="f",
                         requires=("params_view",))
    monkeypatch.setitem(reg.specs, (TRAINER_HOOK, "broken_hook"), spec)
    with pytest.raises(ConformanceError, match=f"'broken_hook' fails '{prop}'"):
        check_trainer_hook("broken_hook")
    check_trainer_hook("sfpo", zscore_window=2)  # the built-in passes, also with its stop rule firing
