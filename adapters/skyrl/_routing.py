"""MoE routing replay (R2 / R3) on SkyRL's FSDP policy worker, for Hugging Face MoE models
(``trainer.algorithm.stablerl_routing_replay=R2|R3``; SkyRL 0.3 replays routes only on Megatron), with
:mod:`stablerl.routing_replay`. **R3** (arXiv 2510.11370): the batch's ``rollout_expert_indices`` (``[B, T,
num_hidden_layers, k]``, zero rows where the engine has no route) are replayed in the old-log-prob pass
(``_forward_micro_batch``) and every update micro-batch (``_forward_backward_micro``, through backward). **R2**
(arXiv 2512.01374): the old-log-prob pass records the experts used per row in that layout; they ride back in
``forward``'s per-sample outputs (with the old pass's statistics, ``_micro``), the entry point's trainer puts them
into the batch as ``rollout_expert_indices``, and the update replays them. Refused: Ulysses sequence parallelism,
``max_tokens_per_microbatch`` with R2 (its row reordering is not followed yet), top-1 routers.
"""

from __future__ import annotations

import torch

from stablerl import routing_replay as rr
from stablerl.params import StableRLError

from ._micro import OLD_PASS, old_pass, update_inputs
from ._names import ALGORITHM

KEY = "stablerl_routing_replay"
ROUTES = "rollout_expert_indices"


def mode_of(algorithm) -> str | None:
    """``"R2"``, ``"R3"`` or None from ``trainer.algorithm.stablerl_routing_replay``."""
    return rr.parse_mode(getattr(algorithm, KEY, None), ALGORITHM + KEY)


def routes_of(worker, indices, attention_mask) -> rr.Routes:
    """SkyRL's ``[B, T, num_hidden_layers, k]`` routes as :class:`~stablerl.routing_replay.Routes` in the layout the
    worker's model forwards (packed under ``remove_microbatch_padding``)."""
    model = worker.model
    if getattr(model, "sequence_parallel_size", 1) > 1:
        raise StableRLError(f"{ALGORITHM}{KEY}: Ulysses sequence parallelism is not supported yet")
    routers = rr.require_routers(model, needed_by=f"{ALGORITHM}{KEY}")
    B, T, H, k = indices.shape
    routes = rr.Routes.from_token_layer_slot(
        indices.reshape(B * T, H, k).cpu(), moe_layers=[r.layer_id for r in routers],
        num_experts=max(r.num_experts for r in routers), batch_shape=(B, T))
    return routes.unpad(attention_mask.cpu()) if getattr(model, "remove_microbatch_padding", False) else routes


def _recorded(cap, attention_mask, num_hidden_layers: int):
    routes = cap.routes()
    B, T = attention_mask.shape
    if routes.batch_shape != (B, T):  # a packed forward: back to the batch layout
        routes = routes.pad(attention_mask.cpu())
    per_token = routes.to_token_layer_slot(num_hidden_layers).reshape(B, T, num_hidden_layers, routes.top_k)
    return per_token.to(torch.uint8 if routes.num_experts <= 256 else torch.int16)  # SkyRL's dtypes


def _num_hidden_layers(model) -> int:
    cfg = getattr(getattr(model, "model", model), "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    return int(cfg.num_hidden_layers)


def _missing(mode: str) -> StableRLError:
    how = ("the generator must return rollout_expert_indices (vLLM with routed-experts return)" if mode == "R3" else
           "R2 records them in the old-log-prob pass: run python -m stablerl.adapters.skyrl.main")
    return StableRLError(f"{ALGORITHM}{KEY}={mode}: the batch has no {ROUTES}; {how}")


def arm(ledger, worker_class) -> None:
    """Patch ``worker_class`` (SkyRL's ``PolicyWorkerBase``): replay in both passes, R2's recording."""
    fwd_micro, fb_micro, forward = (worker_class._forward_micro_batch, worker_class._forward_backward_micro,
                                    worker_class.forward)

    def _forward_micro_batch(self, micro_batch):
        with old_pass(self, micro_batch):  # the old pass's entropy / sum_pi_squared, when read (``_micro``)
            return _routed(self, micro_batch)

    def _routed(self, micro_batch):
        mode = mode_of(self.cfg.algorithm)
        if mode is None:
            return fwd_micro(self, micro_batch)
        if mode == "R2":
            with rr.capture(self.model) as cap:
                out = fwd_micro(self, micro_batch)
            self._stablerl_old[ROUTES].append(_recorded(cap, micro_batch["attention_mask"], _num_hidden_layers(self.model)))
            return out
        indices = micro_batch.get(ROUTES, None) if hasattr(micro_batch, "get") else None
        if indices is None:
            raise _missing(mode)
        with rr.replay(self.model, routes_of(self, indices, micro_batch["attention_mask"])):
            return fwd_micro(self, micro_batch)

    def _forward_backward_micro(self, experience, *args, **kwargs):
        with update_inputs(self, experience):  # the stablerl loss's token_ids / entropy (``_micro``)
            return _update(self, experience, *args, **kwargs)

    def _update(self, experience, *args, **kwargs):
        mode = mode_of(self.cfg.algorithm)
        if mode is None:
            return fb_micro(self, experience, *args, **kwargs)
        if experience.rollout_expert_indices is None:
            raise _missing(mode)
        with rr.replay(self.model, routes_of(self, experience.rollout_expert_indices, experience.attention_mask)):
            return fb_micro(self, experience, *args, **kwargs)

    def forward_(self, data, loss_fn=None, *args, **kwargs):
        keys = old_pass_keys(self.cfg.algorithm)
        if loss_fn is not None or not keys:
            return forward(self, data, loss_fn, *args, **kwargs)
        if getattr(self.cfg, "max_tokens_per_microbatch", 0) > 0:
            raise StableRLError(f"{', '.join(keys)} from the old-log-prob pass (R2, or a selected algorithm reads "
                                "it): max_tokens_per_microbatch > 0 is not supported yet")
        self._stablerl_old = {key: [] for key in keys}
        out = forward(self, data, loss_fn, *args, **kwargs)
        rows, self._stablerl_old = {k: torch.cat(v) for k, v in self._stablerl_old.items()}, None
        for i, sample in enumerate(out.loss_fn_outputs):
            sample.update({key: value[i] for key, value in rows.items()})
        return out

    for name, fn in (("_forward_micro_batch", _forward_micro_batch),
                     ("_forward_backward_micro", _forward_backward_micro), ("forward", forward_)):
        ledger.set_attr(f"PolicyWorkerBase.{name}:routing_replay", worker_class, name, fn)


def old_pass_keys(algorithm) -> list[str]:
    """What the policy's old-log-prob pass also returns per sample: R2's routes, the statistics a selected
    algorithm reads (``_micro.OLD_PASS``)."""
    from ._config import selection

    stats = sorted(selection(algorithm).old_pass_stats())
    return ([ROUTES] if mode_of(algorithm) == "R2" else []) + [OLD_PASS[stat] for stat in stats]


def batch_field(outputs, key: str):
    """``key`` of ``forward``'s per-sample outputs stacked (``[N, ...]``), or None."""
    rows = [o.get(key) for o in outputs]
    return torch.stack(rows) if rows and all(r is not None for r in rows) else None
