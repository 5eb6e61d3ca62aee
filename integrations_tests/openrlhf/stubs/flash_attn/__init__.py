"""Test stand-in for flash-attn 2.8.3 (CUDA only): import-only, see ../README.md."""

__version__ = "2.8.3"
