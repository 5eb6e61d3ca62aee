"""Routing replay (R2/R3) on verl 0.9.1's FSDP engine, through verl's own engine code on CPU.

The engine is verl's ``FSDPEngineWithLMHead`` as the registry hands it out (with the stablerl adapter
imported: our subclass). verl has no CPU platform, so the test builds the engine with verl's
``__init__`` and sets ``module`` to the plain tiny model instead of running ``initialize()`` (FSDP
sharding needs a CUDA device mesh); everything else -- ``left_right_2_no_padding``, micro-batching,
``prepare_model_inputs``, the forward, ``prepare_model_outputs``, backward, ``postprocess_batch_func`` --
is verl's code. The routes come the way verl's agent loop stores them: ``routed_experts`` int16
``[B, T, num_hidden_layers, k]`` over absolute layers, zero rows where the engine has no route (padding
and the last sampled token).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("verl")

from stablerl import routing_replay as rr  # noqa: E402
from stablerl.params import StableRLError  # noqa: E402
from tiny_moe import H, K, VOCAB, tiny_moe  # noqa: E402  (conftest puts this folder on sys.path)

_model = tiny_moe


# ---- a verl batch -------------------------------------------------------------------------------

B, P, R = 4, 5, 6  # rows, prompt width (left-padded), response width (right-padded)
PROMPT_LENS = [5, 3, 4, 2]
RESP_LENS = [6, 4, 1, 5]


def _padded_batch():
    g = torch.Generator().manual_seed(1)
    prompts = torch.zeros(B, P, dtype=torch.long)
    responses = torch.zeros(B, R, dtype=torch.long)
    for i in range(B):
        prompts[i, P - PROMPT_LENS[i]:] = torch.randint(3, VOCAB, (PROMPT_LENS[i],), generator=g)
        responses[i, :RESP_LENS[i]] = torch.randint(3, VOCAB, (RESP_LENS[i],), generator=g)
    pmask = (torch.arange(P).unsqueeze(0) >= P - torch.tensor(PROMPT_LENS).unsqueeze(1)).long()
    rmask = (torch.arange(R).unsqueeze(0) < torch.tensor(RESP_LENS).unsqueeze(1)).long()
    attn = torch.cat([pmask, rmask], 1)
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    return dict(prompts=prompts, responses=responses, input_ids=torch.cat([prompts, responses], 1),
                attention_mask=attn, position_ids=pos, response_mask=rmask)


def _rollout_routes(model, batch, last_missing=True):
    """The routes a rollout engine would report, in verl's layout: captured on a padded forward of
    ``model``, int16 [B, T, H, k], zero rows on padding and (vLLM) on each sequence's last token."""
    with rr.capture(model) as cap, torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
              position_ids=batch["position_ids"])
    routes = cap.routes()
    T = batch["input_ids"].shape[1]
    out = routes.to_token_layer_slot(H).reshape(B, T, H, K).to(torch.int16)
    out[batch["attention_mask"] == 0] = 0
    if last_missing:
        last = batch["attention_mask"].cumsum(-1).argmax(-1)
        out[torch.arange(B), last] = 0
    return out


def _verl_data(batch, routed=None, micro=2, use_remove_padding=True, flag=True, **extra):
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    fields = dict(batch)
    if routed is not None:
        fields["routed_experts"] = routed
    td = TensorDict(fields, batch_size=[B])
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=1.0, use_remove_padding=use_remove_padding, use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=micro, use_fused_kernels=False, calculate_entropy=False, **extra)
    if flag:  # what verl's @_with_routing_replay_flag(enabled=True) sets on compute_log_prob / update_actor
        tu.assign_non_tensor(td, enable_routing_replay=True)
    return td


def _log_probs(output, drop_last=False):
    """verl's per-token log-probs, packed; ``drop_last``: without each row's last position, whose label
    is the wrap-around of verl's roll over the micro-batch (never a response token)."""
    rows = output["model_output"]["log_probs"].unbind() if isinstance(output, dict) else output
    return torch.cat([r[:-1] if drop_last else r for r in rows])


