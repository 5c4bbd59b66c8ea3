"""quantize / dequantize / fake_quant for every format: per-tensor FP8, MX (MXFP8, MXFP4), NVFP4.

All formats share one pipeline, written once in FP32 on a *blocked view* of the input (the block
axis split into (n_blocks, block) so block reductions are plain keepdims reductions):

  amax per block -> scale(s) -> elements y = x * fl(1/scale) -> saturate + round onto the element
  grid -> dequantized = grid * scale (NVFP4 rounds the exact quotients instead, below).

Scale formulas (FP32; fl(.) = rounded to FP32). They are written so that XLA's algebraic rewrites
(division by a constant or a broadcast -> multiplication by the reciprocal; reassociating products
with broadcast operands) leave them unchanged, so jitted and eager results are bit-identical:
  per-tensor FP8  s = amax * fl(1/max_normal); y = x * fl(1/s); dq = code * s.
  MX              s = 2**e (E8M0), e by the floor or rceil rule; y = x * 2**-e; dq = code * 2**e
                  (both exact).
  NVFP4           spec-exact (docs/reference.md §2; every rounding one RNE of the exact value, see
                  exact.py): s_outer = RNE_f32(amax / (6*448)) (6*256 with four_over_six);
                  s_block = RNE_e4m3(amax_block / (6 * s_outer)); code = RNE_e2m1(x / (s_block *
                  s_outer)); dq = RNE_dtype(code * s_block * s_outer), one rounding of the exact
                  product to the output dtype (FP32: fl(code * s_block) * s_outer, the first
                  product exact; BF16/FP16: from that by round to odd, exact.narrow_product).
                  Stochastic rounding rounds both scales up instead (exact ceilings, so no
                  element saturates) and draws from the quotient x * fl(1/fl(s_block*s_outer)).
                  4/6 keeps 4 iff the exact squared (mse) or absolute (mae) error sum of its
                  exact dequantized values code * s_block * s_outer is strictly smaller
                  (four_over_six.py; a tie keeps 6), whatever the output dtype.
  NVFP4 "te"      TransformerEngine's FP32 arithmetic (te.py).

`quantize` stores the grid values in their ml_dtypes type and the scales in theirs (E8M0, E4M3,
FP32); `fake_quant` skips the storage casts and applies the same scales to the FP32 grid values, so
`fake_quant(x) == dequantize(quantize(x)).astype(x.dtype)` bit for bit.

Special values (docs/reference.md §2):
  * MX: NaN/Inf in a block -> E8M0 scale NaN -> the whole block dequantizes to NaN; an all-zero
    block gets the smallest scale 2**-127 and stays exactly 0.
  * Per-tensor FP8 and NVFP4: the scale is taken from the amax of the tensor (of the row for
    per_token), so NaN/Inf anywhere in it makes the FP32 scale NaN and the tensor (row) NaN;
    an all-zero tensor (row) has scale 0 and dequantizes to exactly 0.
  * NVFP4 block scales are E4M3: they saturate at 448 and flush to 0 below 2**-10 (half the smallest
    E4M3 subnormal), in which case the block dequantizes to 0.
  * XLA on CPU flushes FP32 subnormals to zero (inputs and results of float arithmetic). MX
    handles them exactly anyway (scales and dequantization are exponent/bit arithmetic, subnormal
    inputs are scaled from their integer mantissa): an FP32 input 1.14e-38 dequantizes to 2**-126
    under mxfp8_e4m3, and FP32 outputs below 2**-126 are FP32 subnormals (a BF16 output goes
    through XLA's conversion, which may flush them). Per-tensor FP8 and NVFP4 read subnormal
    inputs as (signed) 0, flush dequantized values below 2**-126 to 0, and quantize tensors with
    amax below ~2**-115 (subnormal FP32 scale) to 0; the exact NVFP4 reference
    (tests/quant_reference.py) models the same flush.
  * `tensor_amax` (quantize / fake_quant keyword) replaces the data's amax in the per-tensor scale
    of fp8_e4m3 / fp8_e5m2 / nvfp4 (not per_token): a static, calibrated scale. Elements beyond it
    saturate (at amax; at 1.75 amax for nvfp4 four_over_six, whose outer scale leaves headroom),
    Inf elements saturate too, NaN elements make their block (NVFP4) or themselves (FP8) NaN.
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

from lowrl.quant import exact, formats, four_over_six, te
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
      axis set to 1 for per_token (scale_convention="te": the FP32 tensor amax, which TE's
      dequantization reads). None for the other formats.
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


def _static_amax(tensor_amax: jax.Array) -> jax.Array:
  """A given amax; negative (invalid) values become NaN, so the tensor dequantizes to NaN."""
  return jnp.where(tensor_amax >= 0, tensor_amax, jnp.nan)


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


def _tensor_scales(x_b: jax.Array, cfg: QuantConfig, fmt: ElementFormat, layout: _Layout,
                   tensor_amax: jax.Array | None):
  if tensor_amax is None:
    amax = _abs_max(x_b, None, keepdims=False)
  else:
    amax = _static_amax(tensor_amax)
  scale = jnp.where(jnp.isfinite(amax), amax * _inv_const(fmt.max_normal), jnp.nan)
  return scale, None


def _tensor_params(scale, outer, layout, cfg):
  """(encode multiplier, decode scale) of a per-tensor FP8 scale."""
  del outer, layout, cfg
  return _recip(scale), scale


def _tensor_apply(grid_b, scale, dtype):
  return (grid_b * scale).astype(dtype)


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


def _mx_scales(x_b, cfg, fmt, layout, tensor_amax):
  del tensor_amax  # rejected by check_tensor_amax
  amax_b = _abs_max(x_b, layout.reduce_axes)
  e = _mx_shared_exp(amax_b, cfg, fmt)
  bits = jnp.where(jnp.isfinite(amax_b), e + formats.E8M0_BIAS, formats.E8M0_NAN_BITS)
  scale = lax.bitcast_convert_type(_squeeze(bits.astype(jnp.uint8), layout), formats.E8M0_DTYPE)
  return scale, None


def _mx_scale_exponent(scale, layout) -> tuple[jax.Array, jax.Array]:
  """(e, is_nan) of E8M0 block scales, expanded to the blocked view's rank."""
  bits = _unsqueeze(lax.bitcast_convert_type(scale, jnp.uint8), layout).astype(jnp.int32)
  return bits - formats.E8M0_BIAS, bits == formats.E8M0_NAN_BITS


