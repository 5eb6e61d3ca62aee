"""Routes that travel with a framework's batch rows, one row at a time.

A framework that splits, shuffles and re-batches its rows as Python lists (OpenRLHF's replay buffer, its
``Experience.mm_train_inputs``) carries one :class:`SampleRoutes` per row; the engine's raw per-row array
(R3) travels as :class:`RolloutRoutes` until the trainer's routers are known. :class:`RowLayout` converts
between those rows and the :class:`~.routes.Routes` of one forward pass (padded ``[B, T]`` or packed).
Also here: the vLLM version that returns routes (``enable_return_routed_experts``, vLLM PR #28284), and the
routes of a multi-call agent trajectory (:class:`RecordingEngine`: the last engine call's, aligned and checked).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ..params import StableRLError
from .routes import Routes, RoutesMismatchError, index_dtype

#: vLLM PR #28284 (``enable_return_routed_experts``, ``CompletionOutput.routed_experts``) shipped in 0.14
VLLM_ROUTES_MIN = (0, 14)


def vllm_version() -> Optional[str]:
    """The vLLM version of this process: an imported ``vllm``'s ``__version__``, else the installed
    distribution, else that of ``import vllm``; None when there is no vLLM."""
    module = sys.modules.get("vllm")
    if getattr(module, "__version__", None):
        return str(module.__version__)
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("vllm")
    except (ImportError, PackageNotFoundError):
        pass
    try:
        import vllm
    except Exception:  # noqa: BLE001  (a broken install is reported as missing)
        return None
    return getattr(vllm, "__version__", None)


def check_vllm_routes(what: str, found: Optional[str] = None) -> str:
    """Raise a :class:`StableRLError` naming ``what`` (e.g. the flag that selected R3) unless vLLM can return
    routed experts (vllm >= 0.14); returns the version found."""
    found = found if found is not None else vllm_version()
    need = ".".join(map(str, VLLM_ROUTES_MIN))
    if found is None:
        raise StableRLError(f"{what} needs vLLM >= {need} (enable_return_routed_experts, vLLM PR #28284) in the "
                            "rollout engines; vLLM is not installed")
    nums = [int(x) for x in re.findall(r"\d+", str(found).split("+")[0])[:2]]
    if tuple((nums + [0, 0])[:2]) < VLLM_ROUTES_MIN:
        raise StableRLError(f"{what} needs vLLM >= {need} (enable_return_routed_experts, vLLM PR #28284; "
                            f"hybrid-attention models need >= 0.22), found vllm {found}; use R2 or upgrade vLLM")
    return str(found)


@dataclass
class RolloutRoutes:
    """One row's engine routes before conversion: vLLM's ``routed_experts`` (``[R, num_hidden_layers, k]``,
    absolute decoder layers, rows of tokens ``0..R-1``, already cut to the row) and the row's token count.
    ``routed_experts`` None: every token routed natively (the engine was never called)."""

    routed_experts: Any
    num_tokens: int


@dataclass
class SampleRoutes:
    """The routes of one sample's ``attention_mask == 1`` tokens, in order: ``indices [n, L, k]`` (uint8 up to
    256 experts, as :meth:`Routes.batch_tensor`). Not a tensor, so a framework's ``to(device)`` of a batch
    leaves it on the CPU."""

    indices: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.indices.shape[0])


def _sample(seq: Routes) -> SampleRoutes:
    return SampleRoutes(Routes.pad_batch([seq]).batch_tensor()[0][0])


@dataclass
class RowLayout:
    """The trainer's routers (``num_experts``, MoE ``layer_ids``, ``top_k``) and whether its forward packs the
    samples (``packing``): what converting per-row routes to and from one forward pass needs."""

    num_experts: int
    layer_ids: tuple
    packing: bool
    top_k: Optional[int] = None

    def split(self, routes: Routes, attention_mask: torch.Tensor) -> list[SampleRoutes]:
        """Routes of one forward (padded ``[B, T]`` or packed ``(1, N)``) -> one :class:`SampleRoutes` per sample."""
        mask = attention_mask.detach().bool().cpu()
        if routes.batch_shape != tuple(mask.shape):  # packed: the N = mask.sum() kept tokens, row-major
            routes = routes.pad(mask)
        return [_sample(seq) for seq in routes.unpad(mask).sequences()]

    def join(self, samples: Sequence[SampleRoutes], attention_mask: torch.Tensor) -> Routes:
        """Per-sample routes -> the routes of one forward over ``attention_mask`` (padded, or packed)."""
        mask = attention_mask.detach().bool().cpu()
        for i, (s, n) in enumerate(zip(samples, mask.sum(-1).tolist())):
            if s.num_tokens != n:
                raise RoutesMismatchError(
                    f"routing replay: row {i} carries routes for {s.num_tokens} tokens but its attention_mask has {n}")
        seqs = [Routes.from_batch_tensor(s.indices.unsqueeze(0), num_experts=self.num_experts,
                                         layer_ids=self.layer_ids) for s in samples]
        padded = Routes.pack(seqs).pad(mask)  # row-major mask order = the samples one after the other
        return padded.unpad(mask) if self.packing else padded

    def from_rollout(self, rows: Sequence[Any], what: str) -> list[SampleRoutes]:
        """R3: each row's :class:`RolloutRoutes` -> its :class:`SampleRoutes` (tokens after the engine's last
        call, and rows without an engine call, are routed natively). ``what`` names the feature in errors."""
        out = []
        for i, row in enumerate(rows):
            if not isinstance(row, RolloutRoutes):
                raise StableRLError(f"{what}: row {i} carries {type(row).__name__} instead of the rollout's routes "
                                    "(they were not attached to the row, or another component replaced them)")
            n = int(row.num_tokens)
            if row.routed_experts is None:  # zero rows: not distinct, so routed natively (k >= 2)
                out.append(SampleRoutes(torch.zeros(n, len(self.layer_ids), self.top_k,
                                                    dtype=index_dtype(self.num_experts))))
                continue
            m = len(row.routed_experts)
            if m > n:
                raise RoutesMismatchError(f"{what}: row {i} carries {m} routed rows for {n} tokens")
            seq = Routes.from_vllm(row.routed_experts, moe_layers=self.layer_ids, num_experts=self.num_experts,
                                   num_tokens=n if m == n else m + 1)
            if seq.top_k != self.top_k:
                raise RoutesMismatchError(f"{what}: row {i}: vLLM returned top-{seq.top_k} routes, the trainer's "
                                          f"routers pick {self.top_k} experts (is vLLM serving the same model?)")
            out.append(_sample(seq.extend(n - seq.num_tokens) if seq.num_tokens < n else seq))
        return out


class RecordingEngine:
    """An async vLLM-style engine (``await generate(prompt_token_ids, ...)`` -> ``RequestOutput``) that records every
    call, so an agent's multi-call trajectory can be given the routes of its last call (:meth:`trajectory_routes`).
    Every other attribute is the engine's."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.calls: list = []  # (prompt token ids, RequestOutput)

    async def generate(self, prompt_token_ids, *args, **kwargs):
        out = await self._engine.generate(prompt_token_ids, *args, **kwargs)
        self.calls.append((list(prompt_token_ids), out))
        return out

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def trajectory_routes(self, tokens: Sequence[int], what: str = "routing replay R3", hint: str = "") -> Any:
        """vLLM's ``routed_experts`` of the last call, checked against the trajectory's final ``tokens``
        (:func:`last_call_routes`); None when the engine was never called."""
        if not self.calls:
            return None
        prompt_ids, out = self.calls[-1]
        completion = out.outputs[0]
        return last_call_routes(prompt_ids, completion.token_ids, getattr(completion, "routed_experts", None), tokens,
                                what, calls=len(self.calls), hint=hint)


