"""Pinning activations to the batch split: rows stay on their data shard (data parallelism).

The model code names no mesh (GSPMD propagation lays it out). Left alone, the partitioner may
gather a batch over the data axis (e.g. to meet the FSDP-split embedding table) so that every
device processes every row. `constrain_rows` pins the leading (batch) dimension of an activation
to the mesh axes a caller set with `rows_over` while tracing its jitted program (the sampler's
decode and scoring programs, the RL update); the other dimensions stay free for the partitioner.
Outside such a context it is the identity, so unplaced programs (one device, the simulator's
scan) trace exactly as before.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# (mesh, batch entry) of the program being traced, or None.
_ROWS: contextvars.ContextVar[tuple[Mesh, str | tuple[str, ...]] | None] = contextvars.ContextVar(
    "lowrl_rows", default=None)


@contextlib.contextmanager
def rows_over(mesh: Mesh | None, batch_entry: str | tuple[str, ...] | None) -> Iterator[None]:
  """While tracing inside this context, `constrain_rows` splits leading dims over `batch_entry`
  of `mesh` (None for either: no constraint)."""
  token = _ROWS.set(None if mesh is None or not batch_entry else (mesh, batch_entry))
  try:
    yield
  finally:
    _ROWS.reset(token)


def constrain_rows(x: jax.Array, axis: int = 0) -> jax.Array:
  """`x` with its batch dim (`axis`) pinned to the context's batch axes, other dims free."""
  ctx = _ROWS.get()
  if ctx is None or x.ndim == 0:
    return x
  mesh, entry = ctx
  spec = [P.UNCONSTRAINED] * x.ndim
  spec[axis] = entry
  spec = P(*spec)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def constrain_unsplit(x: jax.Array, axis: int) -> jax.Array:
  """Under a row context: `x` with dim `axis` whole on every device (other dims free)."""
  ctx = _ROWS.get()
  if ctx is None:
    return x
  spec = [P.UNCONSTRAINED] * x.ndim
  spec[axis] = None
  return jax.lax.with_sharding_constraint(x, NamedSharding(ctx[0], P(*spec)))


def constrain_rows_tree(tree, axis: int = 0):
  """`constrain_rows` on every array leaf of `tree` (None leaves stay None)."""
  return jax.tree.map(lambda x: constrain_rows(x, axis), tree)
