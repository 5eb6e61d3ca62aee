"""The cross-framework parity matrix: the shared batch, the algorithms, the listed differences, the results files.

Each framework's nox session runs ``integrations_tests/<framework>/test_parity_matrix.py``: it feeds the
batches built here through that framework's real call site, checks the result against the direct core
call (:func:`core_loss` / :func:`core_advantages`, rel 1e-6) and records it with :class:`Results`
(``$STABLERL_PARITY_DIR/<framework>.json``, default ``build/parity/``). The ``parity`` session
(``integrations_tests/parity/parity_report.py``, torch only) compares the three files with each other
and writes ``docs/parity-matrix.md``.

Everything is fp32. Each algorithm runs in the :data:`SETTINGS`: every hyper-parameter set explicitly, to
the same value, in every framework (so no framework default can make a difference), and nothing set (what
a user gets). A difference from the core call fails the test unless :data:`KNOWN_DIFFERENCES` lists it,
with why. This module imports stablerl and torch only (no framework).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

# one definition of each, shared with the torch-only parity session
from parity_report import DIFFERS, IDENTICAL, NOT_OFFERED, relative_difference, results_dir

import stablerl
from stablerl.contracts import ADVANTAGE_ESTIMATOR, POLICY_LOSS, UNAVAILABLE

KINDS = (POLICY_LOSS, ADVANTAGE_ESTIMATOR)
RTOL = 1e-6
# the aggregations all three frameworks offer (OpenRLHF: token-mean or seq-mean-token-mean)
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean")
FORMAT = 1  # of the results files



# ----------------------------------------------------------------------------- which algorithms


def offered_frameworks(spec) -> list[str]:
    """The frameworks whose users can select ``spec`` (the framework declarations in core)."""
    from stablerl.frameworks import selectable_in

    return list(selectable_in(spec))


def selection_name(framework: str, spec) -> str:
    """The name that selects ``spec`` in ``framework``'s config (``stablerl_<name>`` where the framework
    owns the bare name)."""
    from stablerl.frameworks import framework_names, get_framework

    return framework_names(get_framework(framework), spec)[0]


def not_offered_reason(spec, framework: str) -> str:
    """Why ``framework`` cannot run ``spec``, from its declaration: the inputs it cannot feed, and why not."""
    from stablerl.frameworks import get_framework, missing_inputs, why_missing

    declaration = get_framework(framework)
    missing = missing_inputs(declaration, spec)
    if not missing:
        return f"{framework} has no call site for it"
    return f"{framework} cannot feed {why_missing(declaration, spec, missing)}"


def matrix_algorithms() -> list[tuple[str, str]]:
    """``(kind, name)`` of every built-in policy loss and advantage estimator offered in two or more
    frameworks (third-party plugins installed in one environment only are left out, so every
    environment lists the same algorithms)."""
    registry = stablerl.get_registry()
    out = []
    for kind in KINDS:
        for name in sorted(registry.names(kind)):
            try:
                spec = stablerl.get_spec(kind, name)
            except stablerl.StableRLError:  # listed as unavailable
                continue
            if spec.status == UNAVAILABLE or not spec.plugin.startswith("stablerl."):
                continue
            if len(offered_frameworks(spec)) >= 2:
                out.append((kind, name))
    return out


#: (kind, name) -> hyper-parameters that replace a default no framework's call site can run, and why.
HYPERPARAMETER_OVERRIDES: dict[tuple[str, str], tuple[dict[str, Any], str]] = {
    (ADVANTAGE_ESTIMATOR, "reinforce_ada"): (
        {"global_stat_est": False},
        "its default global_stat_est=True needs the adaptive-sampling rounds' pos_count / neg_count, "
        "which no framework's advantage step passes (MissingInputError in all three)",
    ),
}


#: The settings each framework runs an algorithm under:
#: "explicit": every hyper-parameter set, to the algorithm's (paper) defaults, in each framework's own keys;
#: "defaults": none set (only HYPERPARAMETER_OVERRIDES), as a user who selects the algorithm by name gets it;
#: "no_std_knob": estimators with a norm_adv_by_std_in_grpo hyper-parameter only: nothing set but the
#: framework's own "do not divide advantages by the group std" knob (verl algorithm.norm_adv_by_std_in_grpo=False,
#: TRL scale_rewards="none", OpenRLHF --algo.advantage.no_std_norm), which the estimator should honour.
SETTINGS = ("explicit", "defaults", "no_std_knob")
NO_STD_KNOB = "<framework knob: no std normalisation>"  # a pseudo-key each call site maps to its framework's knob


def applies(kind: str, name: str, setting: str) -> bool:
    if setting != "no_std_knob":
        return True
    return kind == ADVANTAGE_ESTIMATOR and "norm_adv_by_std_in_grpo" in stablerl.get_spec(kind, name).defaults()


def hyperparameters(kind: str, name: str, setting: str = "explicit") -> dict[str, Any]:
    """What the framework is told, in the given setting: every hyper-parameter at the algorithm's
    default ("explicit"), nothing ("defaults"), or only :data:`NO_STD_KNOB` ("no_std_knob"); the
    :data:`HYPERPARAMETER_OVERRIDES` in all."""
    params = dict(stablerl.get_spec(kind, name).defaults()) if setting == "explicit" else {}
    if setting == "no_std_knob":
        params[NO_STD_KNOB] = True
    params.update(HYPERPARAMETER_OVERRIDES.get((kind, name), ({}, ""))[0])
    return params


# ----------------------------------------------------------------------------- the shared batches

# Loss batch: 8 responses in 2 prompt groups of 4 (contiguous, as TRL's sampler lays them out),
# right-padded to T; prompt lengths for the frameworks that lay log-probs over prompt + response.
PROMPT_LENGTHS = (3, 2, 4, 1, 2, 3, 1, 2)
RESPONSE_LENGTHS = (7, 3, 5, 1, 6, 2, 7, 4)
GROUP_SIZE = 4
VOCAB = 5  # few token ids: responses of a group share tokens (GTPO's conflicts)


def loss_batch() -> dict[str, Any]:
    """The deterministic fp32 loss batch ``[B, T]`` (padding holds zeros): log-probs (half the rows near
    the old policy, half far, so both tight and loose clip bounds are crossed), old and rollout log-probs,
    one advantage per response broadcast over its tokens, entropies (current and old-pass), token ids, group ids,
    scores."""
    g = torch.Generator().manual_seed(1234)
    B, T = len(RESPONSE_LENGTHS), max(RESPONSE_LENGTHS)
    lengths = torch.tensor(RESPONSE_LENGTHS)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    old = -torch.rand(B, T, generator=g) * 2.5 - 0.05
    spread = torch.tensor([0.35, 2e-4] * (B // 2)).unsqueeze(1)
    log_prob = (old + spread * torch.randn(B, T, generator=g)).clamp(max=-1e-3)
    rollout = (old + 0.08 * torch.randn(B, T, generator=g)).clamp(max=-1e-3)
    seq_adv = torch.tensor([1.1, -0.6, 0.4, -0.9, 0.8, -1.3, 0.2, 0.5])
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    entropy = torch.rand(B, T, generator=g) * 2.0
    token_ids = torch.randint(0, VOCAB, (B, T), generator=g)
    # the old-log-prob pass's entropy (erc): within +-10% of the current one, so erc's band (0.95, 1.05) cuts
    # some tokens (its own generator: the draws above are unchanged)
    old_entropy = entropy * (1 + 0.1 * (2 * torch.rand(B, T, generator=torch.Generator().manual_seed(4321)) - 1))
    zero = torch.zeros(())
    batch = {
        "log_prob": torch.where(mask, log_prob, zero),
        "old_log_prob": torch.where(mask, old, zero),
        "rollout_log_prob": torch.where(mask, rollout, zero),
        "advantages": seq_adv.unsqueeze(1) * mask,
        "seq_advantages": seq_adv,
        "response_mask": mask,
        "entropy": torch.where(mask, entropy, zero),
        "old_entropy": torch.where(mask, old_entropy, zero),
        "token_ids": token_ids * mask,
        "index": torch.arange(B) // GROUP_SIZE,
        "scores": scores,
        # A-3PO's weight versions as verl's and OpenRLHF's synchronous trainers give them: one per batch, the
        # policy one ahead (alpha = 0); -1 marks tokens that were not generated
        "versions": torch.where(mask, 0, -1),
        "policy_version": 1,
        "prompt_lengths": PROMPT_LENGTHS,
        "response_lengths": RESPONSE_LENGTHS,
    }
    return batch


# Estimator batch: 3 prompt groups of 4 (contiguous): binary rewards, graded rewards, one group of equal
# rewards; response lengths differ (OPO weights by length); the reward sits on the last valid token.
REWARD_LENGTHS = (5, 2, 6, 3, 1, 4, 6, 2, 3, 5, 6, 1)
REWARDS = (1.0, 0.0, 0.0, 1.0, 0.25, 0.75, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0)


def reward_batch() -> dict[str, Any]:
    """The deterministic fp32 estimator batch: ``scores`` [N], ``token_level_rewards`` / ``response_mask`` [N, T]
    and the group ids ``index`` [N]."""
    N, T = len(REWARD_LENGTHS), max(REWARD_LENGTHS)
    lengths = torch.tensor(REWARD_LENGTHS)
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    scores = torch.tensor(REWARDS)
    rewards = torch.zeros(N, T)
    rewards[torch.arange(N), lengths - 1] = scores
    # the old-log-prob pass's per-token log-probs and sum_v pi(v)^2 (optimal_token_baseline) and its entropy (empg),
    # zero on padding
    g = torch.Generator().manual_seed(7)
    old_log_prob = -torch.rand(N, T, generator=g) * 3 * mask
    sum_pi_squared = (0.05 + 0.9 * torch.rand(N, T, generator=g)) * mask
    entropy = torch.rand(N, T, generator=torch.Generator().manual_seed(2468)) * 2.0 * mask
    # a frozen teacher's log-probs of the sampled tokens (on_policy_distillation)
    teacher_log_prob = -torch.rand(N, T, generator=torch.Generator().manual_seed(1357)) * 3 * mask
    return {"scores": scores, "token_level_rewards": rewards, "response_mask": mask,
            "index": torch.arange(N) // GROUP_SIZE, "group_size": GROUP_SIZE,
            "old_log_prob": old_log_prob, "sum_pi_squared": sum_pi_squared, "entropy": entropy,
            "teacher_log_prob": teacher_log_prob}


#: per-token estimator inputs of the old-log-prob pass (and the teacher's) the reward batch carries (each framework
#: feeds them its way)
OLD_PASS_INPUTS = ("old_log_prob", "sum_pi_squared", "entropy", "teacher_log_prob")


def advantage_inputs(name: str, batch: dict) -> dict[str, Any]:
    """The old-log-prob pass's inputs estimator ``name`` declares, from the batch."""
    return {k: batch[k] for k in OLD_PASS_INPUTS if k in stablerl.get_spec(ADVANTAGE_ESTIMATOR, name).requires}


