"""Test stand-in: vllm.engine (see ../../README.md)."""
