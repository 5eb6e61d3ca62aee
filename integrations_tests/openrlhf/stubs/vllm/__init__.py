"""Test stand-in for vLLM 0.29.0 (would replace the CPU torch): import-only, see ../README.md."""

__version__ = "0.29.0"


class SamplingParams:  # imported by openrlhf.trainer.ppo_utils.samples_generator; generation is not tested
    def __init__(self, *args, **kwargs):
        raise RuntimeError("vllm.SamplingParams is a test stand-in (generation is not tested)")