# ----------------------------------------------------------------------------- the direct core calls


def loss_inputs(name: str, batch: dict) -> dict[str, Any]:
    """The declared inputs of loss ``name`` from the batch (what every framework must hand over)."""
    spec = stablerl.get_spec(POLICY_LOSS, name)
    return {k: batch[k] for k in spec.requires}


def core_loss(name: str, batch: dict, loss_agg_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``stablerl.compute_policy_loss`` called directly: (loss, d loss / d log_prob [B, T]). The
    normalisers are this batch's own (its tokens and responses, one rank)."""
    mask = batch["response_mask"]
    leaf = batch["log_prob"].clone().requires_grad_(True)
    ctx = stablerl.Context(token_count=float(mask.sum()), seq_count=float(mask.shape[0]), dp_size=1, state={})
    loss, _ = stablerl.compute_policy_loss(
        name, log_prob=leaf, old_log_prob=batch["old_log_prob"], advantages=batch["advantages"], response_mask=mask,
        loss_agg_mode=loss_agg_mode, ctx=ctx, **loss_inputs(name, batch),
        **hyperparameters(POLICY_LOSS, name, "explicit"),
    )
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad


def core_advantages(name: str, batch: dict, setting: str = "explicit") -> torch.Tensor:
    """``stablerl.compute_advantage`` called directly: the advantages [N, T] (zero on padding). The
    "no_std_knob" setting expects the estimator with ``norm_adv_by_std_in_grpo=False``."""
    params = hyperparameters(ADVANTAGE_ESTIMATOR, name, "explicit")
    if setting == "no_std_knob":
        params["norm_adv_by_std_in_grpo"] = False
    adv, _ = stablerl.compute_advantage(
        name, token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"],
        index=batch["index"], ctx=stablerl.Context(state={}), **advantage_inputs(name, batch), **params,
    )
    return adv * batch["response_mask"]


# ----------------------------------------------------------------------------- listed differences


@dataclass(frozen=True)
class KnownDifference:
    """A framework's result for an algorithm that differs from the core call, and why. ``to_fix``:
    a stablerl bug (the adapter should match), not a framework's documented behaviour."""

    reason: str
    to_fix: bool = False


#: (framework, kind, name, setting) -> why that framework's result differs from the direct core call.
#: A listed difference that no longer differs fails the framework's matrix test: remove it here.
KNOWN_DIFFERENCES: dict[tuple[str, str, str, str], KnownDifference] = {
    # (framework, kind, algorithm, setting) -> why the framework's result must differ from the core call.
    # Empty: every algorithm gives the core call's numbers in every framework that offers it. (OpenRLHF's
    # decoupled_ppo, listed here until the adapter stopped putting OpenRLHF's IS weights on top, now runs.)
}


def known_difference(framework: str, kind: str, name: str, setting: str) -> Optional[KnownDifference]:
    return KNOWN_DIFFERENCES.get((framework, kind, name, setting))


# ----------------------------------------------------------------------------- results files


def _values(x) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).tolist()
    return x


