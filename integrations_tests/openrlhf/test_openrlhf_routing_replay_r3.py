"""MoE routing replay R3 (the experts vLLM chose) through OpenRLHF 0.11.2's real code paths, on CPU.

The "vLLM engine" is a tiny Qwen3-MoE (3 layers, layer 0 dense, 8 experts, top-2) whose routers are a
*perturbed* copy of the trainer's, so the rollout's experts differ from the trainer's native ones. It
answers in vLLM's documented format: ``CompletionOutput.routed_experts`` a numpy uint8 array
``[prompt + completion - 1, num_hidden_layers, k]`` (absolute layers, zero rows for the dense layer, no row
for the last sampled token), and only when the engine was built with ``enable_return_routed_experts``.
The path is OpenRLHF's own: create_vllm_engines -> RolloutRayActor.__init__ (the by-value Ray class) ->
vllm.AsyncEngineArgs -> generate_responses -> SingleTurnAgentExecutor / a MultiTurnAgentExecutor loaded
from --train.agent_func_path -> SamplesGenerator._process_response_into_experience ->
split_rollout_samples -> make_experience -> execute_batch -> PolicyModelActor.forward -> Actor.forward,
then the replay buffer's split / unpad / shuffle and ActorPPOTrainer.training_step (Ray replaced by
direct calls and a pickle round trip, DeepSpeed by an Adam step).
"""

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (nox -s openrlhf installs it)")

import asyncio
import copy
import sys
from types import SimpleNamespace

import numpy as np
import torch

import stablerl.adapters.openrlhf as adapter
from stablerl import routing_replay as rr
from stablerl.adapters.openrlhf import _routing_replay as orr
from stablerl.params import StableRLError
from orlhf_helpers import ppo_trainer, run_without_ray_or_gpu, through_replay_buffer
from test_openrlhf_routing_replay import _Group, _args, _torch_bert_padding

VOCAB, NUM_EXPERTS, TOP_K, LAYERS, MOE_LAYERS = 64, 8, 2, 3, (1, 2)
MAX_LEN = 16  # --data.max_len: the multi-turn rows overflow it with their last environment feedback
PROMPTS = ["5 9 13 2", "7 3 11"]
ORDER = [4, 1, 5, 0]  # the training micro-batch: rows of both rollout batches, shuffled