def _mx_params(scale, outer, layout, cfg):
  """(encode multiplier 2**-e, (e, is_nan)) per block."""
  del outer, cfg
  e, is_nan = _mx_scale_exponent(scale, layout)
  # -e >= -126 since e <= 127 - emax + 1; the clip only matters for NaN blocks (any value).
  return pow2(jnp.clip(-e, -126, 127)), (e, is_nan)


def _mx_encode(x_f32: jax.Array, e_and_nan) -> jax.Array:
  """x * 2**-e exactly, FP32 subnormal x included.

  XLA CPU reads subnormal operands of float arithmetic as 0, so a subnormal x = m * 2**-149 is
  scaled from its integer mantissa m instead: float(m) * 2**(-149 - e) (exact). That is only
  normal for e <= -23; for larger e the result is below 2**-126 * 2**-(e+23), far under any
  element grid's smallest subnormal, and 0 is its round-to-nearest value (and SR's up-probability
  would be below 2**-100).
  """
  e, _ = e_and_nan
  normal = x_f32 * pow2(jnp.clip(-e, -126, 127))  # -e >= -126 except for NaN blocks (any value)
  bits = lax.bitcast_convert_type(x_f32, jnp.int32)
  mant = (bits & 0x7FFFFF).astype(jnp.float32)
  sub = jnp.where(e <= -23, mant * pow2(jnp.clip(-149 - e, -126, 127)), 0.0)
  is_sub = (bits & 0x7F800000) == 0
  return jnp.where(is_sub, _with_sign_of(sub, x_f32), normal)