def _algorithm_notes(framework: str) -> dict:
    from stablerl.frameworks import get_framework

    return dict(get_framework(framework).algorithm_notes)


class Results:
    """One framework's matrix results, written to ``results_dir()/<framework>.json``."""

    def __init__(self, framework: str, version: str):
        self.framework = framework
        self.data: dict[str, Any] = {
            "format": FORMAT, "framework": framework, "version": version, "torch": torch.__version__, "rtol": RTOL,
            "loss_agg_modes": list(LOSS_AGG_MODES), "settings": list(SETTINGS), "algorithms": {},
            "overrides": {f"{k}/{n}": f"{params} ({why})"
                          for (k, n), (params, why) in HYPERPARAMETER_OVERRIDES.items()},
            # what differs by the framework's design, not in the numbers for the same inputs (the declaration's)
            "by_design": dict(_algorithm_notes(framework)),
        }

    @staticmethod
    def key(kind: str, name: str, setting: str) -> str:
        return f"{setting}/{kind}/{name}"

    def record(self, kind: str, name: str, setting: str, status: str, reason: str = "", to_fix: bool = False,
               values: Optional[dict] = None, core: Optional[dict] = None, rel_diff: Optional[dict] = None,
               error: str = "") -> None:
        self.data["algorithms"][self.key(kind, name, setting)] = {
            "kind": kind, "name": name, "setting": setting, "status": status, "reason": reason, "to_fix": to_fix,
            "hyperparameters": hyperparameters(kind, name, setting),
            "values": {k: _values(v) for k, v in (values or {}).items()},
            "core": {k: _values(v) for k, v in (core or {}).items()},
            "rel_diff": dict(rel_diff or {}), "error": error,
        }

    @classmethod
    def fixture(cls, framework: str):
        """A module-scoped pytest fixture: this framework's results, written when the module's tests end."""
        import importlib.metadata

        import pytest

        @pytest.fixture(scope="module")
        def results():
            res = cls(framework, importlib.metadata.version(framework))
            yield res
            res.write()

        return results

    def write(self) -> Path:
        path = results_dir() / f"{self.framework}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True, default=str))
        tmp.replace(path)
        return path


