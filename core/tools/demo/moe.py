"""The MoE routing-mismatch scenario: a rollout engine whose routers see low-bit weights, on TRL's vLLM path.

Real cause modelled: in an MoE model the rollout engine (vLLM/SGLang, other kernels, FP8 weights) and the trainer
pick different experts for some tokens, because the router's top-k is a discontinuous function of its logits; a
token whose experts flipped has a different probability under the two engines (R3, "Stabilizing MoE Reinforcement
Learning by Aligning Training and Inference Routers", arXiv 2510.11370; "Stabilizing Reinforcement Learning with
LLMs", arXiv 2512.01374: the routing mismatch as a cause of MoE RL collapse). stablerl's fix is routing replay R3
(``routing_replay="R3"``): the trainer's forwards use the rollout's experts (:mod:`stablerl.routing_replay`); TRL
has no routing replay.

The policy is a tiny Qwen3-MoE built in code (:func:`build_model`). :class:`QuantizedRouterRollout` stands in for
TRL's ``VLLMGeneration``: ``sync_weights`` copies the trainer's weights into a sampler whose *router* weights only
are rounded to ``precision`` (every other weight stays fp32, so any mismatch is a routing one), and ``generate``
samples from it. The engine's routes reach the trainer as vLLM's ``routed_experts`` (``[tokens - 1, layers, k]``)
through a ``rollout_func`` (:func:`rollout_func`; TRL 1.16's own vLLM path never asks vLLM for them), which every
arm uses, so TRL runs its vLLM code path (``sampling_per_token_logps``, its ``vllm_importance_sampling_*``) in all
of them. Per generation the engine records the mismatch against an fp32 copy of the same weights: the fraction of
response tokens with a changed expert (any MoE layer), the k1 KL on the sampled tokens without and with the
rollout's routes replayed (:attr:`QuantizedRouterRollout.history`).

What it took for the mismatch to matter (docs/stability/moe_routing.md, seed-0 screens): with transformers' default
init (std 0.02, 8 experts top-2, 2 layers; a forward-only probe) a 2-bit router changes the experts of 87% of
response tokens but moves their log-prob by 0.007 nats (the experts' outputs are small against the residual stream);
at init std 0.1 it is 0.26 nats and every arm learns to 1.00. Top-1 (normalised gate weight 1: the chosen expert is
the whole routing difference, so R3 removes it exactly; top-2 leaves the gate weights' difference, a third of the KL
at std 0.2), init std 0.25 and 4 MoE layers give ~95% of response tokens a changed expert and a k1 KL of 1.3-3.1
nats per token without replay, 0 with it. Why that slows training without replay: the gradient trains, for each
token, the expert the trainer's fp32 router picks, not the one that produced the sample, so the trained policy
improves (its entropy falls) while the rollout policy, which reaches the reward, follows only through the shared
weights; TRL's IS corrections reweight the tokens but cannot move the gradient to the rollout's experts. With top-1
and normalised weights the routers get no gradient: both routings are fixed at init and the mismatch does not drift.

Result (3 seeds, 200 steps): the issue's target is NOT met. R3 ends 0.99 / 0.87 / 0.96; TRL's best options end
0.43-0.66 (token_truncate clip 3, the demo's baseline, fails on 1 of 3 seeds; dapo + token_truncate and clip 2 on
none), TRL's default sequence_mask and no correction fail on 3 of 3. TRL is slowed, not collapsed: its token-level
arms still climb at step 200, and with 400 steps (seed 1) token_truncate reaches 0.86 (R3 0.99).

Where the toy exaggerates: the router sees 2-bit weights (a bf16/FP8 router flips the experts of ~10% of tokens and
moves the log-prob by ~0.01 nats: docs/stability/moe_mismatch.md; here ~95% and ~1.5 nats) and the model has 0.45M
parameters with a large init; the mechanism (a sampler routing with rounded router weights, its routes and log-probs
handed to the trainer) is the real one.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

from . import mismatch, task

# the tiny Qwen3-MoE (every decoder layer an MoE layer). Top-1 with normalised top-k weights: the gate weight is 1,
# so the experts chosen are the whole routing difference and R3 removes it exactly (top-2 leaves the gate weights'
# difference). Init std 0.25 (transformers' default 0.02): the experts' outputs large enough that a changed expert
# changes the next-token distribution (abs log-prob difference ~1.5 nats at init vs 0.01 at std 0.02).
MODEL: dict[str, Any] = {"hidden_size": 64, "num_layers": 4, "num_experts": 8, "top_k": 1, "moe_intermediate_size": 64,
                         "initializer_range": 0.25}


def build_model(tokenizer, seed: int = 0, *, hidden_size: int = MODEL["hidden_size"],
                num_layers: int = MODEL["num_layers"], num_experts: int = MODEL["num_experts"],
                top_k: int = MODEL["top_k"], moe_intermediate_size: int = MODEL["moe_intermediate_size"],
                initializer_range: float = MODEL["initializer_range"]):
    """A tiny Qwen3-MoE causal LM, randomly initialised (``seed``): every layer sparse, ``top_k`` of
    ``num_experts`` experts per token, normalised top-k weights."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
        moe_intermediate_size=moe_intermediate_size, num_experts=num_experts, num_experts_per_tok=top_k,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=64,
        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, initializer_range=initializer_range,
    )
    model = Qwen3MoeForCausalLM(config)
    for key in ("pad_token_id", "eos_token_id"):
        setattr(model.generation_config, key, getattr(tokenizer, key))
    model.generation_config.bos_token_id = None
    return model


