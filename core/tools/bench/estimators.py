"""``stablerl bench``, estimators: stablerl's advantage estimators next to verl's own.

Inputs as verl's trainer passes them: ``B`` responses in groups of ``group``, ``uid`` a numpy object
array of uuid strings, ``response_mask`` the int64 attention-mask slice, outcome rewards in {0, 1}
on each response's last valid token. Every stablerl estimator (through
:func:`stablerl.compute_advantage`) is timed interleaved with verl's vectorized GRPO or RLOO (its
own twin where there is one, ``grpo_vectorized`` otherwise: the cost of one pass over the batch)
and, for ``grpo`` and ``rloo``, with verl's per-group loop version too. The pairs with a twin are
also checked to give the same advantages.
"""

from __future__ import annotations

import statistics
import uuid
from typing import Any, Callable, Optional

import numpy as np
import torch

import stablerl
from stablerl import ADVANTAGE_ESTIMATOR

#: stablerl name -> (verl vectorized twin, verl loop twin, keyword arguments for both)
VERL_TWINS = {
    "grpo": ("grpo_vectorized", "grpo", {}),
    "dr_grpo": ("grpo_vectorized", "grpo", {"norm_adv_by_std_in_grpo": False}),
    "rloo": ("rloo_vectorized", "rloo", {}),
    "opo": (None, "opo", {}),
}
#: hyper-parameters for estimators whose defaults need inputs the bench does not build
PARAMS = {"reinforce_ada": {"global_stat_est": False}}
SHAPE = ("B4096xT512", 4096, 512)
GROUP = 8


def make_inputs(B: int, T: int, group: int = GROUP, device: str = "cpu", seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(T // 4, 1), T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).to(torch.int64)
    scores = (torch.rand(B, generator=g) > 0.5).float()
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = scores
    rng = np.random.default_rng(seed)
    uids = [str(uuid.UUID(bytes=rng.bytes(16), version=4)) for _ in range((B + group - 1) // group)]
    index = np.array([uids[i // group] for i in range(B)], dtype=object)
    return {"token_level_rewards": rewards.to(device), "response_mask": mask.to(device), "index": index}


def ours_fn(name: str, inputs: dict) -> Callable:
    params = PARAMS.get(name, {})
    return lambda: stablerl.compute_advantage(name, **inputs, **params)


def verl_fn(core_algos, verl_name: str, inputs: dict, kwargs: dict) -> Callable:
    fn = core_algos.get_adv_estimator_fn(verl_name)
    return lambda: fn(**inputs, **kwargs)


def _pairs(ours: Callable, base: Callable, repeats: int, clock: Callable[[], float], sync: Callable[[], None]):
    def timed(f):
        sync()
        t0 = clock()
        f()
        sync()
        return clock() - t0

    timed(ours), timed(base)
    t_ours, t_base, ratios = [], [], []
    for r in range(repeats):
        if r % 2 == 0:
            a, b = timed(ours), timed(base)
        else:
            b, a = timed(base), timed(ours)
        t_ours.append(a)
        t_base.append(b)
        ratios.append(a / b)
    return {
        "time_ratio": statistics.median(ratios),
        "time_ratio_min": min(ratios),
        "ours_ms_min": 1e3 * min(t_ours),
        "ours_ms_median": 1e3 * statistics.median(t_ours),
        "base_ms_min": 1e3 * min(t_base),
        "base_ms_median": 1e3 * statistics.median(t_base),
    }


def run(core_algos, repeats: int, clock: Callable[[], float], device: str = "cpu",
        shape: tuple = SHAPE, group: int = GROUP, names: Optional[list[str]] = None,
        log: Callable[[str], None] = lambda s: None) -> dict:
    """``{name: {"baseline", "cases": {case: row}, "time_ratio"}}``; with ``core_algos`` None
    (verl absent) ``{"skipped": reason}``."""
    if core_algos is None:
        return {"skipped": "verl is not installed (pip install 'stablerl[verl]')"}
    sync = (lambda: torch.cuda.synchronize()) if device.startswith("cuda") else (lambda: None)
    label, B, T = shape
    inputs = make_inputs(B, T, group, device)
    case = f"{label}/g{group}"
    available = [s.name for s in stablerl.list_algorithms(ADVANTAGE_ESTIMATOR)
                 if s.status != "unavailable" and s.fn is not None and not s.requires]
    out: dict[str, Any] = {}
    for name in available:
        if names and name not in names:
            continue
        vec, loop, kwargs = VERL_TWINS.get(name, (None, None, {}))
        base_name = vec or ("grpo_vectorized" if loop is None else loop)
        entry = out.setdefault(name, {"baseline": f"verl:{base_name}", "twin": vec is not None or loop is not None,
                                      "cases": {}})
        try:
            ours = ours_fn(name, inputs)
            base = verl_fn(core_algos, base_name, inputs, kwargs if base_name in (vec, loop) else {})
            row = _pairs(ours, base, repeats, clock, sync)
            if entry["twin"]:
                mine, theirs = ours()[0], base()[0]
                row["adv_max_abs_diff"] = float((mine.double() - theirs.double()).abs().max())
            if vec is not None and loop is not None:
                loop_row = _pairs(ours, verl_fn(core_algos, loop, inputs, kwargs), repeats, clock, sync)
                row["loop_baseline"] = f"verl:{loop}"
                row["loop_time_ratio"] = loop_row["time_ratio"]
                row["loop_ms_min"] = loop_row["base_ms_min"]
        except Exception as e:  # noqa: BLE001 - one broken estimator must not stop the bench
            row = {"error": f"{type(e).__name__}: {e}"}
        entry["cases"][case] = row
        log(f"{case:<22} {name:<14} " + (
            f"time x{row['time_ratio']:.2f} vs {entry['baseline']}"
            + (f", x{row['loop_time_ratio']:.2f} vs {row['loop_baseline']}" if "loop_time_ratio" in row else "")
            if "error" not in row else row["error"]))
    for entry in out.values():
        ok = [c for c in entry["cases"].values() if "error" not in c]
        entry["time_ratio"] = max((c["time_ratio"] for c in ok), default=None)
    return out


def markdown(estimators: dict) -> list[str]:
    if not estimators:
        return []
    if "skipped" in estimators:
        return [f"Estimator comparison not run: {estimators['skipped']}.", ""]
    lines = ["### Advantage estimators against verl's", "",
             "| estimator | baseline | case | time ratio median [min] | ours ms best (median) | base ms best (median) "
             "| vs verl loop version | max abs diff |",
             "|---|---|---|---|---|---|---|---|"]
    for name, e in estimators.items():
        for case, c in e["cases"].items():
            if "error" in c:
                lines.append(f"| {name} | {e['baseline']} | {case} | error: {c['error'][:80]} |")
                continue
            loop = f"{c['loop_time_ratio']:.2f} ({c['loop_baseline']}, {c['loop_ms_min']:.1f} ms)" if "loop_time_ratio" in c else "-"
            diff = f"{c['adv_max_abs_diff']:.1e}" if "adv_max_abs_diff" in c else "- (no twin)"
            lines.append(f"| {name} | {e['baseline']} | {case} | {c['time_ratio']:.2f} [{c['time_ratio_min']:.2f}] | "
                         f"{c['ours_ms_min']:.2f} ({c['ours_ms_median']:.2f}) | {c['base_ms_min']:.2f} ({c['base_ms_median']:.2f}) "
                         f"| {loop} | {diff} |")
    lines.append("")
    return lines
