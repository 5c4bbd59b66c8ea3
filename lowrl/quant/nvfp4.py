"""Spec-exact NVFP4 (scale_convention="exact"): outer and block scales, element rounding, decoding.

Every rounding is one RNE of the exact value (docs/reference.md §2; exact.py):
  s_outer = RNE_f32(amax / (6*448)) (6*256 with four_over_six), s_block = RNE_e4m3(amax_block /
  (6 * s_outer)), code = RNE_e2m1(x / (s_block * s_outer)), dq = RNE_dtype(code * s_block *
  s_outer). Stochastic rounding rounds both scales up (exact ceilings, so no element saturates)
  and draws from the quotient x * fl(1/fl(s_block*s_outer)). 4/6 keeps 4 iff the exact error sum
  of its exact dequantized values is strictly smaller (four_over_six.py; a tie keeps 6).

Round to nearest goes through per-block *thresholds* (`thresholds`): with v = |x| * 2**-e (e the
outer scale's exponent, an exact rescaling) and S = s_block * G (G = s_outer * 2**-e), the code
passes the i-th E2M1 midpoint m_i iff v >= T_i, T_i the smallest FP32 number for which that
holds, found once per block with exact arithmetic. An element then costs seven comparisons and
selects (`_codes`) instead of an exact quotient rounding of its own. That equals rounding the
exact quotient v / S because v is an FP32 number: v >= P for a real P iff v >= RU_f32(P), and
v > P iff v >= succ(RD_f32(P)). Four thresholds per block suffice (`_seven`).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lowrl.quant import exact, formats, four_over_six
from lowrl.quant.config import QuantConfig
from lowrl.quant.formats import E4M3
from lowrl.quant.layout import (Layout, abs_max, clip, recip, squeeze, static_amax, unsqueeze,
                                where)
from lowrl.quant.rounding import pow2, stochastic_round_to_grid

_materialize = exact.materialize
_opaque = exact.opaque


def outer_amax(amax_b: jax.Array, cfg: QuantConfig, layout: Layout,
                tensor_amax: jax.Array | None) -> jax.Array:
  """The amax an NVFP4 outer scale is taken from: the static one, the row's (per_token, keepdims)
  or the tensor's."""
  if tensor_amax is not None:
    return static_amax(tensor_amax)
  if cfg.per_token:
    return jnp.max(amax_b, axis=layout.index_axis, keepdims=True)
  return jnp.max(amax_b)


def _nvfp4_outer(amax_b: jax.Array, cfg: QuantConfig, layout: Layout,
                 tensor_amax: jax.Array | None) -> jax.Array:
  """FP32 outer scale (blocked view's rank): RNE_fp32(amax / (6*448)) of the exact quotient
  (6*256 with four_over_six); NaN when amax is not finite."""
  amax = outer_amax(amax_b, cfg, layout, tensor_amax)
  denom = 6.0 * (formats.NVFP4_SCALE_MAX_FOUR_OVER_SIX if cfg.four_over_six
                 else formats.NVFP4_SCALE_MAX)
  finite = jnp.isfinite(amax)
  # Stochastic rounding rounds the scales up (exactly): then no element quotient exceeds 6, so no
  # element saturates and SR stays unbiased on every element (RNE scales that round down clip the
  # block max; RNE also flushes tiny blocks to 0).
  q = exact.div_rn(where(finite, amax, 0.0), denom, round_up=cfg.stochastic_rounding)
  # Computed once (a scalar, or one per row): its exact division stays out of every consumer.
  return _materialize(where(finite, q, jnp.nan))


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
  down, g, g_hi, g_lo = _materialize(jnp.stack([pow2(clip(-e, -126, 127)), g, g_hi, g_lo]))
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
  approx = a_b * recip(target * parts.g)
  rnd = exact.ceil_quotient if round_up else exact.round_quotient
  s_block = rnd(a_b, target, parts.g_hi, parts.g_lo, approx, E4M3)
  s_block = where(parts.valid, s_block, 0.0)
  return where(jnp.isnan(amax_b) | jnp.isnan(outer), jnp.nan, s_block)


