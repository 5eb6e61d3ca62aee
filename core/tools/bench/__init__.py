"""``stablerl bench``: what stablerl's policy losses cost next to the frameworks' native ones.

For every stablerl loss with a native twin in verl (``vanilla``, ``gspo``, ``gmpo``/``geo_mean``,
``cispo``, ``sapo``, ``clip_cov``, ``kl_cov``) the bench times forward + backward of ours (the
function the stablerl verl adapter registers in verl as ``stablerl_<name>``) and of verl's own
(both from ``verl.trainer.ppo.core_algos``, called by keyword with the same real ``FSDPActorConfig``
holding the loss's paper hyper-parameters) on the same inputs, interleaved in one process: each
repeat times both, in alternating order, and the ratio ``ours / native`` of that repeat is
recorded; min and median over repeats are reported. Every other loss
(:func:`stablerl.compute_policy_loss`) is measured the same way against stablerl's ``vanilla``
(its cost relative to plain PPO-clip). Without verl only the relative-to-vanilla table is produced.

With TRL installed, a third table compares stablerl's losses with TRL 1.16's built-in
``loss_type``\s (``dapo``, ``bnpo``, ``grpo``, ``dr_grpo``, ``luspo``, ``grpo`` at sequence level,
``cispo``, ``sapo``): TRL's real ``GRPOTrainer._compute_loss`` against the stablerl TRL adapter's
own loss methods, both on stand-in trainers whose forward returns the prepared log-probs
(:mod:`stablerl.tools.bench.trl`). Each pair is first checked to give the same loss and gradient.

Memory. On CUDA: peak allocated bytes above the inputs during forward + backward
(``torch.cuda.max_memory_allocated``). On CPU PyTorch keeps no allocator statistics, so the bench
counts the bytes the loss keeps alive for backward: every tensor the autograd graph saves
(``torch.autograd.graph.saved_tensors_hooks``), deduplicated by storage, excluding the input
tensors themselves. In a training step the loss runs after the model's forward and its saved
tensors live until backward, so this is the loss's contribution to the step's peak; transient
temporaries freed inside the forward are not counted (they are on CUDA).

Usage::

    stablerl bench [--quick] [--json] [--out FILE.md] [--device cpu|cuda] [--dtypes fp32,bf16] [--no-trl]
                   [--no-estimators] [--clock auto|thread|wall]

Nothing is written unless ``--out`` is given.

``--json`` prints one JSON object: ``losses.<name>`` has ``baseline`` (``verl:<name>`` or
``stablerl:vanilla``), ``time_ratio`` and ``mem_ratio`` (worst case over shapes/dtypes of the
median per-repeat ratio), and the per-case details (for a loss with a fused form, the case's
headline numbers are the fused path's, ``path`` says which path ran, and ``eager`` holds the same
call with ``STABLERL_FUSED=0`` against the same baseline, itself on the eager path for ``vanilla``); ``trl.losses.<label>`` the same against TRL
(``baseline`` ``trl:<loss_type>``, ``ours`` ``stablerl:<name>``; ``trl`` is ``{"skipped": reason}``
without TRL); ``routing_replay`` has the forward-time ratio
replay on / off on a tiny Qwen3-MoE and the bytes per token of the stored routes (when
transformers is installed; ``--no-routing`` skips it); ``estimators.<name>`` the time ratio of
:func:`stablerl.compute_advantage` against verl's vectorized estimator (and its loop version) at
B=4096, T=512, groups of 8, string uids (:mod:`stablerl.tools.bench.estimators`; ``--no-estimators``
skips it).

Clock: on CPU with one torch thread the default is the calling thread's CPU time
(``--clock thread``), which other processes on a shared machine do not inflate; ``--clock wall``
times wall-clock.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch

import stablerl
from stablerl import POLICY_LOSS
from stablerl.frameworks import get_framework, load_adapter

from . import estimators as bench_estimators
from . import trl as bench_trl

#: stablerl name -> verl 0.9.1 built-in name
VERL_TWINS = {
    "vanilla": "vanilla",
    "gspo": "gspo",
    "gmpo": "geo_mean",
    "cispo": "cispo",
    "sapo": "sapo",
    "clip_cov": "clip_cov",
    "kl_cov": "kl_cov",
}

#: (label, B, T)
FULL_SHAPES = [("B64xT4096", 64, 4096), ("B4xT65536", 4, 65536)]
QUICK_SHAPES = [("B32xT2048", 32, 2048)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ----------------------------------------------------------------------------- inputs


def make_inputs(B: int, T: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0, group: int = 8,
                vocab: int = 32000) -> dict:
    """A verl-style right-padded batch with every optional input a loss may declare.

    Response lengths are uniform in [T/4, T]; ratios cross the clip bounds (log-ratio noise 0.3);
    advantages are per sequence, broadcast over tokens (GRPO-style), zero on padding.
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(T // 4, 1), T + 1, (B,), generator=g)
    lengths[0] = T
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    old = -torch.rand(B, T, generator=g) * 3 - 0.05
    lp = old + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T) * mask
    rollout = old + 0.05 * torch.randn(B, T, generator=g)
    entropy = torch.rand(B, T, generator=g) * 2
    old_entropy = entropy + 0.1 * torch.randn(B, T, generator=g)
    n_layers, k = 2, 2
    router_old = -torch.rand(B, T, n_layers, k, generator=g) * 2
    router = (router_old + 0.1 * torch.randn(B, T, n_layers, k, generator=g)).clamp(max=0)  # log-probs: <= 0
    f = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return {
        "log_prob": f(lp),
        "old_log_prob": f(old),
        "advantages": f(adv),
        "response_mask": mask.to(device),
        "rollout_log_prob": f(rollout),
        "entropy": f(entropy),
        "old_entropy": f(old_entropy),
        "token_ids": torch.randint(0, vocab, (B, T), generator=g).to(device),
        "index": torch.arange(B, device=device) // group,
        "turn_ids": (torch.arange(T).unsqueeze(0).expand(B, T) * 4 // T).to(device),
        "versions": (4 - torch.randint(0, 3, (B, 1), generator=g)).expand(B, T).contiguous().to(device),
        "policy_version": 4,
        "scores": (torch.rand(B, generator=g) > 0.5).float().to(device),
        "pos_count": torch.randint(0, 8, (B,), generator=g).to(device),
        "neg_count": torch.randint(0, 8, (B,), generator=g).to(device),
        "router_log_prob": f(router),
        "old_router_log_prob": f(router_old),
        # CAPO's LM-head model (H=16; V=vocab covers token_ids); drawn last so the tensors above are unchanged
        "hidden_states": f(torch.randn(B, T, 16, generator=g)),
        "lm_head_weight": f(0.1 * torch.randn(vocab, 16, generator=g)),
        # on-policy distillation (drawn after the rest): a teacher's log-probs, and top-k (k=8 of 16 ids) of both
        # models; the student's carry the gradient (generalized_jsd's gradient flows through them)
        "teacher_log_prob": f((old + 0.3 * torch.randn(B, T, generator=g)).clamp(max=-1e-4)),
        "teacher_topk_log_prob": f(torch.randn(B, T, 16, generator=g).log_softmax(-1)[..., :8]),
        "student_topk_log_prob": f(torch.randn(B, T, 16, generator=g).log_softmax(-1)[..., :8]).requires_grad_(True),
    }


_BASIC = ("log_prob", "old_log_prob", "advantages", "response_mask")


def ours_fn(name: str, inputs: dict, params: Optional[dict] = None, loss_agg_mode: str = "token-mean") -> Callable:
    """A closure ``() -> (loss, metrics, leaf)`` calling :func:`stablerl.compute_policy_loss`
    with the loss's declared extra inputs."""
    spec = stablerl.get_spec(POLICY_LOSS, name)
    extra = {k: inputs[k] for k in spec.requires}
    params = dict(params or {})

    def call(lp: torch.Tensor):
        return stablerl.compute_policy_loss(
            name,
            log_prob=lp,
            old_log_prob=inputs["old_log_prob"],
            advantages=inputs["advantages"],
            response_mask=inputs["response_mask"],
            loss_agg_mode=loss_agg_mode,
            **extra,
            **params,
        )

    return call


# ----------------------------------------------------------------------------- verl side


def _verl_core_algos():
    try:
        from verl.trainer.ppo import core_algos  # noqa: WPS433 - optional dependency
    except Exception:  # noqa: BLE001 - verl absent or broken: relative table only
        return None
    return core_algos


def verl_config(stablerl_name: str, loss_agg_mode: str = "token-mean"):
    """An ``FSDPActorConfig`` holding stablerl's default hyper-parameters for ``stablerl_name``,
    so the native function computes the same loss (e.g. GSPO's 3e-4/4e-4 clip bounds)."""
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    spec = stablerl.get_spec(POLICY_LOSS, stablerl_name)
    d = spec.defaults()
    actor = {k: d[k] for k in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "tau_pos", "tau_neg") if k in d}
    pl = {k: d[k] for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef") if k in d}
    if actor.get("clip_ratio_c", 3.0) is None:
        actor.pop("clip_ratio_c")
    return FSDPActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=2,
        loss_agg_mode=loss_agg_mode,
        policy_loss=PolicyLossConfig(loss_mode=VERL_TWINS[stablerl_name], **pl),
        **actor,
    )


