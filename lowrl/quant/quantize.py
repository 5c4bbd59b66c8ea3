"""quantize / dequantize / fake_quant for every format: per-tensor FP8, MX (MXFP8, MXFP4), NVFP4.

All formats share one pipeline, written once in FP32 on a *blocked view* of the input (the block
axis split into (n_blocks, block) so block reductions are plain keepdims reductions):

  amax per block -> scale(s) -> elements y = x * fl(1/scale) -> saturate + round onto the element
  grid -> dequantized = grid * scale factors.

Scale formulas (FP32; fl(.) = rounded to FP32; divisions by constants are multiplications by
their FP32 reciprocals, see `_inv_const`):
  per-tensor FP8  s = amax * fl(1/max_normal); y = x * fl(1/s); dq = code * s.
  MX              s = 2**e (E8M0), e by the floor or rceil rule; y = x * 2**-e (exact).
  NVFP4           s_outer = amax * fl(1/(6*448))  (fl(1/(6*256)) with four_over_six);
                  s_block = e4m3((amax_block * fl(1/6)) * fl(1/s_outer)); S = s_block * s_outer;
                  y = x * fl(1/S); dq = code * S.

`quantize` stores the grid values in their ml_dtypes type and the scales in theirs (E8M0, E4M3, FP32);
`fake_quant` skips the storage casts and multiplies the FP32 grid values by the same FP32 scale
factors, so `fake_quant(x) == dequantize(quantize(x)).astype(x.dtype)` bit for bit.

Special values (REFERENCE.md §2):
  * MX: NaN/Inf in a block -> E8M0 scale NaN -> the whole block dequantizes to NaN; an all-zero block
    gets the smallest scale 2**-127 and stays exactly 0.
  * Per-tensor FP8 and NVFP4: the scale is taken from the amax of the tensor (of the row for
    per_token), so NaN/Inf anywhere in it makes the FP32 scale NaN and the tensor (row) NaN;
    an all-zero tensor (row) has scale 0 and dequantizes to exactly 0.
  * NVFP4 block scales are E4M3: they saturate at 448 and flush to 0 below 2**-10 (half the smallest
    E4M3 subnormal), in which case the block dequantizes to 0.
  * XLA on CPU flushes FP32 subnormals to zero: dequantized values below 2**-126 become 0, and
    per-tensor / NVFP4 tensors with amax below ~2**-115 (subnormal FP32 scale) quantize to 0.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from lowrl.quant import formats
from lowrl.quant.config import QuantConfig
from lowrl.quant.formats import E4M3, ElementFormat
from lowrl.quant.rounding import f32_exponent, pow2, round_to_grid, stochastic_round_to_grid


@struct.dataclass
class QTensor:
  """A quantized tensor (a pytree: arrays are leaves, the config is static).

  Attributes:
    codes: element codes in their ml_dtypes type (float8_e4m3fn / float8_e5m2 / float4_e2m1fn),
      same shape as the input.
    scale: per-tensor FP8: FP32 scalar. MX: float8_e8m0fnu block scales, NVFP4: float8_e4m3fn block
      scales; block scales have the input's shape with the block axis divided by the block size
      (both of the last two axes for NVFP4 block_2d).
    outer: NVFP4 only: FP32 outer scale, shape () per tensor, or the input's shape with the block
      axis set to 1 for per_token. None for the other formats.
    cfg: the QuantConfig used, with `axis` normalized to a non-negative index.
  """

  codes: jax.Array
  scale: jax.Array
  outer: jax.Array | None
  cfg: QuantConfig = struct.field(pytree_node=False)


class _Layout(NamedTuple):
  """How a tensor is viewed in blocks. Scales are stored with `reduce_axes` of the view squeezed."""

  shape: tuple[int, ...]          # original shape
  blocked_shape: tuple[int, ...]  # shape of the blocked view
  reduce_axes: tuple[int, ...]    # axes of the view that run within one block
  index_axis: int | None          # axis of the view that indexes blocks along cfg.axis (1-D blocks)


def normalize_config(cfg: QuantConfig, ndim: int) -> QuantConfig:
  """Checks cfg.axis against ndim and returns cfg with a non-negative axis."""
  if ndim == 0:
    return cfg  # only per-tensor formats accept scalars (checked in _layout)
  if not -ndim <= cfg.axis < ndim:
    raise ValueError(f"QuantConfig.axis={cfg.axis} is out of range for a {ndim}-d tensor.")
  axis = cfg.axis % ndim
  return cfg if axis == cfg.axis else dataclasses.replace(cfg, axis=axis)


def _layout(shape: tuple[int, ...], cfg: QuantConfig) -> _Layout:
  """Validates shape against cfg (trace time) and describes the blocked view."""
  nd = len(shape)
  if cfg.kind == "tensor":
    return _Layout(shape, shape, tuple(range(nd)), None)
  bs = cfg.block
  if cfg.block_2d:
    if nd < 2:
      raise ValueError(f"block_2d needs a tensor with at least 2 dims, got shape {shape}.")
    m, n = shape[-2:]
    if m % bs or n % bs:
      raise ValueError(f"block_2d: the last two dims {shape[-2:]} must both be multiples of the "
                       f"block size {bs}; pad them or use 1-D blocks (block_2d=False).")
    blocked = shape[:-2] + (m // bs, bs, n // bs, bs)
    return _Layout(shape, blocked, (nd - 1, nd + 1), None)
  if nd == 0:
    raise ValueError(f"{cfg.fmt} quantizes blocks along an axis; got a scalar.")
  a = cfg.axis
  if shape[a] % bs:
    raise ValueError(f"{cfg.fmt}: x.shape[{a}]={shape[a]} is not a multiple of the block size {bs}; "
                     f"pad axis {a} to a multiple of {bs} or quantize along another axis.")
  blocked = shape[:a] + (shape[a] // bs, bs) + shape[a + 1:]
  return _Layout(shape, blocked, (a + 1,), a)


def _check(x: jax.Array, cfg: QuantConfig, key: jax.Array | None) -> tuple[QuantConfig, _Layout]:
  if not isinstance(cfg, QuantConfig):
    raise ValueError(f"Expected a QuantConfig, got {type(cfg).__name__}.")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"Quantizers take floating-point input, got dtype {x.dtype}.")
  if cfg.stochastic_rounding and key is None:
    raise ValueError(f"{cfg.fmt} with stochastic_rounding=True needs a PRNG key: pass "
                     "key=jax.random.key(seed) (or set stochastic_rounding=False).")
  cfg = normalize_config(cfg, x.ndim)
  return cfg, _layout(tuple(x.shape), cfg)


def _squeeze(a: jax.Array, layout: _Layout) -> jax.Array:
  return jnp.squeeze(a, layout.reduce_axes) if a.ndim else a


def _unsqueeze(a: jax.Array, layout: _Layout) -> jax.Array:
  return jnp.expand_dims(a, layout.reduce_axes) if a.ndim else a


def _round(y_f32: jax.Array, fmt: ElementFormat, cfg: QuantConfig, key) -> jax.Array:
  if cfg.stochastic_rounding:
    return stochastic_round_to_grid(y_f32, fmt, key)
  return round_to_grid(y_f32, fmt)


def _recip(s_f32: jax.Array) -> jax.Array:
  """1 / s per scale (before broadcasting), and 0 where s is 0 or NaN, so those codes are 0."""
  pos = s_f32 > 0
  return jnp.where(pos, 1.0 / jnp.where(pos, s_f32, 1.0), 0.0)


def _inv_const(c: float) -> np.float32:
  """FP32-rounded 1/c. Scales use multiplications by reciprocals only: XLA rewrites x / c and
  x / broadcast(s) into x * (1/c) and x * broadcast(1/s) under jit (but not eagerly), so a
  division would quantize differently with and without jit."""
  return np.float32(1.0 / c)


# ---------------------------------------------------------------------------------------------
# Per format: stored scales from the blocked FP32 input, and FP32 dequantization factors from
# the stored scales. Both quantize and fake_quant go through the same factor functions.


def _tensor_scales(x_b: jax.Array, cfg: QuantConfig, fmt: ElementFormat, layout: _Layout):
  amax = jnp.max(jnp.abs(x_b))
  scale = jnp.where(jnp.isfinite(amax), amax * _inv_const(fmt.max_normal), jnp.nan)
  return scale, None


def _tensor_factors(scale, outer, layout):
  del outer, layout
  return (scale,)


def _mx_shared_exp(amax_b: jax.Array, cfg: QuantConfig, fmt: ElementFormat) -> jax.Array:
  """E8M0 exponent per block (int32, in [-127, 127]).

  floor (OCP v1.0): floor(log2 amax) - emax_elem. rceil: the smallest e with amax / 2**e <=
  max_normal, i.e. 2**ceil(log2(amax / max_normal)), decided exactly from amax's mantissa field
  (no rounded division).
  """
  e = f32_exponent(amax_b) - fmt.emax
  if cfg.scale_rounding == "rceil":
    mant = lax.bitcast_convert_type(amax_b, jnp.int32) & 0x7FFFFF
    e = e + (mant > fmt.max_significand_bits).astype(jnp.int32)
  return jnp.clip(e, formats.E8M0_MIN_EXP, formats.E8M0_MAX_EXP)


def _mx_scales(x_b, cfg, fmt, layout):
  amax_b = jnp.max(jnp.abs(x_b), axis=layout.reduce_axes, keepdims=True)
  e = _mx_shared_exp(amax_b, cfg, fmt)
  bits = jnp.where(jnp.isfinite(amax_b), e + formats.E8M0_BIAS, formats.E8M0_NAN_BITS)
  scale = lax.bitcast_convert_type(_squeeze(bits.astype(jnp.uint8), layout), formats.E8M0_DTYPE)
  return scale, None


def _mx_factors(scale, outer, layout):
  """2**e as two normal FP32 factors: XLA CPU treats subnormal operands as 0, and 2**-127 is one."""
  del outer
  bits = _unsqueeze(lax.bitcast_convert_type(scale, jnp.uint8), layout).astype(jnp.int32)
  e = bits - formats.E8M0_BIAS
  e_hi = jnp.maximum(e, -64)
  f_hi = jnp.where(bits == formats.E8M0_NAN_BITS, jnp.nan, pow2(jnp.minimum(e_hi, 127)))
  return (f_hi, pow2(e - e_hi))


def _nvfp4_outer(amax_b: jax.Array, cfg: QuantConfig, layout: _Layout) -> jax.Array:
  """FP32 outer scale (kept in the blocked view's rank): amax / (6 * 448), or / (6 * 256) for 4/6."""
  if cfg.per_token:
    amax = jnp.max(amax_b, axis=layout.index_axis, keepdims=True)
  else:
    amax = jnp.max(amax_b)
  denom = 6.0 * (formats.NVFP4_SCALE_MAX_FOUR_OVER_SIX if cfg.four_over_six
                 else formats.NVFP4_SCALE_MAX)
  return jnp.where(jnp.isfinite(amax), amax * _inv_const(denom), jnp.nan)


def _nvfp4_block_scale(amax_b, outer, target: float) -> jax.Array:
  """E4M3 block scale (FP32 value) mapping the block max to `target`:
  e4m3((amax_b * fl(1/target)) * fl(1/outer)), saturating at 448, 0 where outer is 0 or NaN."""
  return round_to_grid((amax_b * _inv_const(target)) * _recip(outer), E4M3)


def _block_error(x_b, s_f32, layout, metric: str) -> jax.Array:
  err = round_to_grid(x_b * _recip(s_f32), formats.E2M1) * s_f32 - x_b
  err = err * err if metric == "mse" else jnp.abs(err)
  return jnp.sum(err, axis=layout.reduce_axes, keepdims=True)


def _nvfp4_scales(x_b, cfg, fmt, layout):
  amax_b = jnp.max(jnp.abs(x_b), axis=layout.reduce_axes, keepdims=True)
  outer = _nvfp4_outer(amax_b, cfg, layout)
  s_block = _nvfp4_block_scale(amax_b, outer, 6.0)
  if cfg.four_over_six:
    # Four over six: also try mapping the block max to 4 (finer steps near the top of the block),
    # keep whichever reconstructs the block better; ties keep 6.
    s_block4 = _nvfp4_block_scale(amax_b, outer, 4.0)
    err6 = _block_error(x_b, s_block * outer, layout, cfg.four_over_six_metric)
    err4 = _block_error(x_b, s_block4 * outer, layout, cfg.four_over_six_metric)
    s_block = jnp.where(err4 < err6, s_block4, s_block)
  scale = _squeeze(s_block, layout).astype(E4M3.dtype)
  outer_stored = _squeeze(outer, layout) if cfg.per_token else outer
  return scale, outer_stored


def _nvfp4_factors(scale, outer, layout):
  outer = _unsqueeze(outer, layout) if outer.ndim else outer
  return (_unsqueeze(scale.astype(jnp.float32), layout) * outer,)


_SCALES = {"tensor": _tensor_scales, "mx": _mx_scales, "nvfp4": _nvfp4_scales}
_FACTORS = {"tensor": _tensor_factors, "mx": _mx_factors, "nvfp4": _nvfp4_factors}


def _quantize_blocked(x, cfg, layout, key):
  """(FP32 grid values in the blocked view, stored scale, stored outer, FP32 factors)."""
  fmt = formats.element_format(cfg.fmt)
  x_b = x.astype(jnp.float32).reshape(layout.blocked_shape)
  scale, outer = _SCALES[cfg.kind](x_b, cfg, fmt, layout)
  factors = _FACTORS[cfg.kind](scale, outer, layout)
  if cfg.kind == "mx":
    # Elements: x * 2**-e. A power of two, exact; -e >= -126 since e <= 127 - emax + 1.
    bits = _unsqueeze(lax.bitcast_convert_type(scale, jnp.uint8), layout).astype(jnp.int32)
    y_b = x_b * pow2(jnp.clip(formats.E8M0_BIAS - bits, -126, 127))
  else:
    y_b = x_b * _recip(factors[0])
  return _round(y_b, fmt, cfg, key), scale, outer, factors


def quantize(x: jax.Array, cfg: QuantConfig, key: jax.Array | None = None) -> QTensor:
  """Quantizes x (f32/bf16/f16) to cfg's format; key is required iff cfg.stochastic_rounding."""
  cfg, layout = _check(x, cfg, key)
  grid_b, scale, outer, _ = _quantize_blocked(x, cfg, layout, key)
  codes = grid_b.reshape(layout.shape).astype(formats.element_format(cfg.fmt).dtype)
  return QTensor(codes=codes, scale=scale, outer=outer, cfg=cfg)


def dequantize(q: QTensor, dtype=jnp.float32) -> jax.Array:
  """codes * scale(s), computed in FP32, returned in `dtype`."""
  layout = _layout(tuple(q.codes.shape), q.cfg)
  out = q.codes.astype(jnp.float32).reshape(layout.blocked_shape)
  for f in _FACTORS[q.cfg.kind](q.scale, q.outer, layout):
    out = out * f
  return out.reshape(layout.shape).astype(dtype)


def fake_quant(x: jax.Array, cfg: QuantConfig, key: jax.Array | None = None) -> jax.Array:
  """dequantize(quantize(x, cfg, key)) in x.dtype, without materializing the low-precision codes."""
  cfg, layout = _check(x, cfg, key)
  out, _, _, factors = _quantize_blocked(x, cfg, layout, key)
  for f in factors:
    out = out * f
  return out.reshape(layout.shape).astype(x.dtype)
