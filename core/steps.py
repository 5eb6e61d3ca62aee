"""The steps every framework runs, written once: the advantage step and the loss inputs.

An adapter's call site translates its framework's batch into one :class:`BatchRecord` (the gathered ``[N, T]``
tensors plus the framework's own batch object for the providers), calls the step, and writes the result
back. The order (shape rewards -> estimator -> batch filter -> state bookkeeping), the refusals and the
metrics are the step's, so no adapter has an ordering or a policy of its own::

    record = BatchRecord(adapter, response_mask=mask, index=uid, token_level_rewards=rewards, host=data)
    result = AdvantageStep(selection, ctx=make_ctx, state=adapter_state_store,
                           filter_key="algorithm.stablerl_batch_filter", why_no_resampling="...").run(
        record, estimate=frameworks_own_estimator)
    data.batch["advantages"], data.batch["response_mask"] = result.advantages, result.response_mask

What the framework produced for the batch (captured entropies, routes, rollout log-probs, rewards) travels in
the record (``record.produced``), never in temporary attributes on the framework's objects. Inputs an
algorithm declares are read through the adapter's providers (:mod:`stablerl.providers`) only when a
selected algorithm declares them, and once per record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch

from .contracts import ADVANTAGE_ESTIMATOR, BATCH_FILTER, OPTIONAL_INPUTS, REWARD_SHAPER, AlgorithmSpec
from .params import MissingInputError, StableRLError

_UNSET = object()


@dataclass
class BatchRecord:
    """What the framework produced for one batch, as the steps and the providers read it.

    ``response_mask`` ``[N, T]``, ``index`` the ``[N]`` prompt-group ids, and either ``token_level_rewards``
    ``[N, T]`` (verl's layout) or ``scores`` ``[N]`` (one reward per response: TRL, OpenRLHF). ``unscorable``
    ``[N]``: rows no reward function scored (their own group, advantage 0). ``host``: the framework's own batch
    object (a ``DataProto``, a list of experiences, TRL's output dict), read by the providers. ``produced``: what
    the framework's passes produced for this batch beyond its own fields (an entropy recorded in the
    old-log-prob pass, routes, the user's per-response inputs), by input name. ``adapter``: whose providers
    feed the declared inputs."""

    adapter: Any = None
    response_mask: Optional[torch.Tensor] = None
    index: Any = None
    token_level_rewards: Optional[torch.Tensor] = None
    scores: Optional[torch.Tensor] = None
    unscorable: Optional[torch.Tensor] = None
    host: Any = None
    produced: dict = field(default_factory=dict)
    #: ``missing(spec, input_name) -> Exception``: the framework's own error for a required input its batch lacks
    #: (None: core's :class:`MissingInputError`)
    missing: Optional[Callable[[AlgorithmSpec, str], Exception]] = None
    _cache: dict = field(default_factory=dict, repr=False)

    def input(self, kind: str, name: str) -> Any:
        """Input ``name`` for an algorithm of ``kind``: what the batch produced, else the adapter's provider
        (called at most once per record and input), else None."""
        if name in self.produced:
            return self.produced[name]
        key = (kind, name)
        value = self._cache.get(key, _UNSET)
        if value is _UNSET:
            value = None if self.adapter is None else self.adapter.provide(kind, name, self)
            self._cache[key] = value
        return value

    def declared(self, spec: AlgorithmSpec, *, skip: Iterable[str] = (), optional: bool = True) -> dict[str, Any]:
        """Every input ``spec`` requires (less ``skip``: what the call passes itself), and every optional input it
        reads that this batch has; a required input nobody provides raises :class:`MissingInputError` saying
        what the user must set in this framework."""
        skip = set(skip)
        out: dict[str, Any] = {}
        for name in spec.requires:
            if name in skip:
                continue
            value = self.input(spec.kind, name)
            if value is None and self.missing is not None:
                raise self.missing(spec, name)
            if value is None:
                raise MissingInputError(f"{spec.kind.replace('_', ' ')} {spec.name!r} needs input {name!r} "
                                        f"({OPTIONAL_INPUTS.get(name, name)}): {self._how_to_provide(spec.kind, name)}")
            out[name] = value
        if optional:
            for name in spec.optional_inputs:
                if name not in skip:
                    value = self.input(spec.kind, name)
                    if value is not None:
                        out[name] = value
        return out

    def _how_to_provide(self, kind: str, name: str) -> str:
        adapter = self.adapter
        if adapter is None:
            return "no framework adapter feeds this batch"
        provider = adapter.provider(kind, name)
        if provider is not None:
            return (f"{adapter.name} feeds it only with {provider.condition}" if provider.condition
                    else f"{adapter.name}'s batch has none for this step")
        try:
            return f"{adapter.name} cannot feed it ({adapter.spec.why(kind, name)})"
        except Exception:  # noqa: BLE001 - an adapter without a registered declaration (tests)
            return f"{adapter.name} cannot feed it"

    def rewards_on_tokens(self) -> torch.Tensor:
        """``[N, T]`` rewards: ``token_level_rewards``, or each score on its response's last token."""
        if self.token_level_rewards is not None:
            return self.token_level_rewards
        from .ops import scores_on_last_token

        return scores_on_last_token(self.scores.to(self.response_mask.dtype), self.response_mask)

    def response_scores(self) -> torch.Tensor:
        """``[N]`` per-response rewards: ``scores``, or the masked sum of the token-level rewards."""
        if self.scores is not None:
            return self.scores
        rewards = self.token_level_rewards
        return (rewards * self.response_mask.to(rewards.dtype)).sum(-1)


@dataclass(frozen=True)
class AdvantageSelection:
    """The stablerl algorithms selected for the advantage step, each with its hyper-parameters (a name of None:
    not selected; ``estimator`` None: the framework's own estimator runs)."""

    estimator: Optional[str] = None
    estimator_params: dict = field(default_factory=dict)
    reward_shaper: Optional[str] = None
    reward_shaper_params: dict = field(default_factory=dict)
    batch_filter: Optional[str] = None
    batch_filter_params: dict = field(default_factory=dict)

    def specs(self) -> list[AlgorithmSpec]:
        from .api import get_spec

        chosen = ((REWARD_SHAPER, self.reward_shaper), (ADVANTAGE_ESTIMATOR, self.estimator),
                  (BATCH_FILTER, self.batch_filter))
        return [get_spec(kind, name) for kind, name in chosen if name]

    def reads(self, input_name: str) -> bool:
        """Whether a selected algorithm requires (or optionally reads) ``input_name``: an input whose provider runs
        an extra pass is computed only then."""
        return any(input_name in spec.requires or input_name in spec.optional_inputs for spec in self.specs())

    @property
    def active(self) -> bool:
        return bool(self.estimator or self.reward_shaper or self.batch_filter)


@dataclass
class AdvantageResult:
    """The advantage step's output on the record's ``[N, T]`` layout: ``advantages`` (0 outside the new mask),
    ``returns`` (None when the estimator gave none), ``response_mask`` (the filter's, else the input's),
    ``scores`` / ``token_level_rewards`` after the shaper, ``dropped`` ``[N]`` rows a filter emptied (None: no
    filter), ``metrics`` (unprefixed: the adapter logs them its framework's way), ``filter_result``: the batch
    filter's own :class:`~stablerl.contracts.FilterResult` (None: no filter; its ``advantages`` None: the filter kept
    the estimator's)."""

    advantages: torch.Tensor
    returns: Optional[torch.Tensor]
    response_mask: torch.Tensor
    scores: torch.Tensor
    token_level_rewards: Optional[torch.Tensor]
    dropped: Optional[torch.Tensor]
    metrics: dict
    filter_result: Any = None


class AdvantageStep:
    """Shape rewards -> estimator (stablerl's, or the framework's own through ``estimate``) -> batch filter -> state
    bookkeeping, on one :class:`BatchRecord`.

    ``ctx(kind, name)``: the :class:`~stablerl.context.Context` of one algorithm (the adapter's step counter,
    seeded generator and state slot). ``state``: the adapter's :class:`~stablerl.state.StateStore`, advanced once
    per step. ``filter_key`` / ``why_no_resampling``: the config key that chose the filter and why the framework
    cannot duplicate rows (both shown when a filter resamples)."""

    def __init__(self, selection: AdvantageSelection, *, ctx: Callable[[str, str], Any], state: Any = None,
                 filter_key: str = "batch_filter", why_no_resampling: str = "") -> None:
        self.selection, self.ctx, self.state = selection, ctx, state
        self.filter_key, self.why_no_resampling = filter_key, why_no_resampling

    def shape(self, record: BatchRecord) -> dict[str, float]:
        """Apply the reward shaper: ``record.scores`` (and the last token of ``token_level_rewards``) shaped."""
        from .api import get_spec, shape_rewards
        from .ops import last_valid_index

        name = self.selection.reward_shaper
        spec = get_spec(REWARD_SHAPER, name)
        scores = record.response_scores()
        inputs = record.declared(spec, skip=("index", "scores"))
        shaped, metrics = shape_rewards(name, scores=scores, index=record.index, ctx=self.ctx(REWARD_SHAPER, name),
                                        **inputs, **self.selection.reward_shaper_params)
        if record.token_level_rewards is not None:
            rewards, mask = record.token_level_rewards, record.response_mask
            has = mask.sum(-1) > 0
            delta = torch.where(has, shaped.to(rewards.dtype) - scores.to(rewards.dtype), torch.zeros_like(scores,
                                                                                                         dtype=rewards.dtype))
            new = rewards.clone()
            new[torch.arange(new.shape[0], device=new.device), last_valid_index(mask)] += delta
            record.token_level_rewards = new
        if record.scores is not None:
            record.scores = shaped.to(record.scores.dtype)
        return metrics

    def estimate(self, record: BatchRecord, extras: Optional[dict] = None) -> tuple[torch.Tensor, Optional[torch.Tensor], dict]:
        """stablerl's estimator on the record: ``(advantages, returns, metrics)``."""
        from .api import compute_advantage, get_spec
        from .framework_batch import advantages_from_scores

        name = self.selection.estimator
        spec = get_spec(ADVANTAGE_ESTIMATOR, name)
        inputs = record.declared(spec, skip=("index",))
        if extras:
            inputs["extras"] = extras
        ctx = self.ctx(ADVANTAGE_ESTIMATOR, name)
        if record.token_level_rewards is None:  # one score per response: core's scores convention (TRL, OpenRLHF)
            adv, metrics = advantages_from_scores(name, record.scores, record.response_mask, record.index,
                                                  unscorable=record.unscorable, ctx=ctx, **inputs,
                                                  **self.selection.estimator_params)
            return adv, None, metrics
        adv, returns = compute_advantage(name, token_level_rewards=record.token_level_rewards,
                                         response_mask=record.response_mask, index=record.index, ctx=ctx, **inputs,
                                         **self.selection.estimator_params)
        return adv, returns, {}

    def filter(self, record: BatchRecord, advantages: torch.Tensor):
        """The batch filter on the record (core's :func:`~stablerl.framework_batch.apply_filter_result`)."""
        from .api import filter_batch, get_spec
        from .framework_batch import apply_filter_result

        name = self.selection.batch_filter
        spec = get_spec(BATCH_FILTER, name)
        mask = record.response_mask
        inputs = record.declared(spec, skip=("index", "scores"))
        entropy = inputs.pop("entropy", None)
        result = filter_batch(name, advantages=advantages, response_mask=mask, index=record.index,
                              scores=record.response_scores(), entropy=entropy, ctx=self.ctx(BATCH_FILTER, name),
                              **inputs, **self.selection.batch_filter_params)
        return result, apply_filter_result(result, mask, advantages, selected_by=f"{self.filter_key}={name!r}",
                                           why_no_resampling=self.why_no_resampling)

    def run(self, record: BatchRecord, *, estimate: Optional[Callable[[BatchRecord], Any]] = None,
            extras: Optional[dict] = None) -> AdvantageResult:
        """The whole step. ``estimate(record) -> advantages`` or ``(advantages, returns)``: the framework's own
        estimator, called with the shaped record when no stablerl estimator is selected. ``extras``: the
        estimator's per-response extras (reward components)."""
        sel = self.selection
        if sel.estimator is None and estimate is None:
            raise StableRLError("the advantage step has neither a stablerl estimator nor the framework's own")
        metrics: dict[str, float] = {}
        if sel.reward_shaper:
            metrics.update(self.shape(record))
        if sel.estimator:
            advantages, returns, estimator_metrics = self.estimate(record, extras)
            metrics.update(estimator_metrics)
        else:
            out = estimate(record)
            advantages, returns = out if isinstance(out, tuple) else (out, None)
        mask, dropped, filter_result = record.response_mask, None, None
        if sel.batch_filter:
            filter_result, filtered = self.filter(record, advantages)
            advantages, mask, dropped = filtered.advantages, filtered.response_mask, filtered.dropped
            if returns is not None:
                returns = returns * mask.to(returns.dtype)
            metrics.update(filtered.metrics)
        if self.state is not None:
            self.state.advance()
        return AdvantageResult(advantages=advantages, returns=returns, response_mask=mask,
                               scores=record.response_scores(), token_level_rewards=record.token_level_rewards,
                               dropped=dropped, metrics=metrics, filter_result=filter_result)


def loss_inputs(spec: AlgorithmSpec, record: BatchRecord, *, skip: Iterable[str] = ()) -> dict[str, Any]:
    """The loss step's inputs: every input policy loss ``spec`` declares beyond the call's own arguments
    (``skip``), read through the record's providers (see :meth:`BatchRecord.declared`)."""
    return record.declared(spec, skip=skip)


__all__ = ["BatchRecord", "AdvantageSelection", "AdvantageResult", "AdvantageStep", "loss_inputs"]
