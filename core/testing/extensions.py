"""Conformance of the other algorithm kinds: reward shapers, batch filters, controllers, rollout
corrections and MoE router families.

Each ``check_*`` runs the kind's properties on the registered algorithm ``name`` and raises
:class:`ConformanceError` naming the first violated one (``skip=`` leaves properties out):

* reward shapers (:data:`REWARD_SHAPER_PROPERTIES`): ``spec``; ``output`` (finite ``[B]`` rewards,
  finite float metrics); ``deterministic`` (same inputs and generator seed, same rewards bit for
  bit); ``inputs_unchanged`` (nothing given is modified in place); ``undeclared_inputs`` (every
  known per-response input it does not declare changes nothing; a declared one left out is refused
  by ``stablerl.shape_rewards`` / ``filter_batch`` themselves);
  ``permutation`` (shuffling the responses of each group, with their inputs, permutes the rewards).
* batch filters (:data:`BATCH_FILTER_PROPERTIES`): ``spec``; ``output`` (a ``FilterResult`` whose
  rows index the batch, whose mask and advantages have one row per kept row); ``masks_respected``
  (a kept row never gains a token its input mask did not have); ``masked_content`` (what padded
  positions hold changes nothing); ``deterministic``; ``inputs_unchanged``; ``undeclared_inputs``.
* controllers (:data:`CONTROLLER_PROPERTIES`): ``spec``; ``output`` (``step`` returns a dict);
  ``deterministic`` (two fresh instances fed the same statistics agree); ``state_round_trip``
  (``state_dict`` saved with ``torch.save`` mid-run and loaded into a fresh instance continues
  exactly like the original); ``state_snapshot`` (a returned ``state_dict`` does not change when the
  controller steps on).
* rollout corrections (:data:`ROLLOUT_CORRECTION_PROPERTIES`): ``spec``; ``output`` (finite,
  non-negative weights broadcastable to ``[B, T]``, carrying no gradient); ``masked_tokens``
  (garbage in padded positions changes no valid weight); ``on_policy`` (rollout log-probs equal to
  the old ones give weight 1 on every valid token); ``deterministic``.
* trainer hooks (:data:`TRAINER_HOOK_PROPERTIES`): ``spec``; ``output`` (``passes_per_batch`` an int >= 1,
  ``after_pass`` a dict, ``samples_per_prompt`` an int >= 0, finite parameters after each batch);
  ``deterministic`` (two fresh hooks on the same toy parameters and statistics agree bit for bit);
  ``state_round_trip`` and ``state_snapshot`` as for controllers, between batches.
* router families (:data:`ROUTER_FAMILY_PROPERTIES`): ``output`` (finite ``[N, k]`` weights);
  ``gradient`` (reaches ``router_logits``); ``slot_order`` (permuting the k recorded experts
  permutes their weights); ``deterministic``; ``module_attributes`` (``top_k`` / ``num_experts``
  read the router module).
"""

from __future__ import annotations

import copy
import inspect
import io
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Mapping, Optional

import torch

from ..api import filter_batch, get_spec, make_controller, make_trainer_hook, shape_rewards
from ..context import Context
from ..contracts import (
    BATCH_FILTER,
    CONTROLLER,
    REWARD_SHAPER,
    ROLLOUT_CORRECTION,
    ROUTER_FAMILY,
    TRAINER_HOOK,
    FilterResult,
    ParamsView,
    PolicyLossBatch,
    PromptStats,
)
from ..ops import as_floats
from ..params import build_params
from .batches import _garbage_like, _lengths, _synth_input
from .common import _assert_close, _check_skip, _check_spec, _fail, _run_checks, _same

REWARD_SHAPER_PROPERTIES = (
    "spec", "output", "deterministic", "inputs_unchanged", "undeclared_inputs", "permutation",
)
BATCH_FILTER_PROPERTIES = (
    "spec", "output", "masks_respected", "masked_content", "deterministic", "inputs_unchanged", "undeclared_inputs",
)
CONTROLLER_PROPERTIES = ("spec", "output", "deterministic", "state_round_trip", "state_snapshot")
ROLLOUT_CORRECTION_PROPERTIES = ("spec", "output", "masked_tokens", "on_policy", "deterministic")
ROUTER_FAMILY_PROPERTIES = ("output", "gradient", "slot_order", "deterministic", "module_attributes")
TRAINER_HOOK_PROPERTIES = ("spec", "output", "deterministic", "state_round_trip", "state_snapshot")

