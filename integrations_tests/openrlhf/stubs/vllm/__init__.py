"""Test stand-in for vLLM 0.29.0 (would replace the CPU torch): see ../README.md.

As in vLLM >= 0.10, the engine classes are imported lazily (module ``__getattr__``)."""

__version__ = "0.29.0"

_LAZY = {"AsyncEngineArgs": "vllm.engine.arg_utils", "AsyncLLMEngine": "vllm.engine.async_llm_engine"}


class SamplingParams:  # the attributes OpenRLHF's samples generator sets and its agent executors read
    def __init__(self, max_tokens=None, logprobs=None, **kwargs):
        self.max_tokens, self.logprobs = max_tokens, logprobs
        self.__dict__.update(kwargs)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vllm' (test stand-in) has no attribute {name!r}")
