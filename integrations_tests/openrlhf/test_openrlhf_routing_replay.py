"""MoE routing replay (R2) through OpenRLHF 0.11.2's real code paths, on CPU with a tiny Qwen3-MoE.

The old-log-prob pass runs OpenRLHF's BaseModelActor.execute_batch -> PolicyModelActor.forward (the
by-value class Ray builds) -> Actor.forward, called by the real RemoteExperienceMaker.make_experience
(Ray replaced by a pickle round trip); the rows then go through OpenRLHF's replay-buffer split / unpad /
re-batch, and the update is the real ActorPPOTrainer.training_step (DeepSpeed replaced by a plain Adam
step). Padded and packed (--ds.packing_samples) layouts.
"""

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (nox -s openrlhf installs it)")

import os
from types import SimpleNamespace

import torch

import stablerl.adapters.openrlhf as adapter
from orlhf_helpers import (PickleGroup, dry_run, make_args, ppo_trainer, run_without_ray_or_gpu,
                           through_replay_buffer)
from stablerl import routing_replay as rr
from stablerl.adapters.openrlhf import Selection
from stablerl.adapters.openrlhf import _routing_replay as orr
from stablerl.params import StableRLError

VOCAB, NUM_EXPERTS, TOP_K = 64, 8, 2
LENGTHS = (9, 6, 12, 4, 10, 7)  # prompt + response tokens of the six samples
PROMPT = (3, 2, 4, 2, 3, 4)
ORDER = [4, 1, 5, 0]  # the training micro-batch: rows of both rollout batches, shuffled


def tiny_moe(seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, moe_intermediate_size=32, num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=True, max_position_embeddings=64, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )
    model = Qwen3MoeForCausalLM(cfg).float()
    model.config.use_cache = False  # as OpenRLHF's Actor sets; without a cache transformers honours packed position_ids
    return model


def _torch_bert_padding(monkeypatch):
    """flash_attn.bert_padding in torch (the stub raises): what --ds.packing_samples needs on CPU."""
    import openrlhf.models.ring_attn_utils as ring

    def unpad_input(hidden, attention_mask):
        indices = attention_mask.reshape(-1).nonzero().squeeze(-1)
        lens = attention_mask.sum(-1)
        cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
        return hidden.reshape(-1, *hidden.shape[2:])[indices], indices, cu, int(lens.max()), lens

    def pad_input(hidden, indices, batch, seqlen):
        out = hidden.new_zeros(batch * seqlen, *hidden.shape[1:])
        out[indices] = hidden
        return out.view(batch, seqlen, *hidden.shape[1:])

    monkeypatch.setattr(ring, "unpad_input", unpad_input)
    monkeypatch.setattr(ring, "pad_input", pad_input)
    monkeypatch.setattr(ring, "index_first_axis", lambda x, idx: x[idx])
    monkeypatch.setattr(ring, "rearrange", lambda t, pattern: t.reshape(-1, *t.shape[2:]))


def _args(packing, mode):
    args = make_args(policy_loss_type="ppo", stablerl=Selection(routing_replay=mode))
    args.ds = SimpleNamespace(packing_samples=packing, ring_attn_size=1, tensor_parallel_size=1)
    args.train.colocate_actor_ref = False
    args.algo.kl.use_loss = False
    return args