def _sr_elements(x_f32, s_block, parts: _OuterParts, key) -> jax.Array:
  """E2M1 grid values (signed) of x / (s_block * outer), stochastically rounded from the quotient
  x * fl(1/fl(s_block * G)) * 2**-e; 0 in blocks whose scale is 0 (for finite x)."""
  ax = _scaled_by_outer(jnp.abs(x_f32), parts)
  inv = recip(s_block * parts.g)
  return stochastic_round_to_grid(jnp.copysign(ax, x_f32) * inv, formats.E2M1, key)


def with_sign_of(mag_f32: jax.Array, x_f32: jax.Array) -> jax.Array:
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


# ---------------------------------------------------------------------------------------------
# Round to nearest through per-block thresholds.

_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1 magnitudes
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# A tie at a midpoint goes up iff the lower neighbour's grid index is odd (round half to even).
_TIE_UP = (False, True, False, True, False, True, False)


def thresholds(s_block: jax.Array, parts: _OuterParts) -> jax.Array:
  """[4, *s_block.shape] FP32 thresholds of the midpoints 0.25, 0.75, 1.25, 1.75 (module
  docstring): RNE_e2m1(v / (s_block * G)) passes midpoint m_i iff v >= T_i, for every FP32
  v >= 0 (inf included), in blocks with s_block > 0 (other blocks: callers override them). The
  midpoints 2.5, 3.5, 5 are 2 * 1.25, 2 * 1.75, 4 * 1.25 with the same tie direction, and scaling
  by a power of two commutes with rounding: their thresholds are 2 T_2, 2 T_3, 4 T_2 (`_seven`).

  P = m_i * s_block * G exactly: a = m_i * s_block is exact (<= 3 + 4 bits; `_opaque` keeps XLA
  from reassociating it with G), p = fl(a * G), and the sign of P - p is exact: a * g_hi and
  a * g_lo are exact (<= 7 + 12 bits) and a * g_hi - p is exact (the two are within a factor 2,
  Sterbenz), so P - p = (a * g_hi - p) + a * g_lo compares exactly. Ties up (v >= P): T = RU(P) =
  p, or succ(p) when P > p. Ties down (v > P): T = succ(RD(P)) = p when P < p, else succ(p).
  (p is a normal FP32 number: s_block >= 2**-9, G in [1, 2).)
  """
  # The four midpoints on a leading axis: one copy of the arithmetic (each element computed by
  # the same operations as alone).
  shape = (4,) + (1,) * s_block.ndim
  a = _opaque(np.asarray(_MIDPOINTS[:4], np.float32).reshape(shape) * s_block[None])
  p = a * parts.g
  d = a * parts.g_hi - p
  lo = a * parts.g_lo
  bump = where(np.asarray(_TIE_UP[:4]).reshape(shape), lo > -d, lo >= -d)
  return lax.bitcast_convert_type(
      lax.bitcast_convert_type(p, jnp.int32) + bump.astype(jnp.int32), jnp.float32)


def _seven(t4) -> list[jax.Array]:
  """The seven midpoint thresholds from the four of `thresholds` (exact doublings)."""
  return [t4[0], t4[1], t4[2], t4[3], t4[2] * 2.0, t4[3] * 2.0, t4[2] * 4.0]


def _code_thresholds(s_block: jax.Array, t4: jax.Array) -> jax.Array:
  """[7, ...] thresholds for codes: blocks whose scale is 0 or NaN get T_0..T_5 = inf and T_6 =
  NaN, so finite v gives code 0 and v = inf gives 4 there, as the quotient rounding did (NaN
  elements are read as inf, see `_magnitude`)."""
  sentinel = np.array([np.inf] * 6 + [np.nan], np.float32).reshape((7,) + (1,) * s_block.ndim)
  return where(s_block[None] > 0, jnp.stack(_seven(t4)), sentinel)


