"""TRL part of ``stablerl bench``: stablerl's losses against TRL 1.16's built-in ``loss_type``\\s.

TRL has no standalone loss function: its loss lives in ``GRPOTrainer._compute_loss(model, inputs)``,
after the model forward. Both sides are the frameworks' real methods on light stand-in trainers whose
``__init__`` builds no model and whose forward (``_get_per_token_logps_and_entropies``) returns the
prepared log-prob tensor, so only loss computation is timed:

* TRL: ``trl.GRPOTrainer._compute_loss`` (its per-token loss, aggregation and metrics);
* ours: the stablerl TRL adapter's ``GRPOTrainer`` (loaded with ``stablerl.frameworks.load_adapter("trl")``),
  built by its own ``__init__`` from a config selecting ``loss_type="stablerl_<name>"``. The timed call is
  its ``_stablerl_policy_loss`` (the policy term its ``_compute_loss`` adds to TRL's surroundings, which
  it runs with zero advantages: the same cost with any loss); the same-loss check runs its whole
  ``_compute_loss``. So the bench runs the code users run and cannot drift from it.

Pairs (``TRL_TWINS``; the conventions are those of ``integrations_tests/trl/test_trl_parity.py``):
``dapo``/``bnpo``/``grpo``/``dr_grpo``/``luspo`` == ``vanilla`` without dual clip, with the
aggregation of each; ``grpo`` at ``importance_sampling_level="sequence"`` == ``gspo``; ``cispo`` with
TRL's absolute cap ``epsilon_high=c`` == ``cispo`` with ``clip_ratio_high=c-1``; ``sapo`` == ``sapo``.
TRL's ``vespo`` has no stablerl twin. Before timing, every pair is checked to compute the same loss
and gradient on the case's inputs in fp32 (:func:`check_same_loss`); a pair that does not is an
error in the results, not a timing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch

from stablerl.frameworks import load_adapter

#: label -> (TRL loss_type, TRL trainer settings, stablerl loss, its hyper-parameters, loss_agg_mode)
TRL_TWINS: dict[str, tuple[str, dict, str, dict, str]] = {
    "dapo": ("dapo", {"epsilon": 0.2, "epsilon_high": 0.28},
             "vanilla", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": None}, "token-mean"),
    "bnpo": ("bnpo", {"epsilon": 0.2, "epsilon_high": 0.28},
             "vanilla", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": None}, "token-mean"),
    "grpo": ("grpo", {"epsilon": 0.2, "epsilon_high": 0.28},
             "vanilla", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": None}, "seq-mean-token-mean"),
    "dr_grpo": ("dr_grpo", {"epsilon": 0.2, "epsilon_high": 0.28},
                "vanilla", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": None},
                "seq-mean-token-sum-norm"),
    "luspo": ("luspo", {"epsilon": 0.2, "epsilon_high": 0.28},
              "vanilla", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": None}, "seq-mean-token-sum"),
    "grpo_sequence": ("grpo", {"epsilon": 3e-4, "epsilon_high": 4e-4, "importance_sampling_level": "sequence"},
                      "gspo", {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}, "seq-mean-token-mean"),
    "cispo": ("cispo", {"epsilon_high": 1.2}, "cispo", {"clip_ratio_high": 0.2, "clip_ratio_low": 10.0}, "token-mean"),
    "sapo": ("sapo", {}, "sapo", {"tau_pos": 1.0, "tau_neg": 1.05}, "seq-mean-token-mean"),
}

#: agreement required in fp32 (different summation orders, e.g. TRL's sapo forms ``sigmoid * 4 / tau``)
LOSS_RTOL, LOSS_ATOL, GRAD_RTOL = 1e-5, 1e-7, 1e-4


def trl_version() -> Optional[str]:
    """The installed TRL's version, or ``None`` when TRL cannot be imported."""
    try:
        import trl  # noqa: WPS433 - optional dependency
    except Exception:  # noqa: BLE001 - absent or broken: the TRL section is skipped
        return None
    return trl.__version__


