"""The truncated-sampling scenario: a quantized rollout engine that samples with top-p, on TRL's vLLM path.

Real cause modelled: rollouts sampled with ``top_p < 1`` (or ``top_k``/``min_p``) by an engine whose weights differ
from the trainer's. The engine's log-probs are normalised over the tokens it kept (vLLM's ``processed_logprobs``),
the trainer's over the whole vocabulary, so every ratio against the rollout carries the trainer's probability mass
on the kept set, ``M <= 1``, besides the real mismatch (TRL issue #6789; prime-rl PR #2979: runs with truncated
sampling collapse without the fix; DeepSeek-V3.2, arXiv 2512.02556 §3.1 "Keep Sampling Mask"). A correction is
needed (the quantized engine: without one the gradient is off-policy), and every correction TRL ships reads the
biased ratio. stablerl's sampling-mask replay (``sampling_mask_replay``) expresses the rollout's log-probs over the
full vocabulary first, so its correction (``tis``) sees only the real mismatch.

The engine is :class:`stablerl.tools.demo.mismatch.LowPrecisionRollout` with TRL's ``top_p`` (it samples from the
rounded copy of the policy with vLLM's truncation rule and returns the processed log-probs).
"""

from __future__ import annotations

from typing import Any

from . import mismatch

# label -> (loss_type, GRPOConfig overrides). Every arm: the same quantized top-p engine on TRL's vLLM path.
_STABLERL = {"stablerl_loss_agg_mode": "seq-mean-token-mean", "vllm_importance_sampling_correction": False}
# TRL as TRL ships: stablerl's replay (on by default where top_p < 1 meets a ratio against the rollout) off
_TRL_IS = {"vllm_importance_sampling_correction": True, "sampling_mask_replay": "false"}
ARMS: dict[str, tuple[str, dict]] = {
    # TRL, every option it ships for a rollout/trainer mismatch
    "trl_none": ("grpo", {"vllm_importance_sampling_correction": False, "sampling_mask_replay": "false"}),
    "trl_seq_mask": ("grpo", dict(_TRL_IS)),  # TRL's defaults: sequence_mask, clip_max 3
    "trl_seq_trunc": ("grpo", dict(_TRL_IS, vllm_importance_sampling_mode="sequence_truncate")),
    "trl_tok_mask": ("grpo", dict(_TRL_IS, vllm_importance_sampling_mode="token_mask")),
    "trl_tok_trunc": ("grpo", dict(_TRL_IS, vllm_importance_sampling_mode="token_truncate")),  # clip_max 3
    "trl_tok_trunc2": ("grpo", dict(_TRL_IS, vllm_importance_sampling_mode="token_truncate",
                                    vllm_importance_sampling_clip_max=2.0)),
    "trl_tok_mask_band": ("grpo", dict(_TRL_IS, vllm_importance_sampling_mode="token_mask",
                                       vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0)),
    "trl_opm": ("grpo", {"vllm_importance_sampling_correction": False, "off_policy_mask_threshold": 0.5,
                         "sampling_mask_replay": "false"}),
    "trl_tok_trunc2_dapo": ("dapo", dict(_TRL_IS, vllm_importance_sampling_mode="token_truncate",
                                         vllm_importance_sampling_clip_max=2.0)),
    # stablerl: its tis (token, C = 2) without and with sampling-mask replay
    "tis_no_replay": ("stablerl_vanilla", dict(_STABLERL, stablerl_rollout_correction="tis",
                                               sampling_mask_replay="false")),
    "replay_tis": ("stablerl_vanilla", dict(_STABLERL, stablerl_rollout_correction="tis",
                                            sampling_mask_replay="true")),
}
ARM_HELP = {
    "trl_none": "TRL grpo, no correction",
    "trl_seq_mask": "TRL grpo + its default correction (sequence_mask, clip_max 3)",
    "trl_seq_trunc": "TRL grpo + sequence_truncate, clip_max 3",
    "trl_tok_mask": "TRL grpo + token_mask, clip_max 3",
    "trl_tok_trunc": "TRL grpo + token_truncate, clip_max 3",
    "trl_tok_trunc2": "TRL grpo + token_truncate, clip_max 2 (the objective of stablerl's tis)",
    "trl_tok_mask_band": "TRL grpo + token_mask, band 0.5..2",
    "trl_opm": "TRL grpo + off_policy_mask_threshold 0.5, no IS correction",
    "trl_tok_trunc2_dapo": "TRL dapo + token_truncate, clip_max 2",
    "tis_no_replay": "stablerl vanilla + tis (C = 2), sampling_mask_replay off",
    "replay_tis": "stablerl vanilla + tis (C = 2) + sampling_mask_replay (stablerl only)",
}