def _magnitude(x_b: jax.Array, parts: _OuterParts, nan_as_inf: bool = True) -> jax.Array:
  """v = |x| * 2**-e in FP32, NaN read as +inf (integer min of the magnitude bits; a NaN element
  only occurs in a NaN block, where inf and NaN both give code 4). nan_as_inf=False keeps NaN
  (one operation less) for consumers whose NaN-block results do not depend on the codes: the
  decoded values (code * NaN) and the 4/6 choice (both candidates' scales are the same NaN)."""
  bits = lax.bitcast_convert_type(x_b.astype(jnp.float32), jnp.int32) & 0x7FFFFFFF
  if nan_as_inf:
    bits = jnp.minimum(bits, 0x7F800000)
  return lax.bitcast_convert_type(bits, jnp.float32) * parts.down


def _select(v: jax.Array, thr: jax.Array, values) -> jax.Array:
  """values[k] with k = #{i: v >= thr[i]} (thresholds nondecreasing): seven compares and selects."""
  out = values[0]
  for i in range(7):
    out = where(v >= thr[i], values[i + 1], out)
  return out


def _codes(v: jax.Array, thr) -> jax.Array:
  """E2M1 magnitudes RNE_e2m1(v / S) (FP32) from the block's seven thresholds."""
  return _select(v, thr, [np.float32(g) for g in _GRID])


def _choose_block_scale(x_b, amax_b, outer, parts, cfg: QuantConfig, layout: Layout):
  """(s_block, t4 or None): the E4M3 block scale (FP32 values, materialized) and, for round to
  nearest, its four base thresholds (`thresholds`, materialized); with four_over_six the better
  of the 6 and 4 candidates."""
  sr = cfg.stochastic_rounding
  if not cfg.four_over_six:
    s_block = _materialize(_nvfp4_block_scale(amax_b, outer, parts, 6.0, sr))
    return s_block, (None if sr else thresholds(s_block, parts))
  # Four over six: also try mapping the block max to 4 (finer steps near the top of the block),
  # keep whichever reconstructs the block better; ties keep 6. Both candidates' scales come from
  # one copy of the scale rounding, stacked on a leading axis (index 0: 6, 1: 4).
  target = np.array([6.0, 4.0], np.float32).reshape((2,) + (1,) * amax_b.ndim)
  s_both = _materialize(_nvfp4_block_scale(amax_b[None], outer, parts, target, sr))
  # 4/6 compares round-to-nearest errors (also under SR). Codes of blocks whose scale is 0 or NaN
  # do not matter here: their candidates' products code * s are 0 or NaN whatever the code.
  t4_both = _materialize(thresholds(s_both, parts))  # [4, 2, ...]
  v = _magnitude(x_b, parts, nan_as_inf=False)
  code6, code4 = _codes(v[None], _seven(t4_both))  # both candidates in one copy
  use4 = four_over_six.four_wins(
      v, code4, code6, s_both[1], s_both[0], parts.g, parts.g_hi, parts.g_lo,
      _scaled_by_outer(amax_b, parts), layout.reduce_axes, cfg.four_over_six_metric,
      x_sig_bits=jnp.finfo(x_b.dtype).nmant + 1)
  # The per-block choice once into a buffer: fused into its consumers, its integer comparison
  # would be recomputed for each of them.
  use4 = _materialize(use4.astype(jnp.float32)) > 0
  s_block = _materialize(where(use4, s_both[1], s_both[0]))
  return s_block, (None if sr else where(use4[None], t4_both[:, 1], t4_both[:, 0]))


def _scales(x_b, cfg: QuantConfig, layout: Layout, tensor_amax):
  amax_b = abs_max(x_b, layout.reduce_axes, paired=True)
  outer = _nvfp4_outer(amax_b, cfg, layout, tensor_amax)
  parts = _outer_parts(outer)
  s_block, thr = _choose_block_scale(x_b, amax_b, outer, parts, cfg, layout)
  return outer, parts, s_block, thr


