"""GPU check of MoE routing replay (torch + transformers only; no vLLM). Prints one JSON object.

Builds a small Qwen3-MoE-style model in code (random weights, no Hub), then on the GPU:
  1. routing disagreement between a bf16 forward (the "rollout") and an fp32 forward (the "trainer")
     of the same weights, as the fraction of (layer, token, slot) expert choices that differ;
  2. per-token KL(p_bf16 || p_fp32) over the vocabulary, without replay and with the bf16 routes
     replayed in the fp32 forward (R3), plus the mean |log p| difference of the sampled tokens;
  3. bf16 forward time with and without replay hooks (CUDA events, median of N), i.e. the overhead;
  4. self-replay exactness in bf16 (replaying a forward's own routes changes nothing).

Usage: python integrations_tests/gpu/routing_replay_gpu.py [--device cuda|cpu] [--small] [--family qwen3_moe|...]
Exits 0 with a message when CUDA (or transformers) is not available. ``--device cpu --small`` is a
quick smoke run of the same code path.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import statistics
import sys
import time

for _k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(_k, "1")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _import_stablerl():
    """Import stablerl, from the source tree when it is not installed (core/ -> stablerl, plugins/ -> stablerl.plugins)."""
    try:
        import stablerl  # noqa: F401
    except ImportError:
        for name, folder in (("stablerl", "core"), ("stablerl.plugins", "plugins")):
            spec = importlib.util.spec_from_file_location(
                name, os.path.join(ROOT, folder, "__init__.py"), submodule_search_locations=[os.path.join(ROOT, folder)])
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
    from stablerl import routing_replay

    return routing_replay


def build(family: str, small: bool, seed: int = 0):
    import torch
    import transformers

    if small:
        size = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4, vocab_size=256)
    else:  # Qwen3-30B-A3B-like routing (128 experts, top-8) at a small width
        size = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                    moe_intermediate_size=256, num_experts=128, num_experts_per_tok=8, vocab_size=4096)
    E, k = size.pop("num_experts"), size.pop("num_experts_per_tok")
    common = dict(size, intermediate_size=2 * size["hidden_size"], tie_word_embeddings=False, initializer_range=0.05)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, num_experts=E, num_experts_per_tok=k, norm_topk_prob=True)
    elif family == "mixtral":
        common.pop("moe_intermediate_size")
        cfg = transformers.MixtralConfig(**dict(common, intermediate_size=size["moe_intermediate_size"]),
                                         num_local_experts=E, num_experts_per_tok=k)
    elif family == "deepseek_v3":
        common.pop("head_dim")
        common["num_key_value_heads"] = common["num_attention_heads"]  # MLA
        cfg = transformers.DeepseekV3Config(**common, n_routed_experts=E, num_experts_per_tok=k, n_group=8 if E >= 64 else 2,
                                            topk_group=4 if E >= 64 else 1, first_k_dense_replace=1, n_shared_experts=1,
                                            q_lora_rank=None, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
                                            v_head_dim=32)
    else:
        raise SystemExit(f"unknown family {family!r}")
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()


def _changed_tokens(a, b) -> float:
    """Fraction of tokens whose expert set differs in at least one MoE layer."""
    x, y = a.indices.long(), b.indices.long()
    found = (x.unsqueeze(-1) == y.unsqueeze(-2)).any(-1)  # [L, N, k]
    return float((~found).any(-1).any(0).float().mean())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "mixtral", "deepseek_v3"])
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    a = ap.parse_args()

    import torch

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device available; nothing measured"}))
        return 0
    try:
        import transformers
    except ImportError:
        print(json.dumps({"skipped": "transformers is not installed; nothing measured"}))
        return 0
    rr = _import_stablerl()
    dev = torch.device(a.device)
    B = a.batch or (2 if a.small else 16)
    T = a.seq or (32 if a.small else 512)
    iters = a.iters or (3 if a.small else 20)

    t0 = time.time()
    m32 = build(a.family, a.small).to(dev)
    m16 = copy.deepcopy(m32).to(torch.bfloat16)
    V = m32.config.vocab_size
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1)).to(dev)
    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "family": a.family,
           "torch": torch.__version__, "transformers": transformers.__version__, "batch": B, "seq": T,
           "num_experts": rr.find_routers(m32)[0].num_experts, "top_k": rr.find_routers(m32)[0].top_k,
           "moe_layers": len(rr.find_routers(m32))}

    def logp(logits):
        return torch.log_softmax(logits.float(), -1)

    with torch.no_grad():
        with rr.capture(m16) as cap:
            l16 = m16(input_ids=ids).logits
        r16 = cap.routes()
        with rr.capture(m32) as cap:
            l32 = m32(input_ids=ids).logits
        r32 = cap.routes()
        with rr.replay(m32, r16):
            l32r = m32(input_ids=ids).logits
        lp16, lp32, lp32r = logp(l16), logp(l32), logp(l32r)
        p16 = lp16.exp()
        kl_plain = float((p16 * (lp16 - lp32)).sum(-1).mean())
        kl_replay = float((p16 * (lp16 - lp32r)).sum(-1).mean())
        nxt = ids[:, 1:].unsqueeze(-1)
        tok = lambda lp: lp[:, :-1].gather(-1, nxt).squeeze(-1)  # noqa: E731
        out.update(
            routing_disagreement_bf16_vs_fp32=rr.mismatch_fraction(r16, r32),
            tokens_with_any_changed_expert=_changed_tokens(r16, r32),
            kl_bf16_fp32_without_replay=kl_plain,
            kl_bf16_fp32_with_replay=kl_replay,
            mean_abs_logprob_diff_without_replay=float((tok(lp16) - tok(lp32)).abs().mean()),
            mean_abs_logprob_diff_with_replay=float((tok(lp16) - tok(lp32r)).abs().mean()),
            routes_bytes_per_token=r16.bytes_per_token,
        )
        # self-replay exactness in bf16
        with rr.replay(m16, r16):
            l16r = m16(input_ids=ids).logits
        out["bf16_self_replay_max_abs_logit_diff"] = float((l16r.float() - l16.float()).abs().max())

        # forward-time overhead of replay (bf16 model; routes already on the device)
        r16_dev = r16.to(dev)

        def timed(fn):
            times = []
            for _ in range(iters + 2):
                if dev.type == "cuda":
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    fn()
                    e.record()
                    torch.cuda.synchronize()
                    times.append(s.elapsed_time(e))
                else:
                    t = time.perf_counter()
                    fn()
                    times.append((time.perf_counter() - t) * 1e3)
            return statistics.median(times[2:])

        plain_ms = timed(lambda: m16(input_ids=ids))
        h = rr.replay(m16, r16_dev)
        replay_ms = timed(lambda: m16(input_ids=ids))
        h.remove()
        cap = rr.capture(m16)
        capture_ms = timed(lambda: (cap.clear(), m16(input_ids=ids)))
        cap.stop()
        out.update(forward_ms_plain=plain_ms, forward_ms_replay=replay_ms, forward_ms_capture=capture_ms,
                   replay_overhead_fraction=replay_ms / plain_ms - 1.0, capture_overhead_fraction=capture_ms / plain_ms - 1.0)
    if dev.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    out["wall_s"] = time.time() - t0
    out["checks"] = {
        "replay_kl_not_larger": kl_replay <= kl_plain,
        "self_replay_exact": out["bf16_self_replay_max_abs_logit_diff"] == 0.0,
        "disagreement_positive": out["routing_disagreement_bf16_vs_fp32"] > 0,
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