def _routers(model):
    from stablerl import routing_replay as rr

    return rr.require_routers(model, needed_by="the MoE demo scenario")


class QuantizedRouterRollout(mismatch.LowPrecisionRollout):
    """TRL ``VLLMGeneration`` stand-in whose sampler is the policy with its router weights rounded to
    ``precision`` (any of :data:`stablerl.tools.demo.mismatch.PRECISIONS` or intN-rowsK); it also returns the
    routes it used (:attr:`last_routes`, vLLM's ``routed_experts`` layout, one array per completion)."""

    def __init__(self, model, processing_class, *, precision: str = "int2", **kwargs: Any):
        super().__init__(model, processing_class, precision=precision, **kwargs)
        self.reference = None  # fp32 copy of the same weights (the trainer's routes, without its hooks)
        self.last_routes: list = []

    def sync_weights(self) -> None:
        import torch

        source = self.model.module if hasattr(self.model, "module") else self.model
        copies = []
        for _ in range(2):
            m = type(source)(copy.deepcopy(source.config)).eval()
            m.load_state_dict(source.state_dict())
            copies.append(m)
        self.sampler, self.reference = copies
        with torch.no_grad():
            for info in _routers(self.sampler):
                info.module.weight.copy_(mismatch.round_weight(info.module.weight, self.precision))
        self.syncs += 1

    def _measure(self, prompts, completions, logprobs) -> dict[str, float]:
        """The sampler's routes (kept in :attr:`last_routes`) and the mismatch to the fp32 weights: ``flipped``
        (response tokens with >= 1 changed expert in some layer), ``kl`` / ``abs`` / ``ratio_out_of_2x`` without
        replay, ``kl_replay`` / ``abs_replay`` with the sampler's routes replayed in the fp32 forward."""
        import torch

        from stablerl import routing_replay as rr

        layers = self.sampler.config.num_hidden_layers
        self.last_routes = [None] * len(prompts)
        diffs, diffs_replay, flips = [], [], []
        by_length: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_length.setdefault(len(p), []).append(i)
        with torch.no_grad():
            for n, rows in by_length.items():
                width = max(1, max(len(completions[i]) for i in rows))
                ids = torch.tensor([list(prompts[i]) + completions[i]
                                    + [self.pad_token_id] * (width - len(completions[i])) for i in rows],
                                   dtype=torch.long)
                with rr.capture(self.sampler) as cap:
                    self.sampler(input_ids=ids)
                rollout = cap.routes()
                with rr.capture(self.reference) as cap:
                    logits = self.reference(input_ids=ids).logits
                native = cap.routes()
                with rr.replay(self.reference, rollout):
                    logits_replay = self.reference(input_ids=ids).logits
                B, T = ids.shape
                a = rollout.indices.long().view(layers, B, T, -1)
                b = native.indices.long().view(layers, B, T, -1)
                changed = (~(a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1)).any(-1).any(0)  # [B, T]
                targets = ids[:, n:n + width].unsqueeze(2)
                lp = torch.log_softmax(logits[:, n - 1:n - 1 + width].float() / self.temperature, -1).gather(2, targets)
                lp_r = torch.log_softmax(logits_replay[:, n - 1:n - 1 + width].float() / self.temperature,
                                         -1).gather(2, targets)
                for j, (i, seq) in enumerate(zip(rows, rollout.sequences())):
                    k = len(completions[i])
                    # vLLM's layout: one row per forwarded token (the last sampled token is never forwarded)
                    self.last_routes[i] = seq.slice_tokens(0, n + k - 1).to_token_layer_slot(layers).numpy().astype(
                        "uint8")
                    if k:
                        rollout_lp = torch.tensor([x[0] for x in logprobs[i]])
                        diffs.append(rollout_lp - lp[j, :k, 0])
                        diffs_replay.append(rollout_lp - lp_r[j, :k, 0])
                        flips.append(changed[j, n - 1:n - 1 + k].float())
        d = torch.cat(diffs) if diffs else torch.zeros(1)
        dr = torch.cat(diffs_replay) if diffs_replay else torch.zeros(1)
        return {"kl": float(d.mean()), "abs": float(d.abs().mean()),
                "ratio_out_of_2x": float((d.abs() > 0.6931471805599453).float().mean()),
                "kl_replay": float(dr.mean()), "abs_replay": float(dr.abs().mean()),
                "flipped": float(torch.cat(flips).mean()) if flips else 0.0}


