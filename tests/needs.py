"""Skips for tests that need what a platform may lack."""

from __future__ import annotations

import importlib.util

import pytest

from minigrid_engine.errors import TRITON_WHEELS

# find_spec, not import: importing Triton before `minigrid_engine.kernels` sets TRITON_INTERPRET
# would leave it without its CPU interpreter.
triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason=f"no Triton: {TRITON_WHEELS}")