def native_fn(core_algos, stablerl_name: str, inputs: dict, loss_agg_mode: str = "token-mean") -> tuple[Callable, Any]:
    """verl's built-in twin, called by keyword as ``verl.workers.utils.losses.ppo_loss`` does;
    also returns the config it is called with."""
    cfg = verl_config(stablerl_name, loss_agg_mode)
    return _verl_call(core_algos.get_policy_loss_fn(VERL_TWINS[stablerl_name]), inputs, cfg, loss_agg_mode), cfg


def adapter_fn(core_algos, stablerl_name: str, inputs: dict, cfg, loss_agg_mode: str = "token-mean") -> Callable:
    """Ours as verl runs it: the function the stablerl verl adapter registers in verl's policy-loss
    registry (``stablerl_<name>``), called by keyword with the same config as the native twin, so
    the hyper-parameters reach it through the adapter's own mapping."""
    load_adapter("verl")  # registers stablerl's losses into verl (``import verl`` does too, through its plugins)
    fn = core_algos.get_policy_loss_fn(get_framework("verl").prefix + stablerl_name)
    return _verl_call(fn, inputs, cfg, loss_agg_mode)


def _verl_call(fn: Callable, inputs: dict, cfg, loss_agg_mode: str) -> Callable:
    def call(lp: torch.Tensor):
        return fn(
            old_log_prob=inputs["old_log_prob"],
            log_prob=lp,
            advantages=inputs["advantages"],
            response_mask=inputs["response_mask"],
            loss_agg_mode=loss_agg_mode,
            config=cfg,
            rollout_is_weights=None,
        )

    return call


