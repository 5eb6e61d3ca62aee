"""Test stand-in: vllm.inputs.TokensPrompt (a TypedDict in vLLM: a plain dict)."""


class TokensPrompt(dict):
    pass
