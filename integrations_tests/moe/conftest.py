"""Routing-replay integration tests: need transformers (>= 5); skipped without it."""

import os
import sys

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
