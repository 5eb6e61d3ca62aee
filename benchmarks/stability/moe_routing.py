"""MoE routing mismatch: a rollout engine whose routers see low-bit weights, fp32 training, through TRL's vLLM path.

One command (CPU, TRL 1.16, a tiny Qwen3-MoE built in code on "copy the digit"; runs one after another)::

    python benchmarks/stability/moe_routing.py --precisions int2 --seeds 0,1,2 --arms trl_tok_trunc,r3 --append

The arms are :data:`stablerl.tools.demo.moe.ARMS`: every option TRL ships for a rollout mismatch
(``vllm_importance_sampling_mode`` x caps, ``off_policy_mask_threshold``, loss types) and stablerl's routing replay
R3 (alone and with ``tis``). ``--model`` overrides the model (JSON, keys of :data:`stablerl.tools.demo.moe.MODEL`).
Every run is appended to ``<name>.json`` with the measured mismatch (run means of the fraction of response tokens
with a changed expert, the k1 KL without and with the rollout's routes replayed) and its versions; ``<name>.md``
tables every setting. "Failed": final reward (last 10% of logged rewards) < 0.5 or < half the run's best.
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

_MISMATCH_KEYS = ("flipped", "kl", "kl_replay", "abs", "abs_replay")


def train(arm: str, precision: str, *, steps: int, seed: int, lr: float, out_dir: Path, completion_length: int,
          model: dict) -> dict:
    from stablerl.tools import demo
    from stablerl.tools.demo import moe

    record: dict = {"step": [], "metrics": {}}
    args = moe.make_config(str(out_dir / f"{arm}-{precision}-s{seed}"), arm, steps=steps, seed=seed, lr=lr,
                           max_completion_length=completion_length)
    trainer = moe.make_trainer(args, precision, callbacks=[demo._recorder_callback(record, None)], seed=seed,
                               model_kwargs=model)
    t0 = time.perf_counter()
    trainer.train()
    r = summarize(record, arm=arm, precision=precision, seed=seed, lr=lr, steps=steps,
                  time_s=time.perf_counter() - t0, completion_length=completion_length,
                  model={**moe.MODEL, **model})
    r["environment"] = demo.task.environment()
    history = list(trainer.vllm_generation.history)
    r["mismatch"] = {k: sum(h[k] for h in history) / max(1, len(history)) for k in _MISMATCH_KEYS}
    r["mismatch_first_last"] = {k: [history[0][k], history[-1][k]] for k in _MISMATCH_KEYS} if history else {}
    return r


def _setting(r: dict) -> tuple:
    m = r["model"]
    return (r["precision"], float(r["lr"]), int(r["steps"]), int(r["completion_length"]),
            f"{m['num_experts']} experts top-{m['top_k']}, {m['num_layers']} layers, hidden {m['hidden_size']}, "
            f"init {m['initializer_range']}", r["environment"]["torch"], r["environment"]["transformers"])


def _cells(rs: list[dict]) -> list[str]:
    mm = {k: sum(r["mismatch"][k] for r in rs) / len(rs) for k in _MISMATCH_KEYS}
    return [f"{mm['flipped']:.1%}", f"{mm['kl']:.2e} / {mm['kl_replay']:.2e}",
            f"{sum(r['time_s'] for r in rs) / len(rs):.0f}s"]


def write_table(runs: list[dict], name: str) -> Path:
    intro = [f"# MoE routing mismatch: router weights rounded in the rollout engine, fp32 training ({name})", "",
             "Every run is listed. 'failed' = final reward < 0.5 or < half of the run's best (10%-window means). "
             "'flipped': response tokens with >= 1 changed expert (any layer), rollout vs fp32 weights; KL: k1 "
             "estimate on the sampled tokens without / with the rollout's routes replayed (run means over "
             "generations). Command: see the module docstring of benchmarks/stability/moe_routing.py.", ""]
    return C.write_seed_tables(
        name, intro, runs, _setting,
        lambda k: f"router {k[0]}, {k[4]}, lr {k[1]:g}, {k[2]} steps, completions <= {k[3]} tokens; torch {k[5]}, "
                  f"transformers {k[6]}",
        ["flipped", "KL no replay / replay", "time/run"], _cells)


def plot(runs: list[dict], arms: list[str], name: str, seed: int = 0) -> Path:
    """Reward and entropy curves of ``arms`` on ``seed`` in the demo's setting: ``<name>.png``."""
    from stablerl.tools.demo import moe

    d = moe.DEMO
    return C.plot_runs(runs, arms, name, f"MoE, router {d['precision']} in the rollout, seed {seed}",
                       lambda r: r["seed"] == seed and r["model"] == moe.MODEL
                       and (r["precision"], r["steps"], r["completion_length"]) == (d["precision"], d["steps"],
                                                                                 d["completion_length"]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default="trl_tok_trunc,r3")
    p.add_argument("--precisions", default="int2")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--completion-length", type=int, default=16)
    p.add_argument("--model", default="{}", help="JSON overrides of stablerl.tools.demo.moe.MODEL")
    p.add_argument("--name", default="moe_routing")
    p.add_argument("--append", action="store_true")
    p.add_argument("--out", default="/tmp/stablerl-moe")
    p.add_argument("--plot-only", action="store_true", help="write the table and plot from <name>.json; run nothing")
    p.add_argument("--plot-arms", default="trl_seq_mask,trl_tok_trunc,r3,r3_tis")
    a = p.parse_args()
    C.setup(1)
    path = C.DOCS / f"{a.name}.json"
    runs = json.loads(path.read_text())["runs"] if (a.append or a.plot_only) and path.exists() else []
    if a.plot_only:
        write_table(runs, a.name)
        plot(runs, a.plot_arms.split(","), a.name)
        return 0
    model = json.loads(a.model)
    for precision in a.precisions.split(","):
        for seed in [int(s) for s in a.seeds.split(",")]:
            for arm in a.arms.split(","):
                r = train(arm, precision, steps=a.steps, seed=seed, lr=a.lr, out_dir=Path(a.out),
                          completion_length=a.completion_length, model=model)
                runs.append(r)
                mm = r["mismatch"]
                print(f"{arm:<18} {precision} {model} seed {seed}: final {r['final_reward']:.3f} best "
                      f"{r['best_reward']:.3f} failed {r['failed']} flipped {mm['flipped']:.2f} kl {mm['kl']:.2e} "
                      f"kl_replay {mm['kl_replay']:.2e} ({r['time_s']:.0f}s)", flush=True)
                path.write_text(json.dumps({"runs": runs}, indent=1))
                write_table(runs, a.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
