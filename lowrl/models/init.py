"""The parameter tree: `init_params` (random initialisation) and `param_shapes` (its shapes).

Every random leaf (kernels, the embedding) is a slice of ONE standard-normal draw over all of
them, in the tree's flattening order, times fan_in^-1/2 (embedding: D^-1/2; a kernel [in, out] or
stacked experts [E, in, out]: in); norm scales are 1,
biases 0. Two programs compute that draw:

* "fused" (the values every run so far has used): one jitted program that draws and slices. Its
  compile time grows with the number of leaves (each slice a fusion of its own with the draw):
  about 14 s on CPU, over 2 minutes on a GPU, for Qwen3-0.6B's 28 layers.
* "split": the same `jax.random.normal` over the same total size as a program of its own, then
  one small jitted slice-and-scale per distinct leaf shape (the offset is an argument, so the
  28 layers share one compile per kernel shape): compile time independent of depth, peak memory
  one FP32 copy of the random leaves above the params.

Both draw the same counters of the same threefry stream and multiply by the same FP32 scale,
but they are different XLA programs, so an ulp may differ where the compiler evaluates the
normal's erf_inv differently. `method="auto"` therefore keeps "fused" for models up to
`FUSED_MAX_PARAMS` (every config and test model of this repository, the default main job
included: their values stay bit for bit what they were) and takes "split" above it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from lowrl.models import layout
from lowrl.models.config import ModelConfig
from lowrl.models.decoder import Transformer
from lowrl.precision import PrecisionPolicy

Params = Any
METHODS = ("auto", "fused", "split")
# Largest model (parameters) "auto" initialises with the fused program; larger ones use "split".
FUSED_MAX_PARAMS = 50_000_000


@dataclasses.dataclass(frozen=True)
class _Leaves:
  """The tree's leaves in flattening order: which are random, their sizes and scales."""

  treedef: Any
  names: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  random: tuple[int, ...]  # indices of the leaves drawn from the normal
  scales: tuple[float, ...]  # fan_in^-1/2 per random leaf

  @property
  def sizes(self) -> tuple[int, ...]:
    return tuple(math.prod(self.shapes[i]) for i in self.random)

  def fill(self, i: int) -> float:
    """The constant of a non-random leaf: 1 for norm scales, 0 for biases."""
    return 1.0 if self.names[i].endswith("scale") else 0.0


def _leaves(shapes: Params) -> _Leaves:
  flat, treedef = jax.tree_util.tree_flatten_with_path(shapes)
  names = tuple(jax.tree_util.keystr(path, simple=True, separator="/") for path, _ in flat)
  leaf_shapes = tuple(tuple(leaf.shape) for _, leaf in flat)
  random = tuple(i for i, n in enumerate(names) if n.endswith(("kernel", "embedding")))
  scales = tuple((leaf_shapes[i][1] if names[i].endswith("embedding") else leaf_shapes[i][-2])
                 ** -0.5 for i in random)
  return _Leaves(treedef, names, leaf_shapes, random, scales)


def init_from_shapes(shapes: Params, rng: jax.Array, param_dtype=jnp.float32, *,
                     method: str = "auto") -> Params:
  """A fresh parameter tree with the structure of `shapes` (ShapeDtypeStructs), in `param_dtype`.

  `method`: "fused", "split" (module docstring) or "auto" (fused up to FUSED_MAX_PARAMS
  parameters). Deterministic in `rng` for a given method.
  """
  if method not in METHODS:
    raise ValueError(f"init method {method!r}: use one of {METHODS}.")
  leaves = _leaves(shapes)
  dtype = jnp.dtype(param_dtype)
  if method == "auto":
    total = sum(math.prod(s) for s in leaves.shapes)
    method = "fused" if total <= FUSED_MAX_PARAMS else "split"
  if method == "fused":
    return _fused_fn(leaves, dtype)(rng)
  return _split(leaves, rng, dtype)