def with_env(call: Callable, **env: str) -> Callable:
    """``call`` with the environment variables ``env`` set during its forward (the adapters pass
    neither ``recompute_half`` nor ``fused``; both are chosen in forward)."""

    def wrapped(lp: torch.Tensor):
        before = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return call(lp)
        finally:
            for k, v in before.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v

    return wrapped


def with_recompute(call: Callable) -> Callable:
    """``call`` with ``STABLERL_RECOMPUTE_HALF=1`` (and the fused path off, which takes precedence)."""
    return with_env(call, STABLERL_RECOMPUTE_HALF="1", STABLERL_FUSED="0")


def eager(call: Callable) -> Callable:
    """``call`` with the fused path off (``STABLERL_FUSED=0``)."""
    return with_env(call, STABLERL_FUSED="0")


# ----------------------------------------------------------------------------- measurement


#: the clock every timing reads; :func:`run` sets it (see :func:`pick_clock`)
_clock: Callable[[], float] = time.perf_counter


def pick_clock(name: str, device: str) -> tuple[str, Callable[[], float]]:
    """``thread``: CPU time of the calling thread (``time.thread_time``). With one torch thread on CPU
    all the work runs on that thread, and the time other processes hold the cores is not counted,
    which on a shared machine is most of the noise in a wall-clock ratio. ``wall``:
    ``time.perf_counter`` (always on CUDA, where the work is on the device). ``auto``: ``thread``
    on CPU with one torch thread, else ``wall``."""
    if name == "auto":
        name = "thread" if not device.startswith("cuda") and torch.get_num_threads() == 1 else "wall"
    if name == "thread" and device.startswith("cuda"):
        raise ValueError("--clock thread measures CPU time; on CUDA use wall")
    return name, (time.thread_time if name == "thread" else time.perf_counter)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _leaf(inputs: dict) -> torch.Tensor:
    return inputs["log_prob"].detach().clone().requires_grad_(True)


def time_step(call: Callable, inputs: dict, device: str) -> float:
    """Seconds for one forward (incl. metrics) + backward."""
    lp = _leaf(inputs)
    _sync(device)
    t0 = _clock()
    loss = call(lp)[0]
    loss.backward()
    _sync(device)
    return _clock() - t0


def saved_bytes(call: Callable, inputs: dict) -> int:
    """Bytes of the tensors the autograd graph saves for backward (deduplicated by storage,
    inputs excluded): what the loss keeps alive between forward and backward."""
    lp = _leaf(inputs)
    exclude = {t.untyped_storage().data_ptr() for t in inputs.values() if isinstance(t, torch.Tensor)}
    exclude.add(lp.untyped_storage().data_ptr())
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        try:
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr not in exclude and ptr not in seen:
                seen[ptr] = s.nbytes()
        except Exception:  # noqa: BLE001 - e.g. a tensor subclass without storage
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = call(lp)[0]
    total = sum(seen.values()) + loss.numel() * loss.element_size()
    loss.backward()
    return total


