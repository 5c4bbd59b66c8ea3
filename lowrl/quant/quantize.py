"""quantize / dequantize / fake_quant for every format: per-tensor FP8, MX (MXFP8, MXFP4), NVFP4.

All formats share one pipeline, written once in FP32 on a *blocked view* of the input (the block
axis split into (n_blocks, block) so block reductions are plain keepdims reductions):

  amax per block -> scale(s) -> elements y = x * fl(1/scale) -> saturate + round onto the element
  grid -> dequantized = grid * scale.

Scale formulas (FP32; fl(.) = rounded to FP32). They are written so that XLA's algebraic rewrites
(division by a constant or a broadcast -> multiplication by the reciprocal; reassociating products
with broadcast operands) leave them unchanged, so jitted and eager results are bit-identical:
  per-tensor FP8  s = amax * fl(1/max_normal); y = x * fl(1/s); dq = code * s.
  MX              s = 2**e (E8M0), e by the floor or rceil rule; y = x * 2**-e; dq = code * 2**e
                  (both exact).
  NVFP4           s_outer = amax * fl(1/(6*448))  (fl(1/(6*256)) with four_over_six);
                  s_block = e4m3(amax_block * fl(fl(1/6) * fl(1/s_outer))); S = s_block * s_outer;
                  y = x * fl(1/S); dq = code * S.

`quantize` stores the grid values in their ml_dtypes type and the scales in theirs (E8M0, E4M3,
FP32); `fake_quant` skips the storage casts and applies the same scales to the FP32 grid values, so
`fake_quant(x) == dequantize(quantize(x)).astype(x.dtype)` bit for bit.

Special values (REFERENCE.md §2):
  * MX: NaN/Inf in a block -> E8M0 scale NaN -> the whole block dequantizes to NaN; an all-zero
    block gets the smallest scale 2**-127 and stays exactly 0.
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
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from lowrl.quant import formats
from lowrl.quant.config import QuantConfig
from lowrl.quant.formats import E4M3, ElementFormat
from lowrl.quant.rounding import (f32_exponent, pow2, round_to_grid, saturate,
                                  stochastic_round_to_grid)


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
    raise ValueError(f"{cfg.fmt}: x.shape[{a}]={shape[a]} is not a multiple of the block size "
                     f"{bs}; pad axis {a} to a multiple of {bs} or quantize along another axis.")
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


def _abs_max(x_b: jax.Array, axes, keepdims: bool = True) -> jax.Array:
  """max |x| over `axes` as FP32, computed on the input's sign-masked bit patterns as integers.

  For non-negative floats integer order is float order, and every NaN pattern is above +inf, so
  NaN propagates and Inf wins, like a float max. Reducing the raw (e.g. BF16) bits lets XLA fuse
  the mask into the reduction; a float abs gets materialized as a full FP32 copy on CPU.
  """
  if x_b.dtype.itemsize == 4:
    ibits, mask = jnp.int32, 0x7FFFFFFF
  elif x_b.dtype.itemsize == 2:
    ibits, mask = jnp.int16, 0x7FFF
  else:
    return jnp.max(jnp.abs(x_b.astype(jnp.float32)), axis=axes, keepdims=keepdims)
  mag = lax.bitcast_convert_type(x_b, ibits) & mask
  return lax.bitcast_convert_type(jnp.max(mag, axis=axes, keepdims=keepdims), x_b.dtype).astype(
      jnp.float32)


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
# Per format: stored scales from the blocked FP32 input, and dequantization from the stored
# scales. quantize, dequantize and fake_quant all go through the same functions.


def _tensor_scales(x_b: jax.Array, cfg: QuantConfig, fmt: ElementFormat, layout: _Layout):
  amax = _abs_max(x_b, None, keepdims=False)
  scale = jnp.where(jnp.isfinite(amax), amax * _inv_const(fmt.max_normal), jnp.nan)
  return scale, None


def _tensor_params(scale, outer, layout):
  """(encode multiplier, decode scale) of a per-tensor FP8 scale."""
  del outer, layout
  return _recip(scale), scale


def _tensor_apply(grid_b, scale):
  return grid_b * scale


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
  amax_b = _abs_max(x_b, layout.reduce_axes)
  e = _mx_shared_exp(amax_b, cfg, fmt)
  bits = jnp.where(jnp.isfinite(amax_b), e + formats.E8M0_BIAS, formats.E8M0_NAN_BITS)
  scale = lax.bitcast_convert_type(_squeeze(bits.astype(jnp.uint8), layout), formats.E8M0_DTYPE)
  return scale, None


def _mx_scale_exponent(scale, layout) -> tuple[jax.Array, jax.Array]:
  """(e, is_nan) of E8M0 block scales, expanded to the blocked view's rank."""
  bits = _unsqueeze(lax.bitcast_convert_type(scale, jnp.uint8), layout).astype(jnp.int32)
  return bits - formats.E8M0_BIAS, bits == formats.E8M0_NAN_BITS


