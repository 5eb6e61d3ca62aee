"""Test stand-in: vllm.AsyncLLMEngine. ``from_engine_args`` returns ``FACTORY(engine_args)`` when a test set
``FACTORY``, otherwise an :class:`~vllm.engine.hf_engine.HFEngine` (Hugging Face ``generate`` on CPU)."""

FACTORY = None


class AsyncLLMEngine:
    @classmethod
    def from_engine_args(cls, engine_args):
        if FACTORY is not None:
            return FACTORY(engine_args)
        from vllm.engine.hf_engine import HFEngine

        return HFEngine(engine_args)