def cuda_peak_bytes(call: Callable, inputs: dict) -> int:
    """Peak CUDA bytes allocated above the live inputs during forward + backward."""
    lp = _leaf(inputs)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = call(lp)[0]
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def compare(ours: Callable, base: Callable, inputs: dict, device: str, repeats: int, warmup: int = 1,
            max_s: Optional[float] = None) -> dict:
    """Interleaved timing and memory of ``ours`` against ``base`` on the same inputs.

    ``max_s`` caps the timed pairs of an expensive loss (e.g. CAPO's LM-head pass): the repeats
    are cut to fit, but never below 3."""
    for _ in range(warmup):
        step = time_step(ours, inputs, device) + time_step(base, inputs, device)
    if max_s is not None and warmup and step * repeats > max_s:
        repeats = max(3, int(max_s / step))
    t_ours, t_base, ratios = [], [], []
    for r in range(repeats):
        if r % 2 == 0:  # alternate the order so neither side always runs on a warm cache
            a = time_step(ours, inputs, device)
            b = time_step(base, inputs, device)
        else:
            b = time_step(base, inputs, device)
            a = time_step(ours, inputs, device)
        t_ours.append(a)
        t_base.append(b)
        ratios.append(a / b)
    s_ours, s_base = saved_bytes(ours, inputs), saved_bytes(base, inputs)
    if device.startswith("cuda"):
        m_ours, m_base = cuda_peak_bytes(ours, inputs), cuda_peak_bytes(base, inputs)
    else:
        m_ours, m_base = s_ours, s_base
    return {
        "saved_ratio": s_ours / s_base if s_base else float("nan"),
        # headline: median of the per-repeat paired ratios (both sides of a pair see the same
        # machine load); also their min, and the ratio of the best times
        "repeats": repeats,
        "time_ratio": statistics.median(ratios),
        "time_ratio_min": min(ratios),
        "time_ratio_best": min(t_ours) / min(t_base),
        "ours_ms_min": 1e3 * min(t_ours),
        "ours_ms_median": 1e3 * statistics.median(t_ours),
        "base_ms_min": 1e3 * min(t_base),
        "base_ms_median": 1e3 * statistics.median(t_base),
        "mem_ratio": m_ours / m_base if m_base else float("nan"),
        "ours_mem_mb": m_ours / 2**20,
        "base_mem_mb": m_base / 2**20,
    }


def agreement(ours: Callable, base: Callable, inputs: dict) -> dict:
    """Loss and gradient difference of the two implementations on the bench inputs."""
    out = []
    for call in (ours, base):
        lp = _leaf(inputs)
        loss = call(lp)[0]
        (grad,) = torch.autograd.grad(loss, lp)
        out.append((loss.detach().double(), grad.double()))
    (l1, g1), (l2, g2) = out
    scale = max(float(g2.abs().max()), 1e-30)
    return {"loss_abs_diff": abs(float(l1 - l2)), "grad_max_rel_diff": float((g1 - g2).abs().max()) / scale}


# ----------------------------------------------------------------------------- routing replay


def routing_replay_cost(device: str = "cpu", batch: int = 4, seq: int = 128, repeats: int = 7) -> dict:
    """Forward-time overhead of MoE routing replay (R3) on a tiny Qwen3-MoE built in code
    (transformers, random weights), replay on vs off interleaved, and bytes per token of the
    stored routes. Returns ``{"skipped": reason}`` without transformers."""
    try:
        import transformers
    except ImportError:
        return {"skipped": "transformers is not installed (pip install 'stablerl[moe]')"}
    from stablerl import routing_replay as rr

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=32, num_experts_per_tok=4,
        norm_topk_prob=True, tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(device).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        with rr.capture(model) as cap:
            model(input_ids=ids)
        routes = cap.routes()

        def fwd(replay: bool) -> float:
            _sync(device)
            t0 = time.perf_counter()
            if replay:
                with rr.replay(model, routes):
                    model(input_ids=ids)
            else:
                model(input_ids=ids)
            _sync(device)
            return time.perf_counter() - t0

        fwd(False), fwd(True)
        plain, replay, ratios = [], [], []
        for r in range(repeats):
            a, b = (fwd(False), fwd(True)) if r % 2 == 0 else tuple(reversed((fwd(True), fwd(False))))
            plain.append(a)
            replay.append(b)
            ratios.append(b / a)
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "model": f"Qwen3-MoE {n_params / 1e6:.1f}M params, {cfg.num_hidden_layers} MoE layers, "
        f"{cfg.num_experts} experts, top-{cfg.num_experts_per_tok}",
        "tokens": batch * seq,
        "forward_ms_plain_median": 1e3 * statistics.median(plain),
        "forward_ms_replay_median": 1e3 * statistics.median(replay),
        "replay_time_ratio": statistics.median(ratios),
        "replay_time_ratio_min": min(ratios),
        "routes_bytes_per_token": routes.bytes_per_token,
        "routes_dtype": str(routes.dtype),
    }


