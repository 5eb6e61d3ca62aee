"""Every built-in policy loss and advantage estimator passes the conformance suite (stablerl.testing),
and the suite itself catches each kind of broken plugin.

Exceptions are explicit and documented here:

* ``BY_DESIGN``: properties that do not hold for an algorithm by design (skipped, with the reason).
* ``KNOWN_ISSUES``: properties a built-in currently violates (reported to its author). The main
  case skips them; a separate case runs just that property as a non-strict xfail, so the issue
  stays visible and shows up as XPASS once it is fixed (then delete the entry).
"""

from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass

import pytest
import torch

import stablerl
from stablerl import ADVANTAGE_ESTIMATOR, POLICY_LOSS, UNAVAILABLE, AlgorithmSpec, Params
from stablerl.ops import aggregate, broadcast_to_tokens, clamped_log_ratio, masked_mean, masked_sum
from stablerl.testing import (
    ADVANTAGE_ESTIMATOR_PROPERTIES,
    POLICY_LOSS_PROPERTIES,
    ConformanceError,
    check_advantage_estimator,
    check_policy_loss,
    check_two_rank_equality,
    conformance_cases,
)

BY_DESIGN: dict[str, dict[str, str]] = {
    "generalized_jsd": {
        "detached_inputs": "student_topk_log_prob is the student's log-probs at the teacher's top-k ids from the "
        "training forward: the distillation term's gradient flows through it by design (checked against TRL's loss and "
        "by finite differences in tests/test_on_policy_distillation.py)",
    },
    "krpo": {
        "permutation": "the Kalman filter runs over each group's responses in rollout order (arXiv 2505.07527); "
        "reordering the responses within a group changes the advantages",
    },
}

KNOWN_ISSUES: dict[str, dict[str, str]] = {}


def _reinforce_ada_counts(base):
    """REINFORCE-Ada's per-prompt positive/negative counts over all sampling rounds, on each response."""
    uid = list(base["index"])
    gid = torch.tensor([sorted(set(uid), key=uid.index).index(u) for u in uid])
    return {"pos_count": (gid % 3 + 1).long(), "neg_count": (7 - gid % 3).long()}


def _gdpo_components(base):
    """Two reward components per response (one binary, one on another scale), a function of the response's
    position so that permuting the batch permutes them with it."""
    B = len(base["index"])
    i = torch.arange(B, dtype=torch.float64)
    return {"reward_components": torch.stack([(i % 2), 3.0 * torch.sin(i)], -1), "reward_weights": [1.0, 0.5]}


# declared inputs the suite cannot synthesise
INPUTS: dict[str, dict] = {
    "reinforce_ada": {"extras": _reinforce_ada_counts},
    "gdpo": {"extras": _gdpo_components},
}


def _skips() -> dict[str, tuple[str, ...]]:
    names = set(BY_DESIGN) | set(KNOWN_ISSUES)
    return {n: tuple(BY_DESIGN.get(n, {})) + tuple(KNOWN_ISSUES.get(n, {})) for n in names}


# hyper-parameters other than the defaults the suite runs with, and why
PARAMS: dict[str, dict] = {
    # alone, its gradient flows through student_topk_log_prob, not log_prob (the suite follows log_prob): with a task
    # loss added, every property is checked on the sum (tests/test_on_policy_distillation.py checks the term alone)
    "generalized_jsd": {"task_loss": "vanilla"},
}

BUILTIN_CASES = conformance_cases(plugin="stablerl.plugins", kinds=(POLICY_LOSS, ADVANTAGE_ESTIMATOR), skip=_skips(),
                                  inputs=INPUTS, params=PARAMS)


@pytest.mark.parametrize("case", BUILTIN_CASES)
def test_builtin_conformance(case):
    case.run()


def _known_issue_params():
    registered = {s.name: s for s in stablerl.list_algorithms() if s.kind in (POLICY_LOSS, ADVANTAGE_ESTIMATOR)}
    out = []
    for name, issues in sorted(KNOWN_ISSUES.items()):
        for prop, reason in issues.items():
            marks = [pytest.mark.xfail(reason=reason, strict=False, raises=ConformanceError)]
            if name not in registered or registered[name].status == UNAVAILABLE:
                marks = [pytest.mark.skip(reason=f"{name} not registered")]
            out.append(pytest.param(name, prop, id=f"{name}:{prop}", marks=marks))
    return out


