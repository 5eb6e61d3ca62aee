"""stablerl.routing_replay.rows: routes carried row by row through a framework's batch lists (OpenRLHF's
replay buffer), the vLLM version that returns routes, and a multi-call trajectory's routes."""

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from stablerl import StableRLError
from stablerl import routing_replay as rr

E, K = 8, 2  # experts, top-k
LAYERS = (1, 2)  # absolute ids of the MoE layers (layer 0 dense)


def _routes(batch_shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = batch_shape[0] * batch_shape[1]
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(len(LAYERS) * n)]).view(len(LAYERS), n, K)
    return rr.Routes(idx, num_experts=E, batch_shape=batch_shape, layer_ids=LAYERS)


@pytest.mark.parametrize("packing", [False, True])
def test_split_then_join_gives_back_the_forwards_routes(packing):
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    padded = _routes((3, 4))
    layout = rr.RowLayout(E, LAYERS, packing=packing, top_k=K)
    routes = padded.unpad(mask) if packing else padded
    rows = layout.split(routes, mask)
    assert [r.num_tokens for r in rows] == [3, 2, 4] and rows[0].indices.dtype == torch.uint8
    assert tuple(rows[2].indices.shape) == (4, len(LAYERS), K)
    # row 1's routes are its two kept tokens, in order
    assert torch.equal(rows[1].indices.permute(1, 0, 2).long(), padded.as_batch()[:, 1, :2])
    joined = layout.join(rows, mask)
    assert joined.batch_shape == ((1, 9) if packing else (3, 4))
    kept = padded.unpad(mask)
    assert torch.equal((joined if packing else joined.unpad(mask)).indices.long(), kept.indices.long())
    # the rows survive a shuffle: join of permuted rows = the permuted batch's routes
    perm = [2, 0, 1]
    shuffled = layout.join([rows[i] for i in perm], mask[perm])
    assert torch.equal((shuffled if packing else shuffled.unpad(mask[perm])).indices.long(),
                       padded.rows(perm).unpad(mask[perm]).indices.long())
    with pytest.raises(rr.RoutesMismatchError, match="row 0 carries routes for 3 tokens but its attention_mask has 2"):
        layout.join(rows, torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]))


def test_from_rollout_converts_vllm_rows_and_routes_the_rest_natively():
    layout = rr.RowLayout(E, LAYERS, packing=False, top_k=K)
    arr = np.zeros((4, 3, K), np.uint8)  # vLLM: [tokens - 1, num_hidden_layers, k], dense layer 0 all zero
    arr[:, 1:] = np.array([3, 5], np.uint8)
    six = layout.from_rollout([rr.RolloutRoutes(arr, 6), rr.RolloutRoutes(None, 3)], what="R3")
    assert [s.num_tokens for s in six] == [6, 3]
    assert six[0].indices[:4].tolist() == [[[3, 5], [3, 5]]] * 4
    assert six[0].indices[4:].sum() == 0 and six[1].indices.sum() == 0  # no route: natively routed (zero rows)
    with pytest.raises(StableRLError, match=r"R3: row 0 carries SampleRoutes instead of the rollout's routes"):
        layout.from_rollout(six[:1], what="R3")
    with pytest.raises(rr.RoutesMismatchError, match="row 0 carries 4 routed rows for 3 tokens"):
        layout.from_rollout([rr.RolloutRoutes(arr, 3)], what="R3")
    with pytest.raises(rr.RoutesMismatchError, match="vLLM returned top-2 routes, the trainer's routers pick 4"):
        rr.RowLayout(E, LAYERS, packing=False, top_k=4).from_rollout([rr.RolloutRoutes(arr, 6)], what="R3")


def test_check_vllm_routes(monkeypatch):
    assert rr.check_vllm_routes("flag R3", "0.14.0rc1") == "0.14.0rc1"
    assert rr.check_vllm_routes("flag R3", "0.22.1+cu128") == "0.22.1+cu128"
    with pytest.raises(StableRLError, match=r"^flag R3 needs vLLM >= 0\.14 .* found vllm 0\.13\.2; use R2"):
        rr.check_vllm_routes("flag R3", "0.13.2")
    monkeypatch.setattr(rr.rows, "vllm_version", lambda: None)
    with pytest.raises(StableRLError, match=r"vLLM is not installed"):
        rr.check_vllm_routes("flag R3")


def test_recording_engine_returns_the_last_calls_routes():
    class Engine:
        name = "vllm"

        def __init__(self):
            self.answers = [[7, 8], [9]]

        async def generate(self, prompt_token_ids, sampling_params=None):
            ids = self.answers.pop(0)
            routed = np.zeros((len(prompt_token_ids) + len(ids) - 1, 3, K), np.uint8)
            return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, routed_experts=routed)])

    engine = rr.RecordingEngine(Engine())
    assert engine.name == "vllm" and engine.trajectory_routes([1, 2]) is None  # never called

    async def agent():  # two turns, the second re-sends the whole history plus a tool output (60)
        first = await engine.generate([1, 2])
        await engine.generate([1, 2, *first.outputs[0].token_ids, 60])

    asyncio.run(agent())
    routes = engine.trajectory_routes([1, 2, 7, 8, 60, 9, 61], "R3")
    assert routes.shape == (5, 3, K) and len(engine.calls) == 2  # prompt 5 + completion 1 tokens, minus the last
    with pytest.raises(StableRLError, match=r"do not begin with the prompt \+ completion of its last vLLM call "
                                            r"\(2 calls"):
        engine.trajectory_routes([1, 2, 7, 8, 61, 9])
    with pytest.raises(StableRLError, match="vLLM returned no routed_experts.*: check the hook"):
        rr.last_call_routes([1], [2], None, [1, 2], "R3", hint="check the hook")
