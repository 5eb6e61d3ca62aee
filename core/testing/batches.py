"""Synthetic batches: random right-padded policy-loss and estimator batches with every declared input,
and the row / padding transformations the properties apply to them."""

from __future__ import annotations

import zlib
from typing import Any, Mapping, Optional

import numpy as np
import torch

from ..api import compute_advantage, compute_policy_loss
from ..contracts import AlgorithmSpec
from .common import _fail, _fresh_ctx


# sizes of the synthetic batches
B_LOSS, T_LOSS, GROUP_LOSS = 8, 12, 2


B_ADV, T_ADV, GROUP_ADV = 12, 10, 4


EXTRA_COLUMNS = 5


POLICY_VERSION = 10


_FLOAT_INPUTS = ("log_prob", "old_log_prob", "advantages", "rollout_log_prob", "entropy", "old_entropy")


def _lengths(B: int, T: int, g: torch.Generator) -> torch.Tensor:
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    if B > 0:
        lengths[0] = T
    if B > 1:
        lengths[1] = 1  # a row with a single valid token
    return lengths


def _synth_input(name: str, B: int, T: int, g: torch.Generator, dtype: torch.dtype,
                 old_log_prob: Optional[torch.Tensor] = None) -> Any:
    """A plausible value for a declared input (``None`` if the suite does not know it)."""
    if old_log_prob is None:
        old_log_prob = -(torch.rand(B, T, generator=g, dtype=dtype) * 2 + 0.05)
    if name == "old_log_prob":
        return old_log_prob
    if name == "rollout_log_prob":
        return (old_log_prob + 0.05 * torch.randn(B, T, generator=g, dtype=dtype)).clamp(max=-1e-4)
    if name in ("entropy", "old_entropy"):
        return torch.rand(B, T, generator=g, dtype=dtype) * 1.5 + 0.05
    if name == "token_ids":
        return torch.randint(0, 1000, (B, T), generator=g)
    if name == "index":
        return torch.arange(B) // GROUP_LOSS
    if name == "turn_ids":
        return (torch.arange(T) // 4).unsqueeze(0).expand(B, T).clone()
    if name == "versions":
        return POLICY_VERSION - torch.randint(0, 3, (B, T), generator=g)
    if name == "policy_version":
        return POLICY_VERSION
    if name == "scores":
        return torch.randint(0, 2, (B,), generator=g).to(dtype)
    if name == "sum_pi_squared":  # sum_v pi(v)^2 in (0, 1]
        return torch.rand(B, T, generator=g, dtype=dtype) * 0.9 + 0.05
    if name == "reward_baselines":  # a greedy response's reward per row (ReMax)
        return torch.rand(B, generator=g, dtype=dtype)
    if name in ("router_log_prob", "old_router_log_prob"):  # [B, T, layers=2, k=2], shared per seed
        gr = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=g)))
        old = torch.log(torch.rand(B, T, 2, 2, generator=gr, dtype=torch.float64) * 0.5 + 0.05)
        if name == "old_router_log_prob":
            return old.to(dtype)
        return (old + 0.05 * torch.randn(B, T, 2, 2, generator=gr, dtype=torch.float64)).clamp(max=0).to(dtype)
    if name == "hidden_states":  # [B, T, H=8] (CAPO's LM-head model)
        return torch.randn(B, T, 8, generator=g, dtype=dtype)
    if name == "lm_head_weight":  # [V=1000, H=8]: covers the synthesised token_ids
        return 0.5 * torch.randn(1000, 8, generator=g, dtype=dtype)
    if name == "teacher_log_prob":  # a teacher's log-prob of each sampled token, near the student's
        return (old_log_prob + 0.3 * torch.randn(B, T, generator=g, dtype=dtype)).clamp(max=-1e-4)
    if name in ("teacher_topk_log_prob", "student_topk_log_prob"):  # [B, T, k=4] of 4 ids out of 8, mass < 1
        return torch.log_softmax(torch.randn(B, T, 8, generator=g, dtype=torch.float64), -1)[..., :4].to(dtype)
    if name == "teacher_topk_ids":
        return torch.randperm(8, generator=g)[:4].expand(B, T, 4).clone()
    if name == "anchor_ids":  # [B] GiGPO anchor states: 3 ids, so that groups share some
        return torch.randint(0, 3, (B,), generator=g)
    if name == "step_returns":  # [B] discounted returns of agent steps
        return torch.randn(B, generator=g, dtype=dtype)
    return None


def _resolve_extra(name: str, inputs: Mapping[str, Any], base: dict, g: torch.Generator, spec) -> Any:
    if name in inputs:
        value = inputs[name]
        return value(base) if callable(value) else value
    B, T = base["response_mask"].shape
    dtype = base["old_log_prob"].dtype if "old_log_prob" in base else torch.float32
    value = _synth_input(name, B, T, torch.Generator().manual_seed(zlib.crc32(name.encode()) % 1000 + int(g.initial_seed())),
                         dtype, base.get("old_log_prob"))
    if value is None:
        _fail(spec, "declared_inputs", f"declares input {name!r}, which the suite cannot synthesise; "
              f"pass inputs={{{name!r}: value_or_fn}}")
    return value


