"""Test stand-in package flash_attn.utils (import-only)."""