def check_and_record(results: Results, kind: str, name: str, setting: str, values: dict, core: dict) -> None:
    """Compare a framework's ``values`` with the direct core call's ``core`` (same keys), record the
    outcome, and fail unless they agree (rel :data:`RTOL`) or the difference is listed (and real)."""
    diffs = {k: relative_difference(values[k], core[k]) for k in core}
    differs = [k for k, d in diffs.items() if not d <= RTOL]
    listed = known_difference(results.framework, kind, name, setting)
    if not differs:
        results.record(kind, name, setting, IDENTICAL, values=values, core=core, rel_diff=diffs)
        assert listed is None, (
            f"{results.framework} {kind} {name!r} ({setting}) now equals the core call: remove its entry from "
            "KNOWN_DIFFERENCES in integrations_tests/parity/parity_matrix.py"
        )
        return
    detail = ", ".join(f"{k} rel diff {diffs[k]:.3g}" for k in differs)
    if listed is not None:
        results.record(kind, name, setting, DIFFERS, listed.reason, listed.to_fix, values, core, diffs)
        return
    results.record(kind, name, setting, DIFFERS, f"UNLISTED: {detail}", True, values, core, diffs)
    raise AssertionError(
        f"{results.framework} {kind} {name!r} ({setting}) differs from the core call ({detail}) and "
        f"KNOWN_DIFFERENCES gives no reason; values {values} vs core {core}"
    )