# ----------------------------------------------------------------------------- machine


def machine_info(device: str) -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "stablerl": getattr(stablerl, "__version__", None),
        "device": device,
    }
    try:
        info["load_avg_1m"] = os.getloadavg()[0]
    except OSError:
        pass
    try:
        from importlib import metadata

        info["verl"] = metadata.version("verl")
    except Exception:  # noqa: BLE001
        info["verl"] = None
    info["trl"] = bench_trl.trl_version()
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info


# ----------------------------------------------------------------------------- driver


def run(
    quick: bool = False,
    device: str = "cpu",
    dtypes: tuple[str, ...] = ("fp32", "bf16"),
    shapes: Optional[list] = None,
    repeats: Optional[int] = None,
    losses: Optional[list[str]] = None,
    use_verl: bool = True,
    routing: bool = False,
    use_trl: bool = True,
    estimators: bool = True,
    clock: str = "auto",
    log: Callable[[str], None] = lambda s: None,
) -> dict:
    """Measure every policy loss (and every advantage estimator); returns the JSON-able result object."""
    global _clock
    clock, _clock = pick_clock(clock, device)
    shapes = shapes or (QUICK_SHAPES if quick else FULL_SHAPES)
    repeats = repeats or (7 if quick else 15)
    max_s = 4.0 if quick else 30.0  # per loss and case; only expensive losses get fewer repeats
    core_algos = _verl_core_algos() if use_verl else None
    names = [s.name for s in stablerl.list_algorithms(POLICY_LOSS) if s.status != "unavailable" and s.fn is not None]
    if losses:
        names = [n for n in names if n in losses]
    result: dict[str, Any] = {
        "machine": machine_info(device),
        "config": {
            "quick": quick,
            "repeats": repeats,
            "shapes": [list(s) for s in shapes],
            "dtypes": list(dtypes),
            "loss_agg_mode": "token-mean",
            "max_s_per_case": max_s,
            "memory_method": "cuda_peak_allocated" if device.startswith("cuda") else "autograd_saved_tensor_bytes",
            "clock": clock,
            "native": "verl" if core_algos is not None else None,
        },
        "losses": {},
    }
    trl_pairs = bench_trl.selected(losses) if use_trl and bench_trl.trl_version() is not None else []
    if not use_trl:
        result["trl"] = {"skipped": "--no-trl"}
    elif bench_trl.trl_version() is None:
        result["trl"] = {"skipped": "TRL is not installed (pip install 'stablerl[trl]')"}
    else:
        result["trl"] = {"version": bench_trl.trl_version(), "losses": {k: bench_trl.describe(k) for k in trl_pairs}}
    if core_algos is None and use_verl:
        result["note"] = "verl is not installed: only the relative-to-vanilla table (pip install 'stablerl[verl]')"
    recompute_on = os.environ.get("STABLERL_RECOMPUTE_HALF", "0") not in ("", "0", "false", "False")
    result["config"]["recompute_half"] = recompute_on
    from stablerl.fused import fused_requested

    fused_on = fused_requested(None)
    result["config"]["fused"] = fused_on
    torch.manual_seed(0)
    for label, B, T in shapes:
        for dname in dtypes:
            inputs = make_inputs(B, T, DTYPES[dname], device, vocab=4096 if quick else 32000)
            case = f"{label}/{dname}"
            vanilla_ours = ours_fn("vanilla", inputs)
            for name in names:
                entry = result["losses"].setdefault(name, {"cases": {}})
                try:
                    if core_algos is not None and name in VERL_TWINS:
                        base, cfg = native_fn(core_algos, name, inputs)
                        ours = adapter_fn(core_algos, name, inputs, cfg)
                        entry["baseline"] = f"verl:{VERL_TWINS[name]}"
                        row = compare(ours, base, inputs, device, repeats, max_s=max_s)
                        row.update(agreement(ours, base, inputs))
                        has_fused = stablerl.get_spec(POLICY_LOSS, name).fused is not None
                        row["path"] = "fused" if has_fused and fused_on else "eager"
                        if row["path"] == "fused":
                            # the same adapter call on the eager path, against the same baseline
                            again = compare(eager(ours), base, inputs, device, repeats, max_s=max_s)
                            row["eager"] = {k: again[k] for k in (
                                "time_ratio", "time_ratio_min", "time_ratio_best", "mem_ratio", "ours_ms_min",
                                "ours_ms_median", "ours_mem_mb")}
                        if DTYPES[dname] in (torch.bfloat16, torch.float16) and not recompute_on:
                            # the same adapter call with the fp32 forward recomputed in backward
                            again = compare(with_recompute(ours), base, inputs, device, repeats, max_s=max_s)
                            row["recompute_half"] = {k: again[k] for k in (
                                "time_ratio", "time_ratio_min", "mem_ratio", "ours_ms_min", "ours_mem_mb")}
                    else:
                        ours = ours_fn(name, inputs)
                        entry["baseline"] = "stablerl:vanilla"
                        row = compare(ours, vanilla_ours, inputs, device, repeats, max_s=max_s)
                        row["path"] = "fused" if fused_on and stablerl.get_spec(POLICY_LOSS, name).fused else "eager"
                        if row["path"] == "fused":
                            # both on the eager path (the baseline vanilla too)
                            again = compare(eager(ours), eager(vanilla_ours), inputs, device, repeats, max_s=max_s)
                            row["eager"] = {k: again[k] for k in (
                                "time_ratio", "time_ratio_min", "time_ratio_best", "mem_ratio", "ours_ms_min",
                                "ours_ms_median", "ours_mem_mb")}
                except Exception as e:  # noqa: BLE001 - one broken loss must not stop the bench
                    row = {"error": f"{type(e).__name__}: {e}"}
                entry["cases"][case] = row
                log(f"{case:<22} {name:<14} " + (
                    f"time x{row['time_ratio']:.2f} (best/best x{row['time_ratio_best']:.2f})  mem x{row['mem_ratio']:.2f}  "
                    f"vs {entry['baseline']}" + (
                        f"  [{row['path']}; eager: time x{row['eager']['time_ratio']:.2f}  mem x{row['eager']['mem_ratio']:.2f}]"
                        if "eager" in row else f"  [{row['path']}]" if "path" in row else "")
                    if "error" not in row else row["error"]))
            for pair in trl_pairs:
                entry = result["trl"]["losses"][pair]
                try:
                    row = bench_trl.measure(pair, inputs, device, repeats, compare, agreement, max_s=max_s)
                except Exception as e:  # noqa: BLE001 - a disagreement or a TRL change is reported, not fatal
                    row = {"error": f"{type(e).__name__}: {e}"}
                entry["cases"][case] = row
                log(f"{case:<22} {'trl:' + pair:<14} " + (
                    f"time x{row['time_ratio']:.2f} (best/best x{row['time_ratio_best']:.2f})  mem x{row['mem_ratio']:.2f}  "
                    f"{entry['ours']} vs {entry['baseline']}" if "error" not in row else row["error"]))
            del inputs
    if estimators:
        result["estimators"] = bench_estimators.run(
            core_algos, repeats=max(repeats, 11), clock=_clock, device=device, log=log)
    if routing:
        try:
            result["routing_replay"] = routing_replay_cost(device, repeats=repeats)
        except Exception as e:  # noqa: BLE001
            result["routing_replay"] = {"error": f"{type(e).__name__}: {e}"}
        log(f"routing replay: {result['routing_replay']}")
    for entry in [*result["losses"].values(), *result["trl"].get("losses", {}).values()]:  # estimators: their own
        ok = [c for c in entry["cases"].values() if "error" not in c]
        entry["time_ratio"] = max((c["time_ratio"] for c in ok), default=None)
        entry["mem_ratio"] = max((c["mem_ratio"] for c in ok), default=None)
    return result


