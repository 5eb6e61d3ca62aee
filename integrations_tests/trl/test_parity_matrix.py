"""TRL's column of the cross-framework parity matrix (see integrations_tests/parity/parity_matrix.py).

The shared batch goes through the stablerl TRL adapter's real code: ``GRPOTrainer._compute_loss``
(which runs TRL 1.16's own ``_compute_loss`` around the stablerl loss) and the adapter's advantage
step (``AdvantageCallSite.run``), on a trainer object built without ``__init__`` that holds
the attributes those methods read, one process, no gradient accumulation. The model forward is the
only thing replaced: TRL's ``_get_per_token_logps_and_entropies`` returns the batch's log-probs and
entropies (the adapter's override of it still runs). Every TRL knob that touches the loss is set
explicitly (beta 0, no entropy or off-policy mask, no entropy bonus); the stablerl hyper-parameters
go in ``stablerl_loss_params`` / ``stablerl_advantage_params`` (``parity_matrix.SETTINGS``: all, or none).
"""

from __future__ import annotations

import dataclasses
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parity"))

import parity_matrix as M  # noqa: E402

import stablerl  # noqa: E402

FRAMEWORK = "trl"
ALGORITHMS = M.matrix_algorithms()
results = M.Results.fixture(FRAMEWORK)


def _trainer(loss=None, estimator=None, params=None, *, rollout=False, correction_by_trl=True, mode="token-mean",
             **extra_args):
    """A stablerl ``GRPOTrainer`` without ``__init__``: the attributes ``_compute_loss`` (TRL's and the
    adapter's) and the advantage step read, for one process and GA = 1. ``rollout``: vLLM on (its
    log-probs in the batch), with TRL's IS correction on unless ``correction_by_trl=False``."""
    from trl import GRPOConfig as TRLConfig

    from stablerl.adapters.trl import GRPOConfig, GRPOTrainer
    from stablerl.adapters.trl._loop import LoopExtras
    from stablerl.adapters.trl._loss import PolicyLossStep
    from stablerl.adapters.trl._passes import ForwardPasses
    from stablerl.adapters.trl._rollout import AdvantageCallSite
    from stablerl.adapters.trl._routing import RoutingReplay
    from stablerl.adapters.trl.trainer import (advantage_settings, loss_settings, rollout_correction_setting,
                                                without_rollout_correction)
    from stablerl.frameworks import as_params, get_framework, split_call_options
    from stablerl.patching import PatchLedger
    from stablerl.steps import AdvantageSelection

    defaults = {f.name: f.default for f in dataclasses.fields(TRLConfig) if f.default is not dataclasses.MISSING}
    ours = {f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.default is not dataclasses.MISSING}
    args = {**defaults, **ours, "steps_per_generation": 1, "gradient_accumulation_steps": 1, "beta": 0.0,
            "stablerl_loss_agg_mode": mode, **extra_args}
    params = dict(params or {})
    if params.pop(M.NO_STD_KNOB, False):
        args["scale_rewards"] = "none"
    if loss:  # TRL's own keys where TRL has one (epsilon / epsilon_high), stablerl_loss_params for the rest
        for name, key in get_framework(FRAMEWORK).hyperparameter_keys[M.POLICY_LOSS].items():
            if name in params:
                args[key.key] = params.pop(name)
        args["stablerl_loss_params"] = params
    else:
        args["stablerl_advantage_params"] = params
    t = GRPOTrainer.__new__(GRPOTrainer)
    t.args = SimpleNamespace(**args)
    t.loss_type = M.selection_name(FRAMEWORK, stablerl.get_spec(M.POLICY_LOSS, loss)) if loss else "dapo"
    t.epsilon_low = args["epsilon"]  # TRL's own clip: it only clips the zero-advantage host loss here
    t.epsilon_high = args["epsilon_high"] if args["epsilon_high"] is not None else args["epsilon"]
    t.importance_sampling_level = "token"
    t.beta = 0.0
    t.top_entropy_quantile = 1.0
    t.off_policy_mask_threshold = None
    t.use_vllm = rollout  # TRL passes rollout (vLLM) log-probs only with vLLM and its IS correction on
    t.vllm_importance_sampling_correction = rollout and correction_by_trl
    t.aux_loss_enabled = False
    t._entropy_bonus_enabled = False
    t.max_completion_length = None
    t.current_gradient_accumulation_steps = 1
    t.model = SimpleNamespace(training=True)
    t.state = SimpleNamespace(global_step=0, max_steps=1)
    t.accelerator = SimpleNamespace(
        num_processes=1, process_index=0, device=torch.device("cpu"),
        gather=lambda x: x, gather_for_metrics=lambda x: x, reduce=lambda x, reduction="sum": x,
        pad_across_processes=lambda x, dim=0, pad_index=0: x,
    )
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    # the adapter's collaborators, as its __init__ builds them from the effective hyper-parameters (one precedence
    # rule), without the config checks (the matrix reaches every offered algorithm's call site)
    t._stablerl_ledger = PatchLedger("__stablerl_trl_trainer_patch__")
    t._stablerl_loss = loss
    loss_params, options = split_call_options(as_params(loss_settings(t.args, loss))) if loss else ({}, {})
    correction, correction_params = rollout_correction_setting(t.args)
    t._stablerl_losses = PolicyLossStep(t, loss, params=loss_params, call_options=without_rollout_correction(options),
                                        agg_mode=mode, correction=correction, correction_params=correction_params)
    t._stablerl_loop = LoopExtras(t, {"entropy_controller": None, "trainer_hook": None})
    t._stablerl_store = t._stablerl_loop.store  # fresh algorithm state, as the core call has
    t._stablerl_routing = RoutingReplay(t, None)
    t._stablerl_passes = ForwardPasses(t, t._stablerl_routing)
    adv_params = as_params(advantage_settings(t.args, estimator)) if estimator else {}
    t._stablerl_rollout = AdvantageCallSite(t, t._stablerl_passes,
                                            AdvantageSelection(estimator=estimator, estimator_params=adv_params))
    return t


