"""lowrl's cross-CPU pin (lowrl.CROSS_CPU_FLAGS, docs/numerics.md "Across CPUs"): what one CPU can
test of it. Another CPU's bits cannot be produced here; what can: the pin is set (and the ISA cap
with it, so an AVX-512 host generates the code an AVX2 host does), and a program's bits do not
change when it runs on one core instead of all (as on a smaller machine): tests/cpu_probe.py (a
train step of a small decoder and two GEMMs) in a process of its own at XLA's default
optimisation level, as the binaries compile. Also lowrl's opt-in compile preset
(lowrl.COMPILE_FLAGS): set on import when asked, and the probe's bits the same with and without it."""
import functools
import os
import subprocess
import sys

import pytest

import lowrl
from tiny import REPO

PROBE = str(REPO / "tests" / "cpu_probe.py")


@functools.lru_cache
def _digest(recipe: str, xla_flags: str = "", one_core: bool = False,
            fast_compile: bool = False) -> str:
  pre = (lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})) if one_core else None
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags)
  env.pop("LOWRL_XLA_FAST_COMPILE", None)
  if fast_compile:  # lowrl.COMPILE_FLAGS' preset instead of XLA's default pass pipeline
    env["LOWRL_XLA_FAST_COMPILE"] = "1"
  proc = subprocess.run([sys.executable, PROBE, recipe], capture_output=True, text=True,
                        timeout=600, preexec_fn=pre, env=env)
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


def test_import_sets_the_compile_preset_only_when_asked():
  code = "import os, lowrl; print(os.environ['XLA_FLAGS'])"
  run = lambda **env: subprocess.run(  # noqa: E731
      [sys.executable, "-c", code], capture_output=True, text=True, check=True,
      env={**{k: v for k, v in os.environ.items() if k != "LOWRL_XLA_FAST_COMPILE"},
           "XLA_FLAGS": "", **env}).stdout
  for name, value in lowrl.COMPILE_FLAGS:
    assert name not in run()
    assert f"--{name}={value}" in run(LOWRL_XLA_FAST_COMPILE="1")
    assert f"--{name}=CPU_OPT_PRESET_DEFAULT" in run(XLA_FLAGS=f"--{name}=CPU_OPT_PRESET_DEFAULT",
                                                     LOWRL_XLA_FAST_COMPILE="1")


def test_compile_preset_keeps_the_probes_bits():
  """lowrl.COMPILE_FLAGS' FAST_COMPILE preset compiles the probe (a train step under the recipe,
  two GEMMs) to other kernels than XLA's default pipeline; their outputs must be the same bits."""
  assert _digest("nvfp4_recipe") == _digest("nvfp4_recipe", fast_compile=True)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: nothing to compare")
def test_bits_do_not_depend_on_the_number_of_cores():
  assert _digest("nvfp4_recipe") == _digest("nvfp4_recipe", one_core=True)
