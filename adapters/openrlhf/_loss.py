"""StablePolicyLoss: OpenRLHF's PolicyLoss with a stablerl policy loss in its place (imported only inside
OpenRLHF's actor worker, or by tests: it imports ``openrlhf.models.loss``)."""

from __future__ import annotations

from typing import Any, Optional

import torch

import stablerl
from openrlhf.models.loss import PolicyLoss
from openrlhf.models.utils import masked_mean
from stablerl.call_options import option_inputs
from stablerl.frameworks import (as_params, check_call_options, log_effective_settings, pending_loss_inputs,
                                 split_call_options)
from stablerl.params import StableRLError, build_params
from stablerl.state import StateStore

from ._flags import NAME, OPENRLHF_POLICY_LOSSES, PREFIX, check_openrlhf, check_policy_loss_api
from ._selection import Selection, check_rollout_log_probs, resolve
from ._versions import check_version_source

check_openrlhf()
check_policy_loss_api(PolicyLoss)


class StablePolicyLoss(PolicyLoss):
    """OpenRLHF's ``PolicyLoss`` whose ``policy_loss_type`` may be any stablerl policy loss: same constructor kwargs
    (plus keyword-only ``stablerl_params``, ``dp_group``, ``clip_to_params``, ``grad_accum``, ``step_rows``), same keyword call, same 5-tuple
    ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)``. ``ppo`` / ``gspo`` run OpenRLHF's own ``forward``.

    A stablerl loss runs ``stablerl.compute_policy_loss`` with ``token-mean`` (``token_level_loss``) or
    ``seq-mean-token-mean`` and OpenRLHF's normalisers (``batch_num_tokens``, ``global_batch_size``, ``dp_size``),
    so the aggregation equals OpenRLHF's ``aggregate_loss``. OpenRLHF's IS correction is computed by OpenRLHF's code
    (a ``ppo`` probe, :meth:`_openrlhf_is_weights`) and passed as ``is_weights``. Inputs beyond OpenRLHF's call
    (:attr:`fed_inputs`) come from the ``training_step`` patch's record (``._inputs``) or, called directly, :meth:`feed`.
    ``clip_ratio`` is stablerl's ``pg_clipfrac``, ``ppo_kl`` OpenRLHF's; every metric of the last call is in
    :attr:`last_metrics` and, inside ``training_step``, in ``experience.info`` as ``stablerl/<metric>`` (OpenRLHF
    averages them into the status it logs).
    """

    #: the declared inputs OpenRLHF's loss call passes itself
    CALL_INPUTS = frozenset({"rollout_log_prob"})

    def __init__(self, clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, dual_clip: Optional[float] = None,
                 token_level_loss: bool = True, policy_loss_type: str = "ppo", is_correction_level: str = "off",
                 is_correction_mode: str = "mask", is_correction_gating: str = "ratio",
                 is_correction_threshold: list = (0.5, 5.0), *, stablerl_params: Optional[dict] = None,
                 dp_group: Any = None, clip_to_params: bool = True, grad_accum: int = 1,
                 step_rows: Optional[float] = None) -> None:
        is_correction = dict(is_correction_level=is_correction_level, is_correction_mode=is_correction_mode,
                             is_correction_gating=is_correction_gating, is_correction_threshold=is_correction_threshold)
        super().__init__(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, dual_clip=dual_clip,
                         token_level_loss=token_level_loss, policy_loss_type=policy_loss_type, **is_correction)
        self.stablerl_name = resolve(stablerl.POLICY_LOSS, policy_loss_type)
        self.dp_group = dp_group
        #: DeepSpeed's gradient-accumulation steps: OpenRLHF divides its normalisers by them (loss_utils'
        #: ``_optimizer_step_loss_norm``) because DeepSpeed scales each micro-batch's loss by 1 / gas (see _context)
        self.grad_accum = max(int(grad_accum), 1)
        #: rows per optimizer step over every rank (--train.batch_size), masked rows included: OpenRLHF's
        #: global_batch_size counts only rows with a valid token (None with dynamic batching: unknown)
        self.step_rows = step_rows
        self.last_metrics: dict[str, float] = {}
        self.fed_inputs: frozenset = frozenset()
        self.stablerl_spec = None
        #: persistent per-algorithm state (ctx.state: e.g. entropic's controller integral), kept across calls
        #: by this loss object (one per actor worker); saved in OpenRLHF's DeepSpeed checkpoints (see _state)
        self.stablerl_state = StateStore(holds="loss")
        self._fed: Optional[dict] = None
        #: compute_policy_loss options from --actor.stablerl_params (loss_agg_mode, rollout_correction, ...)
        self.call_options: dict = {}
        if self.stablerl_name is None:
            if stablerl_params:
                raise StableRLError(f"stablerl_params given for OpenRLHF's built-in policy_loss_type {policy_loss_type!r}")
            self.stablerl_params: dict = {}
            return
        spec = self.stablerl_spec = stablerl.get_spec(stablerl.POLICY_LOSS, self.stablerl_name)
        self.fed_inputs = frozenset(spec.requires) - self.CALL_INPUTS
        fields = spec.params.field_names()
        params: dict[str, Any] = {}
        # clip_to_params: the clip kwargs set the loss's clip_ratio_low/high/c where it has them; stablerl params win
        if clip_to_params:
            for key, value in (("clip_ratio_low", clip_eps_low), ("clip_ratio_high", clip_eps_high),
                               ("clip_ratio_c", dual_clip)):
                if key in fields:
                    params[key] = value
        # a registered aggregation (delta_l) / a stablerl rollout correction come through the same params
        hyper, self.call_options = split_call_options(stablerl_params or {})
        params.update(hyper)
        build_params(spec, params)  # fail at construction, not at the first step
        check_call_options(NAME, spec, self.call_options, params)
        # top_entropy_quantile < 1: the training forward's entropy, for any loss (the rollout log-probs: OpenRLHF's)
        self.fed_inputs = self.fed_inputs | (frozenset(option_inputs(self.call_options)) - self.CALL_INPUTS)
        self.stablerl_params = params
        check_rollout_log_probs(spec, self.call_options, is_correction_level)
        # the loss corrects for the sampler itself, or stablerl's rollout correction does: OpenRLHF's own
        # weights are not applied on top (core refuses both at once)
        self._corrects_itself = "rollout_log_prob" in spec.requires or "rollout_correction" in self.call_options
        # OpenRLHF's own IS-correction code, run on a ppo loss at ratio 1 (see _openrlhf_is_weights)
        self._is_probe = None if is_correction_level == "off" else PolicyLoss(
            clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=None, token_level_loss=True, policy_loss_type="ppo",
            **is_correction)

    def feed(self, inputs: Optional[dict]) -> None:
        """The next direct call's declared inputs beyond OpenRLHF's (``entropy`` [B, A], ``token_ids`` [B, A],
        ``scores`` [B]); the dict is read at the call, so a forward may still add to it. None clears. Inside
        OpenRLHF's ``training_step`` the adapter hands them over itself (``stablerl.frameworks.loss_inputs``)."""
        self._fed = inputs

    def _fed_inputs(self, record) -> dict:
        if record is not None:  # the training_step's record (._inputs.step_inputs): the adapter's providers
            fed = {name: record.input(stablerl.POLICY_LOSS, name) for name in self.fed_inputs}
        else:  # a direct call: what feed() gave, for this one call
            fed, self._fed = self._fed or {}, None
        missing = [name for name in sorted(self.fed_inputs) if fed.get(name) is None]
        if missing:
            raise stablerl.MissingInputError(
                f"policy loss {self.stablerl_name!r} needs {missing}, which OpenRLHF's loss call does not pass: "
                "stablerl's ActorPPOTrainer.training_step patch hands them over (is the stablerl setup hook active "
                "in the actor workers?); calling the loss directly, pass them with actor_loss_fn.feed({...}) first"
            )
        return {name: fed[name] for name in self.fed_inputs}

    def _openrlhf_is_weights(self, old_log_probs, rollout_log_probs, mask):
        """OpenRLHF's per-token IS coefficient, ``vllm_kl`` and ``is_filter_ratio``, by OpenRLHF's code.

        The probe's per-token loss at ratio 1 with advantage -1 is exactly 1, so OpenRLHF's loss is
        ``sum(coef * mask)`` (token mode, normaliser 1) and its gradient with respect to the
        log-probs is ``coef`` on valid tokens (coef depends on old/rollout log-probs only)."""
        dtype = torch.float64 if old_log_probs.dtype == torch.float64 else torch.float32
        valid = mask.bool()
        zero = torch.zeros((), dtype=dtype, device=old_log_probs.device)
        # padding may hold garbage (NaN/inf): zero it so no statistic or weight picks it up
        old = torch.where(valid, old_log_probs.detach().to(dtype), zero)
        rollout = torch.where(valid, rollout_log_probs.detach().to(dtype), zero)
        with torch.enable_grad():
            x = old.clone().requires_grad_(True)
            probe_loss, _, _, vllm_kl, is_filter_ratio = self._is_probe(
                x, old, -torch.ones_like(old), action_mask=mask, rollout_log_probs=rollout,
                dp_size=1, batch_num_tokens=torch.ones((), dtype=dtype, device=old.device),
            )
            (coef,) = torch.autograd.grad(probe_loss, x)
        coef = torch.where(valid, coef, torch.zeros_like(coef))
        return coef.detach(), vllm_kl.detach(), is_filter_ratio.detach()

    def _context(self, dp_size, batch_num_tokens, global_batch_size):
        counts_given = batch_num_tokens is not None if self.token_level_loss else global_batch_size is not None
        # OpenRLHF's aggregate_loss ignores dp_size when it has no global normaliser. Its normalisers are the
        # optimizer step's tokens / non-empty sequences divided by gas, because DeepSpeed scales each micro-batch's
        # loss by 1 / gas: the Context gets the step's real counts (core's contract: what a controller weighting
        # by sequences, EntroPIC's integral, reads) and dp_size * gas, which gives OpenRLHF's loss unchanged
        ga = self.grad_accum
        kwargs = dict(token_count=None if batch_num_tokens is None else batch_num_tokens * ga,
                      seq_count=None if global_batch_size is None else global_batch_size * ga,
                      dp_size=int(dp_size) * ga if counts_given else 1, row_count=self.step_rows,
                      state=self.stablerl_state.slot(stablerl.POLICY_LOSS, self.stablerl_name))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return stablerl.torch_distributed_context(self.dp_group, **kwargs)
        return stablerl.Context(**kwargs)

    def forward(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                action_mask: Optional[torch.Tensor] = None, rollout_log_probs: Optional[torch.Tensor] = None,
                dp_size: int = 1, batch_num_tokens: Optional[float] = None, global_batch_size: Optional[float] = None):
        if self.stablerl_name is None:
            return super().forward(log_probs, old_log_probs, advantages, action_mask=action_mask,
                                   rollout_log_probs=rollout_log_probs, dp_size=dp_size,
                                   batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)
        mask = action_mask if action_mask is not None else torch.ones_like(log_probs)
        record = pending_loss_inputs(self.stablerl_name)  # open for the whole training_step
        fed = self._fed_inputs(record)
        is_weights = vllm_kl = is_filter_ratio = None
        if self._is_probe is not None:
            if rollout_log_probs is None:
                raise stablerl.MissingInputError(f"--algo.advantage.is_correction_level={self.is_correction_level} "
                                                 "but the experience has no rollout_log_probs")
            is_weights, vllm_kl, is_filter_ratio = self._openrlhf_is_weights(old_log_probs, rollout_log_probs, mask)
            if self._corrects_itself:
                # the loss corrects for the sampler itself (decoupled_ppo, a3po): it gets the vLLM log-probs and
                # OpenRLHF's weights are not applied on top (as the TRL adapter does with vLLM's ratio); the
                # probe's vllm_kl / is_filter_ratio are still logged
                is_weights = None
        loss, metrics = stablerl.compute_policy_loss(
            self.stablerl_name, log_prob=log_probs, old_log_prob=old_log_probs, advantages=advantages,
            response_mask=mask, rollout_log_prob=rollout_log_probs, is_weights=is_weights,
            ctx=self._context(dp_size, batch_num_tokens, global_batch_size),
            **{"loss_agg_mode": "token-mean" if self.token_level_loss else "seq-mean-token-mean", **self.call_options},
            **fed, **self.stablerl_params)
        self.last_metrics = metrics
        device = log_probs.device
        if record is not None and record.host.info is not None:  # training_step merges info into its status
            for key, value in metrics.items():
                record.host.info[f"stablerl/{key}"] = torch.tensor(float(value), device=device)
        clip_ratio = torch.tensor(float(metrics.get("pg_clipfrac", 0.0)), device=device)
        ppo_kl = masked_mean(-(log_probs - old_log_probs).detach(), mask, dim=None)
        return loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio


