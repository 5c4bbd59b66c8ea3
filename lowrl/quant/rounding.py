"""Rounding onto an element grid in FP32 arithmetic: round-to-nearest-even and stochastic.

The casts XLA offers (`x.astype(float8_e4m3fn)`) are slow multi-pass expansions on CPU and have no
stochastic mode, so the quantizers round in FP32: the grid spacing at y is
ulp(y) = 2**(max(floor(log2|y|), emin) - mantissa_bits); y / ulp(y) is exact (a power of two), so
rounding it to an integer and scaling back is the element-format rounding. The round-to-nearest-
even path equals `y.astype(fmt.dtype)` bit for bit after saturation (tested).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from lowrl.quant.formats import ElementFormat

_F32_EXP_MASK = 0xFF
_F32_MANT_BITS = 23


def _mix32(h_u32: jax.Array) -> jax.Array:
  """A bijective 32-bit integer mixer (Wellons' lowbias32: good avalanche, 6 cheap ops)."""
  h_u32 = h_u32 ^ (h_u32 >> 16)
  h_u32 = h_u32 * jnp.uint32(0x7FEB352D)
  h_u32 = h_u32 ^ (h_u32 >> 15)
  h_u32 = h_u32 * jnp.uint32(0x846CA68B)
  return h_u32 ^ (h_u32 >> 16)


def random_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Uniform uint32 bits for stochastic rounding: a counter-based hash of (element index, key).

  jax.random.bits (threefry) costs ~20 rounds per word at run time and seconds of XLA compile per
  program on CPU; rounding noise needs uniform, decorrelated bits, not cryptographic ones. The key's
  raw words (threefry-split keys are themselves random) seed a keyed hash of the element index:
  bits = mix(mix(i ^ mix(k0 ^ c0)) + mix(k1 ^ c1)), k0/k1 the first/last key word, mix a bijective
  32-bit mixer; for a fixed key it is a bijection of the index, so no two elements of one tensor
  (up to 2**32 elements) share bits.
  """
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  words_u32 = key.reshape(-1).astype(jnp.uint32)
  k0, k1 = words_u32[0], words_u32[-1]
  idx_u32 = lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)
  # Mixing the key in before each round keeps nearby keys (k, k + 1) from giving related streams.
  h_u32 = _mix32(idx_u32 ^ _mix32(k0 ^ jnp.uint32(0x9E3779B9)))
  return _mix32(h_u32 + _mix32(k1 ^ jnp.uint32(0x85EBCA6B)))


def f32_exponent(y_f32: jax.Array) -> jax.Array:
  """floor(log2|y|) for normal FP32 y (int32); -127 for zero and FP32 subnormals, any sign."""
  bits = lax.bitcast_convert_type(y_f32, jnp.int32)
  return ((bits >> _F32_MANT_BITS) & _F32_EXP_MASK) - 127


def pow2(e_i32: jax.Array) -> jax.Array:
  """2.0**e as FP32 built from the exponent bits; e must lie in [-126, 127] (normal range)."""
  return lax.bitcast_convert_type((e_i32 + 127) << _F32_MANT_BITS, jnp.float32)


def _grid_exponent(y_f32: jax.Array, fmt: ElementFormat) -> jax.Array:
  """k such that y * 2**k is an integer exactly on fmt's grid points near y."""
  return fmt.mantissa_bits - jnp.maximum(f32_exponent(y_f32), fmt.emin)


def saturate(y_f32: jax.Array, fmt: ElementFormat) -> jax.Array:
  """Clip to ±max_normal (NaN stays NaN): ml_dtypes casts do not saturate (E4M3 465 -> NaN)."""
  return jnp.clip(y_f32, -fmt.max_normal, fmt.max_normal)


@functools.partial(jax.jit, static_argnums=1)
def round_to_grid(y_f32: jax.Array, fmt: ElementFormat) -> jax.Array:
  """Saturate, then round to nearest even onto fmt's grid; returns FP32 values on the grid.

  Equals `saturate(y).astype(fmt.dtype).astype(float32)` bit for bit, signed zeros included,
  except NaN inputs (NaN here; E2M1 has no NaN and ml_dtypes gives -0 — callers mark NaN blocks
  through the scale).
  """
  y_f32 = saturate(y_f32, fmt)
  k = _grid_exponent(y_f32, fmt)
  return jnp.round(y_f32 * pow2(k)) * pow2(-k)


@functools.partial(jax.jit, static_argnums=1)
def stochastic_round_to_grid(y_f32: jax.Array, fmt: ElementFormat, key: jax.Array) -> jax.Array:
  """Saturate, then round stochastically onto fmt's grid (unbiased inside ±max_normal).

  Rounds |y| up to the next grid point with probability equal to the fractional distance from the
  lower grid point (subnormal region included). The fraction is compared with 32 random bits, so
  the probability is exact up to a bias below 2**-32 of the grid spacing.
  """
  y_f32 = saturate(y_f32, fmt)
  k = _grid_exponent(y_f32, fmt)
  t_f32 = y_f32 * pow2(k)
  lo_f32 = jnp.floor(t_f32)
  frac_f32 = t_f32 - lo_f32  # exact: t has at most 24 significant bits
  # frac * 2**32 is exact in FP32 and < 2**32; the conversion truncates to the fixed-point fraction.
  thresh_u32 = (frac_f32 * 4294967296.0).astype(jnp.uint32)
  bits_u32 = random_bits(key, y_f32.shape)
  up_f32 = (bits_u32 < thresh_u32).astype(jnp.float32)
  out_f32 = (lo_f32 + up_f32) * pow2(-k)
  # Zeros keep the input's sign like the RNE cast (-0.1 -> -0, not +0); NaN must survive.
  out_f32 = jnp.copysign(out_f32, y_f32)
  return jnp.where(jnp.isnan(y_f32), y_f32, out_f32)


@jax.jit
def sr_cast_bf16(x_f32: jax.Array, key: jax.Array) -> jax.Array:
  """Unbiased stochastic-rounding cast FP32 -> BF16 (for BF16 master weights).

  Adds 16 uniform random bits to the FP32 bit pattern below the BF16 mantissa and truncates: the
  magnitude rounds up with probability (dropped bits) / 2**16, so E[result] = x exactly (subnormals
  included, as the bit pattern is uniform across them). Values above the largest BF16 may round to
  ±inf, like round-to-nearest; NaN and ±inf pass through unchanged.
  """
  x_f32 = jnp.asarray(x_f32, jnp.float32)
  bits_u32 = lax.bitcast_convert_type(x_f32, jnp.uint32)
  noise_u32 = random_bits(key, x_f32.shape) >> 16
  rounded_u32 = (bits_u32 + noise_u32) & jnp.uint32(0xFFFF0000)
  out_bf16 = lax.bitcast_convert_type((rounded_u32 >> 16).astype(jnp.uint16), jnp.bfloat16)
  # Adding to an inf/NaN pattern could move it (sNaN -> inf); keep the exact cast for those.
  return jnp.where(jnp.isfinite(x_f32), out_bf16, x_f32.astype(jnp.bfloat16))
