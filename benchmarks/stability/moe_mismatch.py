"""MoE training-inference mismatch: bf16 rollout vs fp32 training, with and without routing replay.

One command (CPU, transformers >= 5, tiny MoE models built in code, nothing downloaded)::

    python benchmarks/stability/moe_mismatch.py [--seeds 0,1,2] [--families all] [--budget-min 8]

For each router family (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3) and seed:

1. Build a small MoE model in fp32 (4 decoder layers, 16 experts, top-4; Mixtral top-2;
   DeepSeek-V3: layer 0 dense, 4 groups, top-2 groups) with random weights. The rollout engine is
   a bf16 copy of the same weights.
2. Roll out: ``generate`` in bf16 (KV cache, pure sampling at temperature 1) on random prompts,
   recording the routes (``stablerl.routing_replay.capture``) and the raw next-token logits.
3. Training forward in fp32 over the full sequences (a) with the router's own choices, (b) with
   the rollout's routes replayed (``stablerl.routing_replay.replay``, R3).
4. Report the fraction of routing choices that differ (rollout vs fp32 native routing, per
   (layer, token, slot) as sets; and the fraction of response tokens with at least one changed
   expert in some layer), and over response tokens the mean KL(train || rollout) of the next-token
   distributions and the mean |log p_train - log p_rollout| of the sampled tokens.
   A control rolls out in fp32 through the same ``generate`` path (the decode-path floor).
5. Drift: a few optimizer steps of a toy REINFORCE loss (reward: fraction of response tokens in
   the lower half of the vocabulary, batch-mean baseline, Adam) with a fresh bf16 rollout from the
   current weights every step, training forward with replay on or off; the same metrics per step
   (seeds ``--drift-seeds``, default all three).

Writes docs/stability/moe_mismatch.png, moe_mismatch.md and moe_mismatch.json. Work that would
start after the time budget is skipped and listed as such.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

for _k, _v in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}.items():
    os.environ.setdefault(_k, _v)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3")
LABELS = {"qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE", "mixtral": "Mixtral", "olmoe": "OLMoE",
          "deepseek_v3": "DeepSeek-V3"}


def moe_config(family: str, *, vocab: int, init_std: float):
    import transformers

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab, pad_token_id=0, eos_token_id=1, bos_token_id=1,
                  tie_word_embeddings=False, initializer_range=init_std, output_router_logits=False)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=16, moe_intermediate_size=32, num_experts=16,
                                           num_experts_per_tok=4, norm_topk_prob=True)
    if family == "qwen2_moe":  # norm_topk_prob=False (default) and a shared expert
        return transformers.Qwen2MoeConfig(**common, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                           num_experts=16, num_experts_per_tok=4)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, head_dim=16, num_local_experts=16, num_experts_per_tok=2)
    if family == "olmoe":
        return transformers.OlmoeConfig(**common, num_experts=16, num_experts_per_tok=4)
    if family == "deepseek_v3":  # layer 0 dense, group-limited sigmoid routing with a selection bias
        kw = dict(common, num_key_value_heads=4)
        return transformers.DeepseekV3Config(**kw, first_k_dense_replace=1, moe_intermediate_size=32,
                                             n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                             n_shared_experts=1, routed_scaling_factor=2.5, q_lora_rank=None,
                                             kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                             v_head_dim=16)
    raise KeyError(family)


def build(family: str, seed: int, *, vocab: int, init_std: float):
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(family, vocab=vocab, init_std=init_std)).float()
    if family == "deepseek_v3":  # a non-zero selection bias, as in a trained model
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for layer in model.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None and hasattr(gate, "e_score_correction_bias"):
                    gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape, generator=g) * 0.05)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # fixed-length generation
    return model


def rollout(engine, prompts, new_tokens: int, seed: int):
    """bf16 (or fp32) ``generate`` with route capture; returns (sequences, routes [B, P+N], logits [B, N, V])."""
    import torch

    from stablerl import routing_replay as rr

    torch.manual_seed(seed)
    with torch.no_grad(), rr.capture(engine) as cap:
        out = engine.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                              temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, return_dict_in_generate=True, output_logits=True)
    routes = cap.routes().extend(1)  # the last sampled token is never forwarded
    logits = torch.stack([x.float() for x in out.logits], dim=1)
    return out.sequences, routes, logits


def response_metrics(train_logits, roll_logits, seq, P: int) -> dict:
    """Over response tokens: mean KL(train || rollout), mean |dlogp| of the sampled tokens, entropy."""
    import torch

    lt = torch.log_softmax(train_logits.float(), -1)
    lr_ = torch.log_softmax(roll_logits.float(), -1)
    kl = (lt.exp() * (lt - lr_)).sum(-1)
    tok = seq[:, P:].unsqueeze(-1)
    dlp = (lt.gather(-1, tok) - lr_.gather(-1, tok)).squeeze(-1)
    ent = -(lr_.exp() * lr_).sum(-1)
    return {"kl": float(kl.mean()), "kl_max": float(kl.max()), "abs_dlogp": float(dlp.abs().mean()),
            "max_abs_dlogp": float(dlp.abs().max()), "rollout_entropy": float(ent.mean())}


def route_metrics(a, b, P: int) -> dict:
    """Routing choices that differ: all forwarded tokens (rr.mismatch_fraction) and response tokens with
    at least one changed expert in some MoE layer."""
    from stablerl import routing_replay as rr

    B, T = a.batch_shape
    x, y = a.indices.long(), b.indices.long()
    L = x.shape[0]
    found = (x.unsqueeze(-1) == y.unsqueeze(-2)).any(-1)  # [L, N, k]
    changed = (~found).any(-1) & a.valid & b.valid  # [L, N]
    changed = changed.view(L, B, T)[:, :, P:T - 1]  # response tokens that were forwarded
    return {"flip_frac": rr.mismatch_fraction(a, b), "tokens_any_flip": float(changed.any(0).float().mean()),
            "layer_token_flip": float(changed.float().mean())}


def train_forward(model, seq, P: int, routes=None, grad: bool = False):
    """fp32 forward over the full sequences; logits predicting the response tokens, and the routes it used."""
    import contextlib

    import torch

    from stablerl import routing_replay as rr

    with (contextlib.nullcontext() if grad else torch.no_grad()), rr.capture(model) as cap:
        if routes is not None:
            with rr.replay(model, routes):
                logits = model(input_ids=seq, attention_mask=torch.ones_like(seq)).logits
        else:
            logits = model(input_ids=seq, attention_mask=torch.ones_like(seq)).logits
    return logits[:, P - 1:-1], cap.routes()


def static_run(family: str, seed: int, a) -> dict:
    import torch

    model = build(family, seed, vocab=a.vocab, init_std=a.init_std).eval()
    engine = copy.deepcopy(model).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1000 + seed)
    prompts = torch.randint(2, a.vocab, (a.batch, a.prompt_len), generator=g)
    P = a.prompt_len
    out = {"family": family, "seed": seed}
    t0 = time.perf_counter()
    for name, eng in (("bf16", engine), ("fp32", model)):  # fp32: the same generate path, the decode floor
        seq, r_routes, r_logits = rollout(eng, prompts, a.new_tokens, seed)
        native_logits, native_routes = train_forward(model, seq, P)
        replay_logits, replay_routes = train_forward(model, seq, P, routes=r_routes)
        res = {"no_replay": {**response_metrics(native_logits, r_logits, seq, P), **route_metrics(r_routes, native_routes, P)},
               "replay": {**response_metrics(replay_logits, r_logits, seq, P), **route_metrics(r_routes, replay_routes, P)}}
        out[name] = res
    out["time_s"] = time.perf_counter() - t0
    return out


def drift_run(family: str, seed: int, use_replay: bool, a) -> dict:
    import torch

    model = build(family, seed, vocab=a.vocab, init_std=a.init_std).train()
    engine = copy.deepcopy(model).to(torch.bfloat16).eval()
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    g = torch.Generator().manual_seed(2000 + seed)
    P = a.prompt_len
    rec = {"family": family, "seed": seed, "replay": use_replay, "kl": [], "abs_dlogp": [], "flip_frac": [],
           "reward": []}
    t0 = time.perf_counter()
    for step in range(a.drift_steps):
        engine.load_state_dict(model.state_dict())  # weight sync (cast to bf16)
        prompts = torch.randint(2, a.vocab, (a.batch, P), generator=g)
        seq, r_routes, r_logits = rollout(engine, prompts, a.new_tokens, 10_000 * seed + step)
        # the router's own choices in fp32 (measured in both arms)
        _, native_routes = train_forward(model, seq, P)
        logits, _ = train_forward(model, seq, P, routes=r_routes if use_replay else None, grad=True)
        m = response_metrics(logits.detach(), r_logits, seq, P)
        resp = seq[:, P:]
        reward = (resp < a.vocab // 2).float().mean(1)
        adv = reward - reward.mean()
        logp = torch.log_softmax(logits.float(), -1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
        loss = -(adv.unsqueeze(1) * logp).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        rec["kl"].append(m["kl"])
        rec["abs_dlogp"].append(m["abs_dlogp"])
        rec["flip_frac"].append(route_metrics(r_routes, native_routes, P)["flip_frac"])
        rec["reward"].append(float(reward.mean()))
    rec["time_s"] = time.perf_counter() - t0
    return rec


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def sci(x) -> str:
    return "-" if x is None or x != x else f"{x:.2e}"


def pct(x) -> str:
    return "-" if x is None or x != x else f"{100 * x:.1f}%"


def write_table(data: dict, name: str) -> None:
    cfg, static, drift = data["config"], data["static"], data["drift"]
    lines = [
        "Rollout in bf16 (`generate`, KV cache) vs training forward in fp32, same weights; means over seeds "
        f"{','.join(map(str, cfg['seeds']))} (per-seed values in the JSON). KL and |Δlog p| are per response token.",
        "",
        "| family | experts / top-k | routing choices differing (all tokens) | response tokens with ≥1 changed expert | "
        "KL(train‖rollout), no replay | KL, replay | ratio | mean abs Δlog p, no replay | abs Δlog p, replay | "
        "fp32-rollout floor: flips / KL | rollout entropy (nats) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for fam in cfg["families"]:
        rs = [r for r in static if r["family"] == fam]
        if not rs:
            continue
        f = lambda arm, key, prec="bf16": mean([r[prec][arm][key] for r in rs])  # noqa: E731
        kl_no, kl_re = f("no_replay", "kl"), f("replay", "kl")
        lines.append(
            f"| {LABELS[fam]} | {cfg['experts'][fam]} | {pct(f('no_replay', 'flip_frac'))} | "
            f"{pct(f('no_replay', 'tokens_any_flip'))} | {sci(kl_no)} | {sci(kl_re)} | "
            f"{kl_no / kl_re:.1f}× | {sci(f('no_replay', 'abs_dlogp'))} | {sci(f('replay', 'abs_dlogp'))} | "
            f"{pct(f('no_replay', 'flip_frac', 'fp32'))} / {sci(f('no_replay', 'kl', 'fp32'))} | "
            f"{f('no_replay', 'rollout_entropy'):.2f} |")
    if drift:
        lines += ["", f"Drift: {cfg['drift_steps']} optimizer steps (toy REINFORCE, Adam lr {cfg['lr']}), a fresh bf16 "
                  "rollout from the current weights every step, seeds "
                  f"{','.join(map(str, cfg.get('drift_seeds', cfg['seeds'])))}. Mean over seeds of the per-step KL(train‖rollout) "
                  "(first step → last step) and of the rollout-vs-fp32-native routing flips.", "",
                  "| family | KL no replay (first → last) | KL replay (first → last) | KL over all steps, no replay / replay | "
                  "flips, no-replay arm (first → last) | flips, replay arm (first → last) | reward no replay / replay (last) |",
                  "|---|---|---|---|---|---|---|"]
        for fam in cfg["families"]:
            arms = {rep: [r for r in drift if r["family"] == fam and r["replay"] == rep] for rep in (False, True)}
            if not arms[False] or not arms[True]:
                continue
            fl = lambda rs, key, i: mean([r[key][i] for r in rs])  # noqa: E731
            allk = lambda rs: mean([x for r in rs for x in r["kl"]])  # noqa: E731
            lines.append(
                f"| {LABELS[fam]} | {sci(fl(arms[False], 'kl', 0))} → {sci(fl(arms[False], 'kl', -1))} | "
                f"{sci(fl(arms[True], 'kl', 0))} → {sci(fl(arms[True], 'kl', -1))} | "
                f"{sci(allk(arms[False]))} / {sci(allk(arms[True]))} ({allk(arms[False]) / allk(arms[True]):.1f}×) | "
                f"{pct(fl(arms[False], 'flip_frac', 0))} → {pct(fl(arms[False], 'flip_frac', -1))} | "
                f"{pct(fl(arms[True], 'flip_frac', 0))} → {pct(fl(arms[True], 'flip_frac', -1))} | "
                f"{fl(arms[False], 'reward', -1):.2f} / {fl(arms[True], 'reward', -1):.2f} |")
    if data["skipped"]:
        lines += ["", "Skipped (time budget): " + ", ".join(data["skipped"])]
    lines += ["", f"Models: {cfg['model']}; batch {cfg['batch']} × (prompt {cfg['prompt_len']} + {cfg['new_tokens']} "
              f"sampled tokens), vocabulary {cfg['vocab']}, init std {cfg['init_std']}; transformers "
              f"{cfg['transformers']}, torch {cfg['torch']}; machine: {cfg['machine']}; total "
              f"{cfg['total_s'] / 60:.1f} min."]
    (C.DOCS / f"{name}.md").write_text("\n".join(lines) + "\n")


def plot(data: dict, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, static, drift = data["config"], data["static"], data["drift"]
    fams = [f for f in cfg["families"] if any(r["family"] == f for r in static)]
    fig, axes = plt.subplots(1, 2 if drift else 1, figsize=(11 if drift else 6, 3.8))
    axes = list(axes) if drift else [axes]
    ax = axes[0]
    w = 0.38
    for i, fam in enumerate(fams):
        rs = [r for r in static if r["family"] == fam]
        for j, (arm, color) in enumerate((("no_replay", "tab:red"), ("replay", "tab:blue"))):
            vals = [r["bf16"][arm]["kl"] for r in rs]
            ax.bar(i + (j - 0.5) * w, mean(vals), w, color=color, alpha=0.8,
                   label=("no replay" if arm == "no_replay" else "replay (R3)") if i == 0 else None)
            ax.scatter([i + (j - 0.5) * w] * len(vals), vals, color="k", s=8, zorder=3)
    ax.set_yscale("log")
    flips = [mean([r["bf16"]["no_replay"]["flip_frac"] for r in static if r["family"] == f]) for f in fams]
    ax.set_xticks(range(len(fams)), [f"{LABELS[f]}\n{100 * x:.1f}% flips" for f, x in zip(fams, flips)], fontsize=7)
    ax.set_ylabel("mean KL(train fp32 ‖ rollout bf16) per token")
    ax.set_title("bf16 rollout vs fp32 training", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    if drift:
        ax = axes[1]
        colors = dict(zip(fams, ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown"]))
        for fam in fams:
            for rep, ls in ((False, "--"), (True, "-")):
                rs = [r for r in drift if r["family"] == fam and r["replay"] == rep]
                if not rs:
                    continue
                n = min(len(r["kl"]) for r in rs)
                ys = [mean([r["kl"][i] for r in rs]) for i in range(n)]
                ax.plot(range(n), ys, ls=ls, color=colors[fam], lw=1.2,
                        label=f"{LABELS[fam]} {'replay' if rep else 'no replay'}")
        ax.set_yscale("log")
        ax.set(xlabel="optimizer step (fresh bf16 rollout each step)", ylabel="mean KL per token")
        ax.set_title("drift over training (mean over seeds)", fontsize=10)
        ax.legend(fontsize=6, ncol=2)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(C.DOCS / f"{name}.png", dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--families", default="all", help="comma list of " + ",".join(FAMILIES) + " or 'all'")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--init-std", type=float, default=0.1, help="initializer_range of the random weights")
    ap.add_argument("--drift-steps", type=int, default=8, help="0 skips the drift part")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--drift-seeds", default="0,1,2", help="seeds of the drift part (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget-min", type=float, default=8.0)
    ap.add_argument("--out", default=str(C.DOCS), help="directory for the PNG / table / JSON")
    ap.add_argument("--name", default="moe_mismatch", help="file stem of the outputs (default: %(default)s)")
    ap.add_argument("--from-json", action="store_true", help="only rewrite the table and plot from <name>.json")
    a = ap.parse_args()
    C.DOCS = Path(a.out)
    if a.from_json:
        data = json.loads((C.DOCS / f"{a.name}.json").read_text())
        write_table(data, a.name)
        plot(data, a.name)
        return 0
    import warnings

    import torch
    import transformers

    torch.set_num_threads(max(1, a.threads))
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    budget = C.Budget(a.budget_min)
    seeds = [int(s) for s in a.seeds.split(",")]
    drift_seeds = [int(s) for s in a.drift_seeds.split(",") if s]
    fams = list(FAMILIES) if a.families == "all" else [f for f in a.families.split(",") if f]
    t0 = time.perf_counter()
    static, drift, skipped = [], [], []
    # static part first (cheap), seed-major so a budget cut keeps every family
    for seed in seeds:
        for fam in fams:
            if not budget.allows():
                skipped.append(f"static {fam} seed {seed}")
                continue
            r = static_run(fam, seed, a)
            static.append(r)
            b = r["bf16"]
            C.log(f"{fam:<12} seed {seed}: flips {pct(b['no_replay']['flip_frac'])}, KL no replay "
                  f"{sci(b['no_replay']['kl'])} vs replay {sci(b['replay']['kl'])}; fp32 floor flips "
                  f"{pct(r['fp32']['no_replay']['flip_frac'])} ({r['time_s']:.1f}s)")
    if a.drift_steps > 0:
        for seed in drift_seeds:
            for fam in fams:
                for rep in (False, True):
                    if not budget.allows():
                        skipped.append(f"drift {fam} {'replay' if rep else 'no replay'} seed {seed}")
                        continue
                    r = drift_run(fam, seed, rep, a)
                    drift.append(r)
                    C.log(f"drift {fam:<12} seed {seed} replay={rep!s:<5}: KL {sci(r['kl'][0])} -> {sci(r['kl'][-1])}, "
                          f"flips {pct(r['flip_frac'][0])} -> {pct(r['flip_frac'][-1])} ({r['time_s']:.1f}s)")
    experts = {}
    for fam in fams:
        c = moe_config(fam, vocab=a.vocab, init_std=a.init_std)
        e = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or getattr(c, "n_routed_experts")
        experts[fam] = f"{e} / {c.num_experts_per_tok}"
    config = dict(seeds=seeds, families=fams, experts=experts, batch=a.batch, prompt_len=a.prompt_len,
                  new_tokens=a.new_tokens, vocab=a.vocab, init_std=a.init_std, drift_steps=a.drift_steps, drift_seeds=drift_seeds, lr=a.lr,
                  budget_min=a.budget_min, threads=a.threads,
                  model="4 decoder layers, hidden 64, 16 routed experts (DeepSeek-V3: layer 0 dense, 3 MoE layers)",
                  transformers=transformers.__version__, torch=torch.__version__,
                  total_s=time.perf_counter() - t0, machine=C.machine().replace("torch threads 1", f"torch threads {a.threads}"))
    data = {"config": config, "static": static, "drift": drift, "skipped": skipped}
    C.write_json(a.name, data)
    write_table(data, a.name)
    plot(data, a.name)
    C.log(f"wrote {C.DOCS / (a.name + '.md')} and {a.name}.png ({config['total_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