def build_policy_loss(args, selection: Selection, strategy=None) -> StablePolicyLoss:
    """The StablePolicyLoss for OpenRLHF ``args`` (the kwargs ``ActorPPOTrainer`` passes its PolicyLoss)."""
    dp_group = None
    if strategy is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        from openrlhf.utils.loss_utils import _get_dp_group

        dp_group = _get_dp_group(strategy)
    name = selection.policy_loss
    if name in OPENRLHF_POLICY_LOSSES:  # a stablerl loss whose name OpenRLHF also uses
        name = PREFIX + name
    check_version_source(stablerl.get_spec(stablerl.POLICY_LOSS, selection.policy_loss), args.train)
    settings = selection.loss_settings()  # one precedence rule; the effective-settings table is printed once
    log_effective_settings(NAME, stablerl.get_spec(stablerl.POLICY_LOSS, selection.policy_loss), settings)
    correction = {k: getattr(args.algo.advantage, k) for k in ("is_correction_level", "is_correction_mode",
                                                             "is_correction_gating", "is_correction_threshold")}
    # clip_to_params=False: only the clip flags the user gave set the loss's clip fields (in settings)
    # dynamic batching runs DeepSpeed with gradient_accumulation_steps 1 and undivided normalisers
    dynamic = bool(getattr(args.train, "dynamic_batch_enable", False))
    grad_accum = 1 if strategy is None or dynamic else int(getattr(strategy, "accumulated_gradient", 1) or 1)
    batch_size = getattr(args.train, "batch_size", None)
    step_rows = None if strategy is None or dynamic or batch_size is None else float(batch_size)
    return StablePolicyLoss(clip_eps_low=args.actor.eps_clip_low_high[0], clip_eps_high=args.actor.eps_clip_low_high[1],
                            dual_clip=args.actor.dual_clip, token_level_loss=args.actor.loss_agg_mode == "token-mean",
                            policy_loss_type=name, **correction, stablerl_params=as_params(settings), dp_group=dp_group,
                            clip_to_params=False, grad_accum=grad_accum, step_rows=step_rows)