def _samples():
    """Two rollout batches of three samples, as SamplesGenerator + split_rollout_samples build them."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    g = torch.Generator().manual_seed(1)
    singles = []
    for i, (n, p) in enumerate(zip(LENGTHS, PROMPT)):
        action = torch.zeros(n - 1, dtype=torch.long)
        action[p - 1:] = 1
        singles.append(Experience(
            sequences=torch.randint(2, VOCAB, (1, n), generator=g), attention_mask=torch.ones(1, n, dtype=torch.long),
            action_mask=action.unsqueeze(0), prompts=[f"p{i}"], labels=[""], images=[None], mm_train_inputs=[None],
            rewards=torch.tensor([float(i % 2)]), response_length=torch.tensor([n - p]),
            truncated=torch.tensor([False]), total_length=torch.tensor([float(n)]), info={},
        ))
    return [Experience.concat_experiences(singles[:3], 0), Experience.concat_experiences(singles[3:], 0)]


_Group = PickleGroup  # RayActorGroup stand-in (orlhf_helpers)


def _run(monkeypatch, *, packing, mode, lr=0.05, steps=2, gc=False):
    """Old-log-prob pass + `steps` training steps on one micro-batch; what the routers did at each step."""
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from openrlhf.models import Actor
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    adapter.instrument(now=True)
    _torch_bert_padding(monkeypatch)
    run_without_ray_or_gpu(monkeypatch, ppo_actor)

    args = _args(packing, mode)
    model = tiny_moe()
    actor = Actor(model)
    actor.packing_samples, actor.temperature = packing, 1.0
    if gc:
        actor.gradient_checkpointing_enable()
    routers = [r.module for r in rr.find_routers(model)]
    optim = torch.optim.Adam(actor.parameters(), lr=lr)
    grads = []

    def optimizer_step(optimizer, *a, **k):
        grads.append([float(r.weight.grad.norm()) for r in routers])
        optimizer.step()
        optimizer.zero_grad()

    trainer = ppo_trainer(ppo_actor, args, actor, optim, optimizer_step)
    strategy = trainer.strategy

    # reference: the experts of a native forward at theta_old, padded, one row per sample
    samples_list = _samples()
    with torch.no_grad(), rr.capture(model) as cap:
        for s in samples_list:
            model(s.sequences, attention_mask=s.attention_mask)
    reference = {}
    for s, routes in zip(samples_list, cap.routes_list()):
        for prompt, row, n in zip(s.prompts, routes.sequences(), s.attention_mask.sum(-1).tolist()):
            reference[prompt] = row.slice_tokens(0, n)

    # old-log-prob pass: OpenRLHF's experience maker -> execute_batch -> PolicyModelActor.forward
    worker = object.__new__(ppo_actor.PolicyModelActor.__ray_metadata__.modified_class)
    worker.actor, worker.strategy = actor, strategy
    maker = RemoteExperienceMaker.__new__(RemoteExperienceMaker)
    maker.strategy, maker.args, maker.kl_ctl = strategy, args, SimpleNamespace(value=0.0)
    maker.actor_model_group, maker.critic_model_group = _Group(worker), None
    maker.reward_model_group = maker.initial_model_group = None
    experiences = maker.make_experience(samples_list)

    # replay buffer: split, unpad, shuffle, re-batch (what NaiveReplayBuffer + its collate_fn do)
    batch = through_replay_buffer(experiences, ORDER, packing)

    expected = rr.Routes.pad_batch([reference[p] for p in batch.prompts], side="right",
                                   length=batch.sequences.shape[1])
    if packing:
        expected = expected.unpad(batch.attention_mask)
    seen, original_loss = {}, trainer.actor_loss_fn

    def spy(log_probs, *a, **k):
        seen["log_probs"] = log_probs.detach().clone()
        return original_loss(log_probs, *a, **k)

    trainer.actor_loss_fn = spy
    n_tokens = float(batch.action_mask.sum())
    out = dict(experiences=experiences, batch=batch, expected=expected, used=[], log_probs=[], grads=grads,
               reference=reference, model=model)
    for step in range(steps):
        with rr.capture(model) as cap:
            trainer.training_step(batch, 0.0, step, dict(dp_size=1, batch_num_tokens=n_tokens,
                                                         global_batch_size=float(len(ORDER))))
        out["used"].append(cap.routes())
        out["log_probs"].append(seen["log_probs"])
    return out


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_r2_replays_the_old_pass_experts(monkeypatch, packing):
    native = _run(monkeypatch, packing=packing, mode=None)
    adapter.uninstrument()
    replayed = _run(monkeypatch, packing=packing, mode="R2")

    # the routes travelled with their rows: one SampleRoutes per row, [n_tokens, L, k] uint8, equal to the
    # experts of a native forward at theta_old
    for e in replayed["experiences"]:
        assert [type(s) for s in e.mm_train_inputs] == [orr.SampleRoutes] * len(e.sequences)
        for prompt, s, n in zip(e.prompts, e.mm_train_inputs, e.attention_mask.sum(-1).tolist()):
            assert s.indices.shape == (n, 2, TOP_K) and s.indices.dtype == torch.uint8
            ref = replayed["reference"][prompt]
            assert torch.equal(s.indices.permute(1, 0, 2).long(), ref.indices.long())
    for e in native["experiences"]:
        assert e.mm_train_inputs == [None] * len(e.sequences)  # routing replay off: OpenRLHF's field untouched

    # step 0, unchanged weights: replayed experts = recorded, log-probs identical to the native forward and
    # equal to the old log-probs of the experience maker
    expected = replayed["expected"]
    assert rr.mismatch_fraction(expected, replayed["used"][0]) == 0.0
    assert rr.mismatch_fraction(expected, native["used"][0]) == 0.0
    assert torch.equal(replayed["log_probs"][0], native["log_probs"][0])
    batch = replayed["batch"]
    old = batch.action_log_probs * batch.action_mask
    assert torch.allclose(replayed["log_probs"][0], old, atol=1e-5)

    # step 1, after one Adam step (lr 0.05): native routing drifts, the replay keeps the old pass's experts
    drift = rr.mismatch_fraction(expected, native["used"][1])
    assert drift > 0.2, drift
    assert rr.mismatch_fraction(expected, replayed["used"][1]) == 0.0
    assert all(g > 1e-4 for g in replayed["grads"][1])  # the router still learns
    assert not torch.allclose(replayed["log_probs"][1], native["log_probs"][1])
    print(f"[routing replay, {'packed' if packing else 'padded'}] drift without replay {drift:.3f}, with R2 0.0; "
          f"router grad norms {replayed['grads'][1]}")


def test_r2_keeps_the_replay_through_gradient_checkpointing(monkeypatch):
    plain = _run(monkeypatch, packing=False, mode="R2")
    adapter.uninstrument()
    ckpt = _run(monkeypatch, packing=False, mode="R2", gc=True)
    assert rr.mismatch_fraction(ckpt["expected"], ckpt["used"][1]) == 0.0
    # in step 1 the native experts differ from the recorded ones: a replay lost before the backward
    # recomputation would give other gradients
    assert rr.mismatch_fraction(plain["expected"], plain["used"][1]) == 0.0
    for a, b in zip(plain["grads"], ckpt["grads"]):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-7)
    for name, p in plain["model"].named_parameters():
        assert torch.allclose(p, dict(ckpt["model"].named_parameters())[name], atol=1e-6), name


def test_rows_whose_tokens_do_not_match_raise(monkeypatch):
    state = orr._Armed("R2", NUM_EXPERTS, (0, 1), packing=False)
    samples = [orr.SampleRoutes(torch.zeros(5, 2, TOP_K, dtype=torch.uint8))]
    with pytest.raises(rr.RoutesMismatchError, match="row 0 carries routes for 5 tokens but its attention_mask has 4"):
        state.join(samples, torch.tensor([[1, 1, 1, 1, 0, 0]]))
    experience = SimpleNamespace(mm_train_inputs=[None], sequences=torch.zeros(1, 6), attention_mask=None)
    with pytest.raises(StableRLError, match="carries no routes in mm_train_inputs"):
        orr.batch_routes(state, experience)


def _trainer(monkeypatch, args, model):
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from openrlhf.models import Actor

    monkeypatch.setattr(ppo_actor, "NaiveReplayBuffer", lambda *a, **k: SimpleNamespace())
    monkeypatch.setattr(ppo_actor, "torch_dist_barrier_and_cuda_sync", lambda: None)
    actor = Actor(model)
    actor.packing_samples = False
    return ppo_actor.ActorPPOTrainer(SimpleNamespace(args=args, ring_attn_group=None), actor, None, None, None)


def test_dense_model_r3_and_ring_attention_raise(monkeypatch):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    adapter.instrument(now=True)
    dense = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    with pytest.raises(StableRLError) as err:
        _trainer(monkeypatch, _args(False, "R2"), dense)
    msg = str(err.value)
    assert "--actor.stablerl_routing_replay R2 needs a Mixture-of-Experts actor" in msg
    assert "Qwen3ForCausalLM" in msg
    for family in ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3"):
        assert family in msg
    # R3 on the no-wrapper route (environment variable): armed (test_openrlhf_routing_replay_r3.py runs it)
    monkeypatch.setenv(adapter.ENV_ROUTING_REPLAY, "r3")
    args = _args(False, None)
    del args.stablerl
    armed = adapter.OpenRLHFAdapter().worker(_trainer(monkeypatch, args, tiny_moe()).actor).routes
    assert (armed.mode, armed.num_experts, armed.layer_ids, armed.top_k) == ("R3", NUM_EXPERTS, (0, 1), TOP_K)
    monkeypatch.setenv(adapter.ENV_ROUTING_REPLAY, "R2")
    armed = adapter.OpenRLHFAdapter().worker(_trainer(monkeypatch, args, tiny_moe()).actor).routes
    assert (armed.mode, armed.num_experts, armed.layer_ids, armed.packing) == ("R2", NUM_EXPERTS, (0, 1), False)
    monkeypatch.delenv(adapter.ENV_ROUTING_REPLAY)
    args = _args(True, "R2")
    args.ds.ring_attn_size = 2
    with pytest.raises(StableRLError, match="does not support ring attention / sequence parallelism"):
        _trainer(monkeypatch, args, tiny_moe())
    with pytest.raises(StableRLError, match=r"unknown --actor.stablerl_routing_replay 'R1'; valid: R2, R3"):
        orr.parse_mode("R1")


def test_patches_are_reversible():
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.models import Actor
    from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

    before = (ActorPPOTrainer.training_step, Actor.forward, RemoteExperienceMaker.make_experience)
    adapter.instrument(now=True)
    after = (ActorPPOTrainer.training_step, Actor.forward, RemoteExperienceMaker.make_experience)
    assert all(a is not b and a.__wrapped__ is b for a, b in zip(after, before))
    applied = adapter.is_applied()
    assert all(applied[k] for k in ("ActorPPOTrainer.training_step", "Actor.forward",
                                    "RemoteExperienceMaker.make_experience"))
    adapter.uninstrument()
    assert (ActorPPOTrainer.training_step, Actor.forward, RemoteExperienceMaker.make_experience) == before
    assert not any(adapter.is_applied().values())


# ----------------------------------------------------------------------------- CLI (dry run: Ray is faked)

BASE = ["--actor.model_name_or_path", "Qwen/Qwen3-30B-A3B", "--rollout.n_samples_per_prompt", "4",
        "--algo.advantage.estimator", "group_norm"]


def test_cli_flag(monkeypatch, capsys):
    from stablerl.adapters.openrlhf import train_ppo_ray as wrapper

    args, _ = dry_run(monkeypatch, BASE + ["--actor.stablerl_routing_replay", "r2", "--ds.packing_samples",
                                        "--vllm.num_engines", "1"])
    assert args.stablerl.routing_replay == "R2" and args.actor.stablerl_routing_replay == "R2"
    assert dry_run(monkeypatch, BASE)[0].stablerl.routing_replay is None
    monkeypatch.delenv(adapter.ENV_ROUTING_REPLAY, raising=False)
    r3, r3_init = dry_run(monkeypatch, BASE + ["--actor.stablerl_routing_replay", "r3"])
    assert r3.stablerl.routing_replay == "R3"
    assert r3_init["runtime_env"]["env_vars"][adapter.ENV_ROUTING_REPLAY] == "R3"  # reaches the vLLM rollout workers
    assert adapter.ENV_ROUTING_REPLAY not in os.environ  # set for the run (forwarded to the workers), then restored
    for argv, expected in [
        (["--actor.stablerl_routing_replay", "R4"], "argument --actor.stablerl_routing_replay: invalid choice: 'R4'"),
        (["--actor.stablerl_routing_replay", "R2", "--ds.ring_attn_size", "2"],
         "does not support ring attention / sequence parallelism (--ds.ring_attn_size 2)"),
    ]:
        with pytest.raises(SystemExit) as exc:
            wrapper.main(BASE + argv)
        assert exc.value.code == 2
        assert expected in capsys.readouterr().err
