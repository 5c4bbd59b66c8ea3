"""Several processes, one program: `jax.distributed` set-up and the host side of a global mesh.

Every process runs the same script in lockstep (JAX multi-controller): each sees all devices in
`jax.devices()`, drives its own `jax.local_devices()`, and calls every jitted step with the same
global arrays. Host values (prompts, rewards) are computed identically by every process from the
seed, and `ShardingPlan.put` turns them into global arrays from each process's addressable shards;
`to_host` brings a sharded result back to every host. Only process 0 writes logs, TensorBoard and
JSON files; orbax coordinates checkpoint writes itself.

Launch: call `initialize` before anything touches a device. With a coordinator address, process
count and id it connects explicitly (any platform; CPU collectives go over gloo); with `auto=True`
and no address JAX detects the cluster (Cloud TPU pod slices, SLURM, Open MPI, GKE/Kubernetes).
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, auto: bool = False,
               local_device_ids: Sequence[int] | None = None,
               cpu_collectives: str = "gloo") -> bool:
  """Connects this process to the others; returns False (and does nothing) for a single process.

  Args:
    coordinator_address: "host:port" of process 0's coordinator service (explicit launch).
    num_processes, process_id: required with `coordinator_address`.
    auto: initialize from the cluster environment (TPU pod slice, SLURM, Open MPI, ...) when no
      address is given; the explicit arguments, where given, override what is detected.
    local_device_ids: devices this process drives (e.g. one process per GPU); default all local.
    cpu_collectives: cross-process collectives of the CPU backend ("gloo" or "mpi").

  Raises:
    ValueError: an incomplete or inconsistent explicit launch, naming the missing flag.
  """
  explicit = coordinator_address is not None or num_processes is not None or \
      process_id is not None
  if not explicit and not auto:
    return False
  if coordinator_address is not None and not auto:
    missing = [n for n, v in (("num_processes", num_processes), ("process_id", process_id))
               if v is None]
    if missing:
      raise ValueError(f"--coordinator_address needs --{' and --'.join(missing)} too (or "
                       "--distributed for auto-detection on TPU/GPU clusters).")
  if coordinator_address is None and not auto:
    raise ValueError("--num_processes/--process_id need --coordinator_address=host:port of process "
                     "0 (or --distributed for auto-detection on TPU/GPU clusters).")
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"--num_processes={num_processes} must be >= 1.")
  if process_id is not None and num_processes is not None and \
      not 0 <= process_id < num_processes:
    raise ValueError(f"--process_id={process_id} must be in [0, {num_processes}).")
  jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                             process_id=process_id,
                             local_device_ids=None if local_device_ids is None
                             else list(local_device_ids))
  return True


def is_primary() -> bool:
  """True on the process that writes logs and files (process 0)."""
  return jax.process_index() == 0


def to_host(x: Any) -> np.ndarray:
  """The global value of `x` as a numpy array on every process (all must call this alike)."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def broadcast_from_primary(tree: Any) -> Any:
  """Process 0's values of a host pytree on every process (others pass same-shaped placeholders)."""
  if jax.process_count() == 1:
    return tree
  return multihost_utils.broadcast_one_to_all(tree)
