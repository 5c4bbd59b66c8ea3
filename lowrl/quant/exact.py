"""Exact (spec) rounding of FP32 quotients onto element grids, in FP32 arithmetic only.

"Spec-exact" NVFP4 (REFERENCE.md §2) rounds the exact quotients amax/D, amax_block/(6 s_global)
and x/(s_block s_global) once, to nearest even. An FP32 division (or the reciprocal multiply XLA
turns it into) rounds first, and a second rounding onto a 1- or 3-bit-mantissa grid then flips ties
and near-ties. Here an approximate quotient only picks the grid interval [lo, hi] around the value;
the decision between lo and hi compares the numerator with midpoint * denominator *exactly*:

  the denominator is a * G with `a` (midpoint times a small factor) of <= 8 significant bits and G
  an FP32 number split as G_hi + G_lo, each of <= 12 significant bits (bit masking, no rounding),
  so a*G_hi and a*G_lo are exact FP32 products (<= 20 bits); num - a*G_hi is exact when the two
  are within a factor 2 (Sterbenz) and otherwise already has the right sign and a magnitude above
  a*G_lo, so `num - a*G_hi` vs `a*G_lo` is the exact comparison num vs a*G.

Products being exact, XLA's reassociation of multiplications or LLVM's FMA contraction cannot
change any result, so jitted and eager programs agree bit for bit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from lowrl.quant.formats import ElementFormat
from lowrl.quant.rounding import f32_exponent, pow2, round_to_grid

_LOW12 = 0xFFF


def split12(v_f32: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(hi, lo) with hi = v with its low 12 mantissa bits cleared and lo = v - hi, both exact and of
  <= 12 significant bits each (normal v)."""
  hi = lax.bitcast_convert_type(lax.bitcast_convert_type(v_f32, jnp.int32) & ~_LOW12, jnp.float32)
  return hi, v_f32 - hi


def normalize(s_f32: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(e, G) with s = G * 2**e, G in [1, 2), for normal positive s (e = -127, G meaningless for 0)."""
  e = f32_exponent(s_f32)
  return e, s_f32 * pow2(jnp.clip(-e, -126, 127))


def round_quotient(num: jax.Array, den_a: jax.Array | float, g_hi: jax.Array, g_lo: jax.Array,
                   approx: jax.Array, fmt: ElementFormat) -> jax.Array:
  """RNE_fmt(num / (den_a * (g_hi + g_lo))) of the exact quotient, saturating at fmt.max_normal.

  num >= 0 (FP32, +inf allowed); den_a * g > 0 with den_a of <= 4 significant bits (an E4M3 value
  or 4 or 6) and g = g_hi + g_lo in [1, 2) as from `split12`; approx: the quotient to within a
  relative 2**-20 (only used to find the grid interval). NaN num gives a meaningless value: callers
  mask NaN. Returns FP32 grid values (>= 0).
  """
  lo_top = fmt.max_normal - 2.0 ** (fmt.emax - fmt.mantissa_bits)  # grid point below max_normal
  y = jnp.minimum(approx, lo_top)  # the top interval [lo_top, max] also holds everything above
  k = fmt.mantissa_bits - jnp.maximum(f32_exponent(y), fmt.emin)
  f_i = (y * pow2(k)).astype(jnp.int32)  # floor: y >= 0 and y * 2**k is exact
  u = pow2(-k)
  f = f_i.astype(jnp.float32)
  lo = f * u
  a = (f + 0.5) * u * den_a  # midpoint * den_a: exact (<= mantissa_bits + 2 + 4 bits)
  d = num - a * g_hi
  p = a * g_lo
  # Above the midpoint -> hi; on it -> the even neighbour (hi's grid index f + 1 is even iff f odd).
  up = (d > p) | ((d == p) & ((f_i & 1) == 1))
  return jnp.where(up, lo + u, lo)


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
  return jnp.where(above, nxt, c)


def div_rn(num: jax.Array, den: float, round_up: bool = False) -> jax.Array:
  """FP32 num / den correctly rounded (RNE; the exact ceiling with round_up), num >= 0 finite
  normal (or 0), den a constant with <= 12 significant bits (e.g. 2688 = 6*448, 1536 = 6*256).

  q0 = num * fl(1/den) is within 1 ulp of the quotient; the remainder num - q0*den is exact
  (q0 = q_hi + q_lo split in 12-bit halves, each product exact, the first difference Sterbenz-
  exact and the second a small multiple of a common unit), and comparing it with +-half an ulp
  times den picks q0 or a neighbour, ties to even.
  """
  # Work on num * 2**-en in [1, 4) so that every ulp below is a normal FP32 number; scaling the
  # correctly rounded quotient back by 2**en is exact (results below 2**-126 flush to 0 on XLA).
  en = jnp.clip(f32_exponent(num), -126, 126)  # 126: 2**-127 is not a normal FP32 number
  n1 = num * pow2(-en)  # in [1, 4)
  d = jnp.float32(den)
  q0 = n1 * jnp.float32(1.0 / den)
  q_hi, q_lo = split12(q0)
  r = (n1 - q_hi * d) - q_lo * d
  e = f32_exponent(q0)
  ulp_up = pow2(e - 23)
  is_p2 = (lax.bitcast_convert_type(q0, jnp.int32) & 0x7FFFFF) == 0
  ulp_dn = jnp.where(is_p2, pow2(e - 24), ulp_up)
  odd = (lax.bitcast_convert_type(q0, jnp.int32) & 1) == 1
  h_up, h_dn = 0.5 * ulp_up * d, 0.5 * ulp_dn * d
  if round_up:  # q0 < exact -> next up; q0 - ulp still >= exact -> that (q0 is within 1 ulp)
    up, dn = r > 0, r <= -ulp_dn * d
  else:
    up = (r > h_up) | ((r == h_up) & odd)
    dn = (r < -h_dn) | ((r == -h_dn) & odd)
  q1 = jnp.where(up, q0 + ulp_up, jnp.where(dn, q0 - ulp_dn, q0))
  return jnp.where(num > 0, q1 * pow2(en), 0.0)


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
  q = jnp.where(approx < 5.5, approx, 5.5)
  # Below 1 the grid (0, 0.5, 1) is [1, 2)'s (1, 1.5, 2) shifted by 1: pick there, shift back.
  # (q + 1 rounds, but only moves q by 2**-24, and below 1 the interval ends are 0, 0.5, 1, away
  # from the midpoints 0.25 and 0.75.)
  shift = jnp.where(q < 1.0, 1.0, 0.0)
  bits = lax.bitcast_convert_type(q + shift, jnp.int32)
  m_top = lax.bitcast_convert_type((bits & ~0x3FFFFF) | 0x200000, jnp.float32)
  h = lax.bitcast_convert_type(bits & ~0x7FFFFF, jnp.float32) * 0.25  # half the grid step
  m = m_top - shift  # exact
  d = num - m * s_hi
  p = m * s_lo
  # Ties go up iff the lower neighbour is odd: 0.5, 1.5, 3 (m_top = 1.75, 1.75, 3.5).
  tie_up = (bits & 0x400000) != 0
  up = jnp.where(tie_up, d >= p, d > p)
  return m + jnp.where(up, h, -h)