def _through_compute_loss(monkeypatch, name, b, mode, params):
    import trl

    spec = stablerl.get_spec(M.POLICY_LOSS, name)
    rollout = "rollout_log_prob" in spec.requires
    t = _trainer(loss=name, params=params, rollout=rollout, mode=mode)
    mask = b["response_mask"]
    B, T = mask.shape
    t.max_completion_length = T
    leaf = b["log_prob"].clone().requires_grad_(True)
    # the model forward: TRL's method, under the adapter's override, returns the batch's tensors
    monkeypatch.setattr(trl.GRPOTrainer, "_get_per_token_logps_and_entropies",
                        lambda self, *a, **k: (leaf, b["entropy"], None))
    inputs = {
        "prompt_ids": torch.zeros(B, 0, dtype=torch.long),
        "prompt_mask": torch.zeros(B, 0, dtype=torch.int32),
        "completion_ids": b["token_ids"],
        "completion_mask": mask.to(torch.int32),
        "advantages": b["seq_advantages"],  # TRL's [B]: one advantage per completion
        "old_per_token_logps": b["old_log_prob"],
        "num_items_in_batch": mask.sum().to(torch.float32),
        # extra per-row keys the adapter adds at its advantage step for losses that read groups / scores
        "stablerl_index": b["index"],
        "stablerl_scores": b["scores"],
        # TRL's old-log-prob pass's entropies, which the adapter carries with the rows for erc
        "stablerl_old_entropy": b["old_entropy"],
    }
    if "versions" in spec.requires:  # the generation round the trainer stamps on each row (A-3PO's versions)
        from stablerl.adapters.trl._adapter import VERSION_KEY

        t._stablerl_policy_version = 0  # the round of the batch being trained: the batch's own (synchronous)
        inputs[VERSION_KEY] = torch.full((B,), t._stablerl_policy_version, dtype=torch.long)
    if rollout:
        inputs["sampling_per_token_logps"] = b["rollout_log_prob"]
        inputs["importance_sampling_ratio"] = torch.ones(B, T)  # TRL's own ratio: not applied to such a loss
    loss = t._compute_loss(None, inputs)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), grad


def _through_advantage_step(name, b, params):
    t = _trainer(estimator=name, params=params)
    mask = b["response_mask"]
    n = mask.shape[0]
    out = {"completion_mask": mask.to(torch.int32), "completion_ids": torch.zeros(mask.shape, dtype=torch.long),
           "advantages": torch.zeros(n)}
    group = torch.arange(n) // b["group_size"]  # TRL's RepeatSampler: contiguous groups
    assert torch.equal(group, b["index"])
    # the old-log-prob pass's statistics (optimal_token_baseline: log-probs and sum_pi_squared from TRL's fused LM
    # head; empg: the generating policy's entropies), as the generation batch's record holds them once computed
    from stablerl.adapters.trl._adapter import TRLAdapter
    from stablerl.adapters.trl._records import GenerationBatch

    stats = M.advantage_inputs(name, b)
    teacher = stats.pop("teacher_log_prob", None)  # the teacher's forward (stablerl_teacher_model), once computed
    batch = GenerationBatch(TRLAdapter(), site=t._stablerl_rollout, response_mask=mask.float(), index=group,
                            scores=b["scores"], unscorable=torch.zeros(n, dtype=torch.bool), host=out, rows=slice(0, n),
                            entropy=stats.pop("entropy", None), old_stats=stats or None)
    if teacher is not None:
        batch.produced["teacher_log_prob"] = teacher
    adv = t._stablerl_rollout.run(batch, out)["advantages"]
    return adv * mask


@pytest.mark.parametrize("kind, name", ALGORITHMS, ids=[f"{k}:{n}" for k, n in ALGORITHMS])
def test_parity_matrix(monkeypatch, results, kind, name):
    M.check_case(results, kind, name, lambda *a: _through_compute_loss(monkeypatch, *a), _through_advantage_step)


