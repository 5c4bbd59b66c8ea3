"""Several processes on one machine joined by jax.distributed (CPU collectives over loopback):
the launcher the two-process tests share."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}")
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