def policy_batch(spec: AlgorithmSpec, seed: int = 0, B: int = B_LOSS, T: int = T_LOSS,
                 dtype: torch.dtype = torch.float64, inputs: Optional[Mapping[str, Any]] = None) -> dict:
    """A random right-padded policy-loss batch with every input ``spec`` declares (and ``inputs``)."""
    g = torch.Generator().manual_seed(seed)
    old = -(torch.rand(B, T, generator=g, dtype=torch.float64) * 2 + 0.05)
    lp = (old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    adv = torch.randn(B, generator=g, dtype=torch.float64).unsqueeze(-1).expand(B, T).clone()
    mask = torch.arange(T).unsqueeze(0) < _lengths(B, T, g).unsqueeze(1)
    base = {"log_prob": lp, "old_log_prob": old, "advantages": adv, "response_mask": mask}
    inputs = dict(inputs or {})
    for name in list(spec.requires) + [k for k in inputs if k not in spec.requires]:
        base[name] = _resolve_extra(name, inputs, base, g, spec)
    return {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in base.items()}


def advantage_batch(spec: AlgorithmSpec, seed: int = 0, B: int = B_ADV, T: int = T_ADV, group: int = GROUP_ADV,
                    dtype: torch.dtype = torch.float32, inputs: Optional[Mapping[str, Any]] = None) -> dict:
    """Outcome rewards on the last valid token, verl-style string uids, groups of ``group``."""
    g = torch.Generator().manual_seed(seed)
    lengths = _lengths(B, T, g)
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    scores = torch.randint(0, 2, (B,), generator=g).double()
    continuous = torch.rand(group, generator=g, dtype=torch.float64) * 2 - 0.5
    scores[group: 2 * group] = continuous[: max(0, min(group, B - group))]  # the second group: continuous scores
    rewards = torch.zeros(B, T, dtype=torch.float64)
    rewards[torch.arange(B), lengths - 1] = scores
    uid = np.array([f"prompt-{i // group}" for i in range(B)], dtype=object)
    base = {"token_level_rewards": rewards.to(dtype), "response_mask": mask, "index": uid}
    inputs = dict(inputs or {})
    for name in list(spec.requires) + [k for k in inputs if k not in spec.requires]:
        if name != "index":
            base[name] = _resolve_extra(name, inputs, base, g, spec)
    return base


def _token_aligned(v: Any, shape) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() >= 2 and tuple(v.shape[:2]) == tuple(shape)


def _garbage_like(name: str, t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Finite nonsense for padded positions (what a framework may leave there)."""
    if not t.is_floating_point():
        return torch.randint(0, 1000, t.shape, generator=g).to(t.dtype) if name == "token_ids" else t.clone()
    u = torch.rand(t.shape, generator=g, dtype=torch.float64)
    if name.endswith("log_prob"):
        out = -30 * u
    elif name in ("entropy", "old_entropy"):
        out = 20 * u
    else:
        out = 100 * u - 50
    return out.to(t.dtype)


def _fill_padding(data: dict, seed: int = 99) -> dict:
    """The same batch with finite garbage in every padded position."""
    g = torch.Generator().manual_seed(seed)
    pad = ~data["response_mask"].bool()
    out = dict(data)
    for k, v in data.items():
        if k != "response_mask" and _token_aligned(v, pad.shape):
            p = pad.reshape(pad.shape + (1,) * (v.dim() - 2))
            out[k] = torch.where(p, _garbage_like(k, v, g), v)
    return out


def _pad_columns(data: dict, extra: int, seed: int = 7) -> dict:
    g = torch.Generator().manual_seed(seed)
    shape = data["response_mask"].shape
    out = {}
    for k, v in data.items():
        if _token_aligned(v, shape):
            cols = torch.zeros((shape[0], extra) + tuple(v.shape[2:]), dtype=v.dtype)
            if k != "response_mask":
                cols = _garbage_like(k, cols, g)
            out[k] = torch.cat([v, cols], dim=1)
        else:
            out[k] = v
    return out


def _rows(data: dict, rows: Any, B: int) -> dict:
    """Select rows (a slice or an index tensor) of every per-response entry, also inside ``extras``."""
    out = {}
    for k, v in data.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == B:
            out[k] = v[rows]
        elif isinstance(v, np.ndarray) and v.shape[:1] == (B,):
            out[k] = v[rows.numpy() if isinstance(rows, torch.Tensor) else rows]
        elif isinstance(v, dict):
            out[k] = _rows(v, rows, B)
        else:
            out[k] = v
    return out


def _run_loss(spec, data, params, ctx=None, requires_grad=True, **overrides):
    kw = dict(data)
    kw.update(overrides)
    lp = kw["log_prob"].detach().clone().requires_grad_(requires_grad)
    kw["log_prob"] = lp
    loss, metrics = compute_policy_loss(spec.name, ctx=ctx if ctx is not None else _fresh_ctx(), **kw, **params)
    return loss, metrics, lp


def _run_adv(spec, data, params):
    return compute_advantage(spec.name, ctx=_fresh_ctx(), **data, **params)