@functools.lru_cache(maxsize=None)
def _trainer_classes() -> tuple[type, type]:
    """``(TRLLossHost, AdapterLossHost)``: stand-ins for TRL's ``GRPOTrainer`` and for the stablerl
    TRL adapter's ``GRPOTrainer`` (got through :func:`stablerl.frameworks.load_adapter`), built on
    first use (they subclass the framework's classes, so TRL is imported here, not at import time)."""
    from trl import GRPOTrainer

    adapter = load_adapter("trl")

    class TRLLossHost(GRPOTrainer):
        """TRL 1.16's ``GRPOTrainer`` without its ``__init__`` (no model, data or accelerator):
        the attributes ``_compute_loss`` reads, on one process with no gradient accumulation, no
        KL (``beta=0``), no vLLM, no entropy or off-policy mask and no entropy bonus; its
        forward returns ``self.log_prob``. An attribute TRL reads and this lacks raises
        ``AttributeError``: the case fails."""

        def __init__(self, args=None, **_ignored):
            self.args = args
            self.loss_type = args.loss_type
            self.epsilon_low = args.epsilon
            self.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
            self.importance_sampling_level = args.importance_sampling_level
            self.beta = 0.0
            self.top_entropy_quantile = 1.0
            self.off_policy_mask_threshold = None
            self.use_vllm = False
            self.vllm_importance_sampling_correction = False
            self.aux_loss_enabled = False
            self._entropy_bonus_enabled = False
            self.max_completion_length = args.max_completion_length
            self.current_gradient_accumulation_steps = 1
            self.model = SimpleNamespace(training=True)
            self.state = SimpleNamespace(global_step=0, max_steps=0)
            self.tools = None
            self.accelerator = SimpleNamespace(
                num_processes=1,
                device=torch.device("cpu"),
                gather=lambda t: t,
                gather_for_metrics=lambda t: t,
                reduce=lambda t, reduction="sum": t,
                unwrap_model=lambda m: m,
            )
            self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
            self.log_prob: Optional[torch.Tensor] = None
            self.entropies: Optional[torch.Tensor] = None

        def add_callback(self, callback) -> None:  # no training loop: callbacks never run
            pass

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args,
                                               **kwargs):
            return self.log_prob, self.entropies, None

    class AdapterLossHost(adapter.GRPOTrainer, TRLLossHost):
        """The adapter's ``GRPOTrainer`` with its own ``__init__`` (which reads the stablerl
        settings from ``args``) and its own loss methods; only TRL's base (next in the MRO) is
        the stand-in above."""

    return TRLLossHost, AdapterLossHost


def _config(config_class: type, max_completion_length: int, **settings: Any) -> SimpleNamespace:
    """``config_class``'s defaults (TRL's or the adapter's ``GRPOConfig``) with ``settings``, as a
    namespace: building the real ``TrainingArguments`` would set up an accelerator."""
    defaults = {f.name: f.default for f in dataclasses.fields(config_class) if f.default is not dataclasses.MISSING}
    return SimpleNamespace(**{**defaults, "steps_per_generation": 1, "max_completion_length": max_completion_length,
                              **settings})


def trl_inputs(inputs: dict) -> dict:
    """TRL's batch for ``_compute_loss`` from the bench inputs: ``[B]`` advantages (one per
    sequence), TRL's int32 completion mask, ``num_items_in_batch`` = valid tokens. The prompt is
    empty and the completion ids are one row: the stand-in forward does not read them."""
    mask = inputs["response_mask"]
    B, T = mask.shape
    dev = mask.device
    return {
        "prompt_ids": torch.zeros(1, 0, dtype=torch.long, device=dev),
        "prompt_mask": torch.zeros(B, 0, dtype=torch.int32, device=dev),
        "completion_ids": torch.zeros(1, T, dtype=torch.long, device=dev),
        "completion_mask": mask.to(torch.int32),
        "advantages": inputs["advantages"][:, 0].contiguous(),  # row 0 of every sequence is valid
        "old_per_token_logps": inputs["old_log_prob"],
        "num_items_in_batch": mask.sum().to(torch.float32),
    }


def trl_host(label: str, inputs: dict):
    """A stand-in TRL ``GRPOTrainer`` set up for the TRL side of pair ``label``."""
    from trl import GRPOConfig

    loss_type, settings, _, _, _ = TRL_TWINS[label]
    host_class, _ = _trainer_classes()
    host = host_class(args=_config(GRPOConfig, inputs["log_prob"].shape[1], loss_type=loss_type, **settings))
    host.entropies = inputs["entropy"]
    return host


def adapter_host(label: str, inputs: dict):
    """A stand-in of the stablerl TRL adapter's ``GRPOTrainer`` set up as a user selects our side of
    pair ``label``: ``loss_type="stablerl_<name>"``, ``stablerl_loss_params``, ``stablerl_loss_agg_mode``."""
    _, _, name, params, agg = TRL_TWINS[label]
    _, host_class = _trainer_classes()
    config = _config(load_adapter("trl").GRPOConfig, inputs["log_prob"].shape[1], loss_type=f"stablerl_{name}",
                     stablerl_loss_params=dict(params), stablerl_loss_agg_mode=agg)
    host = host_class(args=config)
    host.entropies = inputs["entropy"]
    return host


def _compute_loss_fn(host, batch: dict) -> Callable:
    """``host._compute_loss`` on ``batch`` with the stand-in forward returning ``lp``: ``(lp) -> (loss, metrics)``."""

    def call(lp: torch.Tensor):
        host.log_prob = lp
        host._metrics = {"train": defaultdict(list)}
        return host._compute_loss(None, batch), host._metrics

    return call