def rollout_func(prompts: list, trainer) -> dict[str, list]:
    """TRL ``rollout_func``: tokenizes the prompt rows, samples one completion per row from the trainer's
    :class:`QuantizedRouterRollout` (TRL syncs its weights first) and returns, besides TRL's keys, vLLM's
    ``routed_experts`` per completion (read by stablerl's R3; a reward function ignores it)."""
    engine = trainer.vllm_generation
    prompt_ids = [trainer.processing_class(p, add_special_tokens=False)["input_ids"] for p in prompts]
    _, completion_ids, logprobs, _ = engine.generate(prompt_ids)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids,
            "logprobs": [[lp[0] for lp in seq] for seq in logprobs], "routed_experts": list(engine.last_routes)}


def _reward(prompts, completions, target, routed_experts=None, **kwargs) -> list[float]:
    return task.copy_reward(prompts, completions, target)


# label -> (loss_type, GRPOConfig overrides). Every arm: the same engine (router weights at `precision`), the same
# rollout_func, TRL's vLLM path.
_STABLERL = {"stablerl_loss_agg_mode": "seq-mean-token-mean", "vllm_importance_sampling_correction": False}
_TRL_IS = {"vllm_importance_sampling_correction": True}
ARMS: dict[str, tuple[str, dict]] = {
    # TRL: every option it ships for a rollout/trainer mismatch
    "trl_none": ("grpo", {"vllm_importance_sampling_correction": False}),
    "trl_seq_mask": ("grpo", dict(_TRL_IS)),  # TRL's defaults (its recommended mode): sequence_mask, clip_max 3
    "trl_seq_trunc": ("grpo", dict(_TRL_IS, vllm_importance_sampling_mode="sequence_truncate")),
    "trl_tok_mask": ("grpo", dict(_TRL_IS, vllm_importance_sampling_mode="token_mask")),
    "trl_tok_trunc": ("grpo", dict(_TRL_IS, vllm_importance_sampling_mode="token_truncate")),  # best in truncated
    "trl_tok_trunc2": ("grpo", dict(_TRL_IS, vllm_importance_sampling_mode="token_truncate",
                                    vllm_importance_sampling_clip_max=2.0)),
    "trl_opm": ("grpo", {"vllm_importance_sampling_correction": False, "off_policy_mask_threshold": 0.5}),
    "trl_tok_trunc_dapo": ("dapo", dict(_TRL_IS, vllm_importance_sampling_mode="token_truncate")),
    # stablerl: routing replay R3 (the rollout's experts in every training forward), alone and with tis
    "r3": ("grpo", {"vllm_importance_sampling_correction": False, "routing_replay": "R3"}),
    "r3_tok_trunc": ("grpo", dict(_TRL_IS, vllm_importance_sampling_mode="token_truncate", routing_replay="R3")),
    "r3_tis": ("stablerl_vanilla", dict(_STABLERL, stablerl_rollout_correction="tis", routing_replay="R3")),
    "tis": ("stablerl_vanilla", dict(_STABLERL, stablerl_rollout_correction="tis")),  # control: no replay
}
ARM_HELP = {
    "trl_none": "TRL grpo, no correction",
    "trl_seq_mask": "TRL grpo + its default correction (sequence_mask, clip_max 3)",
    "trl_seq_trunc": "TRL grpo + sequence_truncate, clip_max 3",
    "trl_tok_mask": "TRL grpo + token_mask, clip_max 3",
    "trl_tok_trunc": "TRL grpo + token_truncate, clip_max 3 (TRL's best in the truncated-sampling grid)",
    "trl_tok_trunc2": "TRL grpo + token_truncate, clip_max 2",
    "trl_opm": "TRL grpo + off_policy_mask_threshold 0.5, no IS correction",
    "trl_tok_trunc_dapo": "TRL dapo + token_truncate, clip_max 3",
    "r3": "TRL grpo + stablerl routing_replay='R3' (stablerl only), no IS correction",
    "r3_tok_trunc": "TRL grpo + token_truncate, clip_max 3 + stablerl routing_replay='R3'",
    "r3_tis": "stablerl vanilla + tis (C = 2) + routing_replay='R3' (stablerl only)",
    "tis": "stablerl vanilla + tis (C = 2), no routing replay",
}

