"""Test stand-in: vllm.AsyncLLMEngine. ``from_engine_args`` calls the ``FACTORY`` a test sets
(an engine with ``async generate(prompt, sampling_params, request_id)`` yielding RequestOutputs)."""

FACTORY = None


class AsyncLLMEngine:
    @classmethod
    def from_engine_args(cls, engine_args):
        if FACTORY is None:
            raise RuntimeError("vllm.AsyncLLMEngine is a test stand-in: set vllm.engine.async_llm_engine.FACTORY")
        return FACTORY(engine_args)