def trl_fn(label: str, inputs: dict, batch: dict) -> Callable:
    """TRL's real ``GRPOTrainer._compute_loss`` for the pair ``label``: ``(lp) -> (loss, metrics)``."""
    return _compute_loss_fn(trl_host(label, inputs), batch)


def ours_fn(label: str, inputs: dict, batch: dict) -> Callable:
    """Ours, timed: the stablerl TRL adapter's own policy-loss step (``GRPOTrainer._stablerl_policy_loss``,
    the term its ``_compute_loss`` adds to TRL's zero-advantage surroundings) on TRL's batch:
    ``(lp) -> (loss, metrics)``."""
    host = adapter_host(label, inputs)

    def call(lp: torch.Tensor):
        host._metrics = {"train": defaultdict(list)}
        loss, _ = host._stablerl_policy_loss(batch, lp, host.entropies, "train")
        return loss, host._metrics

    return call


def adapter_compute_loss_fn(label: str, inputs: dict, batch: dict) -> Callable:
    """Ours, whole: the adapter's ``GRPOTrainer._compute_loss`` (TRL's surroundings run with zero
    advantages, plus the stablerl policy term), i.e. exactly what a user's training step computes:
    ``(lp) -> (loss, metrics)``. The same-loss check uses it."""
    return _compute_loss_fn(adapter_host(label, inputs), batch)


def _loss_and_grad(call: Callable, lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = lp.detach().clone().requires_grad_(True)
    loss = call(leaf)[0]
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach().double(), grad.double()


def check_same_loss(label: str, inputs: dict) -> dict:
    """TRL's loss and ours on the case's inputs upcast to fp32 (so that bf16 rounding inside TRL
    does not hide a formula difference): raises ``AssertionError`` unless loss and gradient agree
    (``LOSS_RTOL``/``LOSS_ATOL``; gradient within ``GRAD_RTOL`` of its largest entry)."""
    fp32 = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in inputs.items()}
    batch = trl_inputs(fp32)
    l_trl, g_trl = _loss_and_grad(trl_fn(label, fp32, batch), fp32["log_prob"])
    l_ours, g_ours = _loss_and_grad(adapter_compute_loss_fn(label, fp32, batch), fp32["log_prob"])
    loss_diff = abs(float(l_ours - l_trl))
    scale = max(float(g_trl.abs().max()), 1e-30)
    grad_diff = float((g_ours - g_trl).abs().max()) / scale
    name = TRL_TWINS[label][2]
    if not loss_diff <= LOSS_ATOL + LOSS_RTOL * abs(float(l_trl)) or not grad_diff <= GRAD_RTOL:
        raise AssertionError(
            f"TRL loss_type={TRL_TWINS[label][0]!r} ({label}) and stablerl {name!r} disagree on the bench inputs "
            f"(fp32): loss {float(l_trl):.9g} vs {float(l_ours):.9g}, gradient max diff {grad_diff:.2e} of its max"
        )
    return {"fp32_loss_abs_diff": loss_diff, "fp32_grad_max_rel_diff": grad_diff}


def selected(losses: Optional[list[str]]) -> list[str]:
    """The pairs to measure: all, or those whose label or stablerl loss is in ``losses``."""
    return [k for k, v in TRL_TWINS.items() if not losses or k in losses or v[2] in losses]


def measure(label: str, inputs: dict, device: str, repeats: int, compare: Callable, agreement: Callable,
            max_s: Optional[float] = None) -> dict[str, Any]:
    """One case of one pair: the fp32 same-loss check, then ``compare`` (bench's interleaved
    timing and memory) and ``agreement`` (differences at the case's dtype)."""
    row: dict[str, Any] = dict(check_same_loss(label, inputs))
    batch = trl_inputs(inputs)
    ours, base = ours_fn(label, inputs, batch), trl_fn(label, inputs, batch)
    # TRL's batch tensors are inputs too: the memory count leaves them out, as it does the bench inputs
    with_batch = {**inputs, **{f"trl_{k}": v for k, v in batch.items()}}
    row.update(compare(ours, base, with_batch, device, repeats, max_s=max_s))
    row.update(agreement(ours, base, inputs))
    return row


def describe(label: str) -> dict[str, Any]:
    """The JSON description of a pair (without results)."""
    loss_type, settings, name, params, agg = TRL_TWINS[label]
    return {
        "baseline": f"trl:{loss_type}",
        "trl_settings": dict(settings),
        "ours": f"stablerl:{name}",
        "ours_params": dict(params),
        "loss_agg_mode": agg,
        "cases": {},
    }
