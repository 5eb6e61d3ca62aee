"""The conformance suite's other kinds (reward shapers, batch filters, controllers, rollout corrections,
router families): every built-in passes it, and each property catches a plugin broken on purpose."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import stablerl
from stablerl import AlgorithmSpec, Params
from stablerl.contracts import (
    BATCH_FILTER,
    CONTROLLER,
    REWARD_SHAPER,
    ROLLOUT_CORRECTION,
    ROUTER_FAMILY,
    TRAINER_HOOK,
    Controller,
    FilterResult,
)
from stablerl.routing_replay import RouterFamily, softmax_gather_weights
from stablerl.testing import (
    BATCH_FILTER_PROPERTIES,
    CONTROLLER_PROPERTIES,
    REWARD_SHAPER_PROPERTIES,
    ROLLOUT_CORRECTION_PROPERTIES,
    ROUTER_FAMILY_PROPERTIES,
    TRAINER_HOOK_PROPERTIES,
    ConformanceError,
    check_batch_filter,
    check_controller,
    check_reward_shaper,
    check_rollout_correction,
    check_router_family,
    conformance_cases,
)

KINDS = (REWARD_SHAPER, BATCH_FILTER, CONTROLLER, ROLLOUT_CORRECTION, ROUTER_FAMILY, TRAINER_HOOK)

BY_DESIGN: dict[str, dict[str, str]] = {
    "redit": {"permutation": "ReDit adds independent noise to each response, drawn in row order from ctx.generator"},
    # training-inference mismatch corrections from blog posts and technical reports without an arXiv id
    "tis": {"spec": "Truncated IS comes from a blog post (Yao et al. 2025), no arXiv id"},
    "seq_mis": {"spec": "sequence-level masked IS comes from a blog post (Liu et al. 2025), no arXiv id"},
    "geo_rs": {"spec": "geometric-mean rejection sampling comes from a blog post, no arXiv id"},
    "opsm": {"spec": "the paper gives no default threshold (the user sets it), so the defaults do not validate"},
    "kl_rs": {"spec": "verl's K2/K3 rejection: the k2/k3 estimators come from a blog post (Schulman 2020), no arXiv id"},
    "divergence_is": {"spec": "OpenRLHF's binary-KL / TV gating is a framework feature (FlashREINFORCE recipe), "
                      "no arXiv id"},
}
PARAMS = {"opsm": {"threshold": 0.5}}

BUILTIN_CASES = conformance_cases(plugin="stablerl.plugins", kinds=KINDS, params=PARAMS,
                                  skip={name: tuple(props) for name, props in BY_DESIGN.items()})


@pytest.mark.parametrize("case", BUILTIN_CASES)
def test_builtin_conformance(case):
    case.run()


def test_every_builtin_of_these_kinds_is_covered_and_the_exceptions_are_real():
    covered = {(c.values[0].kind, c.values[0].name) for c in BUILTIN_CASES}
    builtins = {(s.kind, s.name) for s in stablerl.list_algorithms()
                if s.kind in KINDS and s.plugin.startswith("stablerl.plugins")}
    assert builtins == covered and {k for k, _ in builtins} == set(KINDS)
    names = {s.name for s in stablerl.list_algorithms()}
    properties = (set(REWARD_SHAPER_PROPERTIES) | set(BATCH_FILTER_PROPERTIES) | set(CONTROLLER_PROPERTIES)
                  | set(ROLLOUT_CORRECTION_PROPERTIES) | set(ROUTER_FAMILY_PROPERTIES) | set(TRAINER_HOOK_PROPERTIES))
    for name, props in BY_DESIGN.items():
        assert name in names and set(props) <= properties


def test_by_design_exceptions_still_fail_without_the_skip():
    # each listed property really fails (else the exception is stale and must go)
    with pytest.raises(ConformanceError, match="'redit' fails 'permutation'"):
        check_reward_shaper("redit")
    with pytest.raises(ConformanceError, match="'tis' fails 'spec'"):
        check_rollout_correction("tis")


# --------------------------------------------------------------------------- broken on purpose


@dataclass
class _NoParams(Params):
    pass


def _register(monkeypatch, kind, name, fn, **fields):
    fields.setdefault("formula", "broken on purpose")
    spec = AlgorithmSpec(name=name, kind=kind, fn=fn, params=fields.pop("params", _NoParams), plugin="tests.broken",
                         **fields)
    monkeypatch.setitem(stablerl.get_registry().specs, (kind, name), spec)
    return spec


def _expect(check, name, prop, properties, **kw):
    with pytest.raises(ConformanceError, match=f"'{name}' fails '{prop}'"):
        check(name, skip=[p for p in properties if p != prop], **kw)


def _scale_in_place(b, p, c):
    b.scores.mul_(2.0)  # modifies the caller's rewards
    return b.scores.clone(), {}


BROKEN_SHAPERS = {
    "deterministic": lambda b, p, c: (b.scores + torch.rand(b.scores.shape), {}),  # global RNG, not ctx.generator
    "inputs_unchanged": _scale_in_place,
    # reads an input it does not declare when it happens to be given
    "undeclared_inputs": lambda b, p, c: (b.scores + 0.1 * b.extras.get("lengths", torch.zeros(1)).float(), {}),
    # depends on the row's position, not on the response
    "permutation": lambda b, p, c: (b.scores + torch.arange(b.scores.numel(), dtype=b.scores.dtype), {}),
    "output": lambda b, p, c: (b.scores, {"count": "three"}),  # a metric that is not a number
}


@pytest.mark.parametrize("prop", sorted(BROKEN_SHAPERS))
def test_suite_catches_broken_reward_shaper(monkeypatch, prop):
    _register(monkeypatch, REWARD_SHAPER, f"broken_{prop}", BROKEN_SHAPERS[prop])
    _expect(check_reward_shaper, f"broken_{prop}", prop, REWARD_SHAPER_PROPERTIES)


def _keep_all(b, **kw):
    B = b.advantages.shape[0]
    return FilterResult(rows=torch.arange(B), response_mask=b.response_mask.clone(), **kw)


BROKEN_FILTERS = {
    "masks_respected": lambda b, p, c: FilterResult(rows=torch.arange(b.advantages.shape[0]),
                                                    response_mask=torch.ones_like(b.response_mask)),
    # keeps rows by their advantage summed over every position, padding included
    "masked_content": lambda b, p, c: FilterResult(rows=torch.nonzero(b.advantages.sum(-1) > 0).reshape(-1),
                                                   response_mask=b.response_mask[b.advantages.sum(-1) > 0]),
    "output": lambda b, p, c: FilterResult(rows=torch.arange(b.advantages.shape[0]) + 1, response_mask=b.response_mask),
    "deterministic": lambda b, p, c: FilterResult(rows=torch.randperm(b.advantages.shape[0]),
                                                  response_mask=b.response_mask),
    "undeclared_inputs": lambda b, p, c: _keep_all(b, advantages=b.advantages * (
        2.0 if b.entropy is not None else 1.0)),
}


@pytest.mark.parametrize("prop", sorted(BROKEN_FILTERS))
def test_suite_catches_broken_batch_filter(monkeypatch, prop):
    _register(monkeypatch, BATCH_FILTER, f"broken_{prop}", BROKEN_FILTERS[prop])
    _expect(check_batch_filter, f"broken_{prop}", prop, BATCH_FILTER_PROPERTIES)


class _Counter(Controller):
    def __init__(self, params):
        super().__init__(params)
        self.history: list = []

    def step(self, entropy=None, **unused):
        self.history.append(float(entropy))
        return {"mean": sum(self.history) / len(self.history)}

    def state_dict(self):
        return {"history": list(self.history)}

    def load_state_dict(self, state):
        self.history = list(state["history"])


class _LiveState(_Counter):
    def state_dict(self):
        return {"history": self.history}  # the live list: a saved state changes afterwards


class _ForgetsState(_Counter):
    def load_state_dict(self, state):
        pass


class _Random(_Counter):
    def step(self, entropy=None, **unused):
        return {"noise": float(torch.rand(()))}


@pytest.mark.parametrize("prop,cls", [("state_snapshot", _LiveState), ("state_round_trip", _ForgetsState),
                                      ("deterministic", _Random)])
def test_suite_catches_broken_controller(monkeypatch, prop, cls):
    _register(monkeypatch, CONTROLLER, f"broken_{prop}", cls)
    _expect(check_controller, f"broken_{prop}", prop, CONTROLLER_PROPERTIES)


def test_a_sound_controller_passes(monkeypatch):
    _register(monkeypatch, CONTROLLER, "counter", _Counter)
    check_controller("counter")


def _tis(b, p, c):
    return torch.exp(b.old_log_prob - b.rollout_log_prob).clamp(max=2.0), {}


BROKEN_CORRECTIONS = {
    # a per-sequence weight from every position, padding included
    "masked_tokens": lambda b, p, c: (torch.exp((b.old_log_prob - b.rollout_log_prob).sum(-1, keepdim=True)
                                                .clamp(max=0)), {}),
    "on_policy": lambda b, p, c: (2.0 * _tis(b, p, c)[0], {}),
    "output": lambda b, p, c: (torch.exp(b.log_prob - b.rollout_log_prob), {}),  # carries gradient
}


@pytest.mark.parametrize("prop", sorted(BROKEN_CORRECTIONS))
def test_suite_catches_broken_rollout_correction(monkeypatch, prop):
    _register(monkeypatch, ROLLOUT_CORRECTION, f"broken_{prop}", BROKEN_CORRECTIONS[prop])
    _expect(check_rollout_correction, f"broken_{prop}", prop, ROLLOUT_CORRECTION_PROPERTIES)


def test_a_sound_rollout_correction_passes(monkeypatch):
    _register(monkeypatch, ROLLOUT_CORRECTION, "tis_like", _tis, paper="2500.00000", title="test")
    check_rollout_correction("tis_like")


BROKEN_FAMILIES = {
    "gradient": lambda lg, idx, m: softmax_gather_weights(lg.detach(), idx, True),
    # the weights in descending order, whatever slot each expert is in
    "slot_order": lambda lg, idx, m: softmax_gather_weights(lg, idx, True).sort(-1, descending=True).values,
    "output": lambda lg, idx, m: softmax_gather_weights(lg, idx, True)[:, :1],
}


@pytest.mark.parametrize("prop", sorted(BROKEN_FAMILIES))
def test_suite_catches_broken_router_family(monkeypatch, prop):
    family = RouterFamily(f"broken_{prop}", BROKEN_FAMILIES[prop], class_names=("NoSuchRouter",))
    _register(monkeypatch, ROUTER_FAMILY, f"broken_{prop}", family)
    _expect(check_router_family, f"broken_{prop}", prop, ROUTER_FAMILY_PROPERTIES)


def test_router_family_reads_the_module(monkeypatch):
    family = RouterFamily("fixed_top_k", lambda lg, idx, m: softmax_gather_weights(lg, idx, True),
                          class_names=("NoSuchRouter",), top_k_attr="k")
    _register(monkeypatch, ROUTER_FAMILY, "fixed_top_k", family)
    check_router_family("fixed_top_k")
    with pytest.raises(ConformanceError, match="'fixed_top_k' fails 'module_attributes'"):
        check_router_family("fixed_top_k", module=type("M", (), {"k": 4, "num_experts": 8})())