def _mx_params(scale, outer, layout):
  """(encode multiplier 2**-e, (e, is_nan)) per block."""
  del outer
  e, is_nan = _mx_scale_exponent(scale, layout)
  # -e >= -126 since e <= 127 - emax + 1; the clip only matters for NaN blocks (any value).
  return pow2(jnp.clip(-e, -126, 127)), (e, is_nan)


def _mx_apply(grid_b, e_and_nan):
  """grid * 2**e by adding e to the FP32 exponent field (exact for normal results).

  Not a multiplication: 2**-127 is an FP32 subnormal, which XLA CPU reads as 0, and a split into two
  normal factors is undone by XLA's reassociation of multiplications. Results below 2**-126 flush
  to signed zero, as FP32 arithmetic does on this backend; results beyond FP32 become ±inf.
  """
  e, is_nan = e_and_nan
  g_bits = lax.bitcast_convert_type(grid_b, jnp.int32)
  sign = g_bits & jnp.int32(-0x80000000)
  new_exp = ((g_bits >> 23) & 0xFF) + e
  out_bits = jnp.where(new_exp >= 255, sign | 0x7F800000, g_bits + (e << 23))
  out_bits = jnp.where((new_exp <= 0) | (grid_b == 0), sign, out_bits)
  out = lax.bitcast_convert_type(out_bits, jnp.float32)
  return jnp.where(is_nan | jnp.isnan(grid_b), jnp.nan, out)


def _nvfp4_outer(amax_b: jax.Array, cfg: QuantConfig, layout: _Layout) -> jax.Array:
  """FP32 outer scale (blocked view's rank): amax * fl(1/(6*448)), or fl(1/(6*256)) for 4/6."""
  if cfg.per_token:
    amax = jnp.max(amax_b, axis=layout.index_axis, keepdims=True)
  else:
    amax = jnp.max(amax_b)
  denom = 6.0 * (formats.NVFP4_SCALE_MAX_FOUR_OVER_SIX if cfg.four_over_six
                 else formats.NVFP4_SCALE_MAX)
  return jnp.where(jnp.isfinite(amax), amax * _inv_const(denom), jnp.nan)


def _nvfp4_block_scale(amax_b, outer, target: float) -> jax.Array:
  """E4M3 block scale (FP32 value) mapping the block max to `target`:
  e4m3(amax_b * fl(fl(1/target) * fl(1/outer))), saturating at 448, 0 where outer is 0 or NaN.

  The encode factor is formed on the outer scale's (small) shape first: XLA reassociates
  (amax_b * c) * broadcast(r) into amax_b * broadcast(c * r) under jit, so that is the only
  association that is the same with and without jit.
  """
  ratio = saturate(amax_b * (_inv_const(target) * _recip(outer)), E4M3)
  # round_to_grid(ratio, E4M3), written with an (exact) division by the power of two instead of a
  # multiplication: XLA treats division as expensive and then keeps this per-block result
  # materialized instead of recomputing it inside the elementwise pass for every element.
  k = E4M3.mantissa_bits - jnp.maximum(f32_exponent(ratio), E4M3.emin)
  return jnp.round(ratio * pow2(k)) / pow2(k)


def _opaque(v: jax.Array) -> jax.Array:
  """Clamp to ±FP32 max: a no-op on finite values that LLVM cannot see through.

  XLA CPU lets LLVM contract a multiply feeding an add into one FMA (a*b - c rounded once), and
  whether it does depends on the surrounding fusion; passing the product through a clamp first
  pins the two-rounding result in every program.
  """
  big = np.float32(np.finfo(np.float32).max)
  return jnp.clip(v, -big, big)


# 4/6 error units: per-element errors relative to the block max, in fixed point with 2**-20
# resolution, summed as int32: exact, so the comparison cannot depend on the compiler's FP32
# reduction order, which differs between programs. Blocks of <= 1024 elements keep the sums below
# 2**31 (config.py checks).
_ERR_FRAC_BITS = 20


def _error_units(x_f32, inv_amax_b, dec_b, enc_b, metric: str) -> jax.Array:
  """Per-element reconstruction error with decode scale S = dec_b (fl(1/S) = enc_b) in int32
  fixed point: round(2**20 * r**2) (mse) or round(2**20 * |r|) (mae),
  r = (e2m1(x * fl(1/S)) * S - x) * fl(1/amax_block)."""
  dq = _opaque(round_to_grid(x_f32 * enc_b, formats.E2M1) * dec_b)
  r = jnp.abs(dq - x_f32) * inv_amax_b
  r = r * r if metric == "mse" else r
  return jnp.round(r * np.float32(2**_ERR_FRAC_BITS)).astype(jnp.int32)


