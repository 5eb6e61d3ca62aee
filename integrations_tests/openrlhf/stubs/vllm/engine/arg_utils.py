"""Test stand-in: vllm.engine.arg_utils.AsyncEngineArgs with the fields OpenRLHF 0.11.2's
create_vllm_engines passes, plus enable_return_routed_experts (vLLM PR #28284, vLLM >= 0.14).
An unknown keyword raises TypeError, as the real dataclass does."""

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class AsyncEngineArgs:
    model: str = ""
    enforce_eager: bool = False
    worker_extension_cls: str = ""
    tensor_parallel_size: int = 1
    seed: int = 0
    distributed_executor_backend: Optional[str] = None
    max_model_len: Optional[int] = None
    enable_prefix_caching: bool = False
    dtype: str = "auto"
    trust_remote_code: bool = False
    gpu_memory_utilization: Optional[float] = None
    enable_sleep_mode: bool = False
    limit_mm_per_prompt: Any = None
    logprobs_mode: Optional[str] = None
    max_logprobs: int = 20
    enable_return_routed_experts: bool = False
