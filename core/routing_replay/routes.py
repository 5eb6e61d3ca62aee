"""Recorded routes: :class:`Routes` (top-k expert indices per MoE layer and token), their layouts and
conversions (vLLM, SGLang, padded batches), and :func:`mismatch_fraction`."""

from __future__ import annotations

import base64
from typing import Optional, Sequence

import torch

from ..params import StableRLError
from .families import find_routers


class RoutesMismatchError(StableRLError):
    """Routes that do not fit the batch or the model (token count, MoE layers, top-k, experts)."""


def index_dtype(num_experts: int) -> torch.dtype:
    """uint8 for at most 256 experts, uint16 up to 65536 (vLLM's returned dtype)."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 65536:
        return torch.uint16
    raise StableRLError(f"routing replay supports at most 65536 experts, got {num_experts}")


def _distinct_rows(idx: torch.Tensor) -> torch.Tensor:
    """bool [..., ] True where the k indices of a row are pairwise distinct (always True for k=1)."""
    k = idx.shape[-1]
    if k <= 1:
        return torch.ones(idx.shape[:-1], dtype=torch.bool, device=idx.device)
    x = idx.long()
    eq = x.unsqueeze(-1) == x.unsqueeze(-2)  # [..., k, k]
    return eq.sum(dim=(-1, -2)) == k


class Routes:
    """Recorded top-k expert indices per MoE layer and token.

    ``indices``: ``[L, N, k]`` (uint8 if ``num_experts <= 256`` else uint16), layer-major.
    ``batch_shape``: ``(B, T)`` when the N tokens are a ``[B, T]`` batch flattened row-major (the
    order the router sees a padded batch in); ``None`` for a flat token stream.
    ``cu_seqlens``: ``[S+1]`` int64 boundaries when the tokens are S packed sequences (remove-padding
    layout, batch_shape ``(1, N)``).
    ``layer_ids``: absolute decoder-layer index of each of the L MoE layers (informational).
    ``valid``: optional bool ``[L, N]``. For k >= 2 invalid rows are stored as all-zero rows (not
    distinct) and no mask is kept; for k = 1 the mask is kept (None = all valid).
    """

    __slots__ = ("indices", "num_experts", "batch_shape", "cu_seqlens", "layer_ids", "_mask")

    def __init__(
        self,
        indices: torch.Tensor,
        *,
        num_experts: Optional[int] = None,
        batch_shape: Optional[Sequence[int]] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        layer_ids: Optional[Sequence[int]] = None,
        valid: Optional[torch.Tensor] = None,
    ):
        if not isinstance(indices, torch.Tensor):
            indices = torch.as_tensor(indices)
        if indices.dim() != 3:
            raise RoutesMismatchError(f"Routes.indices must be [num_layers, num_tokens, top_k], got shape {tuple(indices.shape)}")
        if indices.dtype.is_floating_point or indices.dtype == torch.bool:
            raise RoutesMismatchError(f"Routes.indices must be integer, got {indices.dtype}")
        L, N, k = indices.shape
        if k < 1:
            raise RoutesMismatchError("Routes: top_k must be >= 1")
        wide = indices.long() if indices.dtype != torch.long else indices
        if wide.numel():
            lo, hi = int(wide.min()), int(wide.max())
            if lo < 0:
                raise RoutesMismatchError(f"Routes: negative expert index {lo} (mark missing rows invalid instead)")
        else:
            hi = 0
        if num_experts is None:
            num_experts = hi + 1
        elif hi >= num_experts:
            raise RoutesMismatchError(f"Routes: expert index {hi} out of range for num_experts={num_experts}")
        dtype = index_dtype(num_experts)
        if valid is not None:
            valid = torch.as_tensor(valid, dtype=torch.bool, device=indices.device)
            if valid.dim() == 1:
                valid = valid.unsqueeze(0).expand(L, N)
            if tuple(valid.shape) != (L, N):
                raise RoutesMismatchError(f"Routes: valid must be [L, N] = {(L, N)} or [N], got {tuple(valid.shape)}")
            if k >= 2:
                wide = wide.masked_fill(~valid.unsqueeze(-1), 0)
                valid = None
            elif bool(valid.all()):
                valid = None
            else:
                valid = valid.contiguous().clone()
        self.indices = wide.to(dtype).contiguous()
        self.num_experts = int(num_experts)
        if batch_shape is not None:
            batch_shape = (int(batch_shape[0]), int(batch_shape[1]))
            if batch_shape[0] * batch_shape[1] != N:
                raise RoutesMismatchError(f"Routes: batch_shape {batch_shape} does not hold {N} tokens")
        self.batch_shape = batch_shape
        if cu_seqlens is not None:
            cu_seqlens = torch.as_tensor(cu_seqlens, dtype=torch.long).cpu()
            if cu_seqlens.dim() != 1 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != N or bool((cu_seqlens.diff() < 0).any()):
                raise RoutesMismatchError(f"Routes: cu_seqlens must rise from 0 to num_tokens={N}, got {cu_seqlens.tolist()}")
        self.cu_seqlens = cu_seqlens
        self.layer_ids = tuple(int(i) for i in layer_ids) if layer_ids is not None else tuple(range(L))
        if len(self.layer_ids) != L:
            raise RoutesMismatchError(f"Routes: {len(self.layer_ids)} layer_ids for {L} layers")
        self._mask = valid

    # ---- basic properties ---------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.indices.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.indices.shape[1]

    @property
    def top_k(self) -> int:
        return self.indices.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.indices.dtype

    @property
    def device(self) -> torch.device:
        return self.indices.device

    @property
    def valid(self) -> torch.Tensor:
        """bool ``[L, N]``: rows that are replayed (others are routed natively)."""
        v = _distinct_rows(self.indices)
        if self._mask is not None:
            v = v & self._mask.to(v.device)
        return v

    @property
    def token_valid(self) -> torch.Tensor:
        """bool ``[N]``: tokens whose route is valid in every MoE layer."""
        return self.valid.all(0)

    @property
    def nbytes(self) -> int:
        """Storage in bytes (indices, plus the mask kept only for top-1 routes with invalid rows)."""
        n = self.indices.numel() * self.indices.element_size()
        return n + (self._mask.numel() if self._mask is not None else 0)

    @property
    def bytes_per_token(self) -> float:
        return self.nbytes / max(self.num_tokens, 1)

    def __repr__(self) -> str:
        extra = f", batch_shape={self.batch_shape}" if self.batch_shape else ""
        extra += f", sequences={len(self.cu_seqlens) - 1}" if self.cu_seqlens is not None else ""
        return (
            f"Routes(layers={self.num_layers}, tokens={self.num_tokens}, top_k={self.top_k}, "
            f"num_experts={self.num_experts}, dtype={self.dtype}{extra})"
        )

    def _new(self, indices, *, batch_shape=None, cu_seqlens=None, valid=None) -> "Routes":
        return Routes(indices, num_experts=self.num_experts, batch_shape=batch_shape, cu_seqlens=cu_seqlens,
                      layer_ids=self.layer_ids, valid=valid)

    def to(self, device, non_blocking: bool = False) -> "Routes":
        r = self._copy()
        r.indices = self.indices.to(device, non_blocking=non_blocking)
        r._mask = self._mask.to(device, non_blocking=non_blocking) if self._mask is not None else None
        return r

    def pin_memory(self) -> "Routes":
        r = self._copy()
        r.indices = self.indices.pin_memory()
        return r

    def _copy(self) -> "Routes":
        r = object.__new__(Routes)
        for s in Routes.__slots__:
            setattr(r, s, getattr(self, s))
        return r

    def equal(self, other: "Routes") -> bool:
        return (
            self.indices.shape == other.indices.shape
            and bool(torch.equal(self.indices.long().cpu(), other.indices.long().cpu()))
            and bool(torch.equal(self.valid.cpu(), other.valid.cpu()))
        )

    # ---- checks -------------------------------------------------------------------------
    def check(self, *, num_tokens: Optional[int] = None, num_layers: Optional[int] = None,
              top_k: Optional[int] = None, num_experts: Optional[int] = None, where: str = "") -> "Routes":
        """Raise :class:`RoutesMismatchError` naming what does not match; return self."""
        at = f" ({where})" if where else ""
        if num_layers is not None and num_layers != self.num_layers:
            raise RoutesMismatchError(
                f"routes hold {self.num_layers} MoE layers but the model has {num_layers} MoE routers{at}")
        if top_k is not None and top_k != self.top_k:
            raise RoutesMismatchError(f"routes hold top-{self.top_k} experts but the router selects top-{top_k}{at}")
        if num_experts is not None and self.num_experts > num_experts:
            hi = int(self.indices.long().max()) if self.indices.numel() else -1
            if hi >= num_experts:
                raise RoutesMismatchError(f"routes use expert {hi} but the router has {num_experts} experts{at}")
        if num_tokens is not None and num_tokens != self.num_tokens:
            shape = f" (batch_shape {self.batch_shape})" if self.batch_shape else ""
            raise RoutesMismatchError(
                f"routes hold {self.num_tokens} tokens{shape} but the forward pass has {num_tokens} tokens{at}; "
                "align them with Routes.pad_batch / pad_prompt_response / unpad / extend")
        return self

    def check_batch(self, input_ids_or_shape) -> "Routes":
        """Check the routes against a ``[B, T]`` input (tensor or shape)."""
        shape = tuple(input_ids_or_shape.shape[:2]) if isinstance(input_ids_or_shape, torch.Tensor) else tuple(input_ids_or_shape)
        if len(shape) != 2:
            raise RoutesMismatchError(f"expected a [B, T] input shape, got {shape}")
        if self.batch_shape is not None and self.batch_shape != shape:
            raise RoutesMismatchError(f"routes are for a batch of shape {self.batch_shape}, the input is {shape}")
        return self.check(num_tokens=shape[0] * shape[1])

    # ---- sequences and batches ----------------------------------------------------------
    def as_batch(self) -> torch.Tensor:
        """indices viewed as ``[L, B, T, k]`` (needs batch_shape)."""
        if self.batch_shape is None:
            raise RoutesMismatchError("these routes have no batch_shape (flat or packed tokens)")
        return self.indices.view(self.num_layers, *self.batch_shape, self.top_k)

    def _mask_batch(self) -> Optional[torch.Tensor]:
        return None if self._mask is None else self._mask.view(self.num_layers, *self.batch_shape)

    def sequences(self) -> list["Routes"]:
        """One single-sequence Routes per batch row (full width T) or per packed sequence."""
        if self.cu_seqlens is not None:
            b = self.cu_seqlens.tolist()
            return [self.slice_tokens(b[i], b[i + 1]) for i in range(len(b) - 1)]
        if self.batch_shape is None:
            return [self._new(self.indices, valid=self._mask)]
        B, T = self.batch_shape
        return [self.slice_tokens(i * T, (i + 1) * T) for i in range(B)]

    def slice_tokens(self, start: int, end: int) -> "Routes":
        """Tokens ``[start, end)`` of the flat token axis as a flat Routes."""
        m = self._mask[:, start:end] if self._mask is not None else None
        return self._new(self.indices[:, start:end], valid=m)

    def rows(self, index) -> "Routes":
        """Select batch rows (shuffle / micro-batch): ``index`` is a list, slice or LongTensor over B."""
        if self.batch_shape is None:
            raise RoutesMismatchError("rows() needs routes with a batch_shape")
        ib = self.as_batch()[:, index]
        if ib.dim() == 3:  # a single int selected
            ib = ib.unsqueeze(1)
        mb = self._mask_batch()
        mb = None if mb is None else mb[:, index].reshape(self.num_layers, -1)
        B, T = ib.shape[1], ib.shape[2]
        return self._new(ib.reshape(self.num_layers, B * T, self.top_k), batch_shape=(B, T), valid=mb)

    def split(self, micro_batch_size: int) -> list["Routes"]:
        """Split the batch rows into micro-batches of ``micro_batch_size`` rows."""
        if self.batch_shape is None:
            raise RoutesMismatchError("split() needs routes with a batch_shape")
        B = self.batch_shape[0]
        return [self.rows(slice(i, min(i + micro_batch_size, B))) for i in range(0, B, micro_batch_size)]

    @staticmethod
    def _common(seqs: Sequence["Routes"]) -> tuple[int, int, int, tuple]:
        if not seqs:
            raise RoutesMismatchError("no routes given")
        L, k, E, ids = seqs[0].num_layers, seqs[0].top_k, seqs[0].num_experts, seqs[0].layer_ids
        for i, r in enumerate(seqs):
            if r.num_layers != L or r.top_k != k:
                raise RoutesMismatchError(
                    f"routes {i} have {r.num_layers} layers / top-{r.top_k}, routes 0 have {L} layers / top-{k}")
            E = max(E, r.num_experts)
        return L, k, E, ids

    @classmethod
    def concat_tokens(cls, seqs: Sequence["Routes"]) -> "Routes":
        """Concatenate single sequences along the token axis (e.g. the turns of one trajectory)."""
        L, k, E, ids = cls._common(seqs)
        idx = torch.cat([r.indices.long() for r in seqs], dim=1)
        valid = torch.cat([r.valid for r in seqs], dim=1)
        return Routes(idx, num_experts=E, layer_ids=ids, valid=valid)

    @classmethod
    def place(cls, seqs: Sequence["Routes"], starts: Sequence[int], width: int) -> "Routes":
        """A padded ``[B, width]`` batch: sequence i's tokens start at column ``starts[i]``; the rest is
        padding (invalid rows, routed natively). Tokens beyond ``width`` raise."""
        L, k, E, ids = cls._common(seqs)
        B = len(seqs)
        if len(starts) != B:
            raise RoutesMismatchError(f"{len(starts)} start offsets for {B} sequences")
        dev = seqs[0].device
        out = torch.zeros(L, B, width, k, dtype=torch.long, device=dev)
        valid = torch.zeros(L, B, width, dtype=torch.bool, device=dev)
        for i, (r, s) in enumerate(zip(seqs, starts)):
            n = r.num_tokens
            if s < 0 or s + n > width:
                raise RoutesMismatchError(
                    f"sequence {i}: {n} routed tokens starting at column {s} do not fit a row of width {width}")
            out[:, i, s:s + n] = r.indices.long().to(dev)
            valid[:, i, s:s + n] = r.valid.to(dev)
        return Routes(out.view(L, B * width, k), num_experts=E, batch_shape=(B, width), layer_ids=ids,
                      valid=valid.view(L, B * width))

    @classmethod
    def pad_batch(cls, seqs: Sequence["Routes"], side: str = "right", length: Optional[int] = None) -> "Routes":
        """Left- or right-pad single sequences into a ``[B, T]`` batch (T = longest, or ``length``)."""
        if side not in ("left", "right"):
            raise StableRLError(f"side must be 'left' or 'right', got {side!r}")
        width = max(r.num_tokens for r in seqs) if length is None else int(length)
        starts = [0 if side == "right" else width - r.num_tokens for r in seqs]
        return cls.place(seqs, starts, width)

    @classmethod
    def pad_prompt_response(cls, seqs: Sequence["Routes"], prompt_lengths: Sequence[int], prompt_width: int,
                            response_width: int) -> "Routes":
        """verl/TRL layout ``[left-padded prompt | right-padded response]``: sequence i (prompt of
        ``prompt_lengths[i]`` tokens, then its response) is placed so its prompt ends at
        ``prompt_width``; rows have ``prompt_width + response_width`` columns."""
        starts = []
        for i, (r, p) in enumerate(zip(seqs, prompt_lengths)):
            if p > prompt_width or p > r.num_tokens:
                raise RoutesMismatchError(
                    f"sequence {i}: prompt length {p} exceeds prompt_width {prompt_width} or its {r.num_tokens} tokens")
            starts.append(prompt_width - p)
        return cls.place(seqs, starts, prompt_width + response_width)

    @classmethod
    def pack(cls, seqs: Sequence["Routes"]) -> "Routes":
        """Packed (remove-padding) layout: tokens of all sequences back to back, with ``cu_seqlens``."""
        L, k, E, ids = cls._common(seqs)
        lens = [r.num_tokens for r in seqs]
        cu = torch.tensor([0] + lens).cumsum(0)
        idx = torch.cat([r.indices.long() for r in seqs], dim=1)
        valid = torch.cat([r.valid for r in seqs], dim=1)
        return Routes(idx, num_experts=E, batch_shape=(1, int(cu[-1])), cu_seqlens=cu, layer_ids=ids, valid=valid)

    def unpad(self, attention_mask: torch.Tensor) -> "Routes":
        """Padded ``[B, T]`` routes → packed layout keeping tokens where ``attention_mask`` is 1, in
        row-major order (the order of ``flash_attn.bert_padding.unpad_input`` / verl remove-padding)."""
        m = torch.as_tensor(attention_mask).bool()
        if m.dim() != 2:
            raise RoutesMismatchError(f"attention_mask must be [B, T], got {tuple(m.shape)}")
        if self.batch_shape is not None and tuple(m.shape) != self.batch_shape:
            raise RoutesMismatchError(f"attention_mask shape {tuple(m.shape)} != routes batch_shape {self.batch_shape}")
        self.check(num_tokens=m.numel(), where="unpad")
        keep = m.reshape(-1).nonzero().squeeze(-1).to(self.device)
        lens = m.sum(-1).cpu()
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
        valid = self.valid[:, keep]
        return self._new(self.indices.index_select(1, keep), batch_shape=(1, keep.numel()), cu_seqlens=cu, valid=valid)

    def pad(self, attention_mask: torch.Tensor) -> "Routes":
        """Packed routes → padded ``[B, T]`` routes (inverse of :meth:`unpad`); padding rows are invalid."""
        m = torch.as_tensor(attention_mask).bool()
        if m.dim() != 2:
            raise RoutesMismatchError(f"attention_mask must be [B, T], got {tuple(m.shape)}")
        self.check(num_tokens=int(m.sum()), where="pad: tokens where attention_mask is 1")
        keep = m.reshape(-1).nonzero().squeeze(-1).to(self.device)
        L, k = self.num_layers, self.top_k
        out = torch.zeros(L, m.numel(), k, dtype=torch.long, device=self.device)
        valid = torch.zeros(L, m.numel(), dtype=torch.bool, device=self.device)
        out[:, keep] = self.indices.long()
        valid[:, keep] = self.valid
        return self._new(out, batch_shape=tuple(m.shape), valid=valid)

    def extend(self, n: int = 1, side: str = "right") -> "Routes":
        """Add ``n`` invalid (natively routed) token columns to every row (or to a flat sequence), e.g.
        the last sampled token, which no engine forwards and so has no route."""
        if n < 0 or side not in ("left", "right"):
            raise StableRLError(f"extend needs n >= 0 and side in ('left', 'right'), got {n}, {side!r}")
        if self.batch_shape is None:
            r = Routes.pad_batch([self], side=side, length=self.num_tokens + n)
            return self._new(r.indices, valid=r.valid)
        B, T = self.batch_shape
        return Routes.place(self.sequences(), [n if side == "left" else 0] * B, T + n)

    # ---- batch-first tensors (travel with the rows of a framework batch) -------------------
    def batch_tensor(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(indices [B, T, L, k], valid [B, T, L] or None)``: batch-first, so a framework that
        shuffles / splits every tensor along dim 0 (TRL) carries the routes with their rows.

        dtype uint8 for at most 256 experts, int16 up to 32768, else int32 (uint16 is avoided:
        few torch kernels index it). ``valid`` is only returned for top-1 routes with invalid rows
        (for k >= 2 invalid rows are the all-zero rows). Inverse: :meth:`from_batch_tensor`."""
        if self.batch_shape is None:
            raise RoutesMismatchError("batch_tensor() needs routes with a batch_shape")
        dt = torch.uint8 if self.num_experts <= 256 else (torch.int16 if self.num_experts <= 32768 else torch.int32)
        t = self.as_batch().permute(1, 2, 0, 3).to(dt).contiguous()
        mb = self._mask_batch()
        return t, None if mb is None else mb.permute(1, 2, 0).contiguous()

    @classmethod
    def from_batch_tensor(cls, indices: torch.Tensor, *, num_experts: int, layer_ids: Optional[Sequence[int]] = None,
                          valid: Optional[torch.Tensor] = None) -> "Routes":
        """Routes from a batch-first ``[B, T, L, k]`` tensor (and optional ``valid [B, T, L]``), the
        inverse of :meth:`batch_tensor`; the result has ``batch_shape (B, T)``."""
        if not isinstance(indices, torch.Tensor) or indices.dim() != 4:
            shape = tuple(indices.shape) if isinstance(indices, torch.Tensor) else type(indices).__name__
            raise RoutesMismatchError(f"from_batch_tensor expects [B, T, L, k] indices, got {shape}")
        B, T, L, k = indices.shape
        idx = indices.permute(2, 0, 1, 3).reshape(L, B * T, k)
        v = None
        if valid is not None:
            if tuple(valid.shape) != (B, T, L):
                raise RoutesMismatchError(f"from_batch_tensor: valid must be [B, T, L] = {(B, T, L)}, got {tuple(valid.shape)}")
            v = valid.permute(2, 0, 1).reshape(L, B * T)
        return cls(idx, num_experts=num_experts, batch_shape=(B, T), layer_ids=layer_ids, valid=v)

    # ---- rollout-engine formats -----------------------------------------------------------
    @staticmethod
    def _infer_moe_layers(arr: torch.Tensor, model=None) -> list[int]:
        if model is not None:
            return [r.layer_id for r in find_routers(model)]
        H, k = arr.shape[1], arr.shape[2]
        if k < 2:
            raise StableRLError("top-1 routes: cannot tell dense layers from MoE layers; pass moe_layers= or model=")
        if arr.shape[0] == 0:
            raise StableRLError("no routed tokens; pass moe_layers= or model=")
        # a dense layer is zero (vLLM) or -1 (SGLang placeholder) in every row; an MoE row has distinct ids
        dense = ((arr == 0) | (arr < 0)).all(dim=2).all(dim=0)
        return [i for i in range(H) if not bool(dense[i])]

    @classmethod
    def _from_token_layer_slot(cls, arr: torch.Tensor, *, moe_layers, num_experts, num_tokens, model, source) -> "Routes":
        if arr.dim() != 3:
            raise RoutesMismatchError(f"{source}: expected [num_tokens, num_hidden_layers, top_k], got {tuple(arr.shape)}")
        R, H, k = arr.shape
        if moe_layers is None:
            moe_layers = cls._infer_moe_layers(arr, model)
        moe_layers = [int(i) for i in moe_layers]
        if not moe_layers or min(moe_layers) < 0 or max(moe_layers) >= H:
            raise RoutesMismatchError(f"{source}: MoE layer ids {moe_layers} outside 0..{H - 1}")
        if num_experts is None and model is not None:
            num_experts = max(r.num_experts for r in find_routers(model))
        if num_tokens is None:
            num_tokens = R + 1
        if R not in (num_tokens - 1, num_tokens):
            raise RoutesMismatchError(
                f"{source}: {R} routed rows for {num_tokens} tokens; expected {num_tokens - 1} (the last sampled "
                "token is never forwarded) or {num_tokens}")
        sel = arr[:, moe_layers, :].long()  # [R, L, k]
        missing = sel < 0  # SGLang -1 placeholders
        valid = ~missing.any(-1)  # [R, L]
        sel = sel.clamp_min(0)
        if R < num_tokens:
            sel = torch.cat([sel, torch.zeros(1, len(moe_layers), k, dtype=torch.long)], 0)
            valid = torch.cat([valid, torch.zeros(1, len(moe_layers), dtype=torch.bool)], 0)
        return Routes(sel.permute(1, 0, 2), num_experts=num_experts, layer_ids=moe_layers, valid=valid.t())

    @classmethod
    def from_vllm(cls, routed_experts, *, moe_layers: Optional[Sequence[int]] = None, num_experts: Optional[int] = None,
                  num_tokens: Optional[int] = None, model=None) -> "Routes":
        """One sequence from vLLM's ``RequestOutput.outputs[i].routed_experts``.

        ``routed_experts``: numpy/tensor ``[num_tokens - 1, num_hidden_layers, k]`` (uint8 for <= 256
        experts, else uint16), absolute decoder-layer index, zero rows for dense layers; one row fewer than
        prompt + response tokens because the last sampled token is never forwarded. ``moe_layers``: the
        absolute ids of the MoE layers (default: from ``model``, else the layers that are not all zero;
        for top-1 models pass it). The missing last row is added as an invalid row; rows that are not
        distinct (never-forwarded tool tokens) are invalid too.
        """
        arr = _as_int_tensor(routed_experts)
        return cls._from_token_layer_slot(arr, moe_layers=moe_layers, num_experts=num_experts,
                                          num_tokens=num_tokens, model=model, source="from_vllm")

    @classmethod
    def from_sglang(cls, routed_experts, num_hidden_layers: int, top_k: int, *,
                    moe_layers: Optional[Sequence[int]] = None, num_experts: Optional[int] = None,
                    num_tokens: Optional[int] = None, model=None) -> "Routes":
        """One sequence from SGLang's ``meta_info["routed_experts"]``: base64 of a flat int32 array ordered
        (token, layer, slot), ``num_hidden_layers`` absolute layers, -1 placeholders for non-MoE layers.
        An already decoded array/tensor (flat or ``[tokens, layers, k]``) is accepted too."""
        if isinstance(routed_experts, (str, bytes, bytearray)):
            raw = base64.b64decode(routed_experts)
            if len(raw) % 4:
                raise RoutesMismatchError(f"from_sglang: {len(raw)} decoded bytes is not a whole number of int32")
            # native byte order, as SGLang's own decoder (numpy.frombuffer) reads it
            flat = torch.frombuffer(bytearray(raw), dtype=torch.int32) if raw else torch.zeros(0, dtype=torch.int32)
        else:
            flat = _as_int_tensor(routed_experts).reshape(-1)
        per_token = num_hidden_layers * top_k
        if flat.numel() % per_token:
            raise RoutesMismatchError(
                f"from_sglang: {flat.numel()} values is not a multiple of num_hidden_layers * top_k = {per_token}")
        arr = flat.reshape(-1, num_hidden_layers, top_k)
        return cls._from_token_layer_slot(arr, moe_layers=moe_layers, num_experts=num_experts,
                                          num_tokens=num_tokens, model=model, source="from_sglang")

    @classmethod
    def from_token_layer_slot(cls, arr, *, moe_layers: Optional[Sequence[int]] = None, num_experts: Optional[int] = None,
                              model=None, batch_shape: Optional[Sequence[int]] = None,
                              cu_seqlens: Optional[torch.Tensor] = None) -> "Routes":
        """Routes from an ``[N, num_hidden_layers, k]`` array in the engines' absolute-layer layout with one
        row per token (verl's ``routed_experts`` batch field; the inverse of :meth:`to_token_layer_slot`).
        Dense layers are dropped (``moe_layers``, else from ``model``, else the layers that are not all zero);
        rows that are not k distinct experts (zero padding, never-forwarded tokens) are invalid, so top-1
        routes need ``valid`` information this layout cannot carry: they are refused."""
        t = _as_int_tensor(arr)
        if t.dim() == 3 and t.shape[2] < 2:
            raise RoutesMismatchError(
                "from_token_layer_slot: top-1 routes cannot mark padding rows in this layout (a zero row is expert 0)")
        r = cls._from_token_layer_slot(t, moe_layers=moe_layers, num_experts=num_experts,
                                       num_tokens=t.shape[0] if t.dim() == 3 else None, model=model,
                                       source="from_token_layer_slot")
        if batch_shape is None and cu_seqlens is None:
            return r
        return r._new(r.indices, batch_shape=batch_shape if batch_shape is not None else (1, r.num_tokens),
                      cu_seqlens=cu_seqlens, valid=r.valid)

    def to_token_layer_slot(self, num_hidden_layers: Optional[int] = None) -> torch.Tensor:
        """``[N, num_hidden_layers, k]`` int64 in the engines' absolute-layer layout (dense layers 0)."""
        H = num_hidden_layers if num_hidden_layers is not None else max(self.layer_ids) + 1
        out = torch.zeros(self.num_tokens, H, self.top_k, dtype=torch.long, device=self.device)
        out[:, list(self.layer_ids)] = self.indices.long().permute(1, 0, 2)
        return out


