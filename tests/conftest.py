"""Test setup: 8 fake CPU devices for multi-device tests, deterministic, FP32 matmuls.

XLA_FLAGS must be set before jax is imported anywhere, so it lives here (pytest imports
conftest.py first).
"""
import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Tests compare against closed forms in FP32: don't let XLA pick a lower-precision dot.
jax.config.update("jax_default_matmul_precision", "highest")

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
