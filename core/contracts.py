"""The contracts between adapters, core and plugins.

Every algorithm is described by an :class:`AlgorithmSpec`: a name, a kind, the function that
computes it, a dataclass of typed hyper-parameters with the paper's defaults, and what it needs.
Tensors are laid out ``[B, T]`` (B responses, T response positions) and ``response_mask`` is 1
on the tokens that are trained on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from .fast_paths import row_sums_of_product

# Kinds of algorithm. Each has its own hook and its own function contract (see hookspecs.py).
POLICY_LOSS = "policy_loss"
ADVANTAGE_ESTIMATOR = "advantage_estimator"
AGGREGATION = "aggregation"
REWARD_SHAPER = "reward_shaper"
BATCH_FILTER = "batch_filter"
CONTROLLER = "controller"
ROUTER_FAMILY = "router_family"
ROLLOUT_CORRECTION = "rollout_correction"
TRAINER_HOOK = "trainer_hook"
KINDS = (
    POLICY_LOSS, ADVANTAGE_ESTIMATOR, AGGREGATION, REWARD_SHAPER, BATCH_FILTER, CONTROLLER, ROUTER_FAMILY,
    ROLLOUT_CORRECTION, TRAINER_HOOK,
)

# Status of an algorithm: checked against a reference implementation, implemented with stated
# assumptions, or listed but deliberately not implemented (the reason says why).
STABLE = "stable"
EXPERIMENTAL = "experimental"
UNAVAILABLE = "unavailable"
STATUSES = (STABLE, EXPERIMENTAL, UNAVAILABLE)

# Inputs beyond the always-present ones that an algorithm may declare it needs, with how each
# framework provides them (used in the error raised when one is missing).
OPTIONAL_INPUTS: dict[str, str] = {
    "rollout_log_prob": "inference-engine log-probs (verl: rollout.calculate_log_probs=True; "
    "TRL: vllm_importance_sampling_correction=True; OpenRLHF: --algo.advantage.is_correction_level != off)",
    "entropy": "per-token entropy of the current policy (verl: actor.calculate_entropy=True; TRL: always "
    "computed inside _compute_loss; OpenRLHF: the adapter asks the training forward for it, return_entropy)",
    "old_entropy": "per-token entropy of the old policy from the old-log-prob pass",
    "token_ids": "response token ids (verl: batch['responses']; TRL: completion_ids)",
    "index": "group ids of the responses (verl: uid; TRL: contiguous blocks of num_generations)",
    "turn_ids": "per-token turn/segment ids of multi-turn traces (agent loops)",
    "versions": "per-token policy version that generated each token, [B, T] integers (negative: not generated), "
    "counted in weight updates as AReaL does (stablerl.policy_versions; TRL: the generation round that generated the row)",
    "policy_version": "the version of the weights being trained (an integer, never below a trained token's version; "
    "TRL: the generation round of the batch being trained)",
    "sampling_mask": "the rollout engine's kept set per response token under top-k/top-p/min-p sampling "
    "(stablerl.sampling_mask: the engine's CSR SamplingMask, or its SamplingRule to recompute it); the adapter "
    "expresses rollout_log_prob over the full vocabulary with it before any ratio against the rollout is formed",
    "scores": "per-response scalar outcome rewards (labels)",
    "sum_pi_squared": "per-token sum over the vocabulary of the old policy's squared probabilities, [B, T] (verl: "
    "actor_rollout_ref.actor.calculate_sum_pi_squared=True)",
    "reward_baselines": "per-response reward of the greedy (argmax) response to its prompt, [B] (ReMax; verl's "
    "trainer generates and scores it only for its own adv_estimator=remax)",
    "pos_count": "per-response count of positive samples generated for its prompt over all sampling rounds "
    "(an adaptive sampler such as Reinforce-Ada's; no framework's stock trainer provides it)",
    "neg_count": "per-response count of negative samples generated for its prompt over all sampling rounds",
    "router_log_prob": "current-policy router log-probs at the old policy's top-k experts, [B, T, layers, k] (MoE; "
    "stablerl.routing_replay records them)",
    "old_router_log_prob": "old-policy router log-probs at its top-k experts, [B, T, layers, k] (MoE)",
    # CAPO (arXiv 2510.00819): the LM-head linear model of the update
    "hidden_states": "last-layer hidden states [B, T, H] at the positions that predict each response token "
    "(the input of the LM head; HF: output_hidden_states=True, hidden_states[-1] shifted like the logits)",
    "lm_head_weight": "LM-head (unembedding) weight [V, H], logits = hidden_states @ W^T (model.lm_head.weight)",
    "lm_head_exp_avg": "Adam first moment of the LM-head weight [V, H] (torch Adam/AdamW state['exp_avg'])",
    "lm_head_exp_avg_sq": "Adam second moment of the LM-head weight [V, H] (torch Adam/AdamW state['exp_avg_sq'])",
    # per-response extras of reward shapers and batch filters (the user's reward function / agent loop)
    "correct": "per-response correctness [B] bool (from the user's reward function / verifier)",
    "lengths": "per-response lengths [B] in tokens (e.g. response_mask.sum(-1))",
    "flawed": "per-response 'flawed positive' flag [B] bool (FAPO: a generative reward model found an error step)",
    "void_turn": "per-trajectory flag [B] bool: the trajectory has a void turn (SimpleTIR agent loop metadata)",
    # GDPO (arXiv 2601.05242): the reward function's components, before they are summed
    "reward_components": "per-response reward components [B, K] (or a dict of [B] / [B, T] tensors), before the "
    "weighted sum (verl: the fields named by algorithm.gdpo_reward_keys; TRL: each reward function's reward; "
    "OpenRLHF: the extra_logs keys named by --algo.advantage.stablerl_reward_components)",
    "reward_weights": "weights [K] of the reward components (verl: algorithm.gdpo_reward_weights; TRL: "
    "reward_weights; OpenRLHF: --algo.advantage.stablerl_reward_weights)",
    # GiGPO (arXiv 2505.10978): one batch row per agent step
    "anchor_ids": "per-row anchor-state ids [B] ints, one row per agent step: steps of the same episode group "
    "whose observed environment state is identical share an id (GiGPO's step-level groups; the agent loop "
    "hashes the observation)",
    "step_returns": "per-row discounted return from that agent step on, [B]: G_t = r_t + gamma G_{t+1} within "
    "its trajectory (GiGPO Eq. 5; the agent loop computes it from the step rewards)",
    # on-policy distillation: a frozen teacher (same tokenizer) scores the student's own samples
    "teacher_log_prob": "per-token log-prob under the frozen teacher of each sampled token, [B, T] (the framework's "
    "second model pointed at a teacher checkpoint with the student's tokenizer: verl's teacher loop teacher_logprobs; "
    "TRL: stablerl_teacher_model; OpenRLHF: --algo.advantage.stablerl_teacher_model)",
    "teacher_topk_log_prob": "the teacher's top-k next-token log-probs at each response position, [B, T, k] (an extra "
    "teacher forward)",
    "teacher_topk_ids": "the token ids of teacher_topk_log_prob, [B, T, k] ints",
    "student_topk_log_prob": "the current policy's log-probs at teacher_topk_ids, [B, T, k], with gradient (from the "
    "training forward's logits)",
    # what a trainer hook needs from the trainer loop (not tensors: capabilities an adapter provides)
    "params_view": "the policy's trainable parameters and optimizer between optimizer passes over one rollout "
    "batch, and control of how many passes run (a trainer hook's ParamsView and passes_per_batch)",
    "sampling_rounds": "a rollout loop that draws more responses for a prompt in further rounds when a trainer "
    "hook's samples_per_prompt asks for them",
    # what an entropy controller acts on every step (capabilities an adapter provides)
    "entropy_bonus": "an entropy bonus -c agg(H) in the loss whose coefficient c the controller sets before every "
    "step, stepped after it with the step's all-reduced mean entropy",
    "rollout_temperature": "the rollout's sampling temperature, set by the controller every step, and the "
    "controller's control samples in the batch",
    "loss_term": "a loss term of the controller's own on the training forward's entropies, added every step",
}

# inputs every policy loss receives anyway that an advantage estimator may declare (AdvantageBatch fields)
ESTIMATOR_ONLY_INPUTS: dict[str, str] = {
    "old_log_prob": "the old policy's per-token log-probs at the advantage step (verl: old_log_probs; TRL and "
    "OpenRLHF compute advantages before or without them)",
}


@dataclass
class Params:
    """Base class of every algorithm's hyper-parameter dataclass.

    Subclasses declare fields with the paper's defaults and may override :meth:`validate`.
    """

    def validate(self) -> None:  # pragma: no cover - default accepts everything
        return None

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


@dataclass
class NoParams(Params):
    """For algorithms without hyper-parameters."""


@dataclass
class AlgorithmSpec:
    """What a plugin registers: one algorithm."""

    name: str
    kind: str
    fn: Optional[Callable[..., Any]]
    params: type = NoParams
    paper: str = ""  # arXiv id, e.g. "2510.01161"
    title: str = ""
    formula: str = ""  # one line
    status: str = EXPERIMENTAL
    requires: tuple[str, ...] = ()  # names from OPTIONAL_INPUTS
    # inputs read when given, with a stated fallback when not (e.g. steer: old_entropy, else entropy):
    # adapters feed them where the framework has them and never refuse their absence. An input in
    # neither tuple is never read (stablerl.testing checks it), so adapters may leave it out.
    optional_inputs: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()
    reference: str = ""  # the reference implementation it was checked against
    notes: str = ""  # assumptions, conventions, or (for unavailable) the reason
    # policy losses: "per_token" returns a [B, T] loss that core weights by the framework's IS
    # weights and aggregates with loss_agg_mode; "scalar" returns the final loss (the plugin
    # aggregates with stablerl.ops.aggregate itself, e.g. sequence-level objectives).
    output: str = "per_token"
    # True when the algorithm takes statistics over the batch it is called with (ideally through
    # ctx.all_reduce / ctx.all_gather, so they are global over DP ranks; or per call by design,
    # stated in notes): its result then changes when a batch is split into gradient-accumulation
    # micro-batches. stablerl.testing skips its micro-batch check and, when it reduces through
    # ctx, checks that 2 DP ranks equal 1 rank instead.
    batch_statistics: bool = False
    # policy losses: True when the loss reads ``batch.seq_advantages`` whenever it is set (the
    # advantages are one per sequence). Core then hands it a cleaned ``[B, 1]`` tensor to broadcast
    # and builds the per-token ``batch.advantages`` only if something reads it. Opt in only when the
    # loss gives bit for bit the result it gives from ``batch.advantages`` (see docs/plugin-anatomy.md).
    seq_advantages: bool = False
    # scalar-output policy losses: "" when the loss aggregates with the caller's loss_agg_mode and
    # loss_agg_params (read from the batch); else the mode it always uses (its paper's form), or a
    # function of its hyper-parameters returning that mode ("" when they make it follow the caller).
    # Core then refuses loss_agg_params and warns once when another loss_agg_mode is asked for.
    aggregation: Any = ""
    # inputs the DEFAULT settings need, each with the setting that removes the need (e.g. reinforce_ada:
    # {"pos_count": "global_stat_est=False"}); `stablerl list` shows the algorithm as "partial" at most
    requires_unless: dict[str, str] = field(default_factory=dict)
    # policy losses: an optional fused form of ``fn`` (``stablerl.fused``): the same value and metrics
    # without an autograd graph and a closed-form backward, returning a FusedLoss (or None when it has
    # no fused form for this batch); core uses it where safe unless STABLERL_FUSED=0
    fused: Optional[Callable[..., Any]] = None
    plugin: str = ""  # filled by the registry: which plugin registered it

    def fixed_aggregation(self, params: Any = None) -> str:
        """The aggregation this loss always uses with ``params`` ("" when it follows loss_agg_mode)."""
        return self.aggregation(params) if callable(self.aggregation) else self.aggregation

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown kind {self.kind!r} for {self.name!r}; kinds are {list(KINDS)}")
        if self.status not in STATUSES:
            raise ValueError(f"unknown status {self.status!r} for {self.name!r}; statuses are {list(STATUSES)}")
        if self.status != UNAVAILABLE and self.fn is None:
            raise ValueError(f"{self.name!r}: only an 'unavailable' algorithm may have no function")
        if self.status == UNAVAILABLE and not self.notes:
            raise ValueError(f"{self.name!r}: an 'unavailable' algorithm must say why in notes")
        for r in self.requires:
            if r not in OPTIONAL_INPUTS and not (self.kind == ADVANTAGE_ESTIMATOR and r in ESTIMATOR_ONLY_INPUTS):
                raise ValueError(f"{self.name!r} requires unknown input {r!r}; known: {sorted(OPTIONAL_INPUTS)}")
        for r in self.optional_inputs:
            if r not in OPTIONAL_INPUTS:
                raise ValueError(f"{self.name!r} has unknown optional input {r!r}; known: {sorted(OPTIONAL_INPUTS)}")
            if r in self.requires:
                raise ValueError(f"{self.name!r}: input {r!r} is both required and optional")
        if self.output not in ("per_token", "scalar"):
            raise ValueError(f"{self.name!r}: output must be 'per_token' or 'scalar'")
        if not (isinstance(self.params, type) and issubclass(self.params, Params)):
            raise TypeError(f"{self.name!r}: params must be a Params dataclass subclass")
        for r in self.requires_unless:
            if r not in OPTIONAL_INPUTS:
                raise ValueError(f"{self.name!r}: requires_unless names unknown input {r!r}")
        if self.seq_advantages and self.kind != POLICY_LOSS:
            raise ValueError(f"{self.name!r}: only a policy loss may set seq_advantages")

    @property
    def reads(self) -> tuple[str, ...]:
        """Every input the algorithm may read: ``requires`` then ``optional_inputs``."""
        return tuple(self.requires) + tuple(self.optional_inputs)

    def defaults(self) -> dict[str, Any]:
        return dataclasses.asdict(self.params())


@dataclass
class PolicyLossBatch:
    """What a policy loss receives. All tensors ``[B, T]``; only ``log_prob`` carries gradient."""

    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor  # float 0/1
    rollout_log_prob: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    old_entropy: Optional[torch.Tensor] = None
    token_ids: Optional[torch.Tensor] = None
    index: Optional[torch.Tensor] = None  # [B] int64 group ids
    turn_ids: Optional[torch.Tensor] = None
    versions: Optional[torch.Tensor] = None
    policy_version: Optional[int] = None
    scores: Optional[torch.Tensor] = None  # [B]
    router_log_prob: Optional[torch.Tensor] = None  # [B, T, layers, k]
    old_router_log_prob: Optional[torch.Tensor] = None
    hidden_states: Optional[torch.Tensor] = None  # [B, T, H] (CAPO)
    lm_head_weight: Optional[torch.Tensor] = None  # [V, H] (CAPO)
    lm_head_exp_avg: Optional[torch.Tensor] = None  # [V, H] (CAPO, optimizer="adam")
    lm_head_exp_avg_sq: Optional[torch.Tensor] = None  # [V, H] (CAPO, optimizer="adam")
    # framework-computed rollout-correction weights (verl rollout_is_weights), detached
    is_weights: Optional[torch.Tensor] = None
    loss_agg_mode: str = "token-mean"
    # hyper-parameters of a registered aggregation named by loss_agg_mode (e.g. delta_l); a
    # scalar-output loss that follows loss_agg_mode passes both to stablerl.ops.aggregate
    loss_agg_params: Optional[dict[str, Any]] = None
    extras: dict[str, Any] = field(default_factory=dict)
    # [B, 1], only for losses registered with seq_advantages=True and only when the caller's
    # advantages are one per sequence ([B], or a [B, T] view expanded along T): the row's advantage,
    # +0.0 for a row without a valid token. Unlike ``advantages`` it is NOT zero on padding: a
    # per-token loss formed with it is nonzero there, which core's aggregation masks (a loss that
    # aggregates itself must pass the mask product, not ``zero_padded=True``).
    seq_advantages: Optional[torch.Tensor] = None
    # the caller's tensors (stablerl.fused.FusedInputs), set by core for a fused form only: its
    # backward may recompute a factor from them instead of keeping it
    fused_inputs: Any = None
    # bool [B, T], True where response_mask is 1: the mask core's aggregation keeps for backward, so a
    # loss that masks with it adds no mask of its own (set by core; None when a batch is built by hand).
    # It may be the caller's own tensor: never modify it in place; a batch copied with another
    # response_mask (dataclasses.replace) must replace it too
    valid_tokens: Optional[torch.Tensor] = None

    @property
    def bool_mask(self) -> torch.Tensor:
        """``response_mask`` as bool: ``valid_tokens`` when core set it, else a new bool copy."""
        return self.valid_tokens if self.valid_tokens is not None else self.response_mask.bool()

    @property
    def broadcast_advantages(self) -> torch.Tensor:
        """``seq_advantages`` ``[B, 1]`` when core set it (the loss opted in and the advantages are one
        per sequence), else the per-token ``advantages``: what a loss that broadcasts ``A`` multiplies by."""
        return self.seq_advantages if self.seq_advantages is not None else self.advantages


@dataclass
class AdvantageBatch:
    """What an advantage estimator receives."""

    token_level_rewards: torch.Tensor  # [B, T]
    response_mask: torch.Tensor  # [B, T] float 0/1
    index: torch.Tensor  # [B] int64 group ids, 0..n_groups-1
    entropy: Optional[torch.Tensor] = None
    old_log_prob: Optional[torch.Tensor] = None
    extras: dict[str, Any] = field(default_factory=dict)

    # set by core when every response_mask value is exactly 0 or 1 (checked once per batch)
    mask_is_binary: bool = field(default=False, init=False, repr=False, compare=False)
    # (token_level_rewards, response_mask, scores) of the last read: the [B, T] pass is paid once
    # per batch (core reads the scores first, for its finiteness check); a reassigned field recomputes
    _scores_cache: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)
    # (out, per_response) of the last :meth:`on_response_tokens` with a 0/1 mask: core need not mask
    # ``out`` again, and ``out`` is finite exactly where ``per_response`` is (every row has T > 0 entries)
    _masked_output: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)

    @property
    def scores(self) -> torch.Tensor:
        """Outcome score per response: the sum of its token-level rewards (verl's convention)."""
        rewards, mask = self.token_level_rewards, self.response_mask
        cached = self._scores_cache
        if cached is not None and cached[0] is rewards and cached[1] is mask:
            return cached[2]
        scores = None
        if self.mask_is_binary:
            # a product with a 0/1 mask differs from the masked select below only by the sign of zeros
            # on padding, which no sum sees (sums start from +0); exact when no product is NaN, i.e.
            # when the sums are finite (one vectorised pass instead of a bool cast and a select)
            scores = row_sums_of_product(rewards, mask)  # = (rewards * mask).sum(-1), no [B, T] temporary
            if not bool(torch.isfinite(scores).all()):
                scores = None
        if scores is None:
            # where, not a product: a non-finite reward on padding must not leak into the score
            zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
            scores = torch.where(mask.bool(), rewards, zero).sum(-1)
        self._scores_cache = (rewards, mask, scores)
        return scores

    def on_response_tokens(self, per_response: torch.Tensor) -> torch.Tensor:
        """``[B] -> [B, T]``: each response's value on its tokens, zero on padding. Core masks an
        estimator's outputs with ``response_mask``; with a 0/1 mask that is the identity on this
        tensor (``x * m * m == x * m`` bit for bit), so core skips that pass for it, and checks the
        ``[B]`` values for finiteness instead of the ``[B, T]`` tensor."""
        out = per_response.unsqueeze(-1) * self.response_mask
        self._masked_output = (out, per_response) if self.mask_is_binary else None
        return out


@dataclass
class RewardBatch:
    """What a reward shaper receives: one scalar reward per response, before the estimator."""

    scores: torch.Tensor  # [B]
    index: torch.Tensor  # [B] int64 group ids
    extras: dict[str, Any] = field(default_factory=dict)  # e.g. lengths, correct, flawed


@dataclass
class FilterBatch:
    """What a batch filter / sampler receives: the batch after advantage estimation."""

    advantages: torch.Tensor  # [B, T]
    response_mask: torch.Tensor  # [B, T] float 0/1
    index: torch.Tensor  # [B] int64 group ids
    scores: Optional[torch.Tensor] = None  # [B]
    entropy: Optional[torch.Tensor] = None  # [B, T]
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class FilterResult:
    """Which rows to train on, in order (a row may repeat when a sampler resamples), their
    token mask, and optionally new advantages for those rows. Nothing is dropped silently:
    ``metrics`` says how much was filtered."""

    rows: torch.Tensor  # [B'] int64 indices into the input batch
    response_mask: torch.Tensor  # [B', T]
    advantages: Optional[torch.Tensor] = None  # [B', T], None: unchanged
    metrics: dict[str, Any] = field(default_factory=dict)


class Controller:
    """Base of stateful controllers (entropy controllers): state persists across steps.

    Adapters keep one instance per run, call :meth:`step` once per training step with the
    statistics it asks for, persist :meth:`state_dict` with the framework's checkpoint, and
    keep it identical across ranks (the statistics must already be all-reduced).
    """

    def __init__(self, params: Params):
        self.params = params

    def step(self, **stats: Any) -> dict[str, Any]:  # pragma: no cover - interface
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:  # pragma: no cover - interface
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:  # pragma: no cover - interface
        raise NotImplementedError


@dataclass
class ParamsView:
    """The policy's trainable parameters (this rank's local shards under FSDP) and its optimizer, as an
    adapter hands them to a :class:`TrainerHook`. ``parameters()`` yields the same tensors in the same
    order on every call; a hook changes them in place under ``torch.no_grad()``."""

    parameters: Callable[[], Any]  # () -> iterable of torch.Tensor (requires_grad ones)
    optimizer: Any = None  # torch.optim.Optimizer or None where the framework hides it


@dataclass
class PromptStats:
    """What an adaptive sampler knows about one prompt after a sampling round."""

    drawn: int  # responses generated for the prompt so far (all rounds)
    positive: int  # of which rewarded above the sampler's threshold
    rounds: int  # sampling rounds done for the prompt


class TrainerHook:
    """Base of trainer-level techniques: what happens between optimizer passes over one rollout batch,
    and how many responses to draw for a prompt.

    Adapters keep one instance per run and, per rollout batch, call :meth:`passes_per_batch` (how many
    full optimizer passes over the batch, each one pass of the framework's usual update), then
    :meth:`before_batch` with a :class:`ParamsView`, then :meth:`after_pass` after each pass with the
    view and the pass's all-reduced statistics (``entropy``: mean token entropy); they persist
    :meth:`state_dict` with the framework's checkpoint. An adaptive sampler answers
    :meth:`samples_per_prompt`. The defaults are a no-op hook (one pass, the framework's sample count).
    """

    def __init__(self, params: Params):
        self.params = params

    def passes_per_batch(self) -> int:
        return 1

    def before_batch(self, view: ParamsView) -> None:
        return None

    def after_pass(self, view: ParamsView, pass_index: int, **stats: Any) -> dict[str, Any]:
        return {}

    def samples_per_prompt(self, stats: PromptStats) -> int:
        """How many more responses to draw for this prompt (0: done). Default: none beyond the first round."""
        return 0

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None
