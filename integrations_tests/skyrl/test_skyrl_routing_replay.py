"""Routing replay R2 / R3 in SkyRL's FSDP policy worker (``trainer.algorithm.stablerl_routing_replay``): SkyRL's own
``PolicyWorkerBase.forward`` (the old-log-prob pass, its micro-batches) and ``_forward_backward_micro`` (the update)
on SkyRL's ``HFModelWrapper`` around a tiny Qwen3-MoE built in code (2 MoE layers, 8 experts, top-2)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "moe"))
from moe_models import build_moe, left_padded_batch  # noqa: E402

from stablerl import routing_replay as rr  # noqa: E402
from stablerl.params import StableRLError, UnknownNameError  # noqa: E402

B, T, RESPONSE, LAYERS, TOP_K = 4, 10, 5, 2, 2


class _Stop(Exception):
    """Raised by the test's policy loss: the update's forward (and the loss call) ran under the replay."""


def _worker(model, mode, micro=2):
    from skyrl.backends.skyrl_train.workers.worker import PolicyWorkerBase
    from skyrl.backends.skyrl_train.workers.model_wrapper import HFModelWrapper

    seen = {}

    def loss(log_probs, old, advantages, config=None, loss_mask=None, rollout_logprobs=None):
        seen["log_probs"] = log_probs.detach()
        raise _Stop

    algorithm = SimpleNamespace(stablerl_routing_replay=mode, temperature=1.0, use_entropy_loss=False,
                                policy_loss_type="test")
    cfg = SimpleNamespace(algorithm=algorithm, micro_forward_batch_size_per_gpu=micro, max_tokens_per_microbatch=0)
    worker = PolicyWorkerBase.__new__(PolicyWorkerBase)  # SkyRL's worker methods on a model without Ray / FSDP
    worker.model, worker.cfg, worker.policy_loss_fn, worker.seen = HFModelWrapper(model, bf16=False), cfg, loss, seen
    return worker


def _batch(routes=None):
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

    ids, mask = left_padded_batch(B, T)
    data = {"sequences": ids, "attention_mask": mask}
    if routes is not None:
        data["rollout_expert_indices"] = routes
    batch = TrainingInputBatch(data)
    batch.metadata = {"response_length": RESPONSE}
    return batch


def _old_pass(cls, worker, batch):
    """SkyRL's old-log-prob pass: (log-probs [B, RESPONSE], the experts the routers used, the worker's output)."""
    with rr.capture(worker.model) as cap:
        out = cls.forward(worker, batch)
    logp = torch.tensor([o["logprobs"] for o in out.loss_fn_outputs])
    return logp, rr.Routes.concat_tokens(cap.routes_list()), out


def _update(cls, worker, batch, extra: dict):
    """The update micro-batch (all rows) up to SkyRL's loss call: (log-probs, experts used)."""
    from skyrl.backends.skyrl_train.workers.worker_utils import BaseBatchIterator

    full = dict(batch.items()) if hasattr(batch, "items") else {}
    full.update(extra)
    zeros = torch.zeros(B, RESPONSE)
    full.update(action_log_probs=zeros, advantages=zeros, loss_mask=torch.ones(B, RESPONSE))
    tib = type(batch)(full)
    tib.metadata = batch.metadata
    with rr.capture(worker.model) as cap, pytest.raises(_Stop):
        cls._forward_backward_micro(worker, BaseBatchIterator.batch_to_experience(tib), 1.0)
    return worker.seen["log_probs"], cap.routes()


def _as_skyrl(routes: rr.Routes) -> torch.Tensor:
    """Routes as SkyRL's rollout_expert_indices: [B, T, num_hidden_layers, k] uint8."""
    return routes.to_token_layer_slot(LAYERS).reshape(B, T, LAYERS, TOP_K).to(torch.uint8)