def _rows(packed):
    return list(torch.split(packed, [p + r for p, r in zip(PROMPT_LENS, RESP_LENS)]))


def _reference_log_probs(model, batch, routes_bthk=None):
    """Per-token log-probs of the next token over every valid position, packed row-major (verl's
    ``log_probs`` before it cuts the responses), from a plain padded forward (optionally under replay)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    ctx = None
    if routes_bthk is not None:
        T = ids.shape[1]
        routes = rr.Routes.from_token_layer_slot(routes_bthk.reshape(B * T, H, K), model=model, batch_shape=(B, T))
        ctx = rr.replay(model, routes)
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=batch["position_ids"]).logits
    finally:
        if ctx is not None:
            ctx.remove()
    keep = mask.bool()
    # verl rolls the packed token stream as a whole: a row's last position "predicts" the next row's first
    nxt = torch.roll(ids[keep], -1)
    return torch.log_softmax(logits[keep].float(), -1).gather(-1, nxt.unsqueeze(-1)).squeeze(-1)


def _experts_used(model, fn):
    with rr.capture(model) as cap:
        fn()
    return cap.routes_list()


# ---- tests --------------------------------------------------------------------------------------


def test_registry_hands_out_the_replay_engine(adapter, make_engine):
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    cls = EngineRegistry.get_engine_cls("language_model", "fsdp2")
    assert cls.__name__ == "StableRLFSDPEngineWithLMHead" and issubclass(cls, FSDPEngineWithLMHead)
    assert EngineRegistry.get_engine_cls("language_model", "fsdp") is cls
    report = adapter.registration_report()
    assert report["engine"]["engine_class"] == cls.__name__ and "fsdp2:cuda" in report["engine"]["registry_entries"]


@pytest.mark.parametrize("use_remove_padding, pad_to_length", [(True, False), (False, False), (True, True)],
                         ids=["packed", "padded", "packed+bucket_pad"])
def test_r3_replays_rollout_routes_in_compute_log_prob(make_engine, use_remove_padding, pad_to_length):
    model = _model()
    batch = _padded_batch()
    # the "rollout engine": same weights, different numerics -> partly different experts
    rollout = copy.deepcopy(model)
    with torch.no_grad():
        for layer in rollout.model.layers:
            layer.mlp.gate.weight.add_(0.5 * torch.randn_like(layer.mlp.gate.weight))
    routed = _rollout_routes(rollout, batch)
    # pad_to_length: verl appends a static pad (bucket 16) to each packed micro-batch; its rows have no route
    eng = make_engine("R3", model, use_remove_padding=use_remove_padding,
                      **({"pad_to_length": True, "pad_to_length_bucket": 16} if pad_to_length else {}))
    native = _reference_log_probs(model, batch)
    expected = _reference_log_probs(model, batch, routed)
    assert (expected - native).abs().max() > 1e-3  # the rollout's routes really differ

    out = eng.infer_batch(_verl_data(batch, routed, use_remove_padding=use_remove_padding))
    got = _log_probs(out, drop_last=True)
    expected, native = _log_probs(_rows(expected), True), _log_probs(_rows(native), True)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert not rr.find_routers(model)[0].module._forward_hooks  # replay removed after the step
    # the same data without verl's routing-replay flag (the reference model's pass): native routing
    out_ref = eng.infer_batch(_verl_data(batch, routed, use_remove_padding=use_remove_padding, flag=False))
    torch.testing.assert_close(_log_probs(out_ref, drop_last=True), native, atol=1e-5, rtol=1e-5)


def _loss(model_output, data, dp_group=None):
    lp = model_output["log_probs"]
    loss = -torch.cat(list(lp.unbind())).mean()
    return loss, {"loss": loss.detach().item()}


def test_r3_update_pins_experts_and_keeps_router_gradient(make_engine):
    batch = _padded_batch()
    results = {}
    for mode in (None, "R3"):
        model = _model()
        routed = _rollout_routes(model, batch)  # rollout at the current weights
        eng = make_engine(mode, model)
        eng.optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        data = _verl_data(batch, routed)
        eng.optimizer.zero_grad()
        eng.forward_backward_batch(data, _loss, forward_only=False)
        router_grad = model.model.layers[0].mlp.gate.weight.grad.abs().sum().item()
        eng.optimizer.step()
        used = _experts_used(model, lambda: eng.forward_backward_batch(_verl_data(batch, routed), _loss,
                                                                       forward_only=False))
        # each micro-batch's experts, packed, against the rollout's at the same tokens
        mb_routes = rr.Routes.concat_tokens([r for r in used])
        full = rr.Routes.from_token_layer_slot(routed.reshape(-1, H, K), model=model, batch_shape=(B, P + R))
        rollout = full.unpad(batch["attention_mask"])
        results[mode] = (rr.mismatch_fraction(rollout, mb_routes), router_grad)
    drift_native, _ = results[None]
    drift_replay, grad = results["R3"]
    print("R3 update drift native / replay, router grad:", results)
    assert drift_native > 0.05, results
    assert drift_replay == 0.0 and grad > 0, results


@pytest.mark.parametrize("pad_to_length", [False, True], ids=["packed", "packed+bucket_pad"])
def test_r2_records_in_compute_log_prob_and_replays_in_update(make_engine, pad_to_length):
    batch = _padded_batch()
    model = _model()
    eng = make_engine("R2", model, **({"pad_to_length": True, "pad_to_length_bucket": 16} if pad_to_length else {}))
    out = eng.infer_batch(_verl_data(batch))  # compute_log_prob: no routed_experts yet -> record
    rec = out["model_output"]["routed_experts"]
    assert rec.is_nested and rec.dtype == torch.int16
    lens = [int(m.sum()) for m in batch["attention_mask"]]
    assert [t.shape for t in rec.unbind()] == [torch.Size([n, H, K]) for n in lens]
    native = _rollout_routes(model, batch, last_missing=False)
    torch.testing.assert_close(torch.cat(list(rec.unbind())), native[batch["attention_mask"].bool()])

    # update with the recorded routes (verl's trainer puts them in the batch), after a big step
    eng.optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    padded = torch.zeros(B, P + R, H, K, dtype=torch.int16)
    padded[batch["attention_mask"].bool()] = torch.cat(list(rec.unbind()))
    drifted = rr.mismatch_fraction(
        rr.Routes.from_token_layer_slot(native.reshape(-1, H, K), model=model, batch_shape=(B, P + R)),
        rr.Routes.from_token_layer_slot(_rollout_routes(model, batch, last_missing=False).reshape(-1, H, K),
                                        model=model, batch_shape=(B, P + R)))
    print("R2 drift after perturbation:", drifted)
    assert drifted > 0.05
    used = _experts_used(model, lambda: eng.forward_backward_batch(_verl_data(batch, padded), _loss,
                                                                   forward_only=False))
    recorded = rr.Routes.from_token_layer_slot(torch.cat(list(rec.unbind())), model=model)
    # each micro-batch (2 rows) forwards its tokens, then verl's bucket pad (routed natively)
    lens = [p + r for p, r in zip(PROMPT_LENS, RESP_LENS)]
    per_mb = [sum(lens[i:i + 2]) for i in range(0, B, 2)]
    assert [u.num_tokens for u in used] == ([-(-n // 16) * 16 for n in per_mb] if pad_to_length else per_mb)
    used = [u.slice_tokens(0, n) for u, n in zip(used, per_mb)]
    assert rr.mismatch_fraction(recorded, rr.Routes.concat_tokens(used)) == 0.0
    assert model.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0


def test_disabled_mode_is_verls_engine(make_engine):
    batch = _padded_batch()
    model = _model()
    routed = _rollout_routes(_model(seed=3), batch)
    eng = make_engine(None, model)
    out = eng.infer_batch(_verl_data(batch, routed))
    verls = make_engine(None, model, engine_cls="verl")  # verl's own FSDPEngineWithLMHead
    assert type(verls).__name__ == "FSDPEngineWithLMHead"
    torch.testing.assert_close(_log_probs(out), _log_probs(verls.infer_batch(_verl_data(batch, routed))),
                               atol=0, rtol=0)
    assert not rr.find_routers(model)[0].module._forward_hooks


def test_errors(adapter, make_engine):
    batch = _padded_batch()
    eng = make_engine("R3", _model())
    with pytest.raises(StableRLError, match="enable_rollout_routing_replay=True"):
        eng.infer_batch(_verl_data(batch))  # R3 without routes from the rollout
    eng = make_engine("R-3", _model())
    with pytest.raises(StableRLError, match=r"unknown fsdp_config.router_replay.mode 'R-3'.*'R3'"):
        eng.infer_batch(_verl_data(batch, _rollout_routes(_model(), batch)))
    dense = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB)).float()
    eng = make_engine("R2", dense)
    with pytest.raises(StableRLError, match="no MoE router of a known family"):
        eng.infer_batch(_verl_data(batch))
    eng = make_engine("R3", _model())
    eng.use_ulysses_sp = True
    with pytest.raises(StableRLError, match="sequence parallelism"):
        eng.infer_batch(_verl_data(batch, _rollout_routes(_model(), batch)))


def _worker(monkeypatch, *overrides):
    import verl
    from hydra import compose, initialize_config_dir

    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555").items():
        monkeypatch.setenv(k, v)
    conf = os.path.join(os.path.dirname(verl.__file__), "trainer/config")
    with initialize_config_dir(config_dir=conf, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[
            *overrides, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.n=1"])
    from verl.workers.engine_workers import ActorRolloutRefWorker

    return ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor_rollout")


RR_KEY = "+actor_rollout_ref.actor.fsdp_config.router_replay.mode"
ROLLOUT_RR = "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"


@pytest.mark.parametrize("overrides, enabled", [
    ((), False),
    ((f"{RR_KEY}=disabled",), False),
    ((f"{RR_KEY}=R3", ROLLOUT_RR), True),
    ((f"{RR_KEY}=R2",), True),
])
def test_worker_switch(adapter, monkeypatch, overrides, enabled):
    """verl's ActorRolloutRefWorker forces routing replay off for FSDP; the adapter's switch turns it on
    from fsdp_config.router_replay.mode, so verl's own decorators flag compute_log_prob / update_actor."""
    assert _worker(monkeypatch, *overrides).enable_routing_replay is enabled


