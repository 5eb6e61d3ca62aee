"""Test stand-in: vllm.inputs.TokensPrompt (import-only)."""


class TokensPrompt(dict):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("vllm.inputs.TokensPrompt is a test stand-in (generation is not tested)")
