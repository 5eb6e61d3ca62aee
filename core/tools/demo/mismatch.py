"""A low-precision rollout engine for TRL's vLLM path, on CPU: the training--inference mismatch, dialled.

Real cause modelled: a quantized rollout engine. FlashRL / the TIS blog ("Your efficient RL framework
secretly brings you off-policy RL training", Yao et al. 2025) sample with INT8 or FP8 weights in vLLM
while the trainer runs bf16/fp32; QeRL and Kimi K2's INT4 rollouts do the same at 4 bits. The trainer's
``old_log_prob`` is its own recompute, so without a correction the policy gradient is silently
off-policy by ``pi_train / pi_rollout``.

:class:`LowPrecisionRollout` stands in for TRL's ``VLLMGeneration`` (same ``sync_weights()`` /
``generate(prompts, images, num_generations, profiler)`` contract, one completion per prompt row as in
colocate mode): ``sync_weights`` copies the trainer's weights into a sampler whose linear and embedding
weights are rounded to ``precision``, and ``generate`` samples from that copy and returns the sampled
tokens' log-probs under it (vLLM's ``processed_logprobs``: after temperature). TRL then runs exactly its
vLLM code path: ``sampling_per_token_logps``, its own ``vllm_importance_sampling_*`` correction when on,
and the stablerl adapter's ``rollout_log_prob`` / ``stablerl_rollout_correction``. With a real vLLM the
same config runs with ``use_vllm=True`` and nothing of this module.

Precisions: ``fp32`` (no mismatch: the control), ``bf16`` / ``fp16`` (weights and compute in that dtype),
``fp8`` (weights cast to float8 e4m3 and back, compute fp32), ``int8`` / ``int4`` / ``int3`` / ``int2``
(symmetric per-output-row absmax quantization of the weights, compute fp32; ``-tensor``: one absmax scale
per weight matrix, so one large weight coarsens the whole matrix), ``fp8-logits`` (fp32 weights, the
logits rounded to float8 e4m3: an error that grows with the logits' magnitude, i.e. as entropy falls). Where the toy exaggerates:
a 0.3M-parameter model at 4 bits or fewer has a far larger relative error than a 7B model at 8 bits
(the per-row scale is set by few, large weights), so the mismatch per token is much larger than a real
FP8 engine's; the mechanism (a sampler that is a rounded copy of the trained weights, its log-probs
passed to the trainer) is the real one.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
from typing import Any, Optional

from . import task

PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "int8", "int4", "int3", "int2",
              "int8-tensor", "int4-tensor", "int3-tensor", "int2-tensor", "fp8-logits")
# also intN-rowsK (N in 2..8, K >= 1): one absmax scale per block of K output rows, between per-row (K = 1)
# and per-tensor (K >= the matrix's rows)
_INT = re.compile(r"int([2-8])(?:-(tensor)|-rows([1-9]\d*))?")


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS and not _INT.fullmatch(str(precision)):
        from stablerl.params import StableRLError

        raise StableRLError(f"rollout precision {precision!r} is not one of {', '.join(PRECISIONS)} "
                            "(or intN-rowsK: one scale per K output rows)")
    return precision


def round_weight(weight, precision: str):
    """``weight`` rounded to ``precision`` and returned in fp32 (intN: symmetric absmax, one scale per output
    row; ``-tensor``: per matrix; ``-rowsK``: per block of K output rows)."""
    import torch

    if precision == "fp8":
        return weight.to(torch.float8_e4m3fn).to(torch.float32)
    bits = _INT.fullmatch(precision)
    if bits:
        levels = 2 ** (int(bits.group(1)) - 1) - 1
        if bits.group(2):
            absmax = weight.abs().amax()
        elif bits.group(3):
            rows = int(bits.group(3))
            per_row = weight.abs().amax(dim=-1)
            padded = torch.nn.functional.pad(per_row, (0, (-len(per_row)) % rows))
            absmax = padded.view(-1, rows).amax(dim=1).repeat_interleave(rows)[:len(per_row)].unsqueeze(-1)
        else:
            absmax = weight.abs().amax(dim=-1, keepdim=True)
        scale = absmax.clamp_min(1e-12) / levels
        return (weight / scale).round().clamp(-levels, levels) * scale
    return weight.to(torch.float32)


# TRL sampling settings the stand-in does not implement, with the values that mean "off"
_SAMPLING_DEFAULTS = {"repetition_penalty": (None, 1.0), "structured_outputs_regex": (None,)}


class LowPrecisionRollout:
    """TRL ``VLLMGeneration`` stand-in that samples from a copy of the policy rounded to ``precision``."""

    def __init__(self, model, processing_class, *, precision: str = "int4", temperature: float = 1.0,
                 max_completion_length: int = 16, top_p: Optional[float] = None, top_k: Optional[int] = None,
                 min_p: Optional[float] = None, **_vllm_kwargs: Any):
        unsupported = {k: v for k, v in _vllm_kwargs.items() if k in _SAMPLING_DEFAULTS and v not in _SAMPLING_DEFAULTS[k]}
        if unsupported:
            from stablerl.params import StableRLError

            raise StableRLError(f"the low-precision rollout stand-in samples with temperature, top_p, top_k and "
                                f"min_p only; it does not implement {unsupported} (leave them at TRL's defaults)")
        from stablerl.sampling_mask import SamplingRule

        self.model = model  # the trainer's (weights are read at each sync_weights)
        self.precision = check_precision(precision)
        self.temperature = float(temperature or 1.0)
        # vLLM's truncation (its reference order) and its processed_logprobs: normalised over the kept tokens
        self.rule = SamplingRule(temperature=self.temperature, top_k=int(top_k or -1),
                                 top_p=1.0 if top_p is None else float(top_p), min_p=float(min_p or 0.0))
        self.max_completion_length = int(max_completion_length)
        self.eos_token_id = processing_class.eos_token_id
        self.pad_token_id = processing_class.pad_token_id
        self.sampler = None
        self.syncs = 0
        # per generate call: the mismatch on the sampled tokens, measured against the trainer's weights
        self.history: list[dict[str, float]] = []

    def sync_weights(self) -> None:
        import torch

        source = self.model.module if hasattr(self.model, "module") else self.model
        # a fresh module, not a deepcopy: Accelerate wraps the trainer model's forward in an instance attribute
        # that a deepcopy would keep, calling the trained (unrounded) weights
        sampler = type(source)(copy.deepcopy(source.config)).eval()
        sampler.load_state_dict(source.state_dict())
        with torch.no_grad():
            if self.precision in ("bf16", "fp16"):
                sampler.to(torch.bfloat16 if self.precision == "bf16" else torch.float16)
            elif self.precision not in ("fp32", "fp8-logits"):
                for module in sampler.modules():
                    if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                        module.weight.copy_(round_weight(module.weight, self.precision))
        self.sampler = sampler
        self.syncs += 1

    def generate(self, prompts: list[list[int]], images=None, num_generations: int = 1, profiler=None):
        """One completion per prompt row; returns (prompt_ids, completion_ids, logprobs [[[lp]...]], None). With
        top_p / top_k / min_p the log-probs are normalised over the kept tokens (vLLM's processed_logprobs)."""
        import torch

        from stablerl.sampling_mask import processed_log_probs

        if self.sampler is None:
            self.sync_weights()
        profiler = profiler or contextlib.nullcontext()
        completions: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[list[float]]] = [[] for _ in prompts]
        by_length: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_length.setdefault(len(p), []).append(i)
        with profiler, torch.no_grad():
            for rows in by_length.values():
                ids = torch.tensor([prompts[i] for i in rows], dtype=torch.long)
                done = torch.zeros(len(rows), dtype=torch.bool)
                for _ in range(self.max_completion_length):
                    logits = self.sampler(input_ids=ids).logits[:, -1, :].float()
                    if self.precision == "fp8-logits":  # an fp8 output kernel: the logits rounded to e4m3
                        logits = logits.to(torch.float8_e4m3fn).to(torch.float32)
                    logp = processed_log_probs(logits, self.rule)  # / temperature, then top-k/top-p/min-p
                    token = torch.multinomial(logp.exp(), 1).squeeze(1)
                    token_logp = logp.gather(1, token.unsqueeze(1)).squeeze(1)
                    for j, i in enumerate(rows):
                        if not done[j]:
                            completions[i].append(int(token[j]))
                            logprobs[i].append([float(token_logp[j])])
                    done |= token == self.eos_token_id
                    if bool(done.all()):
                        break
                    ids = torch.cat([ids, torch.where(done, self.pad_token_id, token).unsqueeze(1)], dim=1)
            self.history.append(self._measure(prompts, completions, logprobs))
        return [list(p) for p in prompts], completions, logprobs, None

    def _measure(self, prompts, completions, logprobs) -> dict[str, float]:
        """log p_rollout - log p_train on the sampled tokens (the trainer's fp32 forward, same weights):
        mean = the k1 estimate of KL(rollout || train); also the mean |difference| and the fraction of tokens
        whose train/rollout probability ratio is outside [1/2, 2]."""
        import torch

        diffs = []
        by_length: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            if completions[i]:
                by_length.setdefault(len(p), []).append(i)
        with torch.no_grad():
            for n, rows in by_length.items():
                width = max(len(completions[i]) for i in rows)
                # right-padded completions: causal attention, so the padding never reaches a scored position
                ids = torch.tensor([list(prompts[i]) + completions[i] + [self.pad_token_id] * (width - len(completions[i]))
                                    for i in rows], dtype=torch.long)
                logits = self.model(input_ids=ids).logits[:, n - 1:n - 1 + width].float() / self.temperature
                train = torch.log_softmax(logits, dim=-1).gather(2, ids[:, n:n + width].unsqueeze(2)).squeeze(2)
                for j, i in enumerate(rows):
                    k = len(completions[i])
                    diffs.append(torch.tensor([lp[0] for lp in logprobs[i]]) - train[j, :k])
        d = torch.cat(diffs) if diffs else torch.zeros(1)
        return {"kl": float(d.mean()), "abs": float(d.abs().mean()),
                "ratio_out_of_2x": float((d.abs() > 0.6931471805599453).float().mean())}