@pytest.mark.parametrize("overrides, message", [
    ((f"{RR_KEY}=R3",), "set actor_rollout_ref.rollout.enable_rollout_routing_replay=True"),
    ((f"{RR_KEY}=R2", ROLLOUT_RR), "unset actor_rollout_ref.rollout.enable_rollout_routing_replay"),
    ((f"{RR_KEY}=r4",), "unknown fsdp_config.router_replay.mode 'r4'"),
    ((f"{RR_KEY}=R3", ROLLOUT_RR, "actor_rollout_ref.actor.strategy=fsdp_turbo"), "this actor uses 'fsdp_turbo'"),
])
def test_worker_switch_errors(adapter, monkeypatch, overrides, message):
    with pytest.raises(StableRLError, match=message):
        _worker(monkeypatch, *overrides)


def test_a_failed_engine_patch_does_not_break_verl_and_routing_replay_refuses(adapter, monkeypatch):
    from types import ModuleType

    from stablerl.adapters.verl import _engine

    monkeypatch.setitem(_engine._STATE, "error", None)
    _engine._apply(ModuleType("verl_without_the_fsdp_engine"))  # what a future verl might look like: no raise
    assert "FSDPEngineWithLMHead" in _engine.status()["error"]
    with pytest.raises(StableRLError, match="FSDP engine subclass is not installed"):
        _worker(monkeypatch, f"{RR_KEY}=R2")