@pytest.mark.parametrize("name,prop", _known_issue_params())
def test_known_issue(name, prop):
    spec = stablerl.get_registry().get(POLICY_LOSS, name) if any(
        s.name == name for s in stablerl.list_algorithms(POLICY_LOSS)) else None
    if spec is not None:
        check_policy_loss(name, inputs=INPUTS.get(name), skip=[p for p in POLICY_LOSS_PROPERTIES if p != prop])
    else:
        check_advantage_estimator(name, inputs=INPUTS.get(name),
                                  skip=[p for p in ADVANTAGE_ESTIMATOR_PROPERTIES if p != prop])


def test_every_builtin_is_covered():
    covered = {(c.values[0].kind, c.values[0].name) for c in BUILTIN_CASES}
    builtins = {(s.kind, s.name) for s in stablerl.list_algorithms()
                if s.kind in (POLICY_LOSS, ADVANTAGE_ESTIMATOR) and s.plugin.startswith("stablerl.plugins")}
    assert builtins == covered
    assert len([n for k, n in builtins if k == POLICY_LOSS]) >= 2
    assert len([n for k, n in builtins if k == ADVANTAGE_ESTIMATOR]) >= 1


def test_exceptions_name_real_algorithms_and_properties():
    names = {s.name for s in stablerl.list_algorithms()}
    for table in (BY_DESIGN, KNOWN_ISSUES):
        for name, props in table.items():
            assert name in names, f"{name} is not registered: remove it from the exceptions"
            assert set(props) <= set(POLICY_LOSS_PROPERTIES) | set(ADVANTAGE_ESTIMATOR_PROPERTIES)


# --------------------------------------------------------------------------- the suite catches broken plugins


def _ratio(b):
    return torch.exp(clamped_log_ratio(b.log_prob, b.old_log_prob))


def _pg(b):
    return -b.advantages * _ratio(b)


@dataclass
class _NoDefault(Params):
    coef: float


def _broken_losses():
    m = lambda b: b.response_mask  # noqa: E731
    return {
        # loss detached from log_prob
        "output": dict(fn=lambda b, p, c: (_pg(b).detach(), {})),
        # output='scalar' that forgets the framework's IS weights
        "is_weights": dict(output="scalar", fn=lambda b, p, c: (aggregate(_pg(b), m(b), b.loss_agg_mode, c), {})),
        # divides by the padded size B*T
        "padding_length": dict(output="scalar", fn=lambda b, p, c: (masked_sum(_pg(b), m(b)) / m(b).numel(), {})),
        # local token mean, ignoring ctx.token_count
        "micro_batch": dict(output="scalar", fn=lambda b, p, c: (masked_mean(_pg(b), m(b)), {})),
        # reduces over the batch without declaring batch_statistics
        "batch_statistics": dict(fn=lambda b, p, c: (
            -(b.advantages - c.all_reduce(masked_sum(b.advantages, m(b))) / c.all_reduce(m(b).sum())) * _ratio(b), {})),
        # per-row length without a clamp: NaN on an all-masked row
        "degenerate": dict(fn=lambda b, p, c: (_pg(b) * m(b).shape[1] / m(b).sum(-1, keepdim=True), {})),
        # metric not listed in spec.metrics
        "metrics": dict(fn=lambda b, p, c: (_pg(b), {"undeclared": _ratio(b).mean()})),
        # hyper-parameter without a default
        "spec": dict(params=_NoDefault, fn=lambda b, p, c: (_pg(b), {})),
    }


def _register(monkeypatch, kind, name, **fields):
    fields.setdefault("formula", "broken on purpose")
    spec = AlgorithmSpec(name=name, kind=kind, plugin="tests.broken", **fields)
    monkeypatch.setitem(stablerl.get_registry().specs, (kind, name), spec)
    return spec


@pytest.mark.parametrize("prop", sorted(_broken_losses()))
def test_suite_catches_broken_policy_loss(monkeypatch, prop):
    _register(monkeypatch, POLICY_LOSS, f"broken_{prop}", **_broken_losses()[prop])
    with pytest.raises(ConformanceError, match=f"'broken_{prop}' fails '{prop}'"):
        check_policy_loss(f"broken_{prop}", skip=[p for p in POLICY_LOSS_PROPERTIES if p != prop])


def _scores(b):
    return b.scores