AGENT = '''
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def step(self, states, **kwargs):
        import torch

        self.turn += 1
        return {"rewards": torch.tensor(1.0), "scores": 1.0, "environment_feedback": " 60 61 62",
                "done": self.turn >= 2}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


def tiny_moe(seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, mlp_only_layers=[0],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=32, num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=True, max_position_embeddings=64, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )
    model = Qwen3MoeForCausalLM(cfg).float()
    model.config.use_cache = False
    return model


def perturbed(model, scale=1.0, seed=5):
    """The rollout engine's model: the same weights, routers moved (bf16 / kernel drift, exaggerated)."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in rr.find_routers(other):
            w = r.module.weight
            w.add_(scale * w.std() * torch.randn(w.shape, generator=g))
    return other


class Tokenizer:
    """Whitespace-separated token ids (what the agent executors call)."""

    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        return {"input_ids": torch.tensor([[int(t) for t in text.split()]])}

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


class Engine:
    """vllm.AsyncLLMEngine stand-in: the perturbed model routes; random completions of 2-5 tokens."""

    def __init__(self, engine_args, model, seed=3):
        self.engine_args, self.model, self.calls = engine_args, model, []
        self.g = torch.Generator().manual_seed(seed)

    async def is_sleeping(self):
        return False

    async def generate(self, prompt, sampling_params, request_id):
        ids = list(prompt["prompt_token_ids"])
        n = min(int(torch.randint(2, 6, (1,), generator=self.g)), sampling_params.max_tokens)
        new = torch.randint(2, VOCAB, (n,), generator=self.g).tolist()
        routed = None
        if getattr(self.engine_args, "enable_return_routed_experts", False):
            with torch.no_grad(), rr.capture(self.model) as cap:  # the last sampled token is never forwarded
                self.model(torch.tensor([ids + new[:-1]]))
            routed = cap.routes().to_token_layer_slot(LAYERS).numpy().astype(np.uint8)
        self.calls.append((ids, new, routed))
        completion = SimpleNamespace(token_ids=new, text=" " + " ".join(map(str, new)), finish_reason="stop",
                                     logprobs=None, routed_experts=routed)
        yield SimpleNamespace(prompt_token_ids=ids, outputs=[completion])


def rollout_actor(monkeypatch, engine_model, agent_func_path=None, seed=3):
    """OpenRLHF's create_vllm_engines + RolloutRayActor.__init__ (the class Ray ships), Ray left out."""
    import vllm.engine.async_llm_engine as async_llm_engine
    import openrlhf.trainer.ray.vllm_engine as vllm_engine

    built = []

    class Options:
        def remote(self, **kwargs):
            built.append(kwargs)
            return kwargs

    with pytest.MonkeyPatch.context() as mp:  # the actor kwargs OpenRLHF builds for Ray
        mp.setattr(vllm_engine, "RolloutRayActor", SimpleNamespace(options=lambda **kw: Options()))
        vllm_engine.create_vllm_engines(1, 1, "tiny-qwen3-moe", 0, False, False, True, 64, shared_pg=object(),
                                        gpu_memory_utilization=0.5, agent_func_path=agent_func_path)
    engines = []
    monkeypatch.setattr(async_llm_engine, "FACTORY",
                        lambda a: engines.append(Engine(a, engine_model, seed)) or engines[-1])
    monkeypatch.setenv("RAY_ADDRESS", "local")  # else _configure_vllm_env asks the Ray GCS
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    worker = object.__new__(vllm_engine.RolloutRayActor.__ray_metadata__.modified_class)
    asyncio.run(worker.__init__(**built[0]))
    return worker, engines[0]


def rollout(monkeypatch, tmp_path, engine_model):
    """Three single-turn and three two-turn responses, as the vLLM rollout workers return them."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=None, logprobs=None, temperature=1.0)
    single, single_engine = rollout_actor(monkeypatch, engine_model)
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    multi, multi_engine = rollout_actor(monkeypatch, engine_model, agent_func_path=str(agent), seed=4)
    responses = asyncio.run(single.generate_responses(PROMPTS[0], "", params, MAX_LEN, Tokenizer(), num_samples=3))
    responses += asyncio.run(multi.generate_responses(PROMPTS[1], "", params, MAX_LEN, Tokenizer(), num_samples=3))
    return responses, single_engine, multi_engine


def reference(routed, n):
    """The rollout's routes of a row of n tokens from vLLM's array (independent of the adapter): the MoE
    layers' rows, then all-zero (natively routed) rows up to n."""
    idx = torch.zeros(len(MOE_LAYERS), n, TOP_K, dtype=torch.long)
    m = min(len(routed), n)
    idx[:, :m] = torch.from_numpy(routed[:m][:, list(MOE_LAYERS)].astype(np.int64)).permute(1, 0, 2)
    return rr.Routes(idx, num_experts=NUM_EXPERTS, layer_ids=MOE_LAYERS)


def expected_for(seqs, mask, packing):
    routes = rr.Routes.pack(seqs).pad(mask)
    return routes.unpad(mask) if packing else routes


class NativeCheck:
    """Per router call: which tokens used the top-k of their own router logits (native routing)."""

    def __init__(self, model):
        self.calls, self.handles = [], [r.module.register_forward_hook(self.hook) for r in rr.find_routers(model)]

    def hook(self, module, args, output):
        logits, used = output[0].detach(), output[2].detach()
        native = torch.topk(logits.float(), used.shape[-1], dim=-1).indices
        self.calls.append((native.sort(-1).values == used.long().sort(-1).values).all(-1))

    def remove(self):
        for h in self.handles:
            h.remove()


def _native_where_no_route(check, expected_list):
    """Every token without a rollout route (last token, tool output, padding) used its native experts;
    returns how many real such tokens and how many replayed tokens differ from native routing."""
    missing = forced = 0
    for f, expected in enumerate(expected_list):
        for layer in range(len(MOE_LAYERS)):
            native = check.calls[f * len(MOE_LAYERS) + layer]
            invalid = ~expected.valid[layer]
            assert bool(native[invalid].all())
            missing += int(invalid.sum())
            forced += int((~native[expected.valid[layer]]).sum())
    return missing, forced


def _run(monkeypatch, tmp_path, *, packing, mode, lr=0.05, steps=2):
    import ray
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from openrlhf.models import Actor
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    if mode is None:
        monkeypatch.delenv(adapter.ENV_ROUTING_REPLAY, raising=False)
    else:
        monkeypatch.setenv(adapter.ENV_ROUTING_REPLAY, mode)  # what the wrapper forwards to the vLLM workers
    # Ray ships PolicyModelActor by value, its methods wrapped by Ray's tracing at decoration; the wrapped
    # inherited BaseModelActor.execute_batch travels by reference. Pickled in the unpatched "driver",
    # unpickled in the patched "worker", as Ray does:
    assert not adapter.is_applied()["BaseModelActor.execute_batch"]
    policy_actor_class = ray.cloudpickle.dumps(ppo_actor.PolicyModelActor.__ray_metadata__.modified_class)
    adapter.instrument(now=True)
    _torch_bert_padding(monkeypatch)
    run_without_ray_or_gpu(monkeypatch, ppo_actor)

    model = tiny_moe()
    responses, single_engine, multi_engine = rollout(monkeypatch, tmp_path, perturbed(model))
    calls = [c for e in (single_engine, multi_engine) for c in e.calls]

    args = _args(packing, mode)
    args.rollout.micro_batch_size = 3
    generator = SamplesGenerator.__new__(SamplesGenerator)
    generator.strategy, generator.args = SimpleNamespace(args=args), args
    rows = [generator._process_response_into_experience(r, max_len=MAX_LEN) for r in responses]
    for e in rows:
        e.rewards, e.scores = torch.tensor([1.0]), torch.tensor([1.0])  # the same fields in every row
        e.info = {"response_clip_ratio": e.info["response_clip_ratio"]}

    actor = Actor(model)
    actor.packing_samples, actor.temperature = packing, 1.0
    trainer = ppo_trainer(ppo_actor, args, actor, torch.optim.Adam(actor.parameters(), lr=lr))
    strategy = trainer.strategy
    worker = object.__new__(ray.cloudpickle.loads(policy_actor_class))
    worker.actor, worker.strategy = actor, strategy
    maker = RemoteExperienceMaker.__new__(RemoteExperienceMaker)
    maker.strategy, maker.args, maker.kl_ctl = strategy, args, SimpleNamespace(value=0.0)
    maker.tokenizer = SimpleNamespace(pad_token_id=0)
    maker.actor_model_group, maker.critic_model_group = _Group(worker), None
    maker.reward_model_group = maker.initial_model_group = None

    samples_list = maker.split_rollout_samples(rows)
    out = dict(responses=responses, rows=rows, calls=calls, model=model)
    check = NativeCheck(model)
    with rr.capture(model) as cap:
        experiences = maker.make_experience(samples_list)
    out["old_used"], out["old_native"] = cap.routes_list(), check
    check.remove()
    out["experiences"] = experiences

    # the replay buffer: split, unpad, shuffle, re-batch
    batch = through_replay_buffer(experiences, ORDER, packing)
    out.update(batch=batch, used=[], native=[])
    n_tokens = float(batch.action_mask.sum())
    for step in range(steps):
        check = NativeCheck(model)
        with rr.capture(model) as cap:
            trainer.training_step(batch, 0.0, step, dict(dp_size=1, batch_num_tokens=n_tokens,
                                                         global_batch_size=float(len(ORDER))))
        check.remove()
        out["used"].append(cap.routes())
        out["native"].append(check)
    return out


def _references(run):
    """The rollout's routes of each row (by its tokens), from the engine's last call for that row."""
    by_tokens = {}
    for ids, new, routed in run["calls"]:
        by_tokens[tuple(ids + new)] = routed
    refs = []
    for response, row in zip(run["responses"], run["rows"]):
        tokens = response["observation_tokens"]
        routed = max((r for k, r in by_tokens.items() if tuple(tokens[:len(k)]) == k), key=len)
        refs.append(reference(routed, row.sequences.shape[1]))
    return refs


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_r3_replays_the_rollout_experts(monkeypatch, tmp_path, packing):
    run = _run(monkeypatch, tmp_path, packing=packing, mode="R3")

    # 1. the engine kwarg reached AsyncEngineArgs; vLLM's arrays came back in the executors' output
    for ids, new, routed in run["calls"]:
        assert routed.dtype == np.uint8 and routed.shape == (len(ids) + len(new) - 1, LAYERS, TOP_K)
        assert not routed[:, 0].any()  # the dense layer
    multi_turn = [r for r in run["responses"] if len(r["action_ranges"]) == 2]
    assert len(multi_turn) == 3 and len(run["calls"]) == 3 + 6
    for response in run["responses"]:
        last = [c for c in run["calls"] if response["observation_tokens"][:len(c[0]) + len(c[1])] == c[0] + c[1]][-1]
        assert response["routed_experts"] is last[2]  # the last engine call's array, untouched

    # 2. the samples generator put them into the Experience rows, cut to the row (max_len)
    refs = _references(run)
    lengths = [row.sequences.shape[1] for row in run["rows"]]
    assert max(lengths) == MAX_LEN  # a multi-turn row was truncated
    for row, response, n in zip(run["rows"], run["responses"], lengths):
        (routes,) = row.mm_train_inputs
        assert isinstance(routes, orr.RolloutRoutes) and routes.num_tokens == n
        assert np.array_equal(routes.routed_experts, response["routed_experts"][:n])

    # 3. after the old-log-prob pass each row carries SampleRoutes [n, L, k] uint8 = the rollout's routes
    experiences = run["experiences"]
    rows_out = [s for e in experiences for s in e.mm_train_inputs]
    assert [type(s) for s in rows_out] == [orr.SampleRoutes] * 6
    for s, ref, n in zip(rows_out, refs, lengths):
        assert s.indices.dtype == torch.uint8 and s.indices.shape == (n, len(MOE_LAYERS), TOP_K)
        assert torch.equal(s.indices.permute(1, 0, 2).long(), ref.indices)
        assert not s.indices[-1].any()  # the last sampled token has no route: natively routed

    # 4. the old-log-prob pass used exactly the rollout's experts, natively routed where it has none
    old_expected = [expected_for(refs[3 * i:3 * i + 3], e.attention_mask, packing) for i, e in enumerate(experiences)]
    for used, expected in zip(run["old_used"], old_expected):
        assert rr.mismatch_fraction(expected, used) == 0.0
    missing, forced = _native_where_no_route(run["old_native"], old_expected)
    assert missing >= 6 * len(MOE_LAYERS) and forced > 0

    # 5. every training step too (the second after an Adam step at lr 0.05)
    batch = run["batch"]
    order = [refs[i] for i in ORDER]
    expected = expected_for(order, batch.attention_mask, packing)
    for step, (used, check) in enumerate(zip(run["used"], run["native"])):
        assert rr.mismatch_fraction(expected, used) == 0.0, step
        missing, forced = _native_where_no_route(check, [expected])
        assert missing >= len(ORDER) * len(MOE_LAYERS) and forced > 0

    # 6. without routing replay the trainer routes natively: other experts than the rollout's
    adapter.uninstrument()
    native = _run(monkeypatch, tmp_path, packing=packing, mode=None)
    assert all(m is None for e in native["experiences"] for m in e.mm_train_inputs)
    assert all(r.get("routed_experts") is None for r in native["responses"])  # the engine returned none
    old_drift = [rr.mismatch_fraction(x, u) for x, u in zip(old_expected, native["old_used"])]
    drift = [rr.mismatch_fraction(expected, u) for u in native["used"]]
    assert min(old_drift) > 0.2 and min(drift) > 0.2, (old_drift, drift)
    print(f"[R3, {'packed' if packing else 'padded'}] rollout vs trainer experts without replay: old pass "
          f"{old_drift}, training steps {drift}; with R3 0.0 (natively routed tokens without a route: {missing})")


def test_engine_kwarg_and_vllm_version(monkeypatch, tmp_path):
    adapter.instrument(now=True)
    model = perturbed(tiny_moe())
    monkeypatch.setenv(adapter.ENV_ROUTING_REPLAY, "R3")
    _, engine = rollout_actor(monkeypatch, model)
    assert engine.engine_args.enable_return_routed_experts is True
    assert engine.engine_args.model == "tiny-qwen3-moe" and engine.engine_args.seed == 0  # OpenRLHF's kwargs kept
    monkeypatch.setenv(adapter.ENV_ROUTING_REPLAY, "R2")
    _, engine = rollout_actor(monkeypatch, model)
    assert engine.engine_args.enable_return_routed_experts is False

    import vllm

    monkeypatch.setenv(adapter.ENV_ROUTING_REPLAY, "R3")
    monkeypatch.setattr(vllm, "__version__", "0.13.2")
    with pytest.raises(StableRLError, match=r"R3 needs vLLM >= 0\.14 \(enable_return_routed_experts, vLLM PR #28284; "
                                            r"hybrid-attention models need >= 0\.22\), found vllm 0\.13\.2"):
        rollout_actor(monkeypatch, model)
    monkeypatch.setattr(vllm, "__version__", "0.14.0rc1")
    assert orr.check_vllm_for_r3() == "0.14.0rc1"
    monkeypatch.setitem(sys.modules, "vllm", None)  # not installed
    with pytest.raises(StableRLError, match=r"R3 needs vLLM >= 0\.14 .*vLLM is not installed"):
        orr.check_vllm_for_r3()


def test_unalignable_trajectories_and_missing_routes_raise(monkeypatch):
    engine = rr.RecordingEngine(None)
    completion = SimpleNamespace(token_ids=[7, 8], routed_experts=np.zeros((3, LAYERS, TOP_K), np.uint8))
    engine.calls.append(([1, 2], SimpleNamespace(outputs=[completion])))
    assert engine.trajectory_routes([1, 2, 7, 8, 60]) is completion.routed_experts
    with pytest.raises(StableRLError, match="do not begin with the prompt \\+ completion of its last vLLM call"):
        engine.trajectory_routes([1, 3, 7, 8])  # an executor that rewrote the history
    completion.routed_experts = np.zeros((1, LAYERS, TOP_K), np.uint8)
    with pytest.raises(rr.RoutesMismatchError, match="vLLM returned 1 routed rows for 4 prompt \\+ completion tokens"):
        engine.trajectory_routes([1, 2, 7, 8])
    completion.routed_experts = None
    with pytest.raises(StableRLError, match="vLLM returned no routed_experts"):
        engine.trajectory_routes([1, 2, 7, 8])

    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    adapter.instrument(now=True)
    generator = SamplesGenerator.__new__(SamplesGenerator)
    generator.args = _args(False, "R3")
    response = dict(prompt="p", label="", observation_tokens=[1, 2, 7, 8], action_ranges=[(2, 4)],
                    rollout_log_probs=None, reward=1.0, scores=1.0)
    with pytest.raises(StableRLError, match="the agent executor's output has no 'routed_experts'"):
        generator._process_response_into_experience(response, max_len=MAX_LEN)
    state = orr._Armed("R3", NUM_EXPERTS, MOE_LAYERS, False, TOP_K)
    with pytest.raises(StableRLError, match="row 0 carries SampleRoutes instead of the rollout's routes"):
        state.from_rollout([orr.SampleRoutes(torch.zeros(4, 2, TOP_K, dtype=torch.uint8))])


def _probe_execute_batch(worker):
    """In the Ray worker: OpenRLHF's PolicyModelActor.forward, called by Ray's execute_batch, hands the
    rows' mm_train_inputs_list to the armed Actor (what the R3 old-log-prob pass reads)."""
    import torch
    from stablerl.adapters.openrlhf import OpenRLHFAdapter, _routing_replay as orr

    torch.cuda.current_device = lambda: "cpu"

    class FakeActor:
        is_vlm = False

        def __init__(self):
            self.seen = []

        def __call__(self, *args, **kwargs):
            self.seen.append(orr.ROLLOUT_ROUTES.get())
            return torch.zeros(1)

        def eval(self):
            pass

        def train(self):
            pass

    worker.actor = FakeActor()
    OpenRLHFAdapter().worker(worker.actor, create=True).routes = orr._Armed("R3", NUM_EXPERTS, MOE_LAYERS, False, TOP_K)
    worker.strategy = SimpleNamespace(ring_attn_group=None, is_rank_0=lambda: False)


def test_execute_batch_patch_reaches_a_real_ray_worker(monkeypatch):
    """PolicyModelActor is shipped by value with Ray's tracing wrappers around every method; the wrapped
    BaseModelActor.execute_batch goes by reference, so the worker's setup hook patches what Ray runs."""
    ray = pytest.importorskip("ray")
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    from orlhf_helpers import init_ray_with_setup_hook

    init_ray_with_setup_hook(adapter)
    try:
        worker = ppo_actor.PolicyModelActor.options(num_cpus=1, num_gpus=0).remote(1, 0, "127.0.0.1", 29555)
        ray.get(worker.__ray_call__.remote(_probe_execute_batch), timeout=540)
        data = dict(sequences=[torch.zeros(1, 3, dtype=torch.long)] * 2, action_mask=[torch.ones(1, 2)] * 2,
                    attention_mask=[torch.ones(1, 3)] * 2,
                    mm_train_inputs_list=[["rows of batch 0"], ["rows of batch 1"]])
        ray.get(worker.execute_batch.remote("forward", data, 0, 2), timeout=120)
        seen = ray.get(worker.__ray_call__.remote(lambda w: (w.actor.seen, orr.ROLLOUT_ROUTES.get())))
    finally:
        ray.shutdown()
    assert seen == ([["rows of batch 0"], ["rows of batch 1"]], None)  # per item, and cleared afterwards
    assert not adapter.is_applied()["BaseModelActor.execute_batch"]  # the driver was never patched
