"""lowrl's cross-CPU pin (lowrl.CROSS_CPU_FLAGS, docs/numerics.md "Across CPUs"): what one CPU can
test of it. Another CPU's bits cannot be produced here; what can: a program's bits do not change
when XLA's code generation is capped below this host's instruction set (as on a CPU without
AVX-512) or when it runs on one core instead of all (as on a smaller machine). Each variant runs
tests/cpu_probe.py (a train step of a small decoder and two GEMMs) in a process of its own at
XLA's default optimisation level, as the binaries compile."""
import functools
import os
import subprocess
import sys

import pytest

import lowrl
from tiny import REPO

PROBE = str(REPO / "tests" / "cpu_probe.py")


def _cpu_flags() -> set[str]:
  try:
    with open("/proc/cpuinfo") as f:
      return set(next(line for line in f if line.startswith("flags")).split(":")[1].split())
  except (OSError, StopIteration):
    return set()


@functools.lru_cache
def _digest(recipe: str, xla_flags: str = "", one_core: bool = False) -> str:
  pre = (lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})) if one_core else None
  proc = subprocess.run([sys.executable, PROBE, recipe], capture_output=True, text=True,
                        timeout=600, preexec_fn=pre,
                        env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags))
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout.strip()


def test_import_sets_the_pin_unless_told_not_to():
  code = "import os, lowrl; print(os.environ['XLA_FLAGS'])"
  run = lambda **env: subprocess.run(  # noqa: E731
      [sys.executable, "-c", code], capture_output=True, text=True, check=True,
      env={**os.environ, "XLA_FLAGS": "", **env}).stdout
  for name, value in lowrl.CROSS_CPU_FLAGS:
    assert f"--{name}={value}" in run()
    assert name not in run(LOWRL_CPU_PLATFORM_MATH="1")
    assert f"--{name}=true" in run(XLA_FLAGS=f"--{name}=true")  # the user's own value wins


@pytest.mark.skipif("avx512f" not in _cpu_flags(),
                    reason="the host has no AVX-512: capping at AVX2 would change nothing")
def test_bits_do_not_depend_on_avx512():
  # The cap reaches XLA's code generation only from XLA_FLAGS at start-up (a per-compile
  # compiler_options value is not read), hence a process per variant.
  assert _digest("nvfp4_recipe") == _digest("nvfp4_recipe", "--xla_cpu_max_isa=AVX2")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: nothing to compare")
def test_bits_do_not_depend_on_the_number_of_cores():
  assert _digest("nvfp4_recipe") == _digest("nvfp4_recipe", one_core=True)