def _perturb_routers(model, scale, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in rr.find_routers(model):
            r.module.weight.add_(torch.randn(r.module.weight.shape, generator=g) * scale)


def test_r3_replays_the_batch_rollout_expert_indices(worker_class):
    model = build_moe("qwen3_moe")
    engine = copy.deepcopy(model)  # the rollout engine, numerically different routers
    _perturb_routers(engine, 0.5, seed=1)
    with rr.capture(engine) as cap:
        engine(*left_padded_batch(B, T)[:1], attention_mask=left_padded_batch(B, T)[1])
    rollout = cap.routes()
    routes = _as_skyrl(rollout)
    valid = rollout.valid.reshape(LAYERS, B, T).permute(1, 2, 0)  # every (row, token, layer) has a route

    native_lp, native_used, _ = _old_pass(worker_class, _worker(model, None), _batch(routes))
    drift = rr.mismatch_fraction(rollout, native_used)
    assert drift > 0.2, drift  # without replay the trainer routes other experts than the rollout
    worker = _worker(model, "R3")
    old_lp, old_used, _ = _old_pass(worker_class, worker, _batch(routes))
    assert valid.all() and rr.mismatch_fraction(rollout, old_used) == 0.0
    assert not torch.allclose(old_lp, native_lp, atol=1e-3)
    train_lp, train_used = _update(worker_class, worker, _batch(routes), {})
    assert rr.mismatch_fraction(rollout, train_used) == 0.0
    torch.testing.assert_close(train_lp, old_lp, atol=1e-5, rtol=0)  # the same experts, the same log-probs


def test_r2_records_in_the_old_pass_and_replays_in_the_update(worker_class):
    model = build_moe("qwen3_moe")
    worker = _worker(model, "R2", micro=3)  # two micro-batches (3 + 1 rows)
    old_lp, old_used, out = _old_pass(worker_class, worker, _batch())
    recorded = torch.stack([o["rollout_expert_indices"] for o in out.loss_fn_outputs])  # what the trainer gets
    assert recorded.shape == (B, T, LAYERS, TOP_K) and recorded.dtype == torch.uint8
    assert torch.equal(recorded, _as_skyrl(old_used))
    from stablerl.adapters.skyrl._routing import batch_field

    assert torch.equal(batch_field(out.loss_fn_outputs, "rollout_expert_indices"), recorded)

    _perturb_routers(model, 0.5, seed=2)  # an optimizer step's worth of router drift
    native_lp, native_used = _update(worker_class, _worker(model, None), _batch(), {})
    drift = rr.mismatch_fraction(old_used, native_used)
    assert drift > 0.1, drift
    train_lp, train_used = _update(worker_class, worker, _batch(), {"rollout_expert_indices": recorded})
    assert rr.mismatch_fraction(old_used, train_used) == 0.0  # the recorded experts, not the drifted ones
    gap_native, gap_r2 = (native_lp - old_lp).abs().max(), (train_lp - old_lp).abs().max()
    assert gap_r2 < 0.5 * gap_native, (gap_r2, gap_native)
    print(f"[SkyRL R2] expert drift {drift:.3f} -> 0; max |train - old| log-prob {gap_native:.4f} -> {gap_r2:.4f}")


def test_refusals(worker_class):
    model = build_moe("qwen3_moe")
    with pytest.raises(StableRLError, match="stablerl_routing_replay=R3: the batch has no rollout_expert_indices"):
        _old_pass(worker_class, _worker(model, "R3"), _batch())
    with pytest.raises(UnknownNameError, match="stablerl_routing_replay"):
        _old_pass(worker_class, _worker(model, "R4"), _batch())
    worker = _worker(model, "R2")
    worker.cfg.max_tokens_per_microbatch = 64
    with pytest.raises(StableRLError, match="max_tokens_per_microbatch"):
        _old_pass(worker_class, worker, _batch())


def test_config_key_and_reach():
    from stablerl.adapters.skyrl._config import config_class
    from stablerl.frameworks import get_framework, reach
    from stablerl import get_spec

    cfg = config_class().from_cli_overrides(["trainer.algorithm.stablerl_routing_replay=R2"])
    assert cfg.trainer.algorithm.stablerl_routing_replay == "R2"
    status, how = reach(get_framework("skyrl"), get_spec("router_family", "qwen3_moe"))
    assert status == "selectable" and "stablerl_routing_replay=R2" in how


def test_r2_trainer_puts_the_recorded_routes_into_the_batch():
    """The entry point's trainer: the per-sample routes of the policy's old-log-prob pass become the batch's
    rollout_expert_indices (SkyRL's own ``_execute_forward_pass`` runs, its dispatch answers with canned outputs)."""
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
    from skyrl.train.trainer import RayPPOTrainer

    from stablerl.adapters.skyrl._config import config_class
    from stablerl.adapters.skyrl._trainer import StableRayPPOTrainer

    routes = torch.randint(0, 8, (B, T, LAYERS, TOP_K), dtype=torch.uint8)
    canned = SimpleNamespace(loss_fn_outputs=[{"logprobs": [-1.0] * RESPONSE, "rollout_expert_indices": r}
                                              for r in routes])
    class Dispatch:  # SkyRL's WorkerDispatch answering with canned outputs
        def forward(self, *args, **kwargs):
            return canned

        forward_from_staged = forward

    dispatch = Dispatch()
    trainer = StableRayPPOTrainer.__new__(StableRayPPOTrainer)
    trainer.cfg = config_class().from_cli_overrides(["trainer.algorithm.stablerl_routing_replay=R2"])
    trainer.dispatch = dispatch
    logp = trainer._execute_forward_pass("policy", None, "logprobs", None)
    assert logp.shape == (B, RESPONSE) and not vars(dispatch)  # dispatch as it was
    batch = TrainingInputBatch({"sequences": torch.zeros(B, T, dtype=torch.long)})
    RayPPOTrainer_fwd = RayPPOTrainer.fwd_logprobs_values_reward
    try:
        RayPPOTrainer.fwd_logprobs_values_reward = lambda self, data: data
        out = trainer.fwd_logprobs_values_reward(batch)
    finally:
        RayPPOTrainer.fwd_logprobs_values_reward = RayPPOTrainer_fwd
    assert torch.equal(out["rollout_expert_indices"], routes) and trainer.stablerl_old_pass is None


def test_megatron_is_refused():
    """stablerl's replay wraps the FSDP worker's methods: under Megatron (SkyRL's own replay there) it says so."""
    from stablerl.adapters.skyrl._config import config_class
    from stablerl.adapters.skyrl._trainer import StableRayPPOTrainer

    trainer = StableRayPPOTrainer.__new__(StableRayPPOTrainer)
    trainer.cfg = config_class().from_cli_overrides(["trainer.strategy=megatron",
                                                     "trainer.algorithm.stablerl_routing_replay=R3"])
    with pytest.raises(StableRLError, match="not trainer.strategy=megatron"):
        trainer._stablerl_setup()
