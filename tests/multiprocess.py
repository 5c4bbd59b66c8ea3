"""Several processes on one machine joined by jax.distributed (CPU collectives over loopback):
the launcher the two-process tests share."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence

import fusion_emitters

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# How every test process, and every process a test launches, compiles (compiling is about 70% of
# the suite's CPU time; the tiny programs run in milliseconds):
# - XLA's CPU compiler splits each program into parts that it compiles on parallel threads. With
#   the test workers already keeping every core busy that only adds work: one part per program took
#   2.5% (test_sampler.py) to 10% (two simulator tests) less CPU, and the outputs are bit for bit
#   the same (checked on five recipes' forward and gradient and on the default run's metrics).
# - LLVM's optimisation level 0 for the machine code XLA emits (XLA's own HLO passes, fusion
#   included, still run in full): test_training.py + test_async_loop.py took 33% less CPU (221 ->
#   148 s). It changes how elementwise code is vectorised, so results can differ from the default
#   level by a few ulp (exp: at most 4 ulp on 1,000 normal inputs), as they can between two CPUs
#   with different vector units. No test may depend on that: bit-for-bit comparisons are only ever
#   between identical programs, and tolerances come from stated bounds.
# - XLA's "expensive LLVM passes" off as well: test_sampler.py took 13% less CPU (54 -> 46 s, no
#   compilation cache) and a simulator test 9%; the outputs of three recipes' simulated runs
#   (sampling, scoring, update, every quantizer of nvfp4_recipe, mxfp8, nvfp4_naive) are bit for bit
#   those without it.
# - XLA:CPU's elemental IR emitter for fusions, program by program (fusion_emitters.py: not for
#   programs with 4-bit types; `child_env` gives it to launched processes): 54% less compile CPU.
COMPILE_FLAGS = ("--xla_cpu_parallel_codegen_split_count=1 --xla_backend_optimization_level=0 "
                 "--xla_llvm_disable_expensive_passes=true")


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a test process with `devices` fake CPU devices."""
  return f"--xla_force_host_platform_device_count={devices} {COMPILE_FLAGS}"


def child_env(devices: int, **extra: str) -> dict[str, str]:
  """The environment of a Python process a test launches: this one's, the CPU platform with
  `devices` fake devices, the tests' compile flags and emitters (fusion_emitters.py), `extra`."""
  return fusion_emitters.child_env(dict(os.environ, JAX_PLATFORMS="cpu",
                                        XLA_FLAGS=xla_flags(devices), **extra))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_processes(cmds: Sequence[Sequence[str]], devices_per_process: int,
                  timeout: float = 600) -> list[str]:
  """Runs `cmds` (argument lists after the Python interpreter) at once from the repository root,
  each process with `devices_per_process` fake CPU devices; returns their outputs (stdout and
  stderr) after asserting that every one exited with status 0."""
  env = child_env(devices_per_process, PYTHONUNBUFFERED="1")
  procs = [subprocess.Popen([sys.executable, *cmd], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for cmd in cmds]
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
  return outs
