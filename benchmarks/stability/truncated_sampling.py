"""Truncated sampling: a quantized rollout engine sampling with top-p, fp32 training, through TRL's vLLM path.

One command (CPU, TRL 1.16, the demo's tiny model on "copy the digit"; seeds run one after another)::

    python benchmarks/stability/truncated_sampling.py --precisions int2 --top-ps 0.8 --seeds 0,1,2 \
        --arms trl_none,trl_seq_mask,trl_tok_trunc2,replay_tis --append

The arms are :data:`stablerl.tools.demo.truncated.ARMS`: every option TRL ships for a rollout mismatch
(``vllm_importance_sampling_mode`` x caps, ``off_policy_mask_threshold``, loss types) and stablerl's ``tis`` without
and with sampling-mask replay. Every run is appended to ``<name>.json`` (with its torch / transformers versions);
``<name>.md`` tables every setting. "Failed": final reward (last 10% of logged rewards) < 0.5 or < half the run's
best 10%-window mean.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402
from rollout_mismatch import summarize  # noqa: E402


def train(arm: str, precision: str, top_p: float, *, steps: int, seed: int, lr: float, out_dir: Path,
          completion_length: int) -> dict:
    from stablerl.tools import demo
    from stablerl.tools.demo import mismatch, truncated

    record: dict = {"step": [], "metrics": {}}
    args = truncated.make_config(str(out_dir / f"{arm}-{precision}-p{top_p}-s{seed}"), arm, steps=steps, seed=seed,
                                 lr=lr, top_p=top_p, max_completion_length=completion_length)
    trainer = truncated.make_trainer(args, precision, callbacks=[demo._recorder_callback(record, None)], seed=seed)
    t0 = time.perf_counter()
    trainer.train()
    r = summarize(record, arm=arm, precision=precision, top_p=top_p, seed=seed, lr=lr, steps=steps,
                  time_s=time.perf_counter() - t0, completion_length=completion_length)
    r["environment"] = demo.task.environment()
    history = list(mismatch.rollout_of(trainer).history)
    r["mismatch_kl"] = sum(h["kl"] for h in history) / max(1, len(history))
    n = len(record["step"])
    kept = [v for v in record["metrics"].get("sampling_mask/kept_mass", []) + [None] * n if v is not None]
    r["kept_mass_mean"] = sum(kept) / len(kept) if kept else None
    return r


def write_table(runs: list[dict], name: str) -> Path:
    intro = [f"# Truncated sampling: a quantized top-p rollout engine, fp32 training ({name})", "",
             "Every run is listed. 'failed' = final reward < 0.5 or < half of the run's best (10%-window means). "
             "Command: see the module docstring of benchmarks/stability/truncated_sampling.py.", ""]
    return C.write_seed_tables(
        name, intro, runs,
        lambda r: (r["precision"], r["top_p"], float(r["lr"]), int(r["steps"]), int(r["completion_length"]),
                   r["environment"]["torch"], r["environment"]["transformers"]),
        lambda k: f"rollout {k[0]}, top_p {k[1]}, lr {k[2]:g}, {k[3]} steps, completions <= {k[4]} tokens; "
                  f"torch {k[5]}, transformers {k[6]}",
        ["time/run"], lambda rs: [f"{sum(r['time_s'] for r in rs) / len(rs):.0f}s"])


def plot(runs: list[dict], arms: list[str], name: str, seed: int = 0) -> Path:
    """Reward and entropy curves of ``arms`` on ``seed`` (torch 2.13 runs of the demo's setting): ``<name>.png``."""
    from stablerl.tools.demo import truncated

    d = truncated.DEMO
    return C.plot_runs(runs, arms, name, f"{d['precision']} top_p {d['top_p']} rollout, seed {seed}",
                       lambda r: r["seed"] == seed and r["environment"]["torch"].startswith("2.13.0")
                       and (r["precision"], r["top_p"], r["steps"]) == (d["precision"], d["top_p"], d["steps"]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default="trl_none,trl_seq_mask,trl_tok_trunc2,replay_tis")
    p.add_argument("--precisions", default="int2")
    p.add_argument("--top-ps", default="0.8")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--completion-length", type=int, default=16)
    p.add_argument("--name", default="truncated_sampling")
    p.add_argument("--append", action="store_true")
    p.add_argument("--out", default="/tmp/stablerl-truncated")
    p.add_argument("--merge", default=None, help="comma-separated record names whose runs are appended to --name's "
                   "(records written by concurrent invocations), then the table and plot are written; nothing runs")
    p.add_argument("--plot-arms", default="trl_tok_trunc,trl_tok_trunc2,replay_tis")
    a = p.parse_args()
    C.setup(1)
    path = C.DOCS / f"{a.name}.json"
    runs = json.loads(path.read_text())["runs"] if (a.append or a.merge) and path.exists() else []
    if a.merge:
        for other in a.merge.split(","):
            runs += json.loads((C.DOCS / f"{other}.json").read_text())["runs"]
        path.write_text(json.dumps({"runs": runs}, indent=1))
        write_table(runs, a.name)
        plot(runs, a.plot_arms.split(","), a.name)
        return 0
    for precision in a.precisions.split(","):
        for top_p in [float(x) for x in a.top_ps.split(",")]:
            for seed in [int(s) for s in a.seeds.split(",")]:
                for arm in a.arms.split(","):
                    r = train(arm, precision, top_p, steps=a.steps, seed=seed, lr=a.lr, out_dir=Path(a.out),
                              completion_length=a.completion_length)
                    runs.append(r)
                    print(f"{arm:<20} {precision} top_p {top_p} seed {seed}: final {r['final_reward']:.3f} best "
                          f"{r['best_reward']:.3f} failed {r['failed']} ({r['time_s']:.0f}s) "
                          f"torch {r['environment']['torch']}", flush=True)
                    path.write_text(json.dumps({"runs": runs}, indent=1))
                    write_table(runs, a.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