def _mx_apply(grid_b, e_and_nan, dtype):
  """grid * 2**e by adding e to the FP32 exponent field (exact), or, for results below 2**-126,
  by writing the FP32 subnormal's mantissa field grid * 2**(e + 149) (an exact integer: grid
  values are multiples of 2**-16 and e >= -127).

  Not a multiplication: 2**-127 is an FP32 subnormal, which XLA CPU reads as 0, and a split into two
  normal factors is undone by XLA's reassociation of multiplications. Results beyond FP32 become
  ±inf.
  """
  e, is_nan = e_and_nan
  g_bits = lax.bitcast_convert_type(grid_b, jnp.int32)
  sign = g_bits & jnp.int32(-0x80000000)
  new_exp = ((g_bits >> 23) & 0xFF) + e
  out_bits = jnp.where(new_exp >= 255, sign | 0x7F800000, g_bits + (e << 23))
  # Subnormal results (new_exp <= 0 implies e <= -23, so 2**(e + 149) is a normal FP32 number).
  sub_mant = (jnp.abs(grid_b) * pow2(jnp.clip(e + 149, -126, 127))).astype(jnp.int32)
  out_bits = jnp.where(new_exp <= 0, sign | sub_mant, out_bits)
  out_bits = jnp.where(grid_b == 0, sign, out_bits)
  out = lax.bitcast_convert_type(out_bits, jnp.float32)
  return jnp.where(is_nan | jnp.isnan(grid_b), jnp.nan, out).astype(dtype)


def _outer_amax(amax_b: jax.Array, cfg: QuantConfig, layout: _Layout,
                tensor_amax: jax.Array | None) -> jax.Array:
  """The amax an NVFP4 outer scale is taken from: the static one, the row's (per_token, keepdims)
  or the tensor's."""
  if tensor_amax is not None:
    return _static_amax(tensor_amax)
  if cfg.per_token:
    return jnp.max(amax_b, axis=layout.index_axis, keepdims=True)
  return jnp.max(amax_b)


def _nvfp4_outer(amax_b: jax.Array, cfg: QuantConfig, layout: _Layout,
                 tensor_amax: jax.Array | None) -> jax.Array:
  """FP32 outer scale (blocked view's rank): RNE_fp32(amax / (6*448)) of the exact quotient
  (6*256 with four_over_six); NaN when amax is not finite."""
  amax = _outer_amax(amax_b, cfg, layout, tensor_amax)
  denom = 6.0 * (formats.NVFP4_SCALE_MAX_FOUR_OVER_SIX if cfg.four_over_six
                 else formats.NVFP4_SCALE_MAX)
  finite = jnp.isfinite(amax)
  # Stochastic rounding rounds the scales up (exactly): then no element quotient exceeds 6, so no
  # element saturates and SR stays unbiased on every element (RNE scales that round down clip the
  # block max; RNE also flushes tiny blocks to 0).
  q = exact.div_rn(jnp.where(finite, amax, 0.0), denom, round_up=cfg.stochastic_rounding)
  # Computed once (a scalar, or one per row): its exact division stays out of every consumer.
  return _materialize(jnp.where(finite, q, jnp.nan))


class _OuterParts(NamedTuple):
  """The outer scale s = G * 2**e (G in [1, 2), split G = G_hi + G_lo) for exact comparisons."""

  down: jax.Array  # 2**-e (2**127 for s = 0)
  g: jax.Array
  g_hi: jax.Array
  g_lo: jax.Array
  valid: jax.Array  # s > 0 (normal) and not NaN


def _outer_parts(outer: jax.Array) -> _OuterParts:
  """The parts of `outer` (materialized by _nvfp4_outer, or a stored input), computed once into
  one buffer (a scalar per tensor or one per row), not inside every per-block and per-element
  consumer: XLA would otherwise repeat the exponent arithmetic in each of their fusions."""
  e, g = exact.normalize(outer)
  g_hi, g_lo = exact.split12(g)
  down, g, g_hi, g_lo = _materialize(jnp.stack([pow2(jnp.clip(-e, -126, 127)), g, g_hi, g_lo]))
  return _OuterParts(down, g, g_hi, g_lo, outer > 0)


def _scaled_by_outer(v: jax.Array, parts: _OuterParts) -> jax.Array:
  """v * 2**-e (exact; inf where it overflows, which rounds like any value above the grid)."""
  return v * parts.down