def test_delta_l_and_rollout_correction_by_stablerl_loss_params(monkeypatch):
    """stablerl_loss_params={"loss_agg_mode": "delta_l"} reaches compute_policy_loss through the adapter's real
    _compute_loss; the rollout correction gives the same loss by its key (stablerl_rollout_correction) and by
    its alias ({"rollout_correction": "tis"} in stablerl_loss_params), and TRL's own vLLM IS ratio is not applied."""
    import trl

    from stablerl.adapters.trl import GRPOConfig
    from stablerl.adapters.trl.trainer import rollout_correction_setting

    b = M.loss_batch()
    mask = b["response_mask"]
    B, T = mask.shape

    def run(params, rollout, **extra_args):
        t = _trainer(loss="vanilla", params=params, rollout=rollout, correction_by_trl=False, **extra_args)
        t.loss_type = "stablerl_vanilla"
        t.max_completion_length = T
        leaf = b["log_prob"].clone().requires_grad_(True)
        monkeypatch.setattr(trl.GRPOTrainer, "_get_per_token_logps_and_entropies",
                            lambda self, *a, **k: (leaf, b["entropy"], None))
        inputs = {"prompt_ids": torch.zeros(B, 0, dtype=torch.long), "prompt_mask": torch.zeros(B, 0, dtype=torch.int32),
                  "completion_ids": b["token_ids"], "completion_mask": mask.to(torch.int32),
                  "advantages": b["seq_advantages"], "old_per_token_logps": b["old_log_prob"],
                  "num_items_in_batch": mask.sum().to(torch.float32)}
        if rollout:
            inputs["sampling_per_token_logps"] = b["rollout_log_prob"]
            inputs["importance_sampling_ratio"] = torch.full((B, T), 3.0)  # TRL's ratio: must not be applied
        return t._compute_loss(None, inputs).detach()

    common = {k: b[k] for k in ("log_prob", "old_log_prob", "response_mask")}
    common["advantages"] = b["seq_advantages"].unsqueeze(-1).expand(B, T)
    ctx = stablerl.Context(token_count=float(mask.sum()))
    ref, _ = stablerl.compute_policy_loss("vanilla", **common, loss_agg_mode="delta_l", loss_agg_params={"alpha": 0.5},
                                          ctx=ctx)
    token_mean, _ = stablerl.compute_policy_loss("vanilla", **common, ctx=ctx)
    got = run({"loss_agg_mode": "delta_l", "loss_agg_params": {"alpha": 0.5}}, rollout=False)
    torch.testing.assert_close(got, ref.to(got.dtype), rtol=1e-6, atol=1e-7)
    assert abs(float(ref) - float(token_mean)) > 1e-4
    ref, _ = stablerl.compute_policy_loss("vanilla", **common, rollout_log_prob=b["rollout_log_prob"],
                                          rollout_correction="tis", rollout_correction_params={"threshold": 1.5}, ctx=ctx)
    by_alias = run({"rollout_correction": "tis", "rollout_correction_params": {"threshold": 1.5}}, rollout=True)
    by_key = run({}, rollout=True, stablerl_rollout_correction="tis",
                 stablerl_rollout_correction_params={"threshold": 1.5})
    torch.testing.assert_close(by_alias, ref.to(by_alias.dtype), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(by_key, by_alias, rtol=0, atol=0)
    assert abs(float(ref) - float(token_mean)) > 1e-4  # the correction changed the loss
    # the same checks for both spellings, up front: TRL's IS on as well (twice), both spellings at once, bad
    # params, an unknown aggregation by name
    cpu = dict(output_dir="/tmp/stablerl-trl-options", use_cpu=True, report_to="none")
    for spelling in ({"stablerl_loss_params": {"rollout_correction": "tis"}}, {"stablerl_rollout_correction": "tis"}):
        with pytest.raises(stablerl.StableRLError, match=r"rollout_correction='tis' and TRL's "
                                                         r"vllm_importance_sampling_correction=True.*twice"):
            GRPOConfig(loss_type="vanilla", use_vllm=True, vllm_importance_sampling_correction=True, **spelling, **cpu)
        config = GRPOConfig(loss_type="vanilla", vllm_importance_sampling_correction=False, **spelling, **cpu)
        assert rollout_correction_setting(config) == ("tis", {})
    with pytest.raises(stablerl.StableRLError, match=r"threshold"):
        GRPOConfig(loss_type="vanilla", vllm_importance_sampling_correction=False, stablerl_loss_params={
            "rollout_correction": "tis", "rollout_correction_params": {"threshold": -1.0}}, **cpu)
    with pytest.raises(stablerl.StableRLError, match=r"set twice.*alias"):
        GRPOConfig(loss_type="vanilla", vllm_importance_sampling_correction=False, stablerl_rollout_correction="tis",
                   stablerl_loss_params={"rollout_correction": "icepop"}, **cpu)
    with pytest.raises(stablerl.StableRLError, match=r"loss_agg_mode.*'delta_ll'"):
        GRPOConfig(loss_type="vanilla", stablerl_loss_params={"loss_agg_mode": "delta_ll"}, **cpu)