def _nvfp4_scales(x_b, cfg, fmt, layout):
  amax_b = _abs_max(x_b, layout.reduce_axes)
  outer = _nvfp4_outer(amax_b, cfg, layout)
  s_block = _nvfp4_block_scale(amax_b, outer, 6.0)
  if cfg.four_over_six:
    # Four over six: also try mapping the block max to 4 (finer steps near the top of the block),
    # keep whichever reconstructs the block better; ties keep 6.
    s_block4 = _nvfp4_block_scale(amax_b, outer, 4.0)
    dec6, dec4 = s_block * outer, s_block4 * outer
    inv_amax, enc6, enc4 = _recip(amax_b), _recip(dec6), _recip(dec4)
    x_f32 = x_b.astype(jnp.float32)
    metric = cfg.four_over_six_metric
    # err4 < err6 as one exact integer sum (one pass over x instead of two).
    diff = (_error_units(x_f32, inv_amax, dec4, enc4, metric)
            - _error_units(x_f32, inv_amax, dec6, enc6, metric))
    use4 = jnp.sum(diff, axis=layout.reduce_axes, keepdims=True) < 0
    s_block = jnp.where(use4, s_block4, s_block)
  scale = _squeeze(s_block, layout).astype(E4M3.dtype)
  outer_stored = _squeeze(outer, layout) if cfg.per_token else outer
  return scale, outer_stored


def _nvfp4_params(scale, outer, layout):
  """(encode multiplier fl(1/S), decode scale S = s_block * s_outer) per block."""
  outer = _unsqueeze(outer, layout) if outer.ndim else outer
  dec = _unsqueeze(scale.astype(jnp.float32), layout) * outer
  return _recip(dec), dec


_SCALES = {"tensor": _tensor_scales, "mx": _mx_scales, "nvfp4": _nvfp4_scales}
# Per-block (encode, decode) parameters from the stored scales, and the elementwise decode.
# quantize, dequantize and fake_quant all go through these.
_PARAMS = {"tensor": _tensor_params, "mx": _mx_params, "nvfp4": _nvfp4_params}
_APPLY = {"tensor": _tensor_apply, "mx": _mx_apply, "nvfp4": _tensor_apply}


def _quantize_blocked(x, cfg, layout, key):
  """(FP32 grid values in the blocked view, stored scale, stored outer, decode parameters)."""
  fmt = formats.element_format(cfg.fmt)
  x_b = x.reshape(layout.blocked_shape)  # scales read the input dtype, elements work in FP32
  scale, outer = _SCALES[cfg.kind](x_b, cfg, fmt, layout)
  enc, dec = _PARAMS[cfg.kind](scale, outer, layout)
  grid_b = _round(x_b.astype(jnp.float32) * enc, fmt, cfg, key)
  return grid_b, scale, outer, dec


# The public functions validate in Python (errors at trace time, before any compile), then run a
# jitted core: eager callers get one compiled program instead of dozens of op-by-op dispatches, and
# inside an outer jit the inner one is inlined.


@functools.partial(jax.jit, static_argnames=("cfg", "layout"))
def _quantize_jit(x, key, *, cfg, layout):
  grid_b, scale, outer, _ = _quantize_blocked(x, cfg, layout, key)
  codes = grid_b.reshape(layout.shape).astype(formats.element_format(cfg.fmt).dtype)
  return QTensor(codes=codes, scale=scale, outer=outer, cfg=cfg)


@functools.partial(jax.jit, static_argnames=("dtype", "layout"))
def _dequantize_jit(q, *, dtype, layout):
  grid_b = q.codes.astype(jnp.float32).reshape(layout.blocked_shape)
  _, dec = _PARAMS[q.cfg.kind](q.scale, q.outer, layout)
  out = _APPLY[q.cfg.kind](grid_b, dec)
  return out.reshape(layout.shape).astype(dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "layout"))
def _fake_quant_jit(x, key, *, cfg, layout):
  grid_b, _, _, dec = _quantize_blocked(x, cfg, layout, key)
  out = _APPLY[cfg.kind](grid_b, dec)
  return out.reshape(layout.shape).astype(x.dtype)


def quantize(x: jax.Array, cfg: QuantConfig, key: jax.Array | None = None) -> QTensor:
  """Quantizes x (f32/bf16/f16) to cfg's format; key is required iff cfg.stochastic_rounding."""
  x = jnp.asarray(x)
  cfg, layout = _check(x, cfg, key)
  return _quantize_jit(x, key if cfg.stochastic_rounding else None, cfg=cfg, layout=layout)


def dequantize(q: QTensor, dtype=jnp.float32) -> jax.Array:
  """codes * scale(s), computed in FP32, returned in `dtype`."""
  return _dequantize_jit(q, dtype=jnp.dtype(dtype), layout=_layout(tuple(q.codes.shape), q.cfg))


def fake_quant(x: jax.Array, cfg: QuantConfig, key: jax.Array | None = None) -> jax.Array:
  """dequantize(quantize(x, cfg, key)) in x.dtype, without materializing the low-precision codes."""
  x = jnp.asarray(x)
  cfg, layout = _check(x, cfg, key)
  return _fake_quant_jit(x, key if cfg.stochastic_rounding else None, cfg=cfg, layout=layout)