def _nvfp4_block_scale(amax_b, outer, parts: _OuterParts, target,
                       round_up: bool = False) -> jax.Array:
  """E4M3 block scale (FP32 value) RNE_e4m3(amax_b / (target * outer)) of the exact quotient
  (its exact ceiling with round_up), saturating at 448 (RNE values below 2**-10 flush to 0); 0
  where outer is 0, NaN where it or amax_b is NaN. target: 6, or an array of targets (6 and 4
  stacked on a leading axis: both 4/6 candidates in one program piece, each element computed by
  the same operations as alone)."""
  a_b = _scaled_by_outer(amax_b, parts)
  approx = a_b * _recip(target * parts.g)
  rnd = exact.ceil_quotient if round_up else exact.round_quotient
  s_block = rnd(a_b, target, parts.g_hi, parts.g_lo, approx, E4M3)
  s_block = jnp.where(parts.valid, s_block, 0.0)
  return jnp.where(jnp.isnan(amax_b) | jnp.isnan(outer), jnp.nan, s_block)


def _nvfp4_elements(x_f32, s_block, parts: _OuterParts, cfg: QuantConfig, key) -> jax.Array:
  """E2M1 grid values RNE_e2m1(x / (s_block * outer)) of the exact quotient (signed), or
  stochastically rounded; 0 in blocks whose scale is 0 (for finite x)."""
  ax = _scaled_by_outer(jnp.abs(x_f32), parts)
  # Per block, computed once (a division ends XLA's fusion, see _materialize): the approximate
  # reciprocal only picks the grid interval; s_hi + s_lo = s_block * G exactly.
  inv = _recip(s_block * parts.g)
  if cfg.stochastic_rounding:
    return stochastic_round_to_grid(jnp.copysign(ax, x_f32) * inv, formats.E2M1, key)
  # Blocks whose scale is 0 (or NaN: dequantized through the NaN scale) get s_hi = inf: code 0.
  s_hi = jnp.where(s_block > 0, s_block * parts.g_hi, jnp.inf)
  s_lo = jnp.where(s_block > 0, s_block * parts.g_lo, 0.0)
  # The three per-block values in one buffer (one small program piece instead of three).
  inv, s_hi, s_lo = _materialize(jnp.stack([inv, s_hi, s_lo]))
  code = exact.round_e2m1_quotient(ax, s_hi, s_lo, ax * inv)
  return _with_sign_of(code, x_f32)


def _with_sign_of(mag_f32: jax.Array, x_f32: jax.Array) -> jax.Array:
  """copysign for mag >= 0 as one bit OR (jnp.copysign lowers to abs/negate/select on XLA CPU)."""
  sign = lax.bitcast_convert_type(x_f32, jnp.int32) & jnp.int32(-0x80000000)
  return lax.bitcast_convert_type(lax.bitcast_convert_type(mag_f32, jnp.int32) | sign, jnp.float32)


def _nvfp4_apply(grid_b, scales, dtype):
  """RNE_dtype(code * s_block * outer) of the exact product, rounded once: in FP32, (code *
  s_block) * outer (the first product is exact, <= 7 bits; `_opaque` keeps XLA from reassociating
  it into code * (s_block * outer), which rounds differently); in a narrower dtype (BF16, FP16)
  from that FP32 value by round to odd (exact.narrow_product), not by a second rounding."""
  s_block, outer, parts = scales
  cs = _opaque(grid_b * s_block)
  y = cs * outer
  if jnp.dtype(dtype).itemsize >= 4:
    return y.astype(dtype)
  return exact.narrow_product(y, jnp.abs(cs), parts.down, parts.g_hi, parts.g_lo, dtype)


_NO_SR = QuantConfig("nvfp4")


