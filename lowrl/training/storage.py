"""Where the loop keeps parameter trees it only reads: the KL reference and the async versions.

`rl.ref_storage` / `async_rl.version_storage`:
  param     a copy in the parameter (master) dtype on the devices, sharded like the params
            (the default; what the loop always did).
  bfloat16  a BF16 copy on the devices: half an FP32 copy. The reference's logprobs (or the stale
            sampler's rollouts) are then those of the BF16-rounded weights.
  host      a copy in the parameter dtype in host memory (memory kind "pinned_host", each process
            its own shards), moved to the devices for the step that reads it and dropped after:
            the same numbers as `param`, device memory only while it is used.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

STORAGES = ("param", "bfloat16", "host")
_HOST = "pinned_host"


def keep(tree: Any, storage: str) -> Any:
  """A copy of `tree` (fresh buffers: the step donates the params) stored as `storage` says."""
  if storage == "param":
    return jax.tree.map(jnp.copy, tree)
  if storage == "bfloat16":
    return jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating)
        else jnp.copy(x), tree)
  if storage == "host":
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(_HOST)), tree)
  raise ValueError(f"storage {storage!r}: use one of {STORAGES}.")


def use(tree: Any) -> Any:
  """`tree` on the devices (host-stored leaves copied back to device memory; others as they are)."""
  def leaf(x):
    if getattr(x.sharding, "memory_kind", None) == _HOST:
      return jax.device_put(x, x.sharding.with_memory_kind("device"))
    return x
  return None if tree is None else jax.tree.map(leaf, tree)
