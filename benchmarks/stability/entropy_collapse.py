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
# At this scale a batch has <= 256 completion tokens, so the papers' covariance fractions
# (2e-4, 2e-3) select a single token per batch; these variants select ~5% of the tokens.
VARIANTS = ("stablerl_clip_cov:clip_cov_ratio=0.05", "stablerl_kl_cov:kl_cov_ratio=0.05")


def parse_variant(spec: str) -> tuple[str, str, dict]:
    """``'loss:param=value:...'`` -> (label, loss_type, params)."""
    loss, *pairs = spec.split(":")
    params = {}
    for pair in pairs:
        key, value = pair.split("=", 1)
        params[key] = float(value) if value.replace(".", "", 1).replace("e-", "", 1).isdigit() else value
    label = loss + ("(" + ",".join(f"{k}={v}" for k, v in params.items()) + ")" if params else "")
    return label, loss, params


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--losses", default=LOSSES)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS),
                    help="extra runs 'loss_type:param=value[:param=value]' (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--num-iterations", type=int, default=4)
    ap.add_argument("--budget-min", type=float, default=15.0)
    ap.add_argument("--out", default=str(C.DOCS))
    a = ap.parse_args()
    C.setup()
    C.DOCS = Path(a.out)
    budget = C.Budget(a.budget_min)
    seeds = [int(s) for s in a.seeds.split(",")]
    runs_spec = [(loss, loss, {}) for loss in a.losses.split(",") if loss] + [parse_variant(v) for v in a.variants]
    tmp = Path("/tmp/stablerl-stability/entropy")
    runs, skipped = [], []
    t0 = time.perf_counter()
    for seed in seeds:
        for label, loss, params in runs_spec:
            if not budget.allows():
                skipped.append({"loss_type": label, "seed": seed})
                continue
            extra = {"stablerl_loss_params": params} if params else {}
            r = C.train(loss, steps=a.steps, seed=seed, lr=a.lr, out_dir=tmp, num_iterations=a.num_iterations, **extra)
            r["loss_type"] = label
            runs.append(r)
            C.log(f"{label:<20} seed {seed}: reward best {C.fmt(r['best_reward'])} final {C.fmt(r['final_reward'])}, "
                  f"final entropy {C.fmt(r['final_entropy'])}{'  COLLAPSED' if r['collapsed'] else ''} ({r['time_s']:.0f}s)")
    config = dict(steps=a.steps, seeds=seeds, losses=[label for label, _, _ in runs_spec], lr=a.lr, num_iterations=a.num_iterations,
                  budget_min=a.budget_min, total_s=time.perf_counter() - t0, machine=C.machine())
    C.write_json("entropy_collapse", {"config": config, "runs": runs, "skipped": skipped})
    lines = ["| loss_type | seeds | best reward | final reward (per seed) | final entropy, nats (per seed) | "
             "first step with entropy < 0.5 (per seed) | collapsed | s / run |",
             "|---|---|---|---|---|---|---|---|"]
    for label in config["losses"]:
        rs = [r for r in runs if r["loss_type"] == label]
        if not rs:
            continue
        mean = lambda key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
        per = lambda key: ", ".join(C.fmt(r[key]) for r in rs)  # noqa: E731
        lines.append(
            f"| {label} | {','.join(str(r['seed']) for r in rs)} | {C.fmt(mean('best_reward'))} | "
            f"{C.fmt(mean('final_reward'))} ({per('final_reward')}) | {C.fmt(mean('final_entropy'))} ({per('final_entropy')}) | "
            f"{', '.join(str(first_below(r, 0.5)) for r in rs)} | {sum(r['collapsed'] for r in rs)}/{len(rs)} | "
            f"{mean('time_s'):.0f} |"
        )
    if skipped:
        lines += ["", "Skipped (time budget): " + ", ".join(f"{s['loss_type']} seed {s['seed']}" for s in skipped)]
    lines += ["", f"{a.steps} steps, lr {a.lr}, num_iterations {a.num_iterations}, 8 prompts x 8 generations; "
              f"machine: {config['machine']}; total {config['total_s'] / 60:.1f} min."]
    (C.DOCS / "entropy_collapse.md").write_text("\n".join(lines) + "\n")
    plot(runs)
    return 0


def first_below(run: dict, level: float):
    """First optimizer step whose logged entropy is below ``level`` (``-`` if never)."""
    return next((s for s, y in zip(run["steps"], run["entropy"]) if y is not None and y < level), "-")


def plot(runs) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_h) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = list(dict.fromkeys(r["loss_type"] for r in runs))
    seeds = sorted({r["seed"] for r in runs})
    color = {lab: plt.get_cmap("tab10")(i % 10) for i, lab in enumerate(labels)}
    styles = ["-", "--", ":", "-."]
    for r in runs:
        first = r["seed"] == seeds[0]
        for ax, key in ((ax_r, "reward"), (ax_h, "entropy")):
            pts = [(s, y) for s, y in zip(r["steps"], r[key]) if y is not None]
            if pts:
                ax.plot(*zip(*pts), lw=1.1, alpha=0.8, color=color[r["loss_type"]],
                        ls=styles[seeds.index(r["seed"]) % len(styles)],
                        label=r["loss_type"].replace("stablerl_", "") if first else None)
    ax_r.set(xlabel="optimizer step", ylabel="mean reward", ylim=(-0.02, 1.02),
             title="reward (copy the digit); line style = seed " + ",".join(map(str, seeds)))
    ax_h.set(xlabel="optimizer step", ylabel="mean token entropy (nats)", title="policy entropy")
    for ax in (ax_r, ax_h):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(C.DOCS / "entropy_collapse.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