def _nvfp4_quantize(x_b, cfg, layout, key, tensor_amax):
  """(E2M1 grid values, stored E4M3 block scales, stored outer scale, decode parameters).

  With four_over_six and round to nearest, the grid values of both candidates are computed (once,
  stacked) to choose between them, so the chosen block's are returned: they are what
  `_nvfp4_elements` gives for the stored scale (the same function of x, the same scale value and
  the same outer scale). Otherwise the elements are rounded with the chosen scale.

  The decode parameters hold the FP32 block scale before its E4M3 storage cast: the same values
  as `_nvfp4_params` reads back from the stored scale (they are E4M3 grid values, 0 or NaN), so
  fake_quant needs no E4M3 cast at all (quantize's stored scale is then dead code under jit).
  """
  amax_b = _abs_max(x_b, layout.reduce_axes)
  outer = _nvfp4_outer(amax_b, cfg, layout, tensor_amax)
  parts = _outer_parts(outer)
  sr = cfg.stochastic_rounding
  grid_b = None
  if not cfg.four_over_six:
    s_block = _nvfp4_block_scale(amax_b, outer, parts, 6.0, sr)
  else:
    # Four over six: also try mapping the block max to 4 (finer steps near the top of the block),
    # keep whichever reconstructs the block better; ties keep 6. Both candidates run through one
    # copy of the scale and element rounding, stacked on a leading axis (index 0: 6, 1: 4).
    target = np.array([6.0, 4.0], np.float32).reshape((2,) + (1,) * amax_b.ndim)
    s_both = _materialize(_nvfp4_block_scale(amax_b[None], outer, parts, target, sr))
    x_f32 = x_b.astype(jnp.float32)
    # Round-to-nearest grid values of both candidates (4/6 compares round-to-nearest errors),
    # computed once into a buffer: read by the selection and, without SR, by the result.
    codes = _materialize(_nvfp4_elements(x_f32[None], s_both, parts, _NO_SR, None))
    use4 = four_over_six.four_wins(
        _scaled_by_outer(jnp.abs(x_f32), parts), codes[1], codes[0], s_both[1], s_both[0],
        parts.g, parts.g_hi, parts.g_lo, _scaled_by_outer(amax_b, parts), layout.reduce_axes,
        cfg.four_over_six_metric)
    # The per-block choice once into a buffer: fused into the element loop, its integer
    # comparison would be recomputed for every element of the block.
    use4 = _materialize(use4.astype(jnp.float32)) > 0
    s_block = jnp.where(use4, s_both[1], s_both[0])
    if not sr:
      grid_b = jnp.where(use4, codes[1], codes[0])
  s_block = _materialize(s_block)
  if grid_b is None:
    grid_b = _nvfp4_elements(x_b.astype(jnp.float32), s_block, parts, cfg, key)
  scale = _squeeze(s_block, layout).astype(E4M3.dtype)
  outer_stored = _squeeze(outer, layout) if cfg.per_token else outer
  return grid_b, scale, outer_stored, (s_block, outer, parts)


_materialize = exact.materialize
_opaque = exact.opaque


def _nvfp4_params(scale, outer, layout, cfg):
  """(no encode multiplier: elements round exactly in _nvfp4_elements, (s_block, outer, parts))."""
  del cfg
  outer = _unsqueeze(outer, layout) if outer.ndim else outer
  return None, (_materialize(_unsqueeze(scale.astype(jnp.float32), layout)), outer,
                _outer_parts(outer))


# TransformerEngine's NVFP4 conventions (scale_convention="te" | "te_v2_13"): te.py.


def _te_quantize(x_b, cfg, layout, key, tensor_amax):
  del key  # round to nearest only (config.py)
  amax_b = _abs_max(x_b, layout.reduce_axes)
  amax = _outer_amax(amax_b, cfg, layout, tensor_amax)
  grid_b, s_b = te.quantize_blocked(x_b, amax_b, amax, cfg, layout.reduce_axes[0])
  outer_stored = _squeeze(amax, layout) if cfg.per_token else amax
  return grid_b, _squeeze(s_b, layout).astype(E4M3.dtype), outer_stored, te.decode_scale(
      s_b, amax, cfg)


def _te_params(scale, amax, layout, cfg):
  """(no encode multiplier, per-block decode scale) from the stored scales."""
  amax = _unsqueeze(amax, layout) if amax.ndim else amax
  return None, te.decode_scale(_unsqueeze(scale.astype(jnp.float32), layout), amax, cfg)


def _te_apply(grid_b, final_scale, dtype):
  return (grid_b * final_scale).astype(dtype)  # TE casts its FP32 product (dequantize_nvfp4.cuh)


# NVFP4: _nvfp4_quantize and _te_quantize, which return the grid values and decode parameters too.
_SCALES = {"tensor": _tensor_scales, "mx": _mx_scales}
# Per-block (encode, decode) parameters from the stored scales, and the elementwise decode.
# quantize, dequantize and fake_quant all go through these.
_PARAMS = {"tensor": _tensor_params, "mx": _mx_params, "nvfp4": _nvfp4_params,
           "nvfp4_te": _te_params}
_APPLY = {"tensor": _tensor_apply, "mx": _mx_apply, "nvfp4": _nvfp4_apply,
          "nvfp4_te": _te_apply}