# `stablerl demo --scenario truncated` runs these
# TRL's best arm of the search (token_truncate, clip_max 3) and the stablerl fix; `--arms trl_tok_trunc2,replay_tis`
# is the same token-level objective without and with the replay
DEMO: dict[str, Any] = {"arms": ("trl_tok_trunc", "replay_tis"), "precision": "int2", "top_p": 0.8, "lr": 1e-3,
                        "steps": 200, "completion_length": 16, "seed": 0}


def check_arm(arm: str) -> str:
    return mismatch.check_arm(arm, ARMS)


def make_config(output_dir: str, arm: str, *, steps: int, seed: int, lr: float, top_p: float = DEMO["top_p"],
                num_iterations: int = 1, **overrides: Any):
    """The scenario's GRPOConfig on TRL's vLLM path (``use_vllm=True``) with ``top_p``, for one arm."""
    return mismatch.make_config(output_dir, arm, steps=steps, seed=seed, lr=lr, num_iterations=num_iterations,
                                arms=ARMS, top_p=top_p, **overrides)


make_trainer = mismatch.make_trainer  # the quantized engine (it samples with the config's top_p)

#: the versions DEMO_RECORD was made with (an Intel Xeon)
RECORDED_WITH = {"torch": "2.13.0", "transformers": "5.24.0", "trl": "1.16.0", "cpu_kernels": "AVX512"}
#: releases that gave the same rewards for the default arms (AVX-512 kernels)
SAME_WITH = ({"torch": "2.14.1", "transformers": "5.25.0"},)

# (final, best) reward per seed of DEMO's setting, 10%-window means, with torch 2.13.0
# (benchmarks/stability/truncated_sampling.py; every run in docs/stability/truncated_sampling.json; a test checks
# they match), for the demo's "other seeds" lines
DEMO_RECORD: dict[str, dict[int, tuple[float, float]]] = {
    "trl_tok_trunc": {0: (1.0, 1.0), 1: (0.96, 0.98), 2: (0.851, 0.868)},
    "replay_tis": {0: (0.98, 0.996), 1: (0.948, 0.954), 2: (0.915, 0.936)},
    "trl_tok_trunc2": {0: (0.673, 0.963), 1: (0.914, 0.914), 2: (0.948, 0.948)},
    "trl_none": {0: (0.7, 0.732), 1: (0.785, 0.841), 2: (0.903, 0.952)},
    "tis_no_replay": {0: (0.673, 0.963)},
    "trl_tok_mask": {0: (0.73, 0.801)},
    "trl_tok_mask_band": {0: (0.641, 0.721)},
    "trl_opm": {0: (0.646, 0.71)},
    "trl_tok_trunc2_dapo": {0: (0.541, 0.953)},
    "trl_seq_mask": {0: (0.103, 0.12)},
    "trl_seq_trunc": {0: (0.245, 0.281)},
}


def verdict(results: dict[str, dict], *, seed: int, precision: str, lr: float, steps: int, completion_length: int,
            top_p: float) -> list[str]:
    """:func:`stablerl.tools.demo.mismatch.verdict` against this scenario's record."""
    return mismatch.verdict(results, seed=seed, precision=precision, lr=lr, steps=steps,
                            completion_length=completion_length, demo=DEMO, record=DEMO_RECORD, arm_help=ARM_HELP,
                            doc="docs/stability/truncated_sampling.md",
                            script="benchmarks/stability/truncated_sampling.py", extra_match=top_p == DEMO["top_p"])