# sizes of the synthetic batches: groups of 4, one group with continuous rewards
B_EXT, T_EXT, GROUP_EXT = 12, 10, 4
# per-response inputs the suite synthesises for shapers and filters (contracts.OPTIONAL_INPUTS names)
_ROW_INPUTS = ("scores", "correct", "lengths", "flawed", "void_turn", "entropy")


def _ctx() -> Context:
    # mid-run training progress, for algorithms scheduled over it (e.g. d3s)
    return Context(generator=torch.Generator().manual_seed(1234), step=3, total_steps=10)


def _row_input(name: str, base: dict, g: torch.Generator) -> Any:
    mask = base["response_mask"]
    B, T = mask.shape
    if name == "correct":
        return base["scores"] > 0.5
    if name == "lengths":
        return mask.sum(-1).long()
    if name in ("flawed", "void_turn"):
        return torch.rand(B, generator=g) < 0.3
    if name == "scores":
        return base["scores"]
    return _synth_input(name, B, T, g, torch.float32)


def _row_batch(spec, seed: int = 0, inputs: Optional[Mapping[str, Any]] = None, every_input: bool = False) -> dict:
    """Scores (0/1, one group continuous), groups of 4, a right-padded mask and the declared inputs
    (``every_input``: also every input in :data:`_ROW_INPUTS`)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T_EXT).unsqueeze(0) < _lengths(B_EXT, T_EXT, g).unsqueeze(1)
    scores = torch.randint(0, 2, (B_EXT,), generator=g).float()
    scores[GROUP_EXT: 2 * GROUP_EXT] = torch.rand(GROUP_EXT, generator=g) * 2 - 0.5
    adv = torch.randn(B_EXT, generator=g).unsqueeze(-1) * mask
    base = {"response_mask": mask, "scores": scores, "index": torch.arange(B_EXT) // GROUP_EXT, "advantages": adv}
    inputs = dict(inputs or {})
    names = list(spec.requires) + [n for n in (_ROW_INPUTS if every_input else ()) if n not in spec.requires]
    extras = {}
    for name in names + [k for k in inputs if k not in names]:
        if name in ("index", "scores"):
            continue
        if name in inputs:
            value = inputs[name]
            extras[name] = value(base) if callable(value) else value
        else:
            value = _row_input(name, base, g)
            if value is None:
                _fail(spec, "output", f"declares input {name!r}, which the suite cannot synthesise; "
                      f"pass inputs={{{name!r}: value_or_fn}}")
            extras[name] = value
    base["extras"] = extras
    return base


def _run_shaper(spec, data: dict, params: Mapping[str, Any]):
    return shape_rewards(spec.name, scores=data["scores"], index=data["index"], ctx=_ctx(),
                         extras=dict(data["extras"]), **params)


def _run_filter(spec, data: dict, params: Mapping[str, Any]) -> FilterResult:
    extras = dict(data["extras"])
    entropy = extras.pop("entropy", None)
    return filter_batch(spec.name, advantages=data["advantages"], response_mask=data["response_mask"],
                        index=data["index"], scores=data["scores"], entropy=entropy, ctx=_ctx(), extras=extras,
                        **params)


def _snapshot(data: dict) -> dict:
    return {k: (copy.deepcopy(v) if not isinstance(v, torch.Tensor) else v.clone()) for k, v in data.items()}


def _unchanged(spec, before: dict, after: dict) -> None:
    for k, v in before.items():
        if isinstance(v, dict):
            _unchanged(spec, v, after[k])
        elif not _same(v, after[k]):
            _fail(spec, "inputs_unchanged", f"modified its input {k!r} in place")


def _finite_metrics(spec, prop: str, metrics: Mapping[str, Any]) -> None:
    for k, v in metrics.items():
        if not isinstance(v, float) or v != v or v in (float("inf"), float("-inf")):
            _fail(spec, prop, f"metric {k!r} is {v!r}, not a finite float")


def _with_undeclared(spec, data: dict, inputs: Optional[Mapping[str, Any]]) -> tuple[dict, list]:
    """``data`` plus every per-response input the suite makes that ``spec`` does not declare."""
    full = _row_batch(spec, inputs=inputs, every_input=True)
    full["extras"] = {k: v for k, v in full["extras"].items() if k not in spec.reads or k in data["extras"]}
    return full, sorted(set(full["extras"]) - set(data["extras"]))


def _row_properties(spec, data: dict, inputs: Optional[Mapping[str, Any]], run: Callable[[dict], tuple],
                    what: str) -> list:
    """The properties every per-response algorithm shares (a reward shaper, a batch filter), as
    ``_run_checks`` entries: ``run(data)`` returns its output tensors; ``what`` names them in messages."""

    def same(a: tuple, b: tuple) -> bool:
        return all(_same(x, y) for x, y in zip(a, b))

    def deterministic():
        if not same(run(data), run(data)):
            _fail(spec, "deterministic", "two calls with the same inputs and generator seed differ")

    def inputs_unchanged():
        before = _snapshot(data)
        run(data)
        _unchanged(spec, before, data)

    def undeclared():
        full, added = _with_undeclared(spec, data, inputs)
        if not same(run(data), run(full)):
            _fail(spec, "undeclared_inputs", f"giving inputs it does not declare ({added}) changed its {what}")

    return [("deterministic", deterministic), ("inputs_unchanged", inputs_unchanged), ("undeclared_inputs", undeclared)]


def _permute(data: dict, perm: torch.Tensor) -> dict:
    out = {k: (v[perm] if isinstance(v, torch.Tensor) else v) for k, v in data.items() if k != "extras"}
    out["extras"] = {k: (v[perm] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == B_EXT else v)
                     for k, v in data["extras"].items()}
    return out


# ----------------------------------------------------------------------------- reward shapers


def check_reward_shaper(name: str, *, inputs: Optional[Mapping[str, Any]] = None, skip: Iterable[str] = (),
                        **params: Any) -> None:
    """Run every reward-shaper conformance property on the registered shaper ``name``."""
    spec = get_spec(REWARD_SHAPER, name)
    skip = _check_skip(skip, REWARD_SHAPER_PROPERTIES)
    data = _row_batch(spec, inputs=inputs)

    def output():
        shaped, metrics = _run_shaper(spec, data, params)
        if not shaped.is_floating_point():
            _fail(spec, "output", f"rewards of dtype {shaped.dtype}, expected floating")
        _finite_metrics(spec, "output", metrics)

    def permutation():  # responses within a group are exchangeable; groups keep their order
        g = torch.Generator().manual_seed(5)
        perm = torch.cat([i + torch.randperm(GROUP_EXT, generator=g) for i in range(0, B_EXT, GROUP_EXT)])
        ref, _ = _run_shaper(spec, data, params)
        got, _ = _run_shaper(spec, _permute(data, perm), params)
        _assert_close(spec, "permutation", "rewards of shuffled rows vs shuffled rewards", got, ref[perm])

    _run_checks(spec, [
        ("spec", lambda: _check_spec(spec)),
        ("output", output),
        *_row_properties(spec, data, inputs, lambda d: (_run_shaper(spec, d, params)[0],), "rewards"),
        ("permutation", permutation),
    ], skip)


# ----------------------------------------------------------------------------- batch filters


def _result_tuple(r: FilterResult) -> tuple:
    return r.rows, r.response_mask, r.advantages


def check_batch_filter(name: str, *, inputs: Optional[Mapping[str, Any]] = None, skip: Iterable[str] = (),
                       **params: Any) -> None:
    """Run every batch-filter conformance property on the registered filter ``name``."""
    spec = get_spec(BATCH_FILTER, name)
    skip = _check_skip(skip, BATCH_FILTER_PROPERTIES)
    data = _row_batch(spec, inputs=inputs)
    mask = data["response_mask"]

    def output():
        r = _run_filter(spec, data, params)
        rows = r.rows
        if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.dtype != torch.int64:
            _fail(spec, "output", f"rows must be a 1-D int64 tensor, got {getattr(rows, 'dtype', type(rows))}")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= B_EXT):
            _fail(spec, "output", f"rows {rows.tolist()} index outside the batch of {B_EXT}")
        if tuple(r.response_mask.shape) != (rows.numel(), T_EXT):
            _fail(spec, "output", f"response_mask has shape {tuple(r.response_mask.shape)}, expected "
                  f"{(rows.numel(), T_EXT)} (one row per kept row)")
        if r.advantages is not None and (tuple(r.advantages.shape) != (rows.numel(), T_EXT)
                                         or not bool(torch.isfinite(r.advantages).all())):
            _fail(spec, "output", "advantages must be finite with one row per kept row")
        _finite_metrics(spec, "output", r.metrics)

    def masks_respected():
        r = _run_filter(spec, data, params)
        revived = (r.response_mask.bool() & ~mask[r.rows].bool())
        if bool(revived.any()):
            _fail(spec, "masks_respected", f"{int(revived.sum())} tokens masked in the input are valid in the result")

    def masked_content():
        g = torch.Generator().manual_seed(99)
        pad = ~mask
        garbage = dict(data, advantages=torch.where(pad, _garbage_like("advantages", data["advantages"], g),
                                                    data["advantages"]))
        extras = dict(data["extras"])
        if "entropy" in extras:
            extras["entropy"] = torch.where(pad, _garbage_like("entropy", extras["entropy"], g), extras["entropy"])
        garbage["extras"] = extras
        a, b = _run_filter(spec, data, params), _run_filter(spec, garbage, params)
        if not (_same(a.rows, b.rows) and _same(a.response_mask, b.response_mask)):
            _fail(spec, "masked_content", "values in padded positions changed the kept rows or their mask")
        if a.advantages is not None:
            keep = a.response_mask.bool()
            _assert_close(spec, "masked_content", "valid advantages with garbage padding", b.advantages[keep],
                          a.advantages[keep])

    _run_checks(spec, [
        ("spec", lambda: _check_spec(spec)),
        ("output", output),
        ("masks_respected", masks_respected),
        ("masked_content", masked_content),
        *_row_properties(spec, data, inputs, lambda d: _result_tuple(_run_filter(spec, d, params)), "result"),
    ], skip)


# ----------------------------------------------------------------------------- controllers

# statistics the suite can feed a controller's step(), one value per step
_STATS: dict[str, Callable[[int], Any]] = {
    "entropy": lambda i: [1.4, 0.9, 0.4, 0.2, 0.6, 1.1][i % 6],
    "turn_entropy": lambda i: [1.0 - 0.1 * i, 0.8 + 0.05 * i],
    "num_kept": lambda i: 3 + i % 2,
}


def _stats_for(spec, controller, stats: Optional[Callable[[int], Mapping[str, Any]]]) -> Callable[[int], dict]:
    if stats is not None:
        return lambda i: dict(stats(i))
    params = inspect.signature(controller.step).parameters
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [n for n in names if n not in _STATS and params[n].default is inspect.Parameter.empty]
    if unknown:
        _fail(spec, "output", f"step() needs statistics {unknown} the suite cannot make; pass stats=fn(step) -> dict")
    return lambda i: {n: _STATS[n](i) for n in names if n in _STATS}


def _through_checkpoint(state: Any) -> Any:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def check_controller(name: str, *, stats: Optional[Callable[[int], Mapping[str, Any]]] = None,
                     skip: Iterable[str] = (), steps: int = 6, **params: Any) -> None:
    """Run every controller conformance property on the registered controller ``name``.

    ``stats(i)`` gives the statistics of step ``i`` (default: made from ``step()``'s signature)."""
    spec = get_spec(CONTROLLER, name)
    skip = _check_skip(skip, CONTROLLER_PROPERTIES)
    feed = _stats_for(spec, make_controller(name, **params), stats)

    def run(controller, start: int, stop: int) -> list:
        return [controller.step(**feed(i)) for i in range(start, stop)]

    def output():
        for out in run(make_controller(name, **params), 0, steps):
            if not isinstance(out, dict):
                _fail(spec, "output", f"step() returned {type(out).__name__}, expected a dict")

    def deterministic():
        a, b = run(make_controller(name, **params), 0, steps), run(make_controller(name, **params), 0, steps)
        if a != b:
            _fail(spec, "deterministic", f"two fresh controllers fed the same statistics differ: {a} vs {b}")

    def round_trip():
        half = steps // 2
        original = make_controller(name, **params)
        run(original, 0, half)
        restored = make_controller(name, **params)
        restored.load_state_dict(_through_checkpoint(original.state_dict()))
        if not _same_state(original.state_dict(), restored.state_dict()):
            _fail(spec, "state_round_trip", "load_state_dict(state_dict()) gives another state_dict")
        a, b = run(original, half, steps), run(restored, half, steps)
        if a != b:
            _fail(spec, "state_round_trip", f"after a checkpoint round trip the controller continues differently: "
                  f"{a} vs {b}")

    def snapshot():
        controller = make_controller(name, **params)
        run(controller, 0, 1)
        state = controller.state_dict()
        frozen = copy.deepcopy(state)
        run(controller, 1, steps)
        if not _same_state(state, frozen):
            _fail(spec, "state_snapshot", "a state_dict() taken earlier changed when the controller stepped on "
                  "(it shares the controller's live objects; return copies)")

    _run_checks(spec, [
        ("spec", lambda: _check_spec(spec)),
        ("output", output),
        ("deterministic", deterministic),
        ("state_round_trip", round_trip),
        ("state_snapshot", snapshot),
    ], skip)


def check_trainer_hook(name: str, *, skip: Iterable[str] = (), batches: int = 6, **params: Any) -> None:
    """Run every trainer-hook conformance property on the registered trainer hook ``name``: the hook drives
    a toy parameter set through ``batches`` rollout batches (each pass a fixed pseudo-gradient step), fed a
    decreasing entropy, and is asked ``samples_per_prompt`` for a few prompts."""
    spec = get_spec(TRAINER_HOOK, name)
    skip = _check_skip(skip, TRAINER_HOOK_PROPERTIES)
    prompts = [PromptStats(drawn=d, positive=p, rounds=r) for d, p, r in ((4, 0, 1), (8, 4, 2), (8, 8, 1), (32, 1, 4))]

    def run(hook, weights: list, start: int, stop: int) -> list:
        view = ParamsView(parameters=lambda: weights)
        outs = []
        for b in range(start, stop):
            passes = hook.passes_per_batch()
            if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
                _fail(spec, "output", f"passes_per_batch() returned {passes!r}, expected an int >= 1")
            hook.before_batch(view)
            for k in range(passes):
                with torch.no_grad():
                    for i, w in enumerate(weights):  # a deterministic stand-in for an optimizer step
                        w.sub_(0.01 * (i + 1) * torch.sin(w + b + k))
                out = hook.after_pass(view, k, entropy=2.0 / (1 + b) + 0.1 * k)
                if not isinstance(out, dict):
                    _fail(spec, "output", f"after_pass() returned {type(out).__name__}, expected a dict")
                outs.append(out)
            if not all(bool(torch.isfinite(w).all()) for w in weights):
                _fail(spec, "output", f"non-finite parameters after batch {b}")
            for stats in prompts:
                more = hook.samples_per_prompt(stats)
                if not isinstance(more, int) or isinstance(more, bool) or more < 0:
                    _fail(spec, "output", f"samples_per_prompt({stats}) returned {more!r}, expected an int >= 0")
                outs.append(more)
        return outs + [w.clone() for w in weights]

    def fresh_weights() -> list:
        g = torch.Generator().manual_seed(0)
        return [torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)]

    def output():
        run(make_trainer_hook(name, **params), fresh_weights(), 0, batches)

    def deterministic():
        a = run(make_trainer_hook(name, **params), fresh_weights(), 0, batches)
        b = run(make_trainer_hook(name, **params), fresh_weights(), 0, batches)
        if not _same_state(a, b):
            _fail(spec, "deterministic", "two fresh hooks on the same parameters and statistics differ")

    def round_trip():
        half = batches // 2
        w1, w2 = fresh_weights(), None
        original = make_trainer_hook(name, **params)
        run(original, w1, 0, half)
        w2 = [w.clone() for w in w1]
        restored = make_trainer_hook(name, **params)
        restored.load_state_dict(_through_checkpoint(original.state_dict()))
        if not _same_state(original.state_dict(), restored.state_dict()):
            _fail(spec, "state_round_trip", "load_state_dict(state_dict()) gives another state_dict")
        if not _same_state(run(original, w1, half, batches), run(restored, w2, half, batches)):
            _fail(spec, "state_round_trip", "after a checkpoint round trip the hook continues differently")

    def snapshot():
        hook, weights = make_trainer_hook(name, **params), fresh_weights()
        run(hook, weights, 0, 1)
        state = hook.state_dict()
        frozen = copy.deepcopy(state)
        run(hook, weights, 1, batches)
        if not _same_state(state, frozen):
            _fail(spec, "state_snapshot", "a state_dict() taken earlier changed when the hook ran on (return copies)")

    _run_checks(spec, [
        ("spec", lambda: _check_spec(spec)),
        ("output", output),
        ("deterministic", deterministic),
        ("state_round_trip", round_trip),
        ("state_snapshot", snapshot),
    ], skip)


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return _same(a, b)