def _quantize_blocked(x, cfg, layout, key, tensor_amax):
  """(FP32 grid values in the blocked view, stored scale, stored outer, decode parameters)."""
  fmt = formats.element_format(cfg.fmt)
  x_b = x.reshape(layout.blocked_shape)  # scales read the input dtype, elements work in FP32
  if cfg.scheme == "nvfp4":
    return _nvfp4_quantize(x_b, cfg, layout, key, tensor_amax)
  if cfg.scheme == "nvfp4_te":
    return _te_quantize(x_b, cfg, layout, key, tensor_amax)
  scale, outer = _SCALES[cfg.scheme](x_b, cfg, fmt, layout, tensor_amax)
  enc, dec = _PARAMS[cfg.scheme](scale, outer, layout, cfg)
  x_f32 = x_b.astype(jnp.float32)
  if cfg.kind == "mx":
    grid_b = _round(_mx_encode(x_f32, dec), fmt, cfg, key)
  else:
    grid_b = _round(x_f32 * enc, fmt, cfg, key)
  return grid_b, scale, outer, dec


# The public functions validate in Python (errors at trace time, before any compile), then run a
# jitted core: eager callers get one compiled program instead of dozens of op-by-op dispatches, and
# inside an outer jit the inner one is inlined.


@functools.partial(jax.jit, static_argnames=("cfg", "layout"))
def _quantize_jit(x, key, tensor_amax, *, cfg, layout):
  grid_b, scale, outer, _ = _quantize_blocked(x, cfg, layout, key, tensor_amax)
  codes = grid_b.reshape(layout.shape).astype(formats.element_format(cfg.fmt).dtype)
  return QTensor(codes=codes, scale=scale, outer=outer, cfg=cfg)


@functools.partial(jax.jit, static_argnames=("dtype", "layout"))
def _dequantize_jit(q, *, dtype, layout):
  grid_b = q.codes.astype(jnp.float32).reshape(layout.blocked_shape)
  _, dec = _PARAMS[q.cfg.scheme](q.scale, q.outer, layout, q.cfg)
  return _APPLY[q.cfg.scheme](grid_b, dec, dtype).reshape(layout.shape)


@functools.partial(jax.jit, static_argnames=("cfg", "layout"))
def _fake_quant_jit(x, key, tensor_amax, *, cfg, layout):
  grid_b, _, _, dec = _quantize_blocked(x, cfg, layout, key, tensor_amax)
  return _APPLY[cfg.scheme](grid_b, dec, x.dtype).reshape(layout.shape)


def quantize(x: jax.Array, cfg: QuantConfig, key: jax.Array | None = None, *,
             tensor_amax: jax.Array | None = None) -> QTensor:
  """Quantizes x (f32/bf16/f16) to cfg's format; key is required iff cfg.stochastic_rounding.

  tensor_amax: optional (traced) scalar used instead of max|x| for the per-tensor scale of
    fp8_e4m3 / fp8_e5m2 / nvfp4 (not per_token), like an inference engine's static, calibrated
    activation scale; elements beyond it saturate to the format max. Block scales (NVFP4) still
    come from the data. A ValueError for formats without a per-tensor scale.
  """
  x = jnp.asarray(x)
  cfg, layout = _check(x, cfg, key)
  tensor_amax = check_tensor_amax(cfg, tensor_amax)
  return _quantize_jit(x, key if cfg.stochastic_rounding else None, tensor_amax, cfg=cfg,
                       layout=layout)


def dequantize(q: QTensor, dtype=jnp.float32) -> jax.Array:
  """codes * scale(s), computed in FP32, returned in `dtype`."""
  return _dequantize_jit(q, dtype=jnp.dtype(dtype), layout=_layout(tuple(q.codes.shape), q.cfg))


def fake_quant(x: jax.Array, cfg: QuantConfig, key: jax.Array | None = None, *,
               tensor_amax: jax.Array | None = None) -> jax.Array:
  """dequantize(quantize(x, cfg, key, tensor_amax=...)) in x.dtype, without materializing the
  low-precision codes."""
  x = jnp.asarray(x)
  cfg, layout = _check(x, cfg, key)
  tensor_amax = check_tensor_amax(cfg, tensor_amax)
  return _fake_quant_jit(x, key if cfg.stochastic_rounding else None, tensor_amax, cfg=cfg,
                         layout=layout)
