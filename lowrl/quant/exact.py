"""Exact (spec) rounding of FP32 quotients onto element grids, in FP32 and int32 arithmetic.

"Spec-exact" NVFP4 (docs/reference.md §2) rounds the exact quotients amax/D,
amax_block/(6 s_global) and x/(s_block s_global) once, to nearest even. An FP32 division (or the reciprocal multiply XLA
turns it into) rounds first, and a second rounding onto a 1- or 3-bit-mantissa grid then flips ties
and near-ties. Here an approximate quotient only picks the grid interval [lo, hi] around the value;
the decision between lo and hi compares the numerator with midpoint * denominator *exactly*:

  the denominator is a * G with `a` (midpoint times a small factor) of <= 8 significant bits and G
  an FP32 number split as G_hi + G_lo, each of <= 12 significant bits (bit masking, no rounding),
  so a*G_hi and a*G_lo are exact FP32 products (<= 20 bits); num - a*G_hi is exact when the two
  are within a factor 2 (Sterbenz) and otherwise already has the right sign and a magnitude above
  a*G_lo, so `num - a*G_hi` vs `a*G_lo` is the exact comparison num vs a*G.

Products being exact, XLA's reassociation of multiplications or LLVM's FMA contraction cannot
change any result, so jitted and eager programs agree bit for bit. The outer scale's division by a
constant (`div_rn`) is integer arithmetic on the bit pattern instead (exact in any order too).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lowrl.quant.formats import ElementFormat
from lowrl.quant.layout import clip, where
from lowrl.quant.rounding import f32_exponent, pow2, round_to_grid

_LOW12 = 0xFFF
_F32_MAX = np.float32(np.finfo(np.float32).max)
_F32_MIN_NORMAL = np.float32(np.finfo(np.float32).tiny)


def materialize(v: jax.Array) -> jax.Array:
  """v, computed once into a buffer instead of inside every consumer.

  XLA CPU fuses cheap elementwise producers into their consumers, so a per-block value that feeds a
  per-element loop through a broadcast is recomputed for every element (16x the block-scale
  rounding for NVFP4), but it never duplicates an "expensive" op (a division) that way. Dividing by
  a runtime 1 (2 for NaN, so XLA cannot fold it) is an exact identity that ends the fusion here.
  """
  return v / where(jnp.isnan(v), 2.0, 1.0).astype(v.dtype)


def opaque(v: jax.Array) -> jax.Array:
  """min(v, FP32 max): a no-op on the finite products it is applied to (code * s_block, never
  +inf) that neither XLA nor LLVM can see through, so the product is rounded (exactly) on its own
  and not reassociated with, or contracted (FMA) into, the next operation in any program."""
  return jnp.minimum(v, _F32_MAX)


def narrow_product(y_f32: jax.Array, cs_abs: jax.Array, down: jax.Array, g_hi: jax.Array,
                   g_lo: jax.Array, dtype) -> jax.Array:
  """RNE_dtype(cs * s) of the exact product, for y = fl32(cs * s) with s = G * 2**e
  (G = g_hi + g_lo as from `split12`, down = 2**-e) and cs_abs = |cs| (<= 6 significant bits), for
  a float dtype narrower than FP32 (BF16, FP16): one rounding, where y.astype(dtype) rounds twice.

  Round to odd: the FP32 value y' = trunc(exact) with its last bit set when y != exact, else y.
  Rounding y' to any format with at least 2 bits fewer is the correct rounding of the exact value
  (y' keeps the sticky information, and no rounding boundary of the narrow format lies between
  exact and y'). Whether y is above the exact value is decided exactly: |y| * 2**-e - cs * g_hi
  is exact (the two are within a factor 2), cs * g_lo is exact (<= 18 bits), so comparing them is
  comparing |y| with |cs| * s. Results at or below the smallest normal keep y (FP32 subnormals are
  flushed by XLA; the narrow cast of 2**-126 is exact).
  """
  y_r = jnp.abs(y_f32) * down
  d = y_r - cs_abs * g_hi
  p = cs_abs * g_lo
  bits = lax.bitcast_convert_type(y_f32, jnp.int32)
  trunc = bits - (d > p).astype(jnp.int32)  # |y| above the exact value: the FP32 number below
  odd = where((d != p) & (jnp.abs(y_f32) > _F32_MIN_NORMAL), trunc | 1, bits)
  return lax.bitcast_convert_type(odd, jnp.float32).astype(dtype)


def split12(v_f32: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(hi, lo) with hi = v with its low 12 mantissa bits cleared and lo = v - hi, both exact and of
  <= 12 significant bits each (normal v)."""
  hi = lax.bitcast_convert_type(lax.bitcast_convert_type(v_f32, jnp.int32) & ~_LOW12, jnp.float32)
  return hi, v_f32 - hi


def normalize(s_f32: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(e, G) with s = G * 2**e, G in [1, 2), for normal positive s (e = -127, G meaningless for 0)."""
  e = f32_exponent(s_f32)
  return e, s_f32 * pow2(clip(-e, -126, 127))


def round_quotient(num: jax.Array, den_a: jax.Array | float, g_hi: jax.Array, g_lo: jax.Array,
                   approx: jax.Array, fmt: ElementFormat) -> jax.Array:
  """RNE_fmt(num / (den_a * (g_hi + g_lo))) of the exact quotient, saturating at fmt.max_normal.

  num >= 0 (FP32, +inf allowed); den_a * g > 0 with den_a of <= 4 significant bits (an E4M3 value
  or 4 or 6) and g = g_hi + g_lo in [1, 2) as from `split12`; approx: the quotient to within a
  relative 2**-20 (only used to find the grid interval). NaN num gives a meaningless value: callers
  mask NaN. Returns FP32 grid values (>= 0).

  The grid interval around `approx` comes from bit operations, as in `round_e2m1_quotient`: in the
  normal range its lower end is approx truncated to mantissa_bits and its midpoint m sets the next
  bit; below 2**emin (fixed step 2**(emin - mantissa_bits), that of [2**emin, 2**(emin+1)))
  approx + 2**emin picks the interval there and m is shifted back (exact, Sterbenz). The addition
  may round, or `approx` be slightly off, into the neighbouring interval: its comparison then
  still gives the grid point the two share, the right result. Only the comparison with m is
  exact: m * den_a has <= mantissa_bits + 2 + 4 bits, so num - m*den_a*g_hi vs m*den_a*g_lo is the
  exact comparison of num with m * den_a * g (module docstring). Ties go to the even neighbour:
  up iff the lower one's last mantissa bit (its grid index parity) is 1.
  """
  mb = fmt.mantissa_bits
  # Everything above the top interval's midpoint (NaN and inf included) is in the top interval.
  cap = fmt.max_normal - 2.0 ** (fmt.emax - mb - 1)
  q = where(approx < cap, approx, cap)
  shift = where(q < 2.0 ** fmt.emin, 2.0 ** fmt.emin, 0.0)
  bits = lax.bitcast_convert_type(q + shift, jnp.int32)
  low = (1 << (23 - mb)) - 1  # the FP32 mantissa bits below the format's
  m_top = lax.bitcast_convert_type((bits & ~low) | (1 << (22 - mb)), jnp.float32)
  h = lax.bitcast_convert_type(bits & 0x7F800000, jnp.float32) * 2.0 ** (-mb - 1)  # half a step
  m = m_top - shift
  a = m * den_a
  d = num - a * g_hi
  p = a * g_lo
  up = where((bits & (1 << (23 - mb))) != 0, d >= p, d > p)
  return m + where(up, h, -h)


def ceil_quotient(num: jax.Array, den_a: float, g_hi: jax.Array, g_lo: jax.Array,
                  approx: jax.Array, fmt: ElementFormat) -> jax.Array:
  """The smallest fmt grid value >= num / (den_a * (g_hi + g_lo)) (exact; saturating at
  fmt.max_normal), arguments as for `round_quotient` (den_a with <= 3 significant bits).

  c = RNE(approx) is the grid point nearest the quotient or its neighbour; the result is c when
  num <= c * den_a * g (compared exactly as in `round_quotient`: c * den_a has <= 7 bits), else the
  next grid point up (approx is close enough that the one below c is always < the quotient).
  """
  c = round_to_grid(approx, fmt)
  a = c * den_a
  d = num - a * g_hi
  above = d > a * g_lo
  k = fmt.mantissa_bits - jnp.maximum(f32_exponent(c), fmt.emin)
  nxt = jnp.minimum(c + pow2(-k), fmt.max_normal)
  return where(above, nxt, c)


def div_rn(num: jax.Array, den: float, round_up: bool = False) -> jax.Array:
  """FP32 num / den correctly rounded (RNE; the exact ceiling with round_up), num >= 0 finite
  (0 and FP32 subnormals give 0, as XLA reads subnormal operands as 0), den >= 1 a constant
  c * 2**p with c an odd integer < 64 (2688 = 21 * 2**7, 1536 = 3 * 2**9, 6 = 3 * 2).

  Integer arithmetic on the bit pattern, exact at every step: num = M * 2**(E - 150) with the
  24-bit integer significand M and the biased exponent E, so num / den = (2t / c) * 2**(E - 152
  - p - L) with t = M * 2**(L + 1), L = c.bit_length() (t < 2**31). Q = t // c >= 2**24 and
  r = t - Q c; 2t / c lies in [2Q, 2Q + 2), so Z = 2Q + (r != 0) (Z >= 2**25) rounds like it to
  24 significant bits (grid steps >= 4 there: Z keeps the round bit and a sticky bit). The int32
  -> FP32 conversion rounds to nearest even, so it is RNE(2t / c); for the ceiling, a converted
  value below Z moves one FP32 step up. The power of two goes into the exponent field; results
  below 2**-126 become 0, as XLA flushes them (as the earlier FP32-arithmetic version did; checked
  bit for bit against it on every significand of several binades).
  """
  c, p = int(den), 0
  if c != den or c < 1:
    raise ValueError(f"div_rn: den={den} must be an integer >= 1.")
  while c % 2 == 0:
    c, p = c // 2, p + 1
  if c >= 64:
    raise ValueError(f"div_rn: den={den} has an odd factor {c} >= 64 (t would overflow int32).")
  big_l = c.bit_length()
  bits = lax.bitcast_convert_type(num, jnp.int32)
  e = bits >> 23  # the biased exponent (num >= 0: no sign bit)
  t = ((bits & 0x7FFFFF) | 0x800000) << (big_l + 1)
  q = lax.div(t, jnp.int32(c))  # t > 0: truncation is the floor (no sign fix-up as for `//`)
  z = 2 * q + (t != q * c).astype(jnp.int32)
  f = z.astype(jnp.float32)  # RNE to 24 significant bits, in [2**25, 2**27]
  f_bits = lax.bitcast_convert_type(f, jnp.int32)
  if round_up:  # RNE went below Z (f < Z, compared exactly as integers): the next value up
    f_bits = f_bits + (f.astype(jnp.int32) < z).astype(jnp.int32)
  shift = e - (152 + p + big_l)  # the result is f * 2**shift: add shift to f's exponent field
  out_exp = (f_bits >> 23) + shift
  out = lax.bitcast_convert_type(f_bits + (shift << 23), jnp.float32)
  return where((e > 0) & (out_exp > 0), out, 0.0)


def round_e2m1_quotient(num: jax.Array, s_hi: jax.Array, s_lo: jax.Array,
                        approx: jax.Array) -> jax.Array:
  """RNE_e2m1(num / (s_hi + s_lo)) of the exact quotient, saturating at 6; the E2M1 fast path of
  `round_quotient` (same result, tested against it and against Fraction arithmetic).

  num >= 0 (FP32, +inf allowed); s_hi = s_block * G_hi and s_lo = s_block * G_lo (each exact: an
  E4M3 s_block times a 12-bit half of G, see `split12`); approx: the quotient to within a relative
  2**-20. E2M1's grid has only 7 midpoints {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5}; `approx` picks the
  one of its interval with bit operations (no exponent arithmetic, no float->int conversion): for
  approx in [1, 6) the interval's lower end is approx truncated to 1 mantissa bit and its midpoint
  sets the next bit; below 1 the grid step is 0.5. Picking the neighbouring interval when the exact
  quotient lies on the other side of a grid point still gives that grid point, so only the
  comparison with the midpoint needs to be exact: m * s_hi and m * s_lo are exact (<= 3 + 16 bits)
  and `num - m*s_hi` vs `m*s_lo` is the exact comparison num vs m * S (see the module docstring).
  Ties go to the even neighbour: up at 0.75, 1.75, 3.5 (lower neighbour odd). s_hi = +inf (with
  s_lo = 0) gives 0 for every finite num: blocks whose scale is 0.
  """
  # Everything above the top midpoint 5 decides against 5; so does a NaN approx (inf * 0 when a
  # block's scale is 0: s_hi = inf then makes d NaN and the code 4 * 0).
  q = where(approx < 5.5, approx, 5.5)
  # Below 1 the grid (0, 0.5, 1) is [1, 2)'s (1, 1.5, 2) shifted by 1: pick there, shift back.
  # (q + 1 rounds, but only moves q by 2**-24, and below 1 the interval ends are 0, 0.5, 1, away
  # from the midpoints 0.25 and 0.75.)
  shift = where(q < 1.0, 1.0, 0.0)
  bits = lax.bitcast_convert_type(q + shift, jnp.int32)
  m_top = lax.bitcast_convert_type((bits & ~0x3FFFFF) | 0x200000, jnp.float32)
  h = lax.bitcast_convert_type(bits & ~0x7FFFFF, jnp.float32) * 0.25  # half the grid step
  m = m_top - shift  # exact
  d = num - m * s_hi
  p = m * s_lo
  # Ties go up iff the lower neighbour is odd: 0.5, 1.5, 3 (m_top = 1.75, 1.75, 3.5).
  tie_up = (bits & 0x400000) != 0
  up = where(tie_up, d >= p, d > p)
  return m + where(up, h, -h)
