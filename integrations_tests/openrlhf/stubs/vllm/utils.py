"""Test stand-in: vllm.utils.random_uuid (import-only)."""


def random_uuid():
    raise RuntimeError("vllm.utils.random_uuid is a test stand-in (generation is not tested)")
