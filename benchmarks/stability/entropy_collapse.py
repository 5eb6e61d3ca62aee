"""Entropy collapse: vanilla PPO-clip vs the entropy-preserving losses clip_cov, kl_cov, entropic, steer.

One command (CPU, TRL 1.16, the demo's ~0.3M-parameter Qwen2-style model on "copy the digit")::

    python benchmarks/stability/entropy_collapse.py [--steps 150] [--seeds 0] [--budget-min 15]

An aggressive setting (lr 3e-3, num_iterations 4: every TRL built-in loss collapses there) so that
entropy actually collapses within the budget. Every stablerl loss runs through the stablerl TRL
adapter (``loss_type="stablerl_<name>"``) with its paper defaults; TRL passes the per-token
entropy the entropy-aware losses need. Writes docs/stability/entropy_collapse.png, .md and .json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

LOSSES = "stablerl_vanilla,stablerl_clip_cov,stablerl_kl_cov,stablerl_entropic,stablerl_steer"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--losses", default=LOSSES)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--num-iterations", type=int, default=4)
    ap.add_argument("--budget-min", type=float, default=15.0)
    ap.add_argument("--out", default=str(C.DOCS))
    a = ap.parse_args()
    C.setup()
    C.DOCS = Path(a.out)
    budget = C.Budget(a.budget_min)
    seeds = [int(s) for s in a.seeds.split(",")]
    losses = [s for s in a.losses.split(",") if s]
    tmp = Path("/tmp/stablerl-stability/entropy")
    runs, skipped = [], []
    t0 = time.perf_counter()
    for seed in seeds:
        for loss in losses:
            if not budget.allows():
                skipped.append({"loss_type": loss, "seed": seed})
                continue
            r = C.train(loss, steps=a.steps, seed=seed, lr=a.lr, out_dir=tmp, num_iterations=a.num_iterations)
            runs.append(r)
            C.log(f"{loss:<20} seed {seed}: reward best {C.fmt(r['best_reward'])} final {C.fmt(r['final_reward'])}, "
                  f"final entropy {C.fmt(r['final_entropy'])}{'  COLLAPSED' if r['collapsed'] else ''} ({r['time_s']:.0f}s)")
    config = dict(steps=a.steps, seeds=seeds, losses=losses, lr=a.lr, num_iterations=a.num_iterations,
                  budget_min=a.budget_min, total_s=time.perf_counter() - t0, machine=C.machine())
    C.write_json("entropy_collapse", {"config": config, "runs": runs, "skipped": skipped})
    lines = ["| loss_type | seed | initial reward | best reward | final reward | final entropy (nats) | collapsed | s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['loss_type']} | {r['seed']} | {C.fmt(r['initial_reward'])} | {C.fmt(r['best_reward'])} | "
                     f"{C.fmt(r['final_reward'])} | {C.fmt(r['final_entropy'])} | {'yes' if r['collapsed'] else 'no'} | {r['time_s']:.0f} |")
    if skipped:
        lines += ["", "Skipped (time budget): " + ", ".join(f"{s['loss_type']} seed {s['seed']}" for s in skipped)]
    lines += ["", f"{a.steps} steps, lr {a.lr}, num_iterations {a.num_iterations}, 8 prompts x 8 generations; "
              f"machine: {config['machine']}; total {config['total_s'] / 60:.1f} min."]
    (C.DOCS / "entropy_collapse.md").write_text("\n".join(lines) + "\n")
    plot(runs)
    return 0


def plot(runs) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_h) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        for ax, key in ((ax_r, "reward"), (ax_h, "entropy")):
            pts = [(s, y) for s, y in zip(r["steps"], r[key]) if y is not None]
            if pts:
                ax.plot(*zip(*pts), lw=1.2, label=f"{r['loss_type'].replace('stablerl_', '')} s{r['seed']}")
    ax_r.set(xlabel="optimizer step", ylabel="mean reward", title="reward (copy the digit)", ylim=(-0.02, 1.02))
    ax_h.set(xlabel="optimizer step", ylabel="mean token entropy (nats)", title="policy entropy")
    for ax in (ax_r, ax_h):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(C.DOCS / "entropy_collapse.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
