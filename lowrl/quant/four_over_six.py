"""Exact 4/6 selection: is the block's error with scale 4 strictly smaller than with scale 6?

The errors are those of the dequantized FP32 values against the FP32 input, as real numbers:
  mse  D = sum (dq4 - x)**2 - (dq6 - x)**2 = sum (dq4 - dq6) * (dq4 + dq6 - 2x)
  mae  D = sum |dq4 - x| - |dq6 - x|
and 4 wins iff D < 0 (an exact tie keeps 6). D is computed exactly in int32 arithmetic:

  * The caller passes x, dq4, dq6 and amax_b divided by 2**e, e the outer scale's exponent (an
    exact rescaling for values above 2**-126, where dq / 2**e = fl(code * s_block * G) with G the
    outer scale's significand), so they lie near [2**-10, 2**13] and the unit below is a normal
    FP32 number for every block that can contribute.
  * Only elements with dq4 != dq6 contribute (both factors of the mse term, and the mae term, vanish
    otherwise). Such an element has a nonzero dq, so |x| >= S/4 and dq >= S/2 for a block scale
    S = s_block * G >= amax_b / 9 (an E4M3 block scale is >= 2/3 of the quotient it rounds;
    when the 4-scale saturates at 448, amax_b <= 2688 G still gives S4 >= amax_b / 6; when both
    saturate, dq4 == dq6 everywhere; blocks with amax_b < 2**-98 flush both scales to 0). So
    |x| >= amax_b / 36 >= 2**(E - 6) and |dq| >= amax_b / 18 >= 2**(E - 5), E = floor(log2
    amax_b): integer multiples of u = 2**(E - 29), and below 3 * 2**E (< 2**31 u), so
    v * 2**(29 - E) converts to int32 exactly.
  * The differences used, |dq - x| <= S, and each mse factor are below amax_b (< 2**30 u).
  * The mse product of two 31-bit factors and the block sums are carried in 16-bit limbs, each
    partial product and limb sum fitting int32 (blocks of <= 1024 elements, checked in config.py);
    a final carry pass gives the sign of the exact sum.

Integer arithmetic is exact in any order, so the selection is the same in every program (jit or
not, whatever XLA's reduction order).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from lowrl.quant.rounding import f32_exponent, pow2

_MASK16 = 0xFFFF


def _units(v_f32: jax.Array, e_block: jax.Array) -> jax.Array:
  """v / 2**(e_block - 29) as int32: exact (see the module docstring) where it matters."""
  return (v_f32 * pow2(jnp.clip(29 - e_block, -126, 127))).astype(jnp.int32)


def _split16(v_i32: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(hi, lo) with v = hi * 2**16 + lo, lo in [0, 2**16)."""
  return v_i32 >> 16, v_i32 & _MASK16


def _sum_is_negative(limbs: list[jax.Array], axes) -> jax.Array:
  """sign(sum over axes of sum_k limbs[k] * 2**(16 k)) < 0, limbs[k] int32 small enough that
  their sums over axes fit int32; the top limb carries the sign, the others are >= 0."""
  # One variadic reduction: the limbs share their (elementwise) computation in one loop, where
  # separate sums would each recompute the products they come from.
  axes = tuple(a % limbs[0].ndim for a in axes)
  sums = lax.reduce(tuple(limbs), tuple(jnp.int32(0) for _ in limbs),
                    lambda xs, ys: tuple(x + y for x, y in zip(xs, ys)), axes)
  total = [jnp.expand_dims(t, axes) for t in sums]
  carry = jnp.zeros_like(total[0])
  for t in total[:-1]:
    carry = (t + carry) >> 16  # the remainders (t + carry) & 0xFFFF are >= 0
  return total[-1] + carry < 0


def four_wins(x_f32: jax.Array, dq4: jax.Array, dq6: jax.Array, amax_b: jax.Array, axes,
              metric: str) -> jax.Array:
  """True per block (keepdims over `axes`) where the error with scale 4 is strictly smaller than
  with scale 6 (exact, see the module docstring). x, dq4, dq6: FP32 in the blocked view, amax_b:
  the block max (FP32, keepdims), all divided by 2**e of the outer scale."""
  e_block = f32_exponent(amax_b)
  x_u, d4, d6 = _units(x_f32, e_block), _units(dq4, e_block), _units(dq6, e_block)
  contributes = dq4 != dq6
  if metric == "mae":
    v = jnp.where(contributes, jnp.abs(d4 - x_u) - jnp.abs(d6 - x_u), 0)
    hi, lo = _split16(v)
    return _sum_is_negative([lo, hi], axes)
  a = jnp.where(contributes, d4 - d6, 0)
  b = jnp.where(contributes, (d4 - x_u) + (d6 - x_u), 0)
  a_hi, a_lo = _split16(a)
  b_hi, b_lo = _split16(b)
  # a * b = hh 2**32 + (hl + lh) 2**16 + ll; |hh| <= 2**30, |hl|, |lh| < 2**31, ll < 2**32.
  hh, hl, lh = a_hi * b_hi, a_hi * b_lo, a_lo * b_hi
  ll = a_lo.astype(jnp.uint32) * b_lo.astype(jnp.uint32)
  l0 = (ll & _MASK16).astype(jnp.int32)
  l1 = (ll >> 16).astype(jnp.int32) + (hl & _MASK16) + (lh & _MASK16)
  l2 = hh + (hl >> 16) + (lh >> 16)
  l2_hi, l2_lo = _split16(l2)
  return _sum_is_negative([l0, l1, l2_lo, l2_hi], axes)
