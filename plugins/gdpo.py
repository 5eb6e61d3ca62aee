"""GDPO: group reward-decoupled normalisation (arXiv 2601.05242; verl ``gdpo``, TRL ``normalize_then_sum``).

    A_k,i = (r_k,i - mean_g(r_k)) / (std_g(r_k) + epsilon)     per reward component k, within the group g of i
    S_i   = sum_k w_k A_k,i,      A_i = batch-normalise(S)

Each reward component is normalised in its group on its own, so a component with a large spread cannot drown a
weak one (GRPO normalises their sum). The two frameworks differ in the last step and the constants, so both are
offered (``form``):

* ``"verl"`` (default; verl 0.9.1 ``compute_gdpo_outcome_advantage``): group std unbiased, ``epsilon=1e-6``, a
  group of one keeps its raw component (mean 0, std 1); then verl's ``masked_whiten`` over the batch's response
  *tokens* (a response weighs by its length): ``(S - mean_tok) * rsqrt(var_tok + 1e-8)``, var Bessel-corrected.
* ``"trl"`` (TRL 1.16 ``multi_objective_aggregation="normalize_then_sum"``): NaN-aware (a component a reward
  function did not score is left out of its group's statistics and counts 0 in the sum; a group with fewer than
  two scored values gives 0); ``epsilon=1e-4`` in the group step and in the batch step, which is over
  *responses*: ``(S - mean) / (std + epsilon)``, std unbiased; a response no function scored gets 0.

Inputs: ``extras["reward_components"]`` (``[B, K]``, or a dict of ``[B]`` / ``[B, T]`` tensors; without it the
outcome score is the one component, as verl does) and ``extras["reward_weights"]`` (``[K]``, default all 1).
``norm_adv_by_std_in_grpo=False`` skips the group std division (verl's switch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from stablerl import STABLE, Params, hookimpl
from stablerl.ops import reward_component_matrix
from stablerl.params import StableRLError, check
from stablerl.primitives import singleton_convention

FORMS = ("verl", "trl")
_EPSILON = {"verl": 1e-6, "trl": 1e-4}
_WHITEN_EPS = 1e-8  # verl's masked_whiten


@dataclass
class GDPOParams(Params):
    """``form`` ("verl" / "trl"), the group-std ``epsilon`` (None: the form's, 1e-6 / 1e-4) and verl's
    ``norm_adv_by_std_in_grpo``."""

    form: str = "verl"
    epsilon: Optional[float] = None
    norm_adv_by_std_in_grpo: bool = True

    def validate(self) -> None:
        check(self.form in FORMS, f"form must be one of {', '.join(FORMS)}, got {self.form!r}")
        check(self.epsilon is None or self.epsilon >= 0, f"epsilon must be >= 0, got {self.epsilon}")


def _components(b, allow_nan: bool) -> torch.Tensor:
    comps = b.extras.get("reward_components")
    if comps is None:
        return b.scores.to(torch.float64).unsqueeze(-1)
    return reward_component_matrix(comps, b.response_mask, "gdpo", allow_nan=allow_nan)


def _weights(b, k: int, device) -> torch.Tensor:
    w = b.extras.get("reward_weights")
    if w is None:
        return torch.ones(k, dtype=torch.float64, device=device)
    w = torch.as_tensor(w, device=device).to(torch.float64).reshape(-1)
    if w.numel() != k:
        raise StableRLError(f"gdpo: extras['reward_weights'] has {w.numel()} values for {k} reward components")
    if not bool(torch.isfinite(w).all()):
        raise StableRLError("gdpo: extras['reward_weights'] has non-finite values")
    return w


def _group_moments(values: torch.Tensor, valid: torch.Tensor, gid: torch.Tensor):
    """Per-response group mean, unbiased std and count of the ``valid`` entries of ``values`` ``[B, K]``."""
    n_groups = int(gid.max().item()) + 1 if gid.numel() else 0
    v = torch.where(valid, values, torch.zeros_like(values))
    shape = (n_groups, values.shape[1])
    count = values.new_zeros(shape).index_add_(0, gid, valid.to(values.dtype))
    mean = values.new_zeros(shape).index_add_(0, gid, v) / count.clamp(min=1)
    dev = torch.where(valid, values - mean[gid], torch.zeros_like(values))
    var = values.new_zeros(shape).index_add_(0, gid, dev**2) / (count - 1).clamp(min=1)
    return mean[gid], var.sqrt()[gid], count[gid]


def gdpo_advantage(b, p: GDPOParams, ctx):
    trl = p.form == "trl"
    eps = _EPSILON[p.form] if p.epsilon is None else p.epsilon
    comps = _components(b, allow_nan=trl)
    w = _weights(b, comps.shape[1], comps.device)
    valid = ~torch.isnan(comps)
    mean, std, count = _group_moments(comps, valid, b.index)
    if trl:
        normed = comps - mean
        if p.norm_adv_by_std_in_grpo:
            normed = normed / (std + eps)
        normed = torch.where(valid & (count > 1), normed, torch.zeros_like(normed))  # TRL: NaN -> nansum 0
        summed = (normed * w).sum(-1)
        scored = valid.any(-1)
        n = scored.to(summed.dtype).sum()
        sums = ctx.all_reduce(torch.stack([torch.where(scored, summed, torch.zeros_like(summed)).sum(), n]), "sum")
        batch_mean = sums[0] / sums[1].clamp(min=1)
        sq = ctx.all_reduce(torch.where(scored, (summed - batch_mean) ** 2, torch.zeros_like(summed)).sum()
                            .reshape(1), "sum")[0]
        batch_std = torch.sqrt(sq / (sums[1] - 1).clamp(min=1))
        per_seq = torch.where(scored & (sums[1] > 1), (summed - batch_mean) / (batch_std + eps),
                              torch.zeros_like(summed))
        adv = b.on_response_tokens(per_seq.to(b.token_level_rewards.dtype))
        return adv, adv
    mean, std = singleton_convention(mean, std, count)
    normed = comps - mean
    if p.norm_adv_by_std_in_grpo:
        normed = normed / (std + eps)
    summed = (normed * w).sum(-1)
    # verl's masked_whiten over the batch's response tokens: each response counts once per token
    m = b.response_mask.to(torch.float64)
    lengths = m.sum(-1)
    sums = ctx.all_reduce(torch.stack([(summed * lengths).sum(), lengths.sum()]), "sum")
    if float(sums[1]) < 2:
        raise StableRLError("gdpo (form='verl'): whitening needs at least 2 response tokens in the batch (verl "
                            "refuses a mask sum of 0 or 1 too)")
    n = sums[1]
    tok_mean = sums[0] / (n + _WHITEN_EPS)  # verl's masked_mean adds 1e-8 to the count
    sq = ctx.all_reduce((((summed - tok_mean) ** 2) * lengths).sum().reshape(1), "sum")[0]
    var = sq / (n + _WHITEN_EPS) * (n / (n - 1))
    per_seq = (summed - tok_mean) * torch.rsqrt(var + _WHITEN_EPS)
    adv = b.on_response_tokens(per_seq.to(b.token_level_rewards.dtype))
    return adv, adv


@hookimpl
def register_advantage_estimators(register):
    register(
        name="gdpo",
        fn=gdpo_advantage,
        params=GDPOParams,
        paper="2601.05242",
        title="GDPO: per-reward-component group normalisation, weighted sum, batch normalisation",
        formula="A_k = (r_k - mean_g(r_k)) / (std_g(r_k) + eps); A = batch_norm(sum_k w_k A_k)",
        status=STABLE,
        optional_inputs=("reward_components", "reward_weights"),
        batch_statistics=True,
        reference="verl 0.9.1 core_algos.compute_gdpo_outcome_advantage (form='verl'); TRL 1.16 GRPOTrainer "
        "multi_objective_aggregation='normalize_then_sum' (form='trl')",
        notes="Reward components: extras['reward_components'] ([B, K] or a dict of [B] / [B, T] tensors) and "
        "extras['reward_weights'] ([K]); without components the outcome score is the only one (verl's fallback: "
        "then GRPO followed by the batch normalisation). verl: the adapter builds them from "
        "algorithm.gdpo_reward_keys / gdpo_reward_weights (verl's own keys: the reward function's extra fields). "
        "TRL: the adapter passes every reward function's reward and TRL's reward_weights. OpenRLHF: "
        "--algo.advantage.stablerl_reward_components names the reward function's extra_logs keys (and "
        "--algo.advantage.stablerl_reward_weights their weights); without it the outcome score. form='verl' whitens over "
        "tokens (rsqrt(var + 1e-8)), form='trl' normalises over responses (std + 1e-4); verl's is the default "
        "(the name is verl's built-in). The batch statistics are over all DP ranks (ctx.all_reduce).",
    )
