"""Shared pieces of the stability experiments: one TRL GRPO run on the demo's tiny model and task,
a time budget, and the table / plot writers. The model, tokenizer, data set, reward and GRPOConfig
come from :mod:`stablerl.tools.demo` (nothing is downloaded; CPU only)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "stability"


def setup(threads: int = 1) -> None:
    import torch
    import transformers

    from stablerl.tools import demo  # noqa: F401  (sets the offline environment before TRL loads)

    torch.set_num_threads(max(1, threads))
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    logging.getLogger("trl").setLevel(logging.ERROR)


class Budget:
    """A wall-clock budget in minutes: runs that would start after it are skipped (and reported)."""

    def __init__(self, minutes: float):
        self.deadline = time.monotonic() + 60 * minutes
        self.minutes = minutes

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def allows(self) -> bool:
        return self.left_s() > 0


def _window(values: list, frac: float = 0.1) -> list[float]:
    """Means of a sliding window of ``frac`` of the points (the reward is logged once per generation)."""
    v = [x for x in values if x is not None and x == x]
    if not v:
        return []
    k = max(1, int(round(len(v) * frac)))
    return [sum(v[i:i + k]) / k for i in range(len(v) - k + 1)]


def train(loss: str, *, steps: int, seed: int, lr: float, out_dir: Path, num_iterations: int = 1,
          off_policy_inputs: bool = False, **overrides: Any) -> dict:
    """One GRPO run through the real TRL trainer; per-step reward/entropy and a summary.

    ``off_policy_inputs``: build the trainer from :mod:`_offpolicy_trainer` (behaviour log-probs and
    policy versions for decoupled_ppo / a3po; other losses run exactly as with the plain adapter).

    ``collapsed``: the final reward (mean of the last 10% of logged rewards) is below half of the
    run's best 10%-window mean, after that best was at least 0.3 (it learned, then lost it).
    """
    from stablerl.tools import demo

    if off_policy_inputs:
        import _offpolicy_trainer as builders
    else:
        builders = demo
    record: dict[str, Any] = {"step": [], "metrics": {}}
    args = builders.make_config(str(out_dir / "runs" / f"{loss}-s{seed}"), loss, steps=steps, seed=seed, lr=lr,
                                num_iterations=num_iterations, **overrides)
    trainer = builders.make_trainer(args, callbacks=[demo._recorder_callback(record, None)], seed=seed)
    t0 = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - t0
    n = len(record["step"])
    m = {k: v + [None] * (n - len(v)) for k, v in record["metrics"].items()}
    reward, entropy = m.get("reward", [None] * n), m.get("entropy", [None] * n)
    windows = _window(reward)
    best = max(windows) if windows else float("nan")
    final = windows[-1] if windows else float("nan")
    initial = windows[0] if windows else float("nan")
    ent = _window(entropy)
    return {
        "loss_type": loss, "seed": seed, "steps": record["step"], "reward": reward, "entropy": entropy,
        "initial_reward": initial, "best_reward": best, "final_reward": final,
        "final_entropy": ent[-1] if ent else float("nan"),
        "collapsed": bool(best >= 0.3 and final < 0.5 * best),
        "time_s": elapsed,
        # run means of the losses' clip / mask / IS statistics (what each loss did to the stale tokens)
        "metric_means": {k: sum(x for x in v if x is not None) / max(1, sum(x is not None for x in v))
                         for k, v in m.items() if k.startswith(("stablerl/", "clip_ratio/"))},
    }


def machine() -> str:
    cpu = ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{cpu} ({os.cpu_count()} cores, load {load:.1f} at the end), torch threads 1"


def write_json(name: str, data: dict) -> Path:
    DOCS.mkdir(parents=True, exist_ok=True)
    path = DOCS / f"{name}.json"
    # curves are kept (they are small: one value per step)
    path.write_text(json.dumps(data, indent=1, default=str))
    return path


def fmt(x: Optional[float]) -> str:
    return "-" if x is None or x != x else f"{x:.2f}"


def seed_cells(arm: str, runs: list[dict]) -> str:
    """``| arm | seeds | final per seed | best per seed | failed/n |`` of a markdown table row (runs sorted by seed)."""
    return (f"| {arm} | {','.join(str(r['seed']) for r in runs)} | {', '.join(fmt(r['final_reward']) for r in runs)} | "
            f"{', '.join(fmt(r['best_reward']) for r in runs)} | {sum(r['failed'] for r in runs)}/{len(runs)} |")


def by_arm(runs: list[dict]) -> dict[str, list[dict]]:
    """``runs`` grouped by arm (first-seen order), each arm's runs sorted by seed."""
    arms: dict[str, list[dict]] = {}
    for r in runs:
        arms.setdefault(r["arm"], []).append(r)
    return {arm: sorted(rs, key=lambda r: r["seed"]) for arm, rs in arms.items()}


def write_seed_tables(name: str, intro: list[str], runs: list[dict], setting, heading, columns: list[str],
                      cells) -> Path:
    """``<name>.md``: ``intro``, then one section per setting (``setting(run)``, first-seen order) titled
    ``## heading(setting)``: a row per arm (:func:`seed_cells`, then ``cells(arm_runs)``, one per ``columns``)."""
    settings: dict[tuple, list[dict]] = {}
    for r in runs:
        settings.setdefault(setting(r), []).append(r)
    lines = list(intro)
    for key, group in settings.items():
        lines += [f"## {heading(key)}", "",
                  "| arm | seeds | final reward per seed | best per seed | failed | " + " | ".join(columns) + " |",
                  "|" + "---|" * (5 + len(columns))]
        lines += [f"{seed_cells(arm, rs)} " + " | ".join(cells(rs)) + " |" for arm, rs in by_arm(group).items()]
        lines.append("")
    path = DOCS / f"{name}.md"
    path.write_text("\n".join(lines))
    return path


def plot_runs(runs: list[dict], arms: list[str], name: str, title: str, keep) -> Path:
    """Reward and entropy curves (the demo's plot) of the runs of ``arms`` for which ``keep(run)``: ``<name>.png``."""
    from stablerl.tools import demo

    results = {r["arm"]: {"steps": r["steps_logged"], "reward": r["reward"], "entropy": r["entropy"]}
               for r in runs if r["arm"] in arms and keep(r)}
    path = DOCS / f"{name}.png"
    demo.plot({a: results[a] for a in arms if a in results}, path, title=title)
    return path


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