def quantize_blocked(x_b, cfg: QuantConfig, layout: Layout, key, tensor_amax):
  """(E2M1 grid values (FP32, signed), stored E4M3 block scales, stored outer scale, decode
  parameters) of the blocked input.

  The decode parameters hold the FP32 block scale before its E4M3 storage cast: the same values
  as `params` reads back from the stored scale (they are E4M3 grid values, 0 or NaN).
  """
  outer, parts, s_block, thr = _scales(x_b, cfg, layout, tensor_amax)
  if thr is None:  # stochastic rounding
    grid_b = _sr_elements(x_b.astype(jnp.float32), s_block, parts, key)
  else:
    thr = _materialize(_code_thresholds(s_block, thr))
    grid_b = with_sign_of(_codes(_magnitude(x_b, parts), list(thr)), x_b.astype(jnp.float32))
  scale = squeeze(s_block, layout).astype(E4M3.dtype)
  outer_stored = squeeze(outer, layout) if cfg.per_token else outer
  return grid_b, scale, outer_stored, (s_block, outer, parts)


def _decode_table(s_block, outer, parts: _OuterParts, dtype) -> jax.Array:
  """[8, *s_block.shape] FP32 per block, materialized: the decoded magnitudes `_nvfp4_apply(g)`
  of the eight E2M1 magnitudes g, by the same operations (so the same values) as decoding each
  element, in dtype and held exactly in FP32; one copy of the arithmetic on a leading axis.
  Entry 0 is +0, or the scale's NaN in NaN blocks."""
  grid = np.asarray(_GRID, np.float32).reshape((8,) + (1,) * s_block.ndim)
  return _materialize(
      _nvfp4_apply(grid, (s_block[None], outer, parts), dtype).astype(jnp.float32))


def _decode_by_table(x_b, s_block, t4, outer, parts: _OuterParts) -> jax.Array:
  """Each element's decoded value selected from its block's table (`_decode_table`) by the
  block's seven thresholds, with x's sign OR-ed in: seven compares and selects and a few bit
  operations per element; the exact narrow decoding runs once per block and code.

  Equal to `_nvfp4_apply` of the signed codes, bit for bit: decoding is odd in the code
  (fl(-a) = -fl(a); narrow_product's round to odd works on magnitudes; the dtype cast is RNE),
  except in NaN blocks, where it is the scale's NaN whatever x's sign: there the sign is masked
  off (entry 0 is NaN, whose exponent bits shifted left by one set the sign bit, so
  ~(entry0 << 1) clears it; entry 0 is +0 elsewhere and the mask keeps x's sign). The selected
  values are dtype values held in FP32, so the final cast is exact (for BF16, the top half of the
  bits). NaN elements occur only in NaN blocks, whose thresholds are NaN: every compare fails and
  entry 0 is selected, so v need not map NaN to inf here.
  """
  table = _decode_table(s_block, outer, parts, x_b.dtype)
  x_bits = lax.bitcast_convert_type(x_b.astype(jnp.float32), jnp.int32)
  mag = _select(_magnitude(x_b, parts, nan_as_inf=False), _seven(t4), list(table))
  keep_sign = ~(lax.bitcast_convert_type(table[0], jnp.int32) << 1) & jnp.int32(-0x80000000)
  out = lax.bitcast_convert_type(mag, jnp.int32) | (x_bits & keep_sign)
  if x_b.dtype == jnp.bfloat16:
    return lax.bitcast_convert_type(
        lax.shift_right_logical(out, 16).astype(jnp.uint16), jnp.bfloat16)
  return lax.bitcast_convert_type(out, jnp.float32).astype(x_b.dtype)


def _decode_by_product(x_b, s_block, t4, outer, parts: _OuterParts) -> jax.Array:
  """RNE_dtype(y) of y = fl32(code * s_block * outer), the codes from the seven thresholds:
  `_nvfp4_apply` without narrow_product, exact for FP32 output, and for BF16 output where
  `_bf16_double_rounding_free` holds."""
  grid_b = with_sign_of(_codes(_magnitude(x_b, parts, nan_as_inf=False), _seven(t4)),
                        x_b.astype(jnp.float32))
  y = _opaque(grid_b * s_block) * outer
  if x_b.dtype != jnp.bfloat16:
    return y.astype(x_b.dtype)
  # RNE to BF16 on the bits (add half an ulp minus one, plus the kept last bit, truncate): the
  # cast's result for every finite y and inf, without its NaN branch. y is NaN only in NaN blocks,
  # where it is the scale's quiet NaN (0x7FC00000, from jnp.nan), which this keeps as 0x7FC0.
  bits = lax.bitcast_convert_type(y, jnp.int32)
  bits = bits + (0x7FFF + (lax.shift_right_logical(bits, 16) & 1))
  return lax.bitcast_convert_type(
      lax.shift_right_logical(bits, 16).astype(jnp.uint16), jnp.bfloat16)