def markdown(result: dict) -> str:
    """Two tables: against the native twin, and relative to vanilla."""
    m = result["machine"]
    cfg = result["config"]
    lines = [
        f"Machine: {m.get('cpu')} ({m.get('cores')} cores, {m.get('torch_threads')} torch threads"
        + (f", load {m['load_avg_1m']:.1f}" if "load_avg_1m" in m else "")
        + f"), device {m['device']}" + (f" ({m['gpu']})" if m.get("gpu") else "")
        + f", torch {m['torch']}, verl {m.get('verl')}, trl {m.get('trl')}; clock {cfg.get('clock', 'wall')}.",
        f"Repeats: {cfg['repeats']} interleaved pairs per case (order alternating; fewer, at least 3, for a loss "
        f"whose pairs would exceed {cfg.get('max_s_per_case')} s). Time ratio = ours / baseline within "
        f"one repeat, median [min] over repeats; best/best = best ours / best baseline. "
        f"Memory: {cfg['memory_method']}; ratio = ours / baseline.",
        "",
    ]
    twins = {n: e for n, e in result["losses"].items() if e.get("baseline", "").startswith("verl:")}
    rel = {n: e for n, e in result["losses"].items() if not e.get("baseline", "").startswith("verl:")}

    def table(entries: dict, title: str, agree: bool) -> None:
        if not entries:
            return
        lines.append(f"### {title}")
        lines.append("")
        head = "| loss | baseline | case | time ratio median [min] | best/best | ours ms best (median) | base ms best (median) | mem ratio | ours MiB | base MiB |"
        sep = "|---|---|---|---|---|---|---|---|---|---|"
        if agree:
            head += " path | eager: time ratio median [min] / mem ratio | loss diff | grad rel diff | recompute_half: time / mem ratio |"
            sep += "---|---|---|---|---|"
        lines.extend([head, sep])
        for name, e in entries.items():
            for case, c in e["cases"].items():
                if "error" in c:
                    lines.append(f"| {name} | {e.get('baseline', '-')} | {case} | error: {c['error'][:80]} |")
                    continue
                row = (
                    f"| {name} | {e['baseline']} | {case} | {c['time_ratio']:.2f} [{c['time_ratio_min']:.2f}] | {c['time_ratio_best']:.2f} | "
                    f"{c['ours_ms_min']:.1f} ({c['ours_ms_median']:.1f}) | {c['base_ms_min']:.1f} ({c['base_ms_median']:.1f}) | "
                    f"{c['mem_ratio']:.2f} | {c['ours_mem_mb']:.1f} | {c['base_mem_mb']:.1f} |"
                )
                if agree:
                    ec = c.get("eager")
                    row += f" {c.get('path', '-')} |"
                    row += f" {ec['time_ratio']:.2f} [{ec['time_ratio_min']:.2f}] / {ec['mem_ratio']:.2f} |" if ec else " - |"
                    row += f" {c['loss_abs_diff']:.1e} | {c['grad_max_rel_diff']:.1e} |"
                    rc = c.get("recompute_half")
                    row += f" {rc['time_ratio']:.2f} / {rc['mem_ratio']:.2f} |" if rc else " - |"
                lines.append(row)
        lines.append("")

    rr = result.get("routing_replay")
    if rr:
        lines += ["### MoE routing replay (R3)", ""]
        if "forward_ms_plain_median" in rr:
            lines += [
                "| model | tokens | forward ms, replay off | forward ms, replay on | time ratio median [min] | route bytes / token |",
                "|---|---|---|---|---|---|",
                f"| {rr['model']} | {rr['tokens']} | {rr['forward_ms_plain_median']:.1f} | {rr['forward_ms_replay_median']:.1f} | "
                f"{rr['replay_time_ratio']:.2f} [{rr['replay_time_ratio_min']:.2f}] | {rr['routes_bytes_per_token']:g} ({rr['routes_dtype']}) |",
            ]
        else:
            lines.append(f"not measured: {rr.get('skipped') or rr.get('error')}")
        lines.append("")
    table(twins, "Against the native twin (verl)", True)
    trl_entries = result.get("trl", {}).get("losses")
    if trl_entries:
        lines += [f"### Against TRL {result['trl']['version']}'s built-in loss types", "",
                  "| TRL loss_type (label) | ours | case | time ratio median [min] | best/best | ours ms best (median) | "
                  "TRL ms best (median) | mem ratio | ours MiB | TRL MiB | fp32 loss diff | fp32 grad rel diff |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for label, e in trl_entries.items():
            for case, c in e["cases"].items():
                if "error" in c:
                    lines.append(f"| {e['baseline']} ({label}) | {e['ours']} | {case} | error: {c['error'][:120]} |")
                    continue
                lines.append(
                    f"| {e['baseline']} ({label}) | {e['ours']} {e['loss_agg_mode']} | {case} | {c['time_ratio']:.2f} "
                    f"[{c['time_ratio_min']:.2f}] | {c['time_ratio_best']:.2f} | {c['ours_ms_min']:.1f} ({c['ours_ms_median']:.1f}) | "
                    f"{c['base_ms_min']:.1f} ({c['base_ms_median']:.1f}) | {c['mem_ratio']:.2f} | {c['ours_mem_mb']:.1f} | "
                    f"{c['base_mem_mb']:.1f} | {c['fp32_loss_abs_diff']:.1e} | {c['fp32_grad_max_rel_diff']:.1e} |")
        lines.append("")
    elif result.get("trl", {}).get("skipped"):
        lines += [f"TRL comparison not run: {result['trl']['skipped']}.", ""]
    lines += bench_estimators.markdown(result.get("estimators") or {})
    table(rel, "Relative to stablerl's vanilla (no native twin" + ("" if twins else ", or verl not installed") + ")", False)
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stablerl bench", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return p


def _shape_arg(text: str) -> tuple[str, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"must be BxT with positive integers, e.g. 64x4096; got {text!r}")
    b, t = (int(p) for p in parts)
    return (f"B{b}xT{t}", b, t)


def _dtypes_arg(text: str) -> tuple[str, ...]:
    names = tuple(d.strip() for d in text.split(",") if d.strip())
    unknown = [d for d in names if d not in DTYPES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"must be a comma-separated subset of {','.join(DTYPES)}; got {text!r}")
    return names


def _device_arg(text: str) -> str:
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N; got {text!r}")
    return text


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0; got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="B=32 T=2048, 7 repeats (about 2 minutes on 2 cores)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--out", default=None, help="also write the markdown tables to this file (default: no file)")
    p.add_argument("--device", default="cpu", type=_device_arg, help="cpu or cuda")
    p.add_argument("--dtypes", default=("fp32", "bf16"), type=_dtypes_arg, help="comma-separated subset of fp32,bf16")
    p.add_argument("--losses", default=None, help="comma-separated loss names (default: all)")
    p.add_argument("--repeats", type=_positive_int, default=None)
    p.add_argument("--shape", action="append", default=None, type=_shape_arg, metavar="BxT",
                   help="e.g. 64x4096 (repeatable)")
    p.add_argument("--no-verl", action="store_true", help="skip the native comparison even if verl is installed")
    p.add_argument("--no-routing", action="store_true", help="skip the routing-replay measurement (needs transformers)")
    p.add_argument("--no-trl", action="store_true", help="skip the comparison with TRL's built-in loss types")
    p.add_argument("--no-estimators", action="store_true", help="skip the advantage estimators against verl's")
    p.add_argument("--clock", default="auto", choices=("auto", "thread", "wall"),
                   help="thread: CPU time of the calling thread (not inflated by other processes; CPU, 1 thread); "
                   "wall: perf_counter; auto (default): thread on CPU with 1 torch thread, else wall")
    p.add_argument("--threads", type=_non_negative_int, default=1,
                   help="torch CPU threads (default 1: on a shared machine, multi-threaded elementwise ops "
                   "wait for descheduled threads and time noise swamps the ratios; 0 keeps torch's default)")


