"""Thin adapters: one per framework. They translate; the algorithms live in stablerl.plugins."""