@functools.lru_cache(maxsize=16)
def _fused_fn(leaves: _Leaves, param_dtype):
  @jax.jit
  def init(rng):
    # One normal draw sliced into every random leaf: a draw per leaf compiles ~10x slower.
    flat = jax.random.normal(rng, (sum(leaves.sizes),), jnp.float32)
    out = [None] * len(leaves.names)
    offset = 0
    for i, size, scale in zip(leaves.random, leaves.sizes, leaves.scales):
      out[i] = flat[offset:offset + size].reshape(leaves.shapes[i]) * scale
      offset += size
    for i in range(len(out)):
      if out[i] is None:
        out[i] = jnp.full(leaves.shapes[i], leaves.fill(i), jnp.float32)
      out[i] = out[i].astype(param_dtype)
    return jax.tree_util.tree_unflatten(leaves.treedef, out)

  return init


@functools.lru_cache(maxsize=4)
def _normal_fn(n: int, width: int):
  return jax.jit(lambda rng: jax.random.normal(rng, (n,), jnp.float32).reshape(n // width, width))


@functools.lru_cache(maxsize=64)
def _take_fn(rows: int, shape: tuple[int, ...], scale: float, dtype):
  """`rows` rows of the [n / w, w] draw from a traced start row, as `shape` times `scale`."""

  def take(draw_RW, start):
    rows_W = jax.lax.dynamic_slice_in_dim(draw_RW, start, rows, axis=0)
    return (rows_W.reshape(shape) * scale).astype(dtype)

  return jax.jit(take)


@functools.lru_cache(maxsize=16)
def _fill_fn(shape: tuple[int, ...], value: float, dtype):
  return jax.jit(lambda: jnp.full(shape, value, jnp.float32).astype(dtype))


def _split(leaves: _Leaves, rng: jax.Array, dtype) -> Params:
  sizes = leaves.sizes
  # Every size and offset is a multiple of w: slicing [n / w, w] by rows keeps the start index
  # within int32 even for the 2^31+ elements of an 8B model's draw.
  width = functools.reduce(math.gcd, sizes) if sizes else 1
  draw_RW = _normal_fn(sum(sizes), width)(rng)
  out = [None] * len(leaves.names)
  offset = 0
  for i, size, scale in zip(leaves.random, sizes, leaves.scales):
    take = _take_fn(size // width, leaves.shapes[i], scale, dtype)
    out[i] = take(draw_RW, jnp.int32(offset // width))
    offset += size
  del draw_RW
  for i in range(len(out)):
    if out[i] is None:
      out[i] = _fill_fn(leaves.shapes[i], leaves.fill(i), dtype)()
  return jax.tree_util.tree_unflatten(leaves.treedef, out)


def init_params(model_cfg: ModelConfig, rng: jax.Array, param_dtype=jnp.float32, *,
                method: str = "auto") -> Params:
  """A fresh parameter tree (ARCHITECTURE.md layout), deterministic in `rng`.

  Kernels ~ N(0, 1/fan_in), embedding ~ N(0, 1/D) (so tied logits start with unit scale), norm
  scales 1, biases 0. `method`: how the draw is compiled (module docstring): "auto" (the
  fused program up to FUSED_MAX_PARAMS parameters, the split one above), "fused", "split".
  """
  return init_from_shapes(_module_shapes(model_cfg, jnp.dtype(param_dtype)), rng, param_dtype,
                          method=method)


@functools.lru_cache(maxsize=None)
def param_shapes(model_cfg: ModelConfig, param_dtype=jnp.float32) -> Params:
  """ShapeDtypeStructs of `init_params`'s tree (nothing is allocated): the tree to lay out,
  shard or restore into without building the model's values."""
  return jax.eval_shape(lambda: init_params(model_cfg, jax.random.key(0), param_dtype))


@functools.lru_cache(maxsize=16)
def _module_shapes(model_cfg: ModelConfig, param_dtype) -> Params:
  module = Transformer(model_cfg, PrecisionPolicy.unquantized(layout.matmuls(model_cfg)),
                       param_dtype)
  tokens = jnp.zeros((1, 1), jnp.int32)
  return jax.eval_shape(
      lambda: module.init(jax.random.key(0), tokens, tokens, jnp.ones((1, 1), bool))["params"])