def _broken_estimators():
    def ret(adv, b):
        a = broadcast_to_tokens(adv, b.response_mask) if adv.dim() == 1 else adv
        return a, a

    def grpo_no_eps(b):
        from stablerl.ops import group_stats

        mean, std, count = group_stats(b.scores, b.index)
        return (b.scores - mean) / std

    return {
        "masked_content": lambda b, p, c: ret(b.token_level_rewards.sum(-1), b),
        "permutation": lambda b, p, c: ret(_scores(b) - _scores(b).roll(1), b),
        "padding_length": lambda b, p, c: ret(_scores(b) / b.response_mask.shape[1], b),
        "group_of_one": lambda b, p, c: ret(_scores(b) / (torch.bincount(b.index)[b.index] - 1).to(b.scores.dtype), b),
        "equal_rewards": lambda b, p, c: ret(grpo_no_eps(b), b),
        "shapes": lambda b, p, c: tuple(t.double() for t in ret(_scores(b), b)),
        "finite": lambda b, p, c: ret(torch.zeros_like(_scores(b)), b),
    }


@pytest.mark.parametrize("prop", sorted(_broken_estimators()))
def test_suite_catches_broken_estimator(monkeypatch, prop):
    _register(monkeypatch, ADVANTAGE_ESTIMATOR, f"broken_{prop}", fn=_broken_estimators()[prop])
    with pytest.raises(ConformanceError, match=f"'broken_{prop}' fails '{prop}'"):
        check_advantage_estimator(f"broken_{prop}", skip=[p for p in ADVANTAGE_ESTIMATOR_PROPERTIES if p != prop])


def test_skip_names_are_checked():
    with pytest.raises(ValueError, match="unknown conformance properties"):
        check_policy_loss("vanilla", skip=["masked_token"])
    with pytest.raises(LookupError, match="no policy_loss/advantage_estimator/.*/router_family/trainer_hook registered by plugin 'nope'"):
        conformance_cases(plugin="nope")


# --------------------------------------------------------------------------- two ranks catch a local statistic

_LOCAL_STAT_PLUGIN = '''
import torch
from stablerl import hookimpl
from stablerl.ops import clamped_log_ratio, masked_mean


def local_baseline(b, p, ctx):
    # BUG on purpose: the baseline is this rank's mean, not reduced with ctx.all_reduce
    baseline = masked_mean(b.advantages, b.response_mask)
    return -(b.advantages - baseline) * torch.exp(clamped_log_ratio(b.log_prob, b.old_log_prob)), {}


@hookimpl
def register_policy_losses(register):
    register(name="local_baseline", fn=local_baseline, formula="l = -(A - mean A) r", batch_statistics=True)
'''


def test_two_rank_check_catches_an_unreduced_statistic(tmp_path, monkeypatch):
    (tmp_path / "stablerl_localstat.py").write_text(textwrap.dedent(_LOCAL_STAT_PLUGIN))
    info = tmp_path / "stablerl_localstat-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: stablerl-localstat\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[stablerl]\nlocalstat = stablerl_localstat\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("STABLERL_PLUGINS", "localstat")
    try:
        stablerl.reload_registry()
        with pytest.raises(ConformanceError, match="'local_baseline' fails 'two_rank'"):
            check_two_rank_equality("local_baseline")
    finally:
        monkeypatch.undo()
        sys.modules.pop("stablerl_localstat", None)
        stablerl.reload_registry()


def test_optional_inputs_are_validated_and_listed():
    from stablerl import AlgorithmSpec

    fn = lambda b, p, c: (b.log_prob, {})  # noqa: E731
    spec = AlgorithmSpec(name="x", kind="policy_loss", fn=fn, requires=("entropy",), optional_inputs=("old_entropy",))
    assert spec.reads == ("entropy", "old_entropy")
    with pytest.raises(ValueError, match="'x' has unknown optional input 'magic'"):
        AlgorithmSpec(name="x", kind="policy_loss", fn=fn, optional_inputs=("magic",))
    with pytest.raises(ValueError, match="input 'entropy' is both required and optional"):
        AlgorithmSpec(name="x", kind="policy_loss", fn=fn, requires=("entropy",), optional_inputs=("entropy",))


def test_a_loss_reading_an_undeclared_input_fails_conformance(monkeypatch):
    # steer reads old_entropy when given; with the declaration taken away the suite must catch it
    import dataclasses

    from stablerl.registry import get_registry
    from stablerl.testing import ConformanceError, check_policy_loss

    registry = get_registry()
    spec = registry.get("policy_loss", "steer")
    monkeypatch.setitem(registry.specs, ("policy_loss", "steer"), dataclasses.replace(spec, optional_inputs=()))
    with pytest.raises(ConformanceError, match=r"'steer' fails 'undeclared_inputs'.*old_entropy"):
        check_policy_loss("steer")