def run_call_site(results: Results, kind: str, name: str, setting: str, call):
    """``call()``, the framework's call site; an error is recorded (and raised unless listed). Returns
    ``call()``'s value, or ``None`` after a listed error."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - recorded, re-raised unless listed
        listed = known_difference(results.framework, kind, name, setting)
        error = f"{type(exc).__name__}: {exc}"
        if listed is None:
            results.record(kind, name, setting, DIFFERS, f"UNLISTED error: {error}", True, error=error)
            raise
        results.record(kind, name, setting, DIFFERS, listed.reason, listed.to_fix, error=error)
        return None


def check_case(results: Results, kind: str, name: str, loss_call_site, advantage_call_site) -> None:
    """One row of a framework's column, in every setting: ``loss_call_site(name, loss_batch(), loss_agg_mode,
    params) -> (loss, grad)`` for each of :data:`LOSS_AGG_MODES` ("defaults": token-mean only), or
    ``advantage_call_site(name, reward_batch(), params) -> advantages``, against the direct core call.
    ``params``: the hyper-parameters to set in the framework's own keys (:func:`hyperparameters`)."""
    spec = stablerl.get_spec(kind, name)
    failures = []
    for setting in SETTINGS:
        if not applies(kind, name, setting):
            continue
        if results.framework not in offered_frameworks(spec):
            results.record(kind, name, setting, NOT_OFFERED, not_offered_reason(spec, results.framework))
            continue
        params = hyperparameters(kind, name, setting)
        try:
            _check_setting(results, kind, name, setting, params, loss_call_site, advantage_call_site)
        except AssertionError as exc:  # the other setting still runs and is recorded
            failures.append(str(exc))
    assert not failures, "\n".join(failures)


def _check_setting(results, kind, name, setting, params, loss_call_site, advantage_call_site) -> None:
    if kind == POLICY_LOSS:
        batch = loss_batch()
        modes = LOSS_AGG_MODES if setting == "explicit" else LOSS_AGG_MODES[:1]

        def every_mode():
            return {mode: loss_call_site(name, batch, mode, params) for mode in modes}

        out = run_call_site(results, kind, name, setting, every_mode)
        if out is None:
            return
        values, core = {}, {}
        for mode, (loss, grad) in out.items():
            ref_loss, ref_grad = core_loss(name, batch, mode)
            assert torch.isfinite(ref_loss) and ref_grad.abs().sum() > 0  # a non-trivial gradient is compared
            values.update({f"loss[{mode}]": loss, f"grad[{mode}]": grad})
            core.update({f"loss[{mode}]": ref_loss, f"grad[{mode}]": ref_grad})
        check_and_record(results, kind, name, setting, values, core)
    else:
        batch = reward_batch()
        adv = run_call_site(results, kind, name, setting, lambda: advantage_call_site(name, batch, params))
        if adv is None:
            return
        ref = core_advantages(name, batch, setting)
        assert ref.abs().sum() > 0
        check_and_record(results, kind, name, setting, {"advantages": adv}, {"advantages": ref})
