"""Training-inference mismatch: rollouts from a quantized copy of the policy, training in fp32.

One command (CPU, TRL 1.16, the demo's ~0.3M-parameter Qwen2-style model on "copy the digit")::

    python benchmarks/stability/rollout_mismatch.py --precisions int3 --lrs 1e-3 --seeds 0,1,2 \
        --arms none,trl_is,trl_tis,vanilla,m2po,tis,icepop,seq_mis,geo_rs,opsm

The rollout engine is :class:`stablerl.tools.demo.mismatch.LowPrecisionRollout`, a stand-in for TRL's
``VLLMGeneration``: it samples from a copy of the trained weights rounded to ``--precisions`` (int8 /
int4 / int3 / int2 per-row absmax, fp8 e4m3, bf16, fp16, or fp32 = no mismatch) and returns the sampled
tokens' log-probs, and TRL runs its own vLLM code path on them (``use_vllm=True``): the sampling
log-probs, TRL's ``vllm_importance_sampling_correction`` when on, and the stablerl adapter's
``stablerl_rollout_correction`` otherwise. ``num_iterations = 1``: the only off-policyness is the
mismatch. The arms are :data:`stablerl.tools.demo.mismatch.ARMS`.

Every run is appended to ``<name>.json`` (``--append`` keeps the runs already there: the grid grows
with each invocation); ``<name>.md`` tables every (precision, lr) setting and ``<name>.png`` plots the
setting given by ``--plot`` (default: the last one run).

"Failed" (the issue's criterion): the final reward (mean of the last 10% of logged rewards) is below
0.5, or below half of the run's best 10%-window mean.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def train(arm: str, precision: str, *, steps: int, seed: int, lr: float, out_dir: Path,
          completion_length: int = 4) -> dict:
    from stablerl.tools import demo
    from stablerl.tools.demo import mismatch

    record: dict = {"step": [], "metrics": {}}
    args = mismatch.make_config(str(out_dir / f"{arm}-{precision}-s{seed}"), arm, steps=steps, seed=seed, lr=lr,
                                max_completion_length=completion_length)
    trainer = mismatch.make_trainer(args, precision, callbacks=[demo._recorder_callback(record, None)], seed=seed)
    t0 = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - t0
    r = summarize(record, arm=arm, precision=precision, seed=seed, lr=lr, steps=steps, time_s=elapsed,
                  completion_length=completion_length)
    history = list(mismatch.rollout_of(trainer).history)
    # after training: the trained policy's own reward (fp32 sampler) next to its rollout engine's
    r["eval_reward"] = {p: evaluate(trainer.model, p, completion_length=completion_length, seed=seed)
                        for p in dict.fromkeys(("fp32", precision))}
    r["rollout_mismatch"] = history
    r["mismatch_kl"] = sum(h["kl"] for h in history) / max(1, len(history))
    r["mismatch_out_of_2x"] = sum(h["ratio_out_of_2x"] for h in history) / max(1, len(history))
    return r


def evaluate(model, precision: str, *, completion_length: int, seed: int, prompts_per_digit: int = 16) -> float:
    """Mean copy reward of completions sampled (temperature 1) from ``model`` rounded to ``precision`` (fp32:
    the trained policy itself), 16 prompts per digit; after training, so it changes no training run."""
    import torch

    from stablerl.tools import demo
    from stablerl.tools.demo import mismatch

    tokenizer = demo.build_tokenizer()
    engine = mismatch.LowPrecisionRollout(model, tokenizer, precision=precision, max_completion_length=completion_length)
    digits = [d for d in demo.DIGITS for _ in range(prompts_per_digit)]
    torch.manual_seed(10_000 + seed)
    _, completions, _, _ = engine.generate([tokenizer(f"copy {d} :")["input_ids"] for d in digits], None, 1)
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    rewards = demo.copy_reward(None, texts, digits)
    return sum(rewards) / len(rewards)


def summarize(record: dict, **fields) -> dict:
    n = len(record["step"])
    m = {k: v + [None] * (n - len(v)) for k, v in record["metrics"].items()}
    reward, entropy = m.get("reward", [None] * n), m.get("entropy", [None] * n)
    windows = C._window(reward)
    best = max(windows) if windows else float("nan")
    final = windows[-1] if windows else float("nan")
    ent = C._window(entropy)

    def run_mean(key):
        values = [x for x in m.get(key, []) if x is not None]
        return sum(values) / len(values) if values else None

    return {
        **fields, "steps_logged": record["step"], "reward": reward, "entropy": entropy,
        "best_reward": best, "final_reward": final, "final_entropy": ent[-1] if ent else float("nan"),
        "failed": bool(final < 0.5 or final < 0.5 * best),
        # what the rollout differed by, and what each correction did (run means)
        "metric_means": {k: run_mean(k) for k in m if k.startswith(("sampling/", "stablerl/rollout_corr", "stablerl/m2po"))},
    }


def setting_key(r: dict) -> tuple:
    """(precision, lr, steps, longest completion): one table section (completions <= 4 tokens: the demo's)."""
    return (r["precision"], float(r["lr"]), int(r.get("steps", 0)), int(r.get("completion_length", 4)))


def write_table(runs: list[dict], config: dict, name: str) -> Path:
    lines = [f"# Training-inference mismatch: quantized rollout, fp32 training ({name})", "",
             f"Machine: {config.get('machine', '-')}. Command(s): see docs/stability/README.md. Every run is listed; "
             "'failed' = final reward < 0.5 or < half of the run's best (10%-window means). '(search)': the first "
             "seed-0 screen, run with an ad-hoc loop over the same config as arms none / trl_is (its int2 run "
             "repeats the script's seed-0 `none` run exactly).", ""]
    settings: dict[tuple, list[dict]] = {}
    for r in runs:
        settings.setdefault(setting_key(r), []).append(r)
    for (precision, lr, steps, length), group in settings.items():
        lines += [f"## rollout {precision}, lr {lr:g}, {steps} steps"
                  + (f", completions <= {length} tokens" if length != 4 else ""), "",
                  "| arm | seeds | final reward per seed | best per seed | failed | final entropy | mismatch KL(roll‖train), run mean "
                  "| after training: trained policy (fp32) / engine reward | time/run |",
                  "|---|---|---|---|---|---|---|---|---|"]
        arms: dict[str, list[dict]] = {}
        for r in group:
            # runs of the first, seed-0 search (an ad-hoc loop with the same config as arms none / trl_is)
            label = r["arm"] + (" (search)" if r.get("source") == "search" else "")
            arms.setdefault(label, []).append(r)
        for arm, rs in arms.items():
            rs = sorted(rs, key=lambda r: r["seed"])
            kl = [r["mismatch_kl"] for r in rs if r.get("mismatch_kl") is not None]
            trl_abs = [r["trl_abs_logp_difference"] for r in rs if r.get("trl_abs_logp_difference") is not None]
            mismatch_cell = (C.fmt(sum(kl) / len(kl)) if kl else
                             f"mean abs Δlog p {sum(trl_abs) / len(trl_abs):.3f}" if trl_abs else "-")
            times = [r["time_s"] for r in rs if r.get("time_s") == r.get("time_s") and r.get("time_s") is not None]
            evals = [r.get("eval_reward") or {} for r in rs]
            eval_cell = ", ".join(f"{e['fp32']:.2f} / {e.get(r['precision'], e['fp32']):.2f}" if "fp32" in e else "-"
                                  for e, r in zip(evals, rs)) if any(evals) else "-"
            lines.append(
                f"{C.seed_cells(arm, rs)} "
                f"{', '.join(C.fmt(r['final_entropy']) for r in rs)} | {mismatch_cell} | {eval_cell} | "
                f"{f'{sum(times) / len(times):.0f}s' if times else '-'} |")
        lines.append("")
    path = C.DOCS / f"{name}.md"
    path.write_text("\n".join(lines))
    return path


def plot(runs: list[dict], setting: tuple, arms: list[str], name: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    group = [r for r in runs if setting_key(r) == setting and r["arm"] in arms]
    seeds = sorted({r["seed"] for r in group})
    fig, axes = plt.subplots(1, len(seeds), figsize=(4.2 * len(seeds), 3.6), squeeze=False, sharey=True)
    for ax, seed in zip(axes[0], seeds):
        for arm in arms:
            for r in group:
                if r["arm"] == arm and r["seed"] == seed:
                    pts = [(x, y) for x, y in zip(r["steps_logged"], r["reward"]) if y is not None]
                    ax.plot(*zip(*pts), lw=1.2, color=f"C{arms.index(arm)}")  # one colour per arm on every panel
        ax.set(title=f"seed {seed}", xlabel="step", ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean reward (rollout engine's samples)")
    from matplotlib.lines import Line2D

    axes[0][0].legend([Line2D([], [], color=f"C{i}") for i in range(len(arms))], arms, fontsize=8)
    fig.suptitle(f"rollout {setting[0]} weights, fp32 training, lr {setting[1]:g}, {setting[2]} steps"
                 + (f", completions <= {setting[3]} tokens" if setting[3] != 4 else ""))
    fig.tight_layout()
    path = C.DOCS / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    from stablerl.tools.demo import mismatch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precisions", default="int3")
    ap.add_argument("--lrs", default="1e-3")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--arms", default=",".join(mismatch.ARMS))
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--completion-lengths", default="4", help="max_completion_length values (a grid axis)")
    ap.add_argument("--budget-min", type=float, default=60.0)
    ap.add_argument("--out", default=str(C.DOCS), help="directory for the PNG / table / JSON")
    ap.add_argument("--name", default="rollout_mismatch")
    ap.add_argument("--append", action="store_true", help="keep the runs already in <name>.json")
    ap.add_argument("--plot", default=None,
                    help="PRECISION:LR:STEPS[:LENGTH] of the plotted setting (default: the last run)")
    ap.add_argument("--plot-arms", default=None, help="arms in the plot (default: all of that setting)")
    ap.add_argument("--from-json", action="store_true", help="only rewrite the table and plot from <name>.json")
    a = ap.parse_args()
    C.DOCS = Path(a.out)
    path = C.DOCS / f"{a.name}.json"
    old = json.loads(path.read_text()) if (a.append or a.from_json) and path.exists() else {"runs": [], "skipped": []}
    runs, skipped = old["runs"], old.get("skipped", [])
    if not a.from_json:
        C.setup()
        budget = C.Budget(a.budget_min)
        tmp = Path("/tmp/stablerl-stability/rollout_mismatch")
        arms = [mismatch.check_arm(s) for s in a.arms.split(",") if s]
        for s in a.precisions.split(","):
            mismatch.check_precision(s)
        for seed in [int(s) for s in a.seeds.split(",")]:
            for precision in a.precisions.split(","):
                for lr, length in [(float(x), int(n)) for x in a.lrs.split(",") for n in a.completion_lengths.split(",")]:
                    for arm in arms:
                        if not budget.allows():
                            skipped.append({"arm": arm, "precision": precision, "lr": lr, "seed": seed,
                                            "completion_length": length})
                            continue
                        r = train(arm, precision, steps=a.steps, seed=seed, lr=lr, out_dir=tmp, completion_length=length)
                        runs.append(r)
                        # after every run: a crash or a cut budget keeps what was measured
                        C.write_json(a.name, {"config": {"partial": True}, "runs": runs, "skipped": skipped})
                        C.log(f"{precision} lr {lr:g} len {length} seed {seed} {arm:>8}: final {r['final_reward']:.2f} "
                              f"best {r['best_reward']:.2f} {'FAILED' if r['failed'] else ''} ({r['time_s']:.0f}s)")
    config = {"task": "copy the digit", "steps": a.steps, "num_iterations": 1, "machine": C.machine(),
              "arms": {k: [v[0], v[1]] for k, v in mismatch.ARMS.items()}}
    C.write_json(a.name, {"config": config, "runs": runs, "skipped": skipped})
    write_table(runs, config, a.name)
    if runs:
        if a.plot:
            p, lr, steps, *length = a.plot.split(":")
            setting = (p, float(lr), int(steps), int(length[0]) if length else 4)
        else:
            setting = setting_key(runs[-1])
        plot_arms = a.plot_arms.split(",") if a.plot_arms else list(dict.fromkeys(
            r["arm"] for r in runs if setting_key(r) == setting))
        plot(runs, setting, plot_arms, a.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