def last_call_routes(prompt_ids: Sequence[int], completion_ids: Sequence[int], routed: Any,
                     tokens: Sequence[int], what: str, calls: int = 1, hint: str = "") -> Any:
    """vLLM's ``routed_experts`` of a trajectory's last engine call (``calls`` calls in all), checked against
    the trajectory's final ``tokens``: every turn re-sends the whole history, so that call's prompt +
    completion must begin them, and vLLM returns one row per forwarded token (all but the last sampled one).
    ``hint``: what to check when vLLM returned none (how the framework asks for them)."""
    if routed is None:
        raise StableRLError(f"{what}: vLLM returned no routed_experts. The engine needs "
                            "enable_return_routed_experts=True (vllm>=0.14)" + (f": {hint}" if hint else ""))
    covered = list(prompt_ids) + list(completion_ids)
    if list(tokens)[:len(covered)] != covered:
        raise StableRLError(
            f"{what}: the agent's final tokens do not begin with the prompt + completion of its last vLLM call "
            f"({calls} calls; the executor rewrote or truncated the history), so vLLM's routes cannot be "
            "aligned to the trainer's sequence. R3 needs executors whose every call re-sends the whole history")
    if len(routed) not in (len(covered) - 1, len(covered)):
        raise RoutesMismatchError(
            f"{what}: vLLM returned {len(routed)} routed rows for {len(covered)} prompt + completion tokens "
            f"(expected {len(covered) - 1}: the last sampled token is never forwarded)")
    return routed


__all__ = ["VLLM_ROUTES_MIN", "vllm_version", "check_vllm_routes", "RolloutRoutes", "SampleRoutes", "RowLayout",
           "RecordingEngine", "last_call_routes"]