def main(argv: Optional[list[str]] = None, args: Optional[argparse.Namespace] = None) -> int:
    args = args or build_parser().parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("stablerl bench: CUDA is not available", file=sys.stderr)
        return 2
    losses = [n.strip() for n in args.losses.split(",") if n.strip()] if args.losses else None
    if args.losses is not None:
        from stablerl.contracts import POLICY_LOSS
        from stablerl.params import unknown_name_message
        from stablerl.registry import get_registry

        from .trl import TRL_TWINS  # torch-only; labels of TRL's loss types (dapo, ...) select its pairs

        known = get_registry().names(POLICY_LOSS) + [label for label in TRL_TWINS if label not in get_registry().names(POLICY_LOSS)]
        unknown = [n for n in losses or [""] if n not in known]
        if unknown:
            print(f"stablerl bench: {unknown_name_message('--losses entry', unknown[0], known)}", file=sys.stderr)
            return 2
    if args.out and args.out != "-":  # checked before the run, not after minutes of measuring
        folder = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            print(f"stablerl bench: --out {args.out!r}: the folder {folder!r} does not exist or is not writable",
                  file=sys.stderr)
            return 2
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    shapes = list(args.shape) if args.shape else None
    if not args.no_verl and _verl_core_algos() is None:
        print("stablerl bench: verl is not installed, so there is no native twin to compare with; "
              "only the relative-to-vanilla table is produced (pip install 'stablerl[verl]')", file=sys.stderr)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    result = run(
        quick=args.quick,
        device=args.device,
        dtypes=tuple(args.dtypes),
        shapes=shapes,
        repeats=args.repeats,
        losses=losses,
        use_verl=not args.no_verl,
        routing=not args.no_routing,
        use_trl=not args.no_trl,
        estimators=not args.no_estimators,
        clock=args.clock,
        log=log,
    )
    failed = [f"{label} {case}: {c['error']}" for label, e in result["trl"].get("losses", {}).items()
              for case, c in e["cases"].items() if "error" in c]
    for line in failed:
        print(f"stablerl bench: TRL comparison failed for {line}", file=sys.stderr)
    md = markdown(result)
    if args.out and args.out != "-":  # no path in the result: it would name this machine's directories
        with open(args.out, "w") as f:
            f.write(md + "\n")
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(md)
    return 1 if failed else 0  # a TRL pair that does not compute the same loss is a failure, not a timing


if __name__ == "__main__":
    sys.exit(main())
