"""Exact 4/6 selection: is the block's error with scale 4 strictly smaller than with scale 6?

The errors are those of the *exact* dequantized values dq = code * s_block * s_outer (real
numbers, before any rounding to an output dtype) against the input x, so the choice, and with it
the codes and scales, do not depend on the dtype the values are later dequantized to:
  mse  D = sum (dq4 - x)**2 - (dq6 - x)**2
  mae  D = sum |dq4 - x| - |dq6 - x|
and 4 wins iff D < 0 (an exact tie keeps 6). Codes carry x's sign, so |dq - x| = ||dq| - |x||
and everything below works on magnitudes. The caller passes values divided by 2**e, e the outer
scale's exponent (an exact rescaling), so that s_outer becomes G = g * 2**-23 in [1, 2) (g an
integer < 2**24), and a = |code| * s_block (exact in FP32: <= 6 significant bits). Then
dq = a * G and, with sigma_k = sign(a_k G - |x|) (decided exactly, see `_above`),
  mse  D = G * (G * sum(a4**2 - a6**2) - 2 * sum((a4 - a6) |x|))
  mae  D = G * sum(sigma4 a4 - sigma6 a6) - sum((sigma4 - sigma6) |x|)
Both are integers in small units, so the sign of D is integer arithmetic:

  * a = 2c * m * 2**(k - 1) with 2c in {0, 1, 2, 3, 4, 6, 8, 12} (twice the E2M1 magnitude) and the
    E4M3 scale s = m * 2**k (m < 16 an integer; k = exponent - 3, or -9 for subnormals and 0).
    With kb = min(k4, k6): alpha = a / 2**(kb - 1) is an integer <= 12 * 15 * 2 = 360 (s4 >= s6
    and s4 / s6 < 1.7 give k4 - k6 in {0, 1}; s6 = 0 implies s4 <= 2**-9, k4 = -9), so the sums of
    alpha**2 (< 2**21) and sigma * alpha are exact in FP32 (integers below 2**24, any order).
  * Only elements with a4 != a6 contribute (otherwise both terms vanish, in both metrics). Such an
    element has a nonzero code, so |x| >= S / 4 for an S = s_block * G >= amax_b / 9, i.e. |x| >=
    2**(E - 6), E = floor(log2 amax_b): X = |x| / 2**(E - 29) is an integer < 2**30. Its 15-bit
    limbs times (alpha4 - alpha6) (< 2**9) or (sigma4 - sigma6) (<= 2) sum exactly in int32.
  * Dividing by common powers of two, D < 0 iff g * A * 2**t < B with A, B the integer sums above
    and t = kb - E + 4 (mse, where B counts the factor 2 through the unit) or kb - E + 5 (mae);
    t lies in [-3, 4] for every block that can contribute. That comparison is done per block in
    15-bit limbs (`_lt_shifted`): cheap next to the per-element work.

Integer (and exact integer-valued FP32) arithmetic is exact in any order, so the selection is the
same in every program (jit or not, whatever XLA's reduction order).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lowrl.quant import exact
from lowrl.quant.layout import clip, where
from lowrl.quant.rounding import f32_exponent, pow2

_M15 = 0x7FFF


def _scale_k(s_f32: jax.Array) -> jax.Array:
  """k of an E4M3 value s = m * 2**k, m < 16 an integer (normal: exponent - 3; subnormal or 0:
  -9), int32."""
  return jnp.maximum(f32_exponent(s_f32), -6) - 3


def _limbs15(v: jax.Array) -> list[jax.Array]:
  """v (int32) = l1 * 2**15 + l0 with l0 in [0, 2**15)."""
  return [v & _M15, v >> 15]


def _normalize(limbs: list[jax.Array], n: int) -> list[jax.Array]:
  """n 15-bit limbs (the top one signed) of sum_i limbs[i] * 2**(15 i); |limbs[i]| < 2**30."""
  out, carry = [], jnp.zeros_like(limbs[0])
  for i in range(n - 1):
    t = (limbs[i] if i < len(limbs) else 0) + carry
    out.append(t & _M15)
    carry = t >> 15
  top = (limbs[n - 1] if n - 1 < len(limbs) else 0) + carry
  return out + [top]


def _lt_shifted(p: list[jax.Array], b: list[jax.Array], t: jax.Array) -> jax.Array:
  """p * 2**t < b exactly, p and b given as 15-bit-limb integers (any limb sizes < 2**30), per
  block; t in [-14, 14]. Both are normalized to 15-bit limbs, the smaller side shifted left."""
  # |p|, |b| < 2**46: three 15-bit limbs and a small signed top limb.
  n = 4
  p, b = _normalize(p, n), _normalize(b, n)
  sp, sb = jnp.maximum(t, 0), jnp.maximum(-t, 0)
  # Shifting normalized limbs by < 15 bits keeps them below 2**30; renormalize the difference.
  diff = [lax.shift_left(pi, sp) - lax.shift_left(bi, sb) for pi, bi in zip(p, b)]
  return _normalize(diff, n)[-1] < 0


def _above(a: jax.Array, g_hi: jax.Array, g_lo: jax.Array, x_abs: jax.Array) -> jax.Array:
  """sign(a * (g_hi + g_lo) - |x|) in {-1, 0, 1} (FP32), exactly: a * g_hi and a * g_lo are exact
  (<= 6 + 12 bits) and |x| - a * g_hi is exact or already decisive (exact.py's module docstring)."""
  d = x_abs - a * g_hi
  p = a * g_lo
  return (p > d).astype(jnp.float32) - (p < d).astype(jnp.float32)


_MAGIC = np.float32(1.5 * 2.0**23)  # x + _MAGIC has unit spacing for |x| < 2**22
_MAGIC_BITS = int(np.float32(_MAGIC).view(np.int32))


def _small_int(v: jax.Array) -> jax.Array:
  """int32 of an integer-valued FP32 v with |v| < 2**22, exactly (v + 1.5 * 2**23 is exact and
  has unit spacing, so its bit pattern minus the magic number's is v): two operations, where
  astype's saturating conversion takes six. Other values give some int32 (callers multiply
  those by 0)."""
  return lax.bitcast_convert_type(v + _MAGIC, jnp.int32) - _MAGIC_BITS


def _one_limb_shift(x_sig_bits: int, block_elems: int, metric: str) -> int | None:
  """k such that X = X' * 2**k with X' an integer for every contributing element, when the
  whole sum of coef_x * X' fits in int32 (|sum| < n * 2**coef_bits * 2**(30 - k)), else None (15-bit limbs). An input with p significant
  bits has |x| >= 2**(E - 6) on contributing elements, so X (unit 2**(E - 29)) is a multiple of
  2**(23 - p + 1) and X' = X / 2**k < 2**(30 - k); |coef_x| < 2**9 (mse) or <= 2 (mae)."""
  if x_sig_bits >= 24:
    return None
  k = 24 - x_sig_bits
  coef_bits = 9 if metric == "mse" else 2
  return k if block_elems * 2 ** (coef_bits + 30 - k) <= 2 ** 31 else None


def four_wins(x_abs: jax.Array, code4: jax.Array, code6: jax.Array, s4: jax.Array, s6: jax.Array,
              g: jax.Array, g_hi: jax.Array, g_lo: jax.Array, amax_b: jax.Array, axes,
              metric: str, x_sig_bits: int = 24) -> jax.Array:
  """True per block (keepdims over `axes`) where the exact error with scale 4 is strictly
  smaller than with scale 6 (module docstring). x_abs: |x| / 2**e (FP32, blocked view); code4,
  code6: E2M1 grid magnitudes (>= 0); s4, s6: E4M3 block scales (keepdims); g = g_hi + g_lo: the
  outer scale's significand; amax_b: the block max / 2**e (keepdims); x_sig_bits: significant
  bits of the input dtype (8 BF16, 11 FP16, 24 FP32): 16-bit inputs sum X in one int32 limb."""
  kb = jnp.minimum(_scale_k(s4), _scale_k(s6))
  e_block = f32_exponent(amax_b)
  axes = tuple(ax % x_abs.ndim for ax in axes)
  n = int(np.prod([x_abs.shape[ax] for ax in axes]))
  k = _one_limb_shift(x_sig_bits, n, metric)
  # The per-block factors once into one buffer (materialize: fused into the element loops, their
  # exponent arithmetic would be redone for every element). s * unit_a is exact (a power of two
  # times an E4M3 value, >= 1), so code * (s * unit_a) = (code * s) * unit_a.
  unit_a = pow2(clip(1 - kb, -126, 127))
  su4, su6, unit_x = exact.materialize(jnp.stack([
      s4 * unit_a, s6 * unit_a, pow2(clip(29 - (k or 0) - e_block, -126, 127))]))
  al4, al6 = code4 * su4, code6 * su6  # integers <= 360
  if metric == "mae":
    a4, a6 = code4 * s4, code6 * s6  # exact: <= 6 significant bits
    sig4, sig6 = _above(a4, g_hi, g_lo, x_abs), _above(a6, g_hi, g_lo, x_abs)
    coef_a = sig4 * al4 - sig6 * al6
    coef_x = _small_int(sig4 - sig6)
    t_off = 5
  else:
    coef_a = al4 * al4 - al6 * al6
    coef_x = _small_int(al4 - al6)
    t_off = 4
  zero_f, zero_i = jnp.float32(0), jnp.int32(0)
  add = lambda u, v: tuple(p + q for p, q in zip(u, v))  # noqa: E731
  # One variadic reduction: the sums share their elementwise inputs in one loop.
  if k is None:
    x_units = (x_abs * unit_x).astype(jnp.int32)
    x_lo, x_hi = _limbs15(x_units)
    sum_a, b_lo, b_hi = lax.reduce((coef_a, coef_x * x_lo, coef_x * x_hi),
                                   (zero_f, zero_i, zero_i), add, axes)
    b = [jnp.expand_dims(b_lo, axes), jnp.expand_dims(b_hi, axes)]
  else:
    # X' < 2**22 for every finite element (|x| <= amax_b), an exact integer where it counts.
    sum_a, b1 = lax.reduce((coef_a, coef_x * _small_int(x_abs * unit_x)), (zero_f, zero_i), add,
                           axes)
    b1 = jnp.expand_dims(b1, axes)
    lo, hi = _limbs15(b1)
    # B = B' * 2**k in 15-bit limbs (each < 2**30).
    b = ([lo << k, hi << k] if k <= 15 else
         [jnp.zeros_like(lo), lo << (k - 15), hi << (k - 15)])
  sum_a = jnp.expand_dims(sum_a, axes)
  # g * A in 15-bit limbs: g = g1 2**15 + g0 (g < 2**24), A = A1 2**15 + A0 (|A| < 2**21).
  g_int = (g * 8388608.0).astype(jnp.int32)
  g0, g1 = _limbs15(g_int)
  a0, a1 = _limbs15(sum_a.astype(jnp.int32))
  p = [g0 * a0, g1 * a0 + g0 * a1, g1 * a1]
  t = clip(kb - e_block + t_off, -14, 14)
  return _lt_shifted(p, b, t)
