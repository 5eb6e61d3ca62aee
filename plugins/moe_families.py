"""Built-in MoE router families for routing replay (``stablerl.routing_replay``).

R3: arXiv 2510.11370; R2: arXiv 2512.01374. Each family says how to recognise its router module
(class name, matched over the MRO so subclasses match too) and how to recompute the gate weights
of *given* expert indices from the router's live logits, with the same normalisation as the
router's own forward (transformers 5.x, read from ``modeling_<family>.py``):

- Qwen3-MoE / Qwen2-MoE / OLMoE: ``w = softmax(logits, fp32).gather(idx)``; ``w /= sum(w)`` only if
  ``norm_topk_prob``; cast to the logits' dtype. (Qwen2-MoE's shared expert is outside the router and
  is untouched.)
- Mixtral: ``w = softmax(logits.float()).gather(idx); w /= sum(w)`` always; stays fp32.
- DeepSeek-V3: ``w = sigmoid(logits).gather(idx)`` (``e_score_correction_bias`` only affects the
  selection, not the weights); ``w /= sum(w) + 1e-20`` if ``norm_topk_prob``; ``w *= routed_scaling_factor``.

Third parties add families the same way::

    from stablerl import hookimpl
    from stablerl.routing_replay import RouterFamily, softmax_gather_weights

    @hookimpl
    def register_router_families(register):
        register(RouterFamily("my_moe", recompute=..., class_names=("MyMoeRouter",)).spec(paper="..."))
"""

from __future__ import annotations

from stablerl import EXPERIMENTAL, hookimpl
from stablerl.routing_replay import RouterFamily, sigmoid_gather_weights, softmax_gather_weights

_PAPER = "2510.11370"


def _softmax_norm_flag(logits, idx, module):
    """Qwen3-MoE / Qwen2-MoE / OLMoE: full fp32 softmax, gather, renormalise iff norm_topk_prob."""
    return softmax_gather_weights(logits, idx, bool(getattr(module, "norm_topk_prob", False)), out_dtype=logits.dtype)


def _softmax_always_norm(logits, idx, module):
    """Mixtral: full fp32 softmax, gather, always renormalise, weights stay fp32."""
    return softmax_gather_weights(logits.float(), idx, True)


def _sigmoid_scaled(logits, idx, module):
    """DeepSeek-V3: sigmoid scores (no correction bias), gather, renormalise iff norm_topk_prob, scale."""
    return sigmoid_gather_weights(
        logits, idx, bool(getattr(module, "norm_topk_prob", True)), float(getattr(module, "routed_scaling_factor", 1.0))
    )


QWEN3_MOE = RouterFamily(
    "qwen3_moe", _softmax_norm_flag, class_names=("Qwen3MoeTopKRouter",),
    description="Qwen3-MoE router: softmax(fp32) top-k, renormalised iff norm_topk_prob",
)
QWEN2_MOE = RouterFamily(
    "qwen2_moe", _softmax_norm_flag, class_names=("Qwen2MoeTopKRouter",),
    description="Qwen2-MoE router: softmax(fp32) top-k, renormalised iff norm_topk_prob; shared expert untouched",
)
OLMOE = RouterFamily(
    "olmoe", _softmax_norm_flag, class_names=("OlmoeTopKRouter",),
    description="OLMoE router: softmax(fp32) top-k, renormalised iff norm_topk_prob",
)
MIXTRAL = RouterFamily(
    "mixtral", _softmax_always_norm, class_names=("MixtralTopKRouter",),
    description="Mixtral router: softmax(fp32) top-k, always renormalised, fp32 weights",
)
DEEPSEEK_V3 = RouterFamily(
    "deepseek_v3", _sigmoid_scaled, class_names=("DeepseekV3TopkRouter",),
    description="DeepSeek-V3 router: sigmoid scores, bias-corrected group-limited selection, weights without "
    "bias, renormalised iff norm_topk_prob, x routed_scaling_factor",
)

FAMILIES = (QWEN3_MOE, QWEN2_MOE, OLMOE, MIXTRAL, DEEPSEEK_V3)

_SOFTMAX_FLAG = "w = softmax(z, fp32).gather(-1, idx); w /= w.sum(-1) iff norm_topk_prob; w.to(z.dtype)"
_FORMULAS = {
    "qwen3_moe": _SOFTMAX_FLAG,
    "qwen2_moe": _SOFTMAX_FLAG,
    "olmoe": _SOFTMAX_FLAG,
    "mixtral": "w = softmax(z, fp32).gather(-1, idx); w /= w.sum(-1)  (always; fp32)",
    "deepseek_v3": "w = sigmoid(z).gather(-1, idx); w /= w.sum(-1) + 1e-20 iff norm_topk_prob; w *= routed_scaling_factor",
}

_NOTES = (
    "Replays recorded top-k expert indices; gate weights recomputed from the current router logits with the "
    "family's own normalisation (gradient reaches the router). Hook on the router's forward output "
    "(router_logits, top_k_weights, top_k_index), transformers >= 5. Invalid rows (padding, missing last "
    "token, duplicated ids) keep native routing. Verified on CPU with tiny models built in code: self-replay "
    "is bitwise exact; no drift under replay after an optimizer step; holds under gradient checkpointing. "
    "idx = the replayed expert indices, z = the router's live logits. Use: stablerl.routing_replay.replay(model, "
    "routes) (docs/routing-replay.md)."
)


@hookimpl
def register_router_families(register):
    for fam in FAMILIES:
        register(fam.spec(paper=_PAPER, formula=_FORMULAS[fam.name],
                          status=EXPERIMENTAL, reference="transformers 5.24 modeling_" + fam.name + ".py router forward",
                          notes=_NOTES))
