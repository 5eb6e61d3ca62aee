"""Stateful algorithms in a framework's training loop: what every adapter that drives an entropy controller or
a trainer hook decides the same way, written once.

* :class:`ControllerDriver`: an entropy controller checked against the statistics the framework provides,
  stepped once per optimizer step, its last decision kept and re-applied on restore (saved with it), and its
  loss term (EPO's ``penalty``) called with the arguments it takes.
* :class:`HookPasses`: a trainer hook over the optimizer passes of each rollout batch, for loops that report
  events (a pass starts, a pass ended) rather than running the passes themselves.

A driver (and a hook) is tracked in a :class:`stablerl.state.StateStore` like any object with ``state_dict()``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, Optional

import torch

from .api import make_controller, make_trainer_hook
from .contracts import ParamsView
from .ops import as_floats
from .params import MissingInputError


def scalar_metrics(values: Optional[dict], prefix: str = "") -> dict[str, float]:
    """``{prefix + key: float}`` of the numbers (bools included) in ``values``; anything else is not a metric."""
    return {prefix + k: float(v) for k, v in (values or {}).items() if isinstance(v, (bool, int, float))}


class ControllerDriver:
    """Entropy controller ``name`` in a training loop.

    ``provides``: the statistics the framework can hand to ``step`` (a controller requiring another one is
    refused, naming ``framework`` and what it gives); ``apply``: puts a decision into effect (e.g. the sampling
    temperature), called after every step and after a restore."""

    def __init__(self, name: str, params: dict, *, provides: Iterable[str], framework: str, gives: str,
                 apply: Callable[[dict], None]):
        self.name, self.apply = name, apply
        self.controller = make_controller(name, **params)
        accepted = inspect.signature(self.controller.step).parameters
        needed = [n for n, p in accepted.items() if p.default is inspect.Parameter.empty
                  and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in set(provides)]
        if needed:
            raise MissingInputError(f"entropy_controller {name!r} needs statistic(s) {needed} that {framework} does "
                                    f"not provide ({gives})")
        self._accepted = set(accepted)
        self.decision: dict[str, Any] = {}
        penalty = getattr(self.controller, "penalty", None)
        self.penalty = penalty if callable(penalty) else None  # a loss term (EPO) or None
        self.per_turn = self.penalty is not None and "turn_index" in inspect.signature(penalty).parameters

    def step(self, **stats: Any) -> dict[str, float]:
        """One optimizer step: the controller sees the statistics it accepts; its decision (plain values only) is
        kept and applied. Returns the decision's numbers as metrics."""
        decision = self.controller.step(**{k: v for k, v in stats.items() if k in self._accepted})
        self.decision = {k: v for k, v in (decision or {}).items() if v is None or isinstance(v, (bool, int, float, str))}
        self.apply(self.decision)
        return scalar_metrics(self.decision)

    def loss_term(self, entropies: torch.Tensor, response_mask: torch.Tensor, ctx: Any,
                  turn_index: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
        """The controller's penalty, token-mean under ``ctx``; a per-turn penalty without ``turn_index`` sees every
        sample as turn 0."""
        kwargs: dict[str, Any] = {"loss_agg_mode": "token-mean", "ctx": ctx}
        if self.per_turn:
            kwargs["turn_index"] = (torch.zeros(entropies.size(0), dtype=torch.long, device=entropies.device)
                                    if turn_index is None else turn_index)
        term, metrics = self.penalty(entropies, response_mask=response_mask.to(entropies.dtype), **kwargs)
        return term, as_floats(metrics)  # numbers or 0-dim tensors, as a loss's metrics

    def state_dict(self) -> dict:
        return {"state": self.controller.state_dict(), "decision": dict(self.decision)}

    def load_state_dict(self, state: dict) -> None:
        self.controller.load_state_dict(state["state"])
        self.decision = dict(state.get("decision") or {})
        self.apply(self.decision)


class HookPasses:
    """Trainer hook ``name`` over the optimizer passes of each rollout batch: :meth:`before_pass` at the start of
    every pass (the first of a batch calls ``before_batch``), :meth:`after_pass` at its end (``after_pass`` with the
    pass index)."""

    def __init__(self, name: str, params: dict):
        self.name = name
        self.hook = make_trainer_hook(name, **params)
        self.pass_index: Optional[int] = None  # within the current batch; None between batches
        self.passes = self.hook.passes_per_batch()

    def before_pass(self, view: ParamsView, passes: Optional[int] = None) -> bool:
        """True when this pass starts a batch (``before_batch`` was called). ``passes``: the batch's number of passes
        where the framework has fixed it already (TRL's ``num_iterations``), else the hook's ``passes_per_batch()``."""
        if self.pass_index is not None:
            return False
        self.passes = self.hook.passes_per_batch() if passes is None else passes
        self.hook.before_batch(view)
        self.pass_index = 0
        return True

    def after_pass(self, view: ParamsView, **stats: Any) -> dict[str, float]:
        """The hook acts after a pass; returns its numbers as metrics (nothing between batches)."""
        if self.pass_index is None:
            return {}
        k = self.pass_index
        metrics = scalar_metrics(self.hook.after_pass(view, k, **stats))
        self.pass_index = None if k + 1 >= self.passes else k + 1
        return metrics


__all__ = ["ControllerDriver", "HookPasses", "scalar_metrics"]