# `stablerl demo --scenario moe` runs these: TRL's best arm of the grid (token_truncate, clip 3: the best mean final
# over 3 seeds, tied with dapo + token_truncate, and TRL's best in the truncated-sampling grid) and R3
DEMO: dict[str, Any] = {"arms": ("trl_tok_trunc", "r3"), "precision": "int2", "lr": 1e-3, "steps": 200,
                        "completion_length": 16, "seed": 0}
#: the versions DEMO_RECORD was made with (an Intel Xeon)
RECORDED_WITH = {"torch": "2.13.0", "transformers": "5.24.0", "trl": "1.16.0", "cpu_kernels": "AVX512"}
#: releases that gave the same rewards for the demo's two arms on seeds 0, 1, 2 (AVX-512 kernels; 2.15.0 measured
#: 2026-12-06, what `pip install -e ".[trl]"` installs that day)
SAME_WITH = ({"torch": "2.14.1", "transformers": "5.25.0"}, {"torch": "2.15.0", "transformers": "5.25.0"})
# (final, best) reward per seed of DEMO's setting and MODEL, 10%-window means, with torch 2.13.0
# (benchmarks/stability/moe_routing.py; every run in docs/stability/moe_routing.json; a test checks they match), for
# the demo's "other seeds" lines. The target is NOT met: TRL's best does not fail (token_truncate fails on 1
# of 3 seeds, dapo + token_truncate and clip 2 on none) and R3 ends >= 0.9 on 2 of 3.
DEMO_RECORD: dict[str, dict[int, tuple[float, float]]] = {
    "r3": {0: (0.992, 0.993), 1: (0.867, 0.871), 2: (0.964, 0.964)},
    "trl_tok_trunc": {0: (0.431, 0.464), 1: (0.662, 0.707), 2: (0.57, 0.588)},
    "trl_tok_trunc_dapo": {0: (0.533, 0.538), 1: (0.538, 0.554), 2: (0.568, 0.614)},
    "trl_tok_trunc2": {0: (0.501, 0.522), 1: (0.516, 0.524), 2: (0.554, 0.605)},
    "trl_none": {0: (0.423, 0.458), 1: (0.38, 0.512), 2: (0.441, 0.504)},
    "trl_seq_mask": {0: (0.077, 0.079), 1: (0.088, 0.108), 2: (0.096, 0.119)},
    "trl_tok_mask": {0: (0.348, 0.37)},
    "trl_opm": {0: (0.294, 0.294)},
    "trl_seq_trunc": {0: (0.069, 0.071)},
}


def check_arm(arm: str) -> str:
    return mismatch.check_arm(arm, ARMS)


def make_config(output_dir: str, arm: str, *, steps: int, seed: int, lr: float, num_iterations: int = 1,
                **overrides: Any):
    """The scenario's GRPOConfig on TRL's vLLM path (``use_vllm=True``), for one arm."""
    return mismatch.make_config(output_dir, arm, steps=steps, seed=seed, lr=lr, num_iterations=num_iterations,
                                arms=ARMS, **overrides)


def make_trainer(args, precision: str, callbacks=None, seed: int = 0, model_kwargs: Optional[dict] = None):
    """The task's trainer on the tiny Qwen3-MoE, its rollout engine a :class:`QuantizedRouterRollout` with router
    weights at ``precision``, generating through :func:`rollout_func`."""
    import functools

    import trl.trainer.grpo_trainer as grpo_module

    mismatch.check_precision(precision)
    tokenizer = task.build_tokenizer()
    model = build_model(tokenizer, seed=seed, **(model_kwargs or {}))
    saved = grpo_module.VLLMGeneration
    grpo_module.VLLMGeneration = functools.partial(QuantizedRouterRollout, precision=precision)
    try:
        return task.make_trainer(args, tokenizer=tokenizer, model=model, reward=_reward, callbacks=callbacks,
                                 seed=seed, rollout_func=rollout_func)
    finally:
        grpo_module.VLLMGeneration = saved


def verdict(results: dict[str, dict], *, seed: int, precision: str, lr: float, steps: int,
            completion_length: int) -> list[str]:
    """:func:`stablerl.tools.demo.mismatch.verdict` against this scenario's record."""
    return mismatch.verdict(results, seed=seed, precision=precision, lr=lr, steps=steps,
                            completion_length=completion_length, demo=DEMO, record=DEMO_RECORD, arm_help=ARM_HELP,
                            doc="docs/stability/moe_routing.md", script="benchmarks/stability/moe_routing.py")
