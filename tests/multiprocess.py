"""Several processes on one machine joined by jax.distributed (CPU collectives over loopback):
the launcher the two-process tests share."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# XLA's CPU compiler splits each program into parts that it compiles on parallel threads. With the
# test workers already keeping every core busy that only adds work: one part per program took 2.5%
# (test_sampler.py) to 10% (two simulator tests) less CPU, and the outputs are bit for bit the same
# (checked on five recipes' forward and gradient and on the default run's metrics). Every test
# process and every process a test launches compiles this way.
COMPILE_FLAGS = "--xla_cpu_parallel_codegen_split_count=1"


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a test process with `devices` fake CPU devices."""
  return f"--xla_force_host_platform_device_count={devices} {COMPILE_FLAGS}"


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_processes(cmds: Sequence[Sequence[str]], devices_per_process: int,
                  timeout: float = 600) -> list[str]:
  """Runs `cmds` (argument lists after the Python interpreter) at once from the repository root,
  each process with `devices_per_process` fake CPU devices; returns their outputs (stdout and
  stderr) after asserting that every one exited with status 0."""
  env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu",
             XLA_FLAGS=xla_flags(devices_per_process))
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