# Odd parts of every product code * s_block / 2**k (code in E2M1, s_block E4M3: (1 or 3) * m,
# m <= 15 an integer).
_ODD_PARTS = np.array(sorted({(g * m) >> ((g * m) & -(g * m)).bit_length() - 1
                              for g in (1, 3) for m in range(1, 16)}), np.float32)


def _bf16_double_rounding_free(outer: jax.Array) -> jax.Array:
  """True when RNE_bf16(fl32(cs * outer)) = RNE_bf16(cs * outer) for every product cs = code *
  s_block (scalar, over every outer scale given).

  The two differ only where y = fl32(z) is exactly a BF16 midpoint (low 16 bits 0x8000) and
  z != y: every BF16 grid point and midpoint is an FP32 number and RNE_f32 is monotone, so y
  stays in z's closed interval between neighbouring ones; at a grid point y is within half an
  FP32 step of z, far from any midpoint. cs = c * 2**k with c an odd integer in _ODD_PARTS, and
  for normal results fl32(c * 2**k * outer) = 2**k * fl32(c * outer) has the same low bits, so
  checking the 13 products c * outer (normal: outer >= 2**-126, c * outer < 2**123) covers
  every element. Results at or below 2**-126 are flushed or kept as they are on both paths
  (narrow_product keeps them), and overflow rounds to inf on both.
  """
  c = _ODD_PARTS.reshape((-1,) + (1,) * outer.ndim)
  low = lax.bitcast_convert_type(c * outer[None], jnp.int32) & 0xFFFF
  return ~jnp.any(low == 0x8000)


def fake_quant_blocked(x_b, cfg: QuantConfig, layout: Layout, tensor_amax) -> jax.Array:
  """Round to nearest: the decoded value of the code from the block's thresholds, bit for bit
  `_nvfp4_apply` of `quantize_blocked`'s codes, by the cheapest exact path: the plain FP32
  product for FP32 output, and for BF16 output too when no product can round twice
  (`_bf16_double_rounding_free`, decided once per tensor: lax.cond runs one branch); else (and
  for FP16) per-block tables of exactly rounded values (`_decode_by_table`).

  Blocks whose scale is 0 or NaN may get other codes than `quantize_blocked`'s (no sentinel
  thresholds), but not other decoded values: code * 0 * outer is 0 with x's sign, and a NaN
  scale's products are that NaN, whatever the code.
  """
  outer, parts, s_block, t4 = _scales(x_b, cfg, layout, tensor_amax)
  # Four threshold planes (the other three are exact doublings, in the loop): the element pass
  # reads every per-block plane once per element, and fewer planes measured faster.
  t4 = _materialize(t4)
  if x_b.dtype == jnp.float32:
    return _decode_by_product(x_b, s_block, t4, outer, parts)
  by_table = lambda: _decode_by_table(x_b, s_block, t4, outer, parts)  # noqa: E731
  if x_b.dtype != jnp.bfloat16:
    return by_table()
  return lax.cond(_bf16_double_rounding_free(outer),
                  lambda: _decode_by_product(x_b, s_block, t4, outer, parts), by_table)


def params(scale, outer, layout: Layout, cfg: QuantConfig):
  """(no encode multiplier: elements round exactly in quantize_blocked, (s_block, outer, parts))."""
  del cfg
  outer = unsqueeze(outer, layout) if outer.ndim else outer
  return None, (_materialize(unsqueeze(scale.astype(jnp.float32), layout)), outer,
                _outer_parts(outer))


apply = _nvfp4_apply
