"""How a tensor is viewed in quantization blocks, and the small helpers every format shares.

The quantizers work on a *blocked view* of the input: the block axis split into (n_blocks, block)
(both of the last two axes for NVFP4 block_2d), so block reductions are keepdims reductions over
`Layout.reduce_axes` and stored block scales are those reductions with the axes squeezed.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lowrl.quant.config import QuantConfig


class Layout(NamedTuple):
  """How a tensor is viewed in blocks. Scales are stored with `reduce_axes` of the view squeezed."""

  shape: tuple[int, ...]          # original shape
  blocked_shape: tuple[int, ...]  # shape of the blocked view
  reduce_axes: tuple[int, ...]    # axes of the view that run within one block
  index_axis: int | None          # axis of the view that indexes blocks along cfg.axis (1-D blocks)


def normalize_config(cfg: QuantConfig, ndim: int) -> QuantConfig:
  """Checks cfg.axis against ndim and returns cfg with a non-negative axis."""
  if ndim == 0:
    return cfg  # only per-tensor formats accept scalars (checked in block_layout)
  if not -ndim <= cfg.axis < ndim:
    raise ValueError(f"QuantConfig.axis={cfg.axis} is out of range for a {ndim}-d tensor.")
  axis = cfg.axis % ndim
  return cfg if axis == cfg.axis else dataclasses.replace(cfg, axis=axis)


def block_layout(shape: tuple[int, ...], cfg: QuantConfig) -> Layout:
  """Validates shape against cfg (trace time) and describes the blocked view."""
  nd = len(shape)
  if cfg.kind == "tensor":
    return Layout(shape, shape, tuple(range(nd)), None)
  bs = cfg.block
  if cfg.block_2d:
    if nd < 2:
      raise ValueError(f"block_2d needs a tensor with at least 2 dims, got shape {shape}.")
    m, n = shape[-2:]
    if m % bs or n % bs:
      raise ValueError(f"block_2d: the last two dims {shape[-2:]} must both be multiples of the "
                       f"block size {bs}; pad them or use 1-D blocks (block_2d=False).")
    blocked = shape[:-2] + (m // bs, bs, n // bs, bs)
    return Layout(shape, blocked, (nd - 1, nd + 1), None)
  if nd == 0:
    raise ValueError(f"{cfg.fmt} quantizes blocks along an axis; got a scalar.")
  a = cfg.axis
  if shape[a] % bs:
    raise ValueError(f"{cfg.fmt}: x.shape[{a}]={shape[a]} is not a multiple of the block size "
                     f"{bs}; pad axis {a} to a multiple of {bs} or quantize along another axis.")
  blocked = shape[:a] + (shape[a] // bs, bs) + shape[a + 1:]
  return Layout(shape, blocked, (a + 1,), a)


def check_tensor_amax(cfg: QuantConfig, tensor_amax) -> jax.Array | None:
  """Validates a static per-tensor amax for cfg (trace time); returns it as an FP32 scalar."""
  if tensor_amax is None:
    return None
  if cfg.kind == "mx" or cfg.per_token:
    raise ValueError(f"tensor_amax sets a per-tensor scale, but {cfg.fmt}"
                     f"{' per_token' if cfg.per_token else ''} has none: pass tensor_amax=None or "
                     "use fp8_e4m3 / fp8_e5m2 / nvfp4 without per_token.")
  tensor_amax = jnp.asarray(tensor_amax)
  if tensor_amax.shape != () or not jnp.issubdtype(tensor_amax.dtype, jnp.floating):
    raise ValueError(f"tensor_amax must be a floating-point scalar, got shape {tensor_amax.shape} "
                     f"dtype {tensor_amax.dtype}.")
  return tensor_amax.astype(jnp.float32)


def static_amax(tensor_amax: jax.Array) -> jax.Array:
  """A given amax; negative (invalid) values become NaN, so the tensor dequantizes to NaN."""
  return where(tensor_amax >= 0, tensor_amax, jnp.nan)



def where(cond, a, b) -> jax.Array:
  """jnp.where(cond, a, b) (same promotion, same select) as one inline select: jnp.where lowers
  to a private StableHLO function per call site, and program size is what lowering and
  compilation time scale with."""
  dtype = jnp.result_type(a, b)
  cond, a, b = jnp.broadcast_arrays(cond, jnp.asarray(a, dtype), jnp.asarray(b, dtype))
  return lax.select(cond, a, b)


def clip(v: jax.Array, lo, hi) -> jax.Array:
  """jnp.clip(v, lo, hi) (max, then min) inline, without its private function (see `where`)."""
  return jnp.minimum(jnp.maximum(v, lo), hi)


def squeeze(a: jax.Array, layout: Layout) -> jax.Array:
  return jnp.squeeze(a, layout.reduce_axes) if a.ndim else a


def unsqueeze(a: jax.Array, layout: Layout) -> jax.Array:
  return jnp.expand_dims(a, layout.reduce_axes) if a.ndim else a


def abs_max(x_b: jax.Array, axes, keepdims: bool = True, paired: bool = False) -> jax.Array:
  """max |x| over `axes` as FP32, computed on the input's sign-masked bit patterns as integers.

  For non-negative floats integer order is float order, and every NaN pattern is above +inf, so
  NaN propagates and Inf wins, like a float max. Reducing the raw (e.g. BF16) bits lets XLA fuse
  the mask into the reduction; a float abs gets materialized as a full FP32 copy on CPU.
  paired: read 16-bit inputs two at a time (`_abs_max_pairs`) when the last axis is reduced and
  even: faster for NVFP4's 16-element blocks on XLA CPU, slower for MX's 32 (measured), so opt-in.
  """
  last = x_b.ndim - 1
  if paired and x_b.dtype.itemsize == 2 and x_b.ndim and x_b.shape[-1] % 2 == 0 and (
      axes is None or last in [a % x_b.ndim for a in axes]):
    return _abs_max_pairs(x_b, axes, keepdims)
  if x_b.dtype.itemsize == 4:
    ibits, mask = jnp.int32, 0x7FFFFFFF
  elif x_b.dtype.itemsize == 2:
    ibits, mask = jnp.int16, 0x7FFF
  else:
    return jnp.max(jnp.abs(x_b.astype(jnp.float32)), axis=axes, keepdims=keepdims)
  mag = lax.bitcast_convert_type(x_b, ibits) & mask
  return lax.bitcast_convert_type(jnp.max(mag, axis=axes, keepdims=keepdims), x_b.dtype).astype(
      jnp.float32)


def _abs_max_pairs(x_b: jax.Array, axes, keepdims: bool) -> jax.Array:
  """abs_max of a 16-bit float tensor whose last axis (even, reduced) is read in pairs: two
  elements' bits as one int32, their two 15-bit magnitudes maxed elementwise, then one int32
  reduction over half as many elements (XLA CPU vectorizes an int16 reduction over a short minor
  axis poorly). The same integer maximum, so the same result."""
  # The sign bits cleared, so the shift is exact.
  pairs = lax.bitcast_convert_type(x_b.reshape(x_b.shape[:-1] + (x_b.shape[-1] // 2, 2)),
                                   jnp.int32) & 0x7FFF7FFF
  mag = jnp.maximum(pairs >> 16, pairs & 0x7FFF)
  m = jnp.max(mag, axis=axes, keepdims=keepdims).astype(jnp.int16)
  return lax.bitcast_convert_type(m, x_b.dtype).astype(jnp.float32)


def recip(s_f32: jax.Array) -> jax.Array:
  """1 / s per scale (before broadcasting), and 0 where s is 0 or NaN, so those codes are 0."""
  pos = s_f32 > 0
  return where(pos, 1.0 / where(pos, s_f32, 1.0), 0.0)


def inv_const(c: float) -> np.float32:
  """FP32-rounded 1/c. Scales use multiplications by reciprocals only: XLA rewrites x / c and
  x / broadcast(s) into x * (1/c) and x * broadcast(1/s) under jit (but not eagerly), so a
  division would quantize differently with and without jit."""
  return np.float32(1.0 / c)
