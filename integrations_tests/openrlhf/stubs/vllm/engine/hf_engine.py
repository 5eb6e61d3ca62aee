"""Test stand-in for vLLM's AsyncLLMEngine behind OpenRLHF's real ``RolloutRayActor``: the engine loads
``engine_args.model`` with transformers and samples with ``generate``, on CPU, in float32.

What OpenRLHF 0.11.2's rollout actor calls, and what this returns:

- ``generate(prompt, sampling_params, request_id)``: an async generator yielding one RequestOutput-like
  object; ``outputs[0]`` has ``token_ids``, ``finish_reason`` ("stop" at EOS, else "length"), ``logprobs``
  (when ``sampling_params.logprobs`` is set: one ``{token_id: Logprob}`` per token, the log-softmax of the
  logits after temperature / top-p, vLLM's ``processed_logprobs``) and, when
  ``engine_args.enable_return_routed_experts``, ``routed_experts`` ([tokens-1, layers, top_k] uint8, as
  vLLM >= 0.14 returns them for R3);
- ``collective_rpc("init_process_group" | "update_weight", args)``: the weight sync of
  ``--vllm.sync_backend gloo``: a gloo group with the trainer's rank 0 (see ``vllm.distributed``), then one
  broadcast per parameter, copied into the model by name;
- ``is_sleeping`` / ``sleep`` / ``wake_up`` / ``reset_prefix_cache``: nothing to do on CPU;
- ``output_processor.get_num_unfinished_requests()``: the requests in flight.
"""

from __future__ import annotations

import datetime
from types import SimpleNamespace

import torch
import torch.distributed as dist


class Logprob(SimpleNamespace):
    """vllm.sequence.Logprob: ``logprob``, ``rank``, ``decoded_token``."""


class HFEngine:
    def __init__(self, engine_args):
        from transformers import AutoModelForCausalLM

        self.engine_args = engine_args
        torch.manual_seed(engine_args.seed)
        self.model = AutoModelForCausalLM.from_pretrained(engine_args.model, dtype=torch.float32)
        self.model.eval()
        self.model.config.use_cache = True
        self.params = dict(self.model.named_parameters())
        self._in_flight = 0
        self.output_processor = SimpleNamespace(get_num_unfinished_requests=lambda: self._in_flight)
        self._group = None
        self.weight_updates = 0

    # -- lifecycle: nothing to release on CPU
    async def is_sleeping(self):
        return False

    async def sleep(self, level=1):
        return None

    async def wake_up(self, tags=None):
        return None

    async def reset_prefix_cache(self):
        return None

    # -- weight sync (WorkerWrap's methods, through collective_rpc)
    async def collective_rpc(self, method, args=(), kwargs=None):
        return [getattr(self, "_rpc_" + method)(*args, **(kwargs or {}))]

    def _rpc_init_process_group(self, master_address, master_port, rank, world_size, group_name, backend, use_ray):
        if backend != "gloo" or use_ray:
            raise ValueError(f"the CPU vLLM stand-in syncs weights over gloo only, got backend={backend!r} "
                             f"use_ray={use_ray}: pass --vllm.sync_backend gloo")
        timeout = datetime.timedelta(seconds=300)
        store = dist.TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)
        self._group = dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def _rpc_update_weight(self, name, dtype, shape, empty_cache=False):
        if self._group is None:
            raise RuntimeError("update_weight before init_process_group")
        buffer = torch.empty(shape, dtype=dtype)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._group.broadcast([buffer], opts).wait()
        if name not in self.params:
            raise KeyError(f"the trainer sent weight {name!r}, which the rollout model does not have")
        with torch.no_grad():
            self.params[name].copy_(buffer.to(self.params[name].dtype))
        self.weight_updates += 1

    # -- generation
    async def generate(self, prompt, sampling_params, request_id):
        self._in_flight += 1
        try:
            yield self._generate(list(prompt["prompt_token_ids"]), sampling_params)
        finally:
            self._in_flight -= 1

    @torch.no_grad()
    def _generate(self, ids: list, sp):
        cfg = self.model.generation_config
        top_k = getattr(sp, "top_k", -1)
        out = self.model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=True, temperature=getattr(sp, "temperature", 1.0), top_p=getattr(sp, "top_p", 1.0),
            top_k=top_k if top_k and top_k > 0 else None, max_new_tokens=sp.max_tokens,
            min_new_tokens=getattr(sp, "min_tokens", 0) or 0, pad_token_id=cfg.pad_token_id,
            eos_token_id=cfg.eos_token_id, output_scores=True, return_dict_in_generate=True,
        )
        new = out.sequences[0, len(ids):].tolist()
        eos = cfg.eos_token_id
        if eos in new:  # generate pads after EOS; vLLM stops at it
            new = new[: new.index(eos) + 1]
        finish_reason = "stop" if new and new[-1] == eos else "length"
        logprobs = None
        if getattr(sp, "logprobs", None) is not None:
            logprobs = []
            for token, scores in zip(new, out.scores):
                value = torch.log_softmax(scores[0].float(), dim=-1)[token].item()
                logprobs.append({token: Logprob(logprob=value, rank=None, decoded_token=None)})
        routed = self._routed_experts(ids + new[:-1]) if getattr(
            self.engine_args, "enable_return_routed_experts", False) else None
        completion = SimpleNamespace(token_ids=new, text="", finish_reason=finish_reason, logprobs=logprobs,
                                     routed_experts=routed)
        return SimpleNamespace(prompt_token_ids=ids, outputs=[completion], finished=True)

    def _routed_experts(self, tokens: list):
        """The experts each router chose for ``tokens`` (the last sampled token is never forwarded)."""
        from stablerl.routing_replay import capture

        with capture(self.model) as cap:
            self.model(torch.tensor([tokens]))
        layers = self.model.config.num_hidden_layers
        return cap.routes().to_token_layer_slot(layers).numpy().astype("uint8")