# ----------------------------------------------------------------------------- rollout corrections


def _correction_batch(seed: int = 0, on_policy: bool = False) -> PolicyLossBatch:
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T_EXT).unsqueeze(0) < _lengths(B_EXT, T_EXT, g).unsqueeze(1)
    old = -(torch.rand(B_EXT, T_EXT, generator=g, dtype=torch.float64) * 2 + 0.05)
    lp = (old + 0.2 * torch.randn(B_EXT, T_EXT, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    rollout = old.clone() if on_policy else (old + 0.3 * torch.randn(B_EXT, T_EXT, generator=g,
                                                                     dtype=torch.float64)).clamp(max=-1e-4)
    adv = torch.randn(B_EXT, generator=g, dtype=torch.float64).unsqueeze(-1) * mask
    m = mask.double()
    return PolicyLossBatch(log_prob=lp.requires_grad_(True), old_log_prob=old * m, advantages=adv, response_mask=m,
                           rollout_log_prob=rollout * m, index=torch.arange(B_EXT) // GROUP_EXT, valid_tokens=mask)


def _run_correction(spec, batch: PolicyLossBatch, params: Mapping[str, Any]):
    weights, metrics = spec.fn(batch, build_params(spec, params), _ctx())
    return torch.as_tensor(weights), as_floats(metrics)  # as compute_policy_loss reports them


def check_rollout_correction(name: str, *, skip: Iterable[str] = (), **params: Any) -> None:
    """Run every rollout-correction conformance property on the registered correction ``name``
    (the function ``compute_policy_loss(..., rollout_correction=name)`` applies)."""
    spec = get_spec(ROLLOUT_CORRECTION, name)
    skip = _check_skip(skip, ROLLOUT_CORRECTION_PROPERTIES)
    batch = _correction_batch()
    valid = batch.valid_tokens

    def full(w: torch.Tensor) -> torch.Tensor:
        return w.expand(B_EXT, T_EXT) if w.dim() == 2 else w

    def output():
        w, metrics = _run_correction(spec, batch, params)
        if w.dim() != 2 or w.shape[0] != B_EXT or w.shape[1] not in (1, T_EXT):
            _fail(spec, "output", f"weights of shape {tuple(w.shape)}, expected [B, T] or [B, 1]")
        w = full(w)
        if not bool(torch.isfinite(w[valid]).all()) or bool((w[valid] < 0).any()):
            _fail(spec, "output", "weights on valid tokens must be finite and >= 0")
        if w.requires_grad:
            _fail(spec, "output", "weights carry gradient (a correction weight is a constant of the update)")
        _finite_metrics(spec, "output", metrics)

    def masked_tokens():
        g = torch.Generator().manual_seed(99)
        pad = ~valid
        garbage = PolicyLossBatch(**{**batch.__dict__})
        for key in ("old_log_prob", "rollout_log_prob"):
            t = getattr(batch, key)
            setattr(garbage, key, torch.where(pad, _garbage_like(key, t, g), t))
        garbage.log_prob = torch.where(pad, _garbage_like("log_prob", batch.log_prob.detach(), g),
                                       batch.log_prob.detach()).requires_grad_(True)
        a, b = full(_run_correction(spec, batch, params)[0]), full(_run_correction(spec, garbage, params)[0])
        _assert_close(spec, "masked_tokens", "weights on valid tokens with garbage padding", b[valid], a[valid])

    def on_policy():
        w = full(_run_correction(spec, _correction_batch(on_policy=True), params)[0])
        _assert_close(spec, "on_policy", "weights when rollout_log_prob == old_log_prob", w[valid],
                      torch.ones_like(w[valid]))

    def deterministic():
        a, b = _run_correction(spec, batch, params)[0], _run_correction(spec, batch, params)[0]
        if not _same(a, b):
            _fail(spec, "deterministic", "two calls with the same inputs differ")

    _run_checks(spec, [
        ("spec", lambda: _check_spec(spec)),
        ("output", output),
        ("masked_tokens", masked_tokens),
        ("on_policy", on_policy),
        ("deterministic", deterministic),
    ], skip)


# ----------------------------------------------------------------------------- router families


def check_router_family(name: str, *, module: Any = None, top_k: int = 2, num_experts: int = 8,
                        skip: Iterable[str] = ()) -> None:
    """Run every router-family conformance property on the registered family ``name``.

    ``module`` stands for the router module the family reads its settings from (default: an
    object with the family's ``top_k`` / ``num_experts`` attributes and nothing else)."""
    spec = get_spec(ROUTER_FAMILY, name)
    skip = _check_skip(skip, ROUTER_FAMILY_PROPERTIES)
    family = spec.fn
    if module is None:
        module = SimpleNamespace(**{family.top_k_attr: top_k, family.num_experts_attr: num_experts})
    g = torch.Generator().manual_seed(0)
    N = 16
    logits = torch.randn(N, num_experts, generator=g, dtype=torch.float32)
    indices = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(N)])

    def recompute(lg: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return family.recompute_weights(lg, idx, module)

    def output():
        w = recompute(logits, indices)
        if tuple(w.shape) != (N, top_k) or not w.is_floating_point() or not bool(torch.isfinite(w).all()):
            _fail(spec, "output", f"weights must be finite floats of shape {(N, top_k)}, got {tuple(w.shape)} {w.dtype}")

    def gradient():
        lg = logits.clone().requires_grad_(True)
        w = recompute(lg, indices)
        if not w.requires_grad:
            _fail(spec, "gradient", "the weights do not depend on router_logits (the router would stop learning)")
        (grad,) = torch.autograd.grad((w * torch.arange(1, top_k + 1, dtype=w.dtype)).sum(), lg)
        if not bool(torch.isfinite(grad).all()) or not bool((grad != 0).any()):
            _fail(spec, "gradient", "the gradient on router_logits is zero or not finite")

    def slot_order():
        perm = torch.arange(top_k - 1, -1, -1)
        _assert_close(spec, "slot_order", "weights of reversed expert slots vs reversed weights",
                      recompute(logits, indices[:, perm]), recompute(logits, indices)[:, perm])

    def deterministic():
        if not _same(recompute(logits, indices), recompute(logits, indices)):
            _fail(spec, "deterministic", "two calls with the same inputs differ")

    def module_attributes():
        if family.top_k(module) != top_k or family.num_experts(module) != num_experts:
            _fail(spec, "module_attributes", f"top_k/num_experts read {family.top_k(module)}/"
                  f"{family.num_experts(module)} from a module with {top_k}/{num_experts}")

    _run_checks(spec, [
        ("output", output),
        ("gradient", gradient),
        ("slot_order", slot_order),
        ("deterministic", deterministic),
        ("module_attributes", module_attributes),
    ], skip)


EXTENSION_CHECKS: dict[str, Callable[..., None]] = {
    REWARD_SHAPER: check_reward_shaper,
    BATCH_FILTER: check_batch_filter,
    CONTROLLER: check_controller,
    ROLLOUT_CORRECTION: check_rollout_correction,
    ROUTER_FAMILY: check_router_family,
    TRAINER_HOOK: check_trainer_hook,
}