@contextlib.contextmanager
def simulated_vllm(precision: str):
    """While active, TRL's ``GRPOTrainer(args.use_vllm=True)`` builds a :class:`LowPrecisionRollout` instead of
    a vLLM engine (TRL's module attribute ``VLLMGeneration`` is swapped for the construction only)."""
    import trl.trainer.grpo_trainer as grpo_module

    check_precision(precision)
    saved = grpo_module.VLLMGeneration
    grpo_module.VLLMGeneration = functools.partial(LowPrecisionRollout, precision=precision)
    try:
        yield
    finally:
        grpo_module.VLLMGeneration = saved


def rollout_of(trainer) -> Optional[LowPrecisionRollout]:
    engine = getattr(trainer, "vllm_generation", None)
    return engine if isinstance(engine, LowPrecisionRollout) else None


# ----------------------------------------------------------------------------- the scenario's arms

# label -> (loss_type, GRPOConfig overrides). Every arm runs TRL's vLLM path on the same low-precision
# rollout; only the treatment of the mismatch differs. The stablerl corrections run on stablerl's vanilla
# PPO loss with TRL grpo's per-sequence aggregation, so "none" (TRL grpo) and "vanilla" differ only in the
# clip bounds, which never act here (one update per batch: the ratio to the trainer's recompute is 1).
_STABLERL = {"stablerl_loss_agg_mode": "seq-mean-token-mean", "vllm_importance_sampling_correction": False}
ARMS: dict[str, tuple[str, dict]] = {
    "none": ("grpo", {"vllm_importance_sampling_correction": False}),
    "trl_is": ("grpo", {"vllm_importance_sampling_correction": True}),  # TRL's defaults: sequence_mask, C = 3
    "trl_tis": ("grpo", {"vllm_importance_sampling_correction": True,
                         "vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 2.0}),
    "vanilla": ("stablerl_vanilla", dict(_STABLERL)),
    "m2po": ("stablerl_m2po", {"vllm_importance_sampling_correction": False}),
    **{name: ("stablerl_vanilla", dict(_STABLERL, stablerl_rollout_correction=name))
       for name in ("tis", "icepop", "seq_mis", "geo_rs")},
    # DeepSeek-V3.2 gives no default delta; 0.5 is the value of TRL's off_policy_mask_threshold example
    "opsm": ("stablerl_vanilla", dict(_STABLERL, stablerl_rollout_correction="opsm",
                                      stablerl_rollout_correction_params={"threshold": 0.5})),
}
ARM_HELP = {
    "none": "TRL grpo, no correction (vllm_importance_sampling_correction=False)",
    "trl_is": "TRL grpo with TRL's own correction at its defaults (sequence_mask, clip_max 3)",
    "trl_tis": "TRL grpo with TRL's token_truncate correction, clip_max 2",
    "vanilla": "stablerl vanilla (PPO clip), no correction",
    "m2po": "stablerl m2po; its old_log_prob is the trainer's recompute, so it does not see the mismatch",
    "tis": "stablerl vanilla + stablerl_rollout_correction='tis' (C = 2, token)",
    "icepop": "stablerl vanilla + 'icepop' (band 0.5..5, token)",
    "seq_mis": "stablerl vanilla + 'seq_mis' (sequence ratio, rejected above 2)",
    "geo_rs": "stablerl vanilla + 'geo_rs' (geometric-mean ratio band 0.999..1.001)",
    "opsm": "stablerl vanilla + 'opsm' (DeepSeek-V3.2 off-policy sequence mask, delta 0.5: no paper default)",
}


def check_arm(arm: str, arms: Optional[dict] = None) -> str:
    """``arm`` if it is one of ``arms`` (default: this scenario's :data:`ARMS`), else a did-you-mean error."""
    arms = ARMS if arms is None else arms
    if arm not in arms:
        from stablerl.params import UnknownNameError, unknown_name_message

        raise UnknownNameError(unknown_name_message("arm", arm, arms))
    return arm


def make_config(output_dir: str, arm: str, *, steps: int, seed: int, lr: float, num_iterations: int = 1,
                arms: Optional[dict] = None, **overrides: Any):
    """The demo's GRPOConfig on TRL's vLLM path (``use_vllm=True``), for one arm of the scenario (of ``arms``:
    another scenario's arms, default :data:`ARMS`)."""
    loss, arm_overrides = (ARMS if arms is None else arms)[check_arm(arm, arms)]
    return task.make_config(output_dir, loss, steps=steps, seed=seed, lr=lr, num_iterations=num_iterations,
                            **{"use_vllm": True, "vllm_mode": "colocate", **arm_overrides, **overrides})


def make_trainer(args, precision: str, callbacks=None, seed: int = 0):
    """:func:`stablerl.tools.demo.make_trainer` with the rollout engine replaced by :class:`LowPrecisionRollout`."""
    with simulated_vllm(precision):
        return task.make_trainer(args, callbacks=callbacks, seed=seed)


# ----------------------------------------------------------------------------- the demo's setting

# `stablerl demo` (scenario "mismatch") runs these; the multi-seed record is docs/stability/rollout_mismatch.md.
# Completions of up to 16 tokens: a sequence's summed log-ratio is what sequence-level IS sees and what an
# uncorrected gradient accumulates (the toy's 16 tokens x ~0.15 nats stand for thousands x ~0.001-0.01)
# two arms by default (the failure and its fix, in about 3 minutes); `--arms trl_is,tis,none` adds no correction
DEMO: dict[str, Any] = {"arms": ("trl_is", "tis"), "precision": "int2", "lr": 1e-3, "steps": 200,
                        "completion_length": 16, "seed": 0}
# (final, best) reward per seed of DEMO's setting, 10%-window means (benchmarks/stability/rollout_mismatch.py;
# every run with its curve in docs/stability/rollout_mismatch.json; a test checks they match), for the demo's
# "other seeds" lines
DEMO_RECORD: dict[str, dict[int, tuple[float, float]]] = {
    "tis": {0: (0.959, 0.959), 1: (0.965, 0.965), 2: (0.717, 0.907)},
    "trl_is": {0: (0.1, 0.118), 1: (0.364, 0.377), 2: (0.361, 0.366)},
    "none": {0: (0.25, 0.383), 1: (0.685, 0.731), 2: (0.493, 0.577)},
}


def failed(result: dict) -> bool:
    """The issue's criterion: final reward below 0.5, or below half of the run's best (10%-window means)."""
    reward = [v for v in result["reward"] if v is not None and v == v]
    if not reward:
        return True
    k = max(1, int(round(len(reward) * 0.1)))
    best = max(sum(reward[i:i + k]) / k for i in range(len(reward) - k + 1))
    final = task.window_mean(reward)
    return final < 0.5 or final < 0.5 * best


def recorded_failed(final: float, best: float) -> bool:
    """:func:`failed` on a recorded (final, best) pair."""
    return final < 0.5 or final < 0.5 * best


def verdict(results: dict[str, dict], *, seed: int, precision: str, lr: float, steps: int,
            completion_length: int = 4, demo: Optional[dict] = None, record: Optional[dict] = None,
            arm_help: Optional[dict] = None, doc: str = "docs/stability/rollout_mismatch.md",
            script: str = "benchmarks/stability/rollout_mismatch.py", extra_match: bool = True) -> list[str]:
    """Which arms failed on this seed, the gap between the best and the worst arm, and, for the recorded
    setting (:data:`DEMO`), how many of the other recorded seeds agree: the same arms fail and the same hold
    (:data:`DEMO_RECORD`, the finals of docs/stability/rollout_mismatch.json). Another scenario passes its own
    ``demo`` setting, ``record``, ``arm_help``, ``doc`` and ``script`` (``extra_match``: its own settings beyond
    these four match its record)."""
    setting, helps = demo or DEMO, arm_help or ARM_HELP
    recorded_runs = DEMO_RECORD if record is None else record
    lines = [f"on seed {seed} (failed = final reward < 0.5 or < half of the run's best):"]
    verdicts = {arm: failed(r) for arm, r in results.items()}
    width = max(8, *map(len, results))  # arm names aligned
    for arm, r in results.items():
        lines.append(f"  {arm:<{width}} {'FAILED' if verdicts[arm] else 'held  '}  final {r['final_reward']:.2f}  "
                     f"({helps.get(arm, arm)})")
    if len(results) >= 2:
        ranked = sorted(results, key=lambda a: results[a]["final_reward"])
        low, high = ranked[0], ranked[-1]
        gap = results[high]["final_reward"] - results[low]["final_reward"]
        lines.append(f"largest difference: {high} ends {gap:+.2f} above {low}")
    recorded = (precision == setting["precision"] and lr == setting["lr"] and steps == setting["steps"]
                and completion_length == setting["completion_length"] and extra_match)
    if not recorded:
        lines.append(f"other seeds: not the recorded setting (see {doc}); run {script} for them")
        return lines
    arms = [a for a in results if a in recorded_runs]
    others = sorted(set.intersection(*(set(recorded_runs[a]) for a in arms)) - {seed}) if arms else []
    if not others:
        lines.append(f"other seeds: none recorded for these arms ({doc})")
        return lines
    width = max(width, *map(len, recorded_runs))
    agree = [s for s in others if all(recorded_failed(*recorded_runs[a][s]) == verdicts[a] for a in arms)]
    lines.append(f"other seeds: {len(agree)} of {len(others)} recorded ({', '.join(map(str, others))}) agree "
                 "(the same arms fail, the same hold); their finals:")
    for a in arms:
        finals = ", ".join(f"{recorded_runs[a][s][0]:.2f}" for s in others)
        n_failed = sum(recorded_failed(*recorded_runs[a][s]) for s in others)
        n_high = sum(recorded_runs[a][s][0] >= 0.9 for s in others)
        lines.append(f"  {a:<{width}} {finals}  (failed on {n_failed} of {len(others)}; >= 0.9 on {n_high} of {len(others)})")
    for a in recorded_runs:
        if a not in results:  # recorded arms this run left out (e.g. `none` with the default arms)
            seeds = sorted(recorded_runs[a])
            n_failed = sum(recorded_failed(*recorded_runs[a][s]) for s in seeds)
            lines.append(f"  {a:<{width}} not run here; recorded on seeds {', '.join(map(str, seeds))}: "
                         f"{', '.join(f'{recorded_runs[a][s][0]:.2f}' for s in seeds)} (failed on {n_failed} of "
                         f"{len(seeds)}; --arms {','.join(list(results) + [a])})")
    lines.append(f"every run and curve: {doc}")
    return lines
