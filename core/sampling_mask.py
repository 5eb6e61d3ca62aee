"""Sampling-mask replay: ratios against a truncated-sampling rollout without the kept-mass bias.

When a rollout engine samples with ``top_k``, ``top_p`` or ``min_p``, the log-probs it returns are
normalised over the *kept* tokens, while the trainer's are normalised over the whole vocabulary. Every
ratio against the rollout (TIS/IcePop/MIS weights, bypass-mode PPO, TRL's vLLM IS correction, M2PO's
second moment) then carries the trainer's probability mass on the kept set, which is not a policy change
(TRL issue #6789; DeepSeek-V3.2, arXiv 2512.02556 §3.1, "Keep Sampling Mask")::

    log pi_trainer(y) - log mu_kept(y) = [log pi_trainer_kept(y) - log mu_kept(y)] + log M,
    M = sum over the kept set K of pi_trainer(v)

The replay measures ``log M`` in the trainer's old-log-prob (or first) forward, where the logits exist, and
expresses the rollout's log-prob over the full vocabulary, ``log mu(y) + log M``. Every consumer of
``rollout_log_prob`` then forms ``pi_trainer / pi_trainer_kept * mu_kept / mu ...`` correctly, with no change
to any loss: the trainer-vs-rollout part of a ratio is compared over the same kept set, and the ratio
between two trainer forwards (the PPO ratio) stays over the full vocabulary, where it is a policy change.

The kept set comes from the engine where it returns one (vLLM >= 0.28 ``return_sampling_mask``: per token
a CSR list of kept ids, :class:`SamplingMask`), or is recomputed from the trainer's logits with the engine's
rule (:class:`SamplingRule`, :func:`kept_mask`, vLLM's PyTorch reference order: temperature, min_p, top_k,
top_p). Nothing here stores a dense ``[B, T, V]`` tensor: masks are CSR, and ``log M`` is computed in
chunks of positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .params import StableRLError

__all__ = [
    "SamplingRule", "SamplingMask", "kept_mask", "processed_log_probs", "log_kept_mass",
    "rollout_log_prob_over_vocab", "REPLAY_OPTION", "ReplayDecision", "resolve_replay", "log_kept_mass_rows",
    "replay_rollout_log_prob", "KEPT_MASS_METRIC", "log_replay_decision", "concat_positions",
]

_CHUNK = 256  # positions per chunk: bounds the [chunk, V] temporaries


@dataclass(frozen=True)
class SamplingRule:
    """The engine's truncation rule (vLLM's SamplingParams names). ``top_k`` <= 0 or ``top_p`` = 1 or
    ``min_p`` = 0 switch that filter off; ``temperature`` is applied only by :func:`processed_log_probs`
    (the other functions take logits already divided by it, as verl, TRL and OpenRLHF compute them)."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise StableRLError(f"SamplingRule.temperature must be > 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or int(self.top_k) != self.top_k:
            raise StableRLError(f"SamplingRule.top_k must be an integer (<= 0 disables it), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise StableRLError(f"SamplingRule.top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.min_p <= 1:
            raise StableRLError(f"SamplingRule.min_p must be in [0, 1], got {self.min_p!r}")

    @property
    def truncates(self) -> bool:
        """Whether the rule keeps only part of the vocabulary (otherwise there is nothing to replay)."""
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


def kept_mask(logits: torch.Tensor, rule: SamplingRule) -> torch.Tensor:
    """Boolean ``[..., V]``: the tokens ``rule`` keeps, from temperature-scaled ``logits``.

    vLLM's PyTorch reference (``apply_top_k_top_p_pytorch``, min_p processor before it): min_p drops tokens
    with probability < min_p * max probability; top_k keeps the tokens whose logit is >= the k-th largest
    (ties kept); top_p sorts ascending and drops the prefix whose cumulative probability is <= 1 - top_p,
    always keeping the most likely token."""
    x = logits.detach().float()
    shape = x.shape
    x = x.reshape(-1, shape[-1]).clone()
    if rule.min_p > 0:
        probs = x.softmax(-1)
        x.masked_fill_(probs < probs.amax(-1, keepdim=True) * rule.min_p, float("-inf"))
    if 0 < rule.top_k < shape[-1]:
        kth = x.topk(int(rule.top_k), dim=-1).values[:, -1:]
        x.masked_fill_(x < kth, float("-inf"))
    if rule.top_p < 1:
        x_sort, idx = x.sort(dim=-1, descending=False)
        cum = x_sort.softmax(-1).cumsum(-1)
        drop = cum <= 1 - rule.top_p
        drop[:, -1] = False
        x_sort.masked_fill_(drop, float("-inf"))
        x = x.scatter(-1, idx, x_sort)
    return (x > float("-inf")).reshape(shape)


def processed_log_probs(raw_logits: torch.Tensor, rule: SamplingRule) -> torch.Tensor:
    """What an engine returns in vLLM's ``logprobs_mode="processed_logprobs"``: float32 log-softmax of the
    logits divided by the temperature, over the kept set only (-inf elsewhere). For stand-in engines."""
    scaled = raw_logits.float() / rule.temperature
    return scaled.masked_fill(~kept_mask(scaled, rule), float("-inf")).log_softmax(-1)


@dataclass(frozen=True)
class SamplingMask:
    """The engine's kept set per position, compact (CSR): the kept ids of position ``i`` (row-major over
    ``shape``, e.g. ``[B, T]``) are ``token_ids[offsets[i]:offsets[i + 1]]``. Never densified whole."""

    token_ids: torch.Tensor  # [nnz] integer
    offsets: torch.Tensor  # [N + 1] int64, N = prod(shape)
    shape: tuple

    def __post_init__(self) -> None:
        n = 1
        for s in self.shape:
            n *= int(s)
        if self.offsets.dim() != 1 or self.offsets.numel() != n + 1:
            raise StableRLError(f"SamplingMask.offsets must have prod(shape) + 1 = {n + 1} entries for shape "
                                f"{tuple(self.shape)}, got {tuple(self.offsets.shape)}")
        if self.offsets.numel() and (int(self.offsets[0]) != 0 or int(self.offsets[-1]) != self.token_ids.numel()
                                     or bool((self.offsets[1:] < self.offsets[:-1]).any())):
            raise StableRLError("SamplingMask.offsets must start at 0, be non-decreasing and end at "
                                f"len(token_ids) = {self.token_ids.numel()}")

    @classmethod
    def from_dense(cls, mask: torch.Tensor) -> "SamplingMask":
        """From a boolean ``[..., V]`` mask (tests and stand-in engines; an engine returns CSR directly)."""
        flat = mask.reshape(-1, mask.shape[-1]).bool()
        counts = flat.sum(-1)
        offsets = torch.zeros(flat.shape[0] + 1, dtype=torch.long, device=mask.device)
        offsets[1:] = counts.cumsum(0)
        return cls(flat.nonzero()[:, 1].to(torch.int32), offsets, tuple(mask.shape[:-1]))

    def dense_rows(self, start: int, end: int, vocab_size: int) -> torch.Tensor:
        """Boolean ``[end - start, V]`` for positions ``start:end`` (flattened), one chunk at a time."""
        lo, hi = int(self.offsets[start]), int(self.offsets[end])
        ids = self.token_ids[lo:hi].long()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise StableRLError(f"SamplingMask holds token ids outside [0, {vocab_size}): the mask is from "
                                "another vocabulary than the trainer's logits")
        rows = torch.repeat_interleave(torch.arange(end - start, device=ids.device),
                                       (self.offsets[start + 1:end + 1] - self.offsets[start:end]).to(ids.device))
        out = torch.zeros(end - start, vocab_size, dtype=torch.bool, device=ids.device)
        out[rows, ids] = True
        return out

    @property
    def nbytes(self) -> int:
        return self.token_ids.numel() * self.token_ids.element_size() + self.offsets.numel() * 8


def log_kept_mass(logits: torch.Tensor, token_ids: torch.Tensor, response_mask: torch.Tensor, *,
                  mask: Optional[SamplingMask] = None, rule: Optional[SamplingRule] = None) -> torch.Tensor:
    """``log M`` ``[B, T]``: log of the trainer's probability mass on the rollout's kept set, no gradient.

    ``logits`` ``[B, T, V]`` are the trainer's, already divided by the sampling temperature (their
    log-softmax is the trainer's log-prob). The kept set is the engine's ``mask`` where given; otherwise it
    is recomputed from ``logits`` with ``rule`` and, since the trainer's logits differ slightly from the
    engine's, the sampled token is added to it where the recomputation dropped it (an engine's mask that
    excludes the sampled token is an error). 0 at masked positions."""
    if (mask is None) == (rule is None):
        raise StableRLError("log_kept_mass needs exactly one of mask= (the engine's kept set) or rule= "
                            "(recompute it with the engine's SamplingRule)")
    if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(token_ids.shape):
        raise StableRLError(f"log_kept_mass: logits must be [B, T, V] matching token_ids {tuple(token_ids.shape)}, "
                            f"got {tuple(logits.shape)}")
    if mask is not None and tuple(mask.shape) != tuple(token_ids.shape):
        raise StableRLError(f"SamplingMask has shape {tuple(mask.shape)}, the batch's tokens {tuple(token_ids.shape)}")
    b, t, v = logits.shape
    flat_logits = logits.detach().reshape(b * t, v).float()
    flat_ids = token_ids.reshape(-1).long()
    valid = response_mask.reshape(-1).bool()
    out = torch.zeros(b * t, dtype=torch.float32, device=logits.device)
    for start in range(0, b * t, _CHUNK):
        end = min(start + _CHUNK, b * t)
        x, ids, ok = flat_logits[start:end], flat_ids[start:end], valid[start:end]
        if mask is not None:
            kept = mask.dense_rows(start, end, v).to(x.device)
            sampled_kept = kept.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
            bad = ok & ~sampled_kept
            if bool(bad.any()):
                pos = int(bad.nonzero()[0]) + start
                raise StableRLError(f"sampling mask: the kept set at position {divmod(pos, t)} (batch row, token) "
                                    f"excludes the sampled token {int(flat_ids[pos])}; the mask does not belong "
                                    "to these tokens")
        else:
            kept = kept_mask(x, rule)
            kept.scatter_(-1, ids.unsqueeze(-1), True)
        mass = x.masked_fill(~kept, float("-inf")).logsumexp(-1) - x.logsumexp(-1)
        out[start:end] = torch.where(ok, mass, torch.zeros_like(mass))
    return out.reshape(b, t)


def rollout_log_prob_over_vocab(rollout_log_prob: torch.Tensor, log_mass: torch.Tensor,
                                response_mask: torch.Tensor) -> torch.Tensor:
    """The rollout's kept-set log-probs expressed over the full vocabulary: ``log mu(y) + log M``. Feed this
    wherever the framework feeds ``rollout_log_prob``; masked positions are left as they were."""
    if rollout_log_prob.shape != log_mass.shape:
        raise StableRLError(f"rollout_log_prob {tuple(rollout_log_prob.shape)} and log kept mass "
                            f"{tuple(log_mass.shape)} differ in shape")
    adjusted = (rollout_log_prob.float() + log_mass.float()).to(rollout_log_prob.dtype)
    return torch.where(response_mask.bool(), adjusted, rollout_log_prob)


# ----------------------------------------------------------------------------- the adapters' shared glue

#: the user option every adapter reads (``auto`` | ``true`` | ``false``) and the metric each logs
REPLAY_OPTION = "sampling_mask_replay"
KEPT_MASS_METRIC = "sampling_mask/kept_mass"
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


@dataclass(frozen=True)
class ReplayDecision:
    """Whether an adapter replays the rollout's kept set, with which rule (None: the engine's masks), and why
    (the line of the start-up table)."""

    on: bool
    rule: Optional[SamplingRule]
    reason: str
    framework: str = ""

    def line(self) -> str:
        state = "on" if self.on else "off"
        rule = "" if self.rule is None else (f"; kept set recomputed with SamplingRule(temperature={self.rule.temperature}, "
                                             f"top_k={self.rule.top_k}, top_p={self.rule.top_p}, min_p={self.rule.min_p})")
        return f"stablerl/{self.framework}: sampling-mask replay {state} ({self.reason}){rule if self.on else ''}"


def resolve_replay(value, rule: Optional[SamplingRule], *, rollout_log_probs: bool, key: str, framework: str = "",
                   engine_masks: bool = False, rule_keys: str = "") -> ReplayDecision:
    """Resolve the user's ``sampling_mask_replay`` (``key`` names where it is set): ``auto`` (default, also None)
    is on when the rollout's ``rule`` truncates (or the batch carries the engine's masks) and rollout log-probs are
    used; ``true`` forces it on (an error without rollout log-probs: nothing to correct); ``false`` off."""
    text = "auto" if value is None else str(value).strip().lower()
    if isinstance(value, bool):
        text = "true" if value else "false"
    if text not in ("auto",) + _TRUE + _FALSE:
        raise StableRLError(f"{key} must be auto, true or false, got {value!r}")
    where = rule_keys or "the rollout's sampling settings"
    if text in _FALSE:
        return ReplayDecision(False, rule, f"{key}=false", framework)
    truncates = engine_masks or (rule is not None and rule.truncates)
    if text in _TRUE:
        if not rollout_log_probs:
            raise StableRLError(f"{key}=true, but this run forms no ratio against rollout log-probs (none are "
                                "collected): there is nothing to replay the kept set into")
        why = f"{key}=true" + ("" if truncates else f"; {where} keep the whole vocabulary, so log M = 0")
        return ReplayDecision(True, None if engine_masks else rule, why, framework)
    if not rollout_log_probs:
        return ReplayDecision(False, rule, f"auto: no rollout log-probs are used", framework)
    if not truncates:
        return ReplayDecision(False, rule, f"auto: {where} do not truncate (top_k <= 0, top_p = 1, min_p = 0)", framework)
    return ReplayDecision(True, None if engine_masks else rule,
                          "auto: the engine's kept sets" if engine_masks else f"auto: {where} truncate", framework)


_LOGGED_DECISIONS: set = set()


def log_replay_decision(decision: ReplayDecision) -> None:
    """Print the decision's line once per process (with the effective-settings tables, on stderr)."""
    import sys

    line = decision.line()
    if line not in _LOGGED_DECISIONS:
        _LOGGED_DECISIONS.add(line)
        print(line, file=sys.stderr, flush=True)


def log_kept_mass_rows(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, *,
                       mask: Optional[SamplingMask] = None, rule: Optional[SamplingRule] = None,
                       temperature: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``log M`` ``[n]`` at the positions ``rows`` of a packed ``[N, V]`` ``logits`` (a framework's no-padding
    layout), the sampled tokens ``token_ids`` ``[n]``; ``mask`` (if given) covers exactly these ``n`` positions in
    order; ``temperature`` ``[n]`` (if given) divides the raw logits of each row, as the framework's log-prob
    forward does. Rows are gathered one chunk at a time: no ``[n, V]`` copy."""
    if logits.dim() != 2 or rows.dim() != 1 or token_ids.shape != rows.shape:
        raise StableRLError(f"log_kept_mass_rows: logits [N, V], rows [n] and token_ids [n], got "
                            f"{tuple(logits.shape)}, {tuple(rows.shape)}, {tuple(token_ids.shape)}")
    if mask is not None and tuple(mask.shape) != (rows.numel(),):
        raise StableRLError(f"SamplingMask has shape {tuple(mask.shape)} for {rows.numel()} response positions")
    out = torch.zeros(rows.numel(), dtype=torch.float32, device=logits.device)
    rows = rows.to(logits.device)
    for start in range(0, rows.numel(), _CHUNK):
        end = min(start + _CHUNK, rows.numel())
        chunk = logits.detach().index_select(0, rows[start:end]).float()
        if temperature is not None:
            chunk = chunk / temperature[start:end].to(chunk.device, torch.float32).clamp(min=1e-8).unsqueeze(-1)
        chunk = chunk.unsqueeze(0)
        ids = token_ids[start:end].to(logits.device).unsqueeze(0)
        sub = None
        if mask is not None:
            lo, hi = int(mask.offsets[start]), int(mask.offsets[end])
            sub = SamplingMask(mask.token_ids[lo:hi], mask.offsets[start:end + 1] - lo, (1, end - start))
        out[start:end] = log_kept_mass(chunk, ids, torch.ones_like(ids, dtype=torch.bool), mask=sub,
                                       rule=None if sub is not None else rule)[0]
    return out


def concat_positions(masks, keep, what: str = "sampling mask") -> SamplingMask:
    """One CSR mask over the kept positions of several rows, row-major: ``masks[i]`` a 1-D :class:`SamplingMask` (row
    ``i``'s kept sets per position), ``keep[i]`` a boolean tensor over that row's positions (the response positions a
    framework computes ``log M`` at). ``what`` names the source in errors."""
    if len(masks) != len(keep):
        raise StableRLError(f"{what}: {len(masks)} masks for {len(keep)} rows")
    ids, counts = [], []
    for i, (mask, row_keep) in enumerate(zip(masks, keep)):
        if not isinstance(mask, SamplingMask) or len(mask.shape) != 1 or mask.shape[0] < row_keep.numel():
            raise StableRLError(f"{what}: row {i} must be a SamplingMask of shape [>= {row_keep.numel()}] (one kept set "
                                f"per position), got {type(mask).__name__} {getattr(mask, 'shape', '')}")
        for t in row_keep.nonzero().flatten().tolist():
            lo, hi = int(mask.offsets[t]), int(mask.offsets[t + 1])
            ids.append(mask.token_ids[lo:hi])
            counts.append(hi - lo)
    offsets = torch.zeros(len(counts) + 1, dtype=torch.long)
    offsets[1:] = torch.tensor(counts, dtype=torch.long).cumsum(0) if counts else offsets[1:]
    return SamplingMask(torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int32), offsets, (len(counts),))


def replay_rollout_log_prob(rollout_log_prob: torch.Tensor, log_mass: torch.Tensor, response_mask: torch.Tensor,
                            metrics: Optional[dict] = None) -> torch.Tensor:
    """:func:`rollout_log_prob_over_vocab`, and the mean kept mass over response tokens into ``metrics`` under
    :data:`KEPT_MASS_METRIC` (the adapters' one call)."""
    log_mass = log_mass.to(rollout_log_prob.device)
    valid = response_mask.bool()
    if metrics is not None and bool(valid.any()):
        metrics[KEPT_MASS_METRIC] = float(log_mass.float()[valid].exp().mean())
    return rollout_log_prob_over_vocab(rollout_log_prob, log_mass, response_mask)