def _as_int_tensor(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        t = x
    else:
        import numpy as np

        a = np.asarray(x)
        if a.dtype.kind not in "iu":
            raise RoutesMismatchError(f"routed experts must be integers, got dtype {a.dtype}")
        if a.dtype == np.uint16 or a.dtype == np.uint32:
            a = a.astype(np.int64)
        t = torch.from_numpy(np.ascontiguousarray(a))
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise RoutesMismatchError(f"routed experts must be integers, got {t.dtype}")
    return t.cpu().long()


def mismatch_fraction(a: Routes, b: Routes) -> float:
    """Fraction of (layer, token, slot) choices of ``a`` not chosen by ``b``.

    Compared as sets per (layer, token): a row differs in as many slots as it has experts that the
    other row lacks (order inside the top-k does not count). Rows invalid in either are skipped;
    0.0 when no row is comparable.
    """
    if a.indices.shape != b.indices.shape:
        raise RoutesMismatchError(f"cannot compare routes of shape {tuple(a.indices.shape)} and {tuple(b.indices.shape)}")
    x, y = a.indices.long().cpu(), b.indices.long().cpu()
    both = (a.valid & b.valid).cpu()
    found = (x.unsqueeze(-1) == y.unsqueeze(-2)).any(-1)  # [L, N, k]
    differ = (~found) & both.unsqueeze(-1)
    denom = int(both.sum()) * a.top_k
    return float(differ.sum()) / denom if denom else 0.0
