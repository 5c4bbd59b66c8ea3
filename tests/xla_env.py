"""XLA flags of the test processes: this one (conftest.py) and the subprocesses tests start.

`--xla_backend_optimization_level=0` skips LLVM's optimisation passes on the CPU: they dominate the
compile time of the suite's small programs (a simulator test file compiles in ~40% less time) and
barely matter to how fast those programs run. It does not relax floating point (no fast-math
either way), and every program a test compares with another is compiled under the same flags, so
bit-for-bit comparisons stay bit-for-bit.
"""
COMPILE_FAST = "--xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a test process with `devices` fake CPU devices."""
  return f"--xla_force_host_platform_device_count={devices} {COMPILE_FAST}"
