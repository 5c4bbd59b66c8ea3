"""Random Hadamard transform (RHT) of 16-wide blocks along an axis.

Each block v of 16 consecutive elements becomes T v with T = H16 · diag(signs) / 4: H16 the
Sylvester Hadamard matrix (entries ±1, H Hᵀ = 16 I), signs a fixed random ±1 vector. T is
orthonormal, so applying it to both operands along their contracting axis leaves the product unchanged
(aᵀ b = (T a)ᵀ (T b)) while spreading outliers across the block before quantization.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

RHT_BLOCK = 16
# Fixed, seed-derived sign vector: every RHT in the project uses the same transform.
DEFAULT_SIGNS = np.where(np.random.default_rng(20260701).random(RHT_BLOCK) < 0.5, -1.0, 1.0)


def hadamard_matrix(n: int = RHT_BLOCK) -> np.ndarray:
  """Sylvester Hadamard matrix of order n (a power of two), entries ±1, float32."""
  if n < 1 or n & (n - 1):
    raise ValueError(f"Hadamard order must be a power of two, got {n}.")
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return h


def rht_matrix(signs=None) -> np.ndarray:
  """T = H16 · diag(signs) / 4 (orthonormal), float32; signs defaults to DEFAULT_SIGNS."""
  signs = DEFAULT_SIGNS if signs is None else np.asarray(signs, np.float32)
  if signs.shape != (RHT_BLOCK,) or not np.all(np.abs(signs) == 1):
    raise ValueError(f"signs must be {RHT_BLOCK} values of ±1, got {signs!r}.")
  return (hadamard_matrix(RHT_BLOCK) * signs[None, :] / 4.0).astype(np.float32)


def _apply(x: jax.Array, axis: int, mat: np.ndarray) -> jax.Array:
  if x.ndim == 0 or not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis={axis} is out of range for shape {x.shape}.")
  axis %= x.ndim
  n = x.shape[axis]
  if n % RHT_BLOCK:
    raise ValueError(f"RHT works on blocks of {RHT_BLOCK}: x.shape[{axis}]={n} is not a multiple "
                     f"of {RHT_BLOCK}; pad the axis.")
  return _apply_jit(x, axis, jnp.asarray(mat))


@functools.partial(jax.jit, static_argnums=1)
def _apply_jit(x: jax.Array, axis: int, mat: jax.Array) -> jax.Array:
  n = x.shape[axis]
  dtype = x.dtype
  blocked = x.shape[:axis] + (n // RHT_BLOCK, RHT_BLOCK) + x.shape[axis + 1:]
  x_b = x.astype(jnp.float32).reshape(blocked)
  # out[..., j, ...] = sum_i mat[j, i] x[..., i, ...] over the in-block axis.
  out_b = jnp.tensordot(x_b, mat, axes=((axis + 1,), (1,)),
                        precision=lax.Precision.HIGHEST)
  out_b = jnp.moveaxis(out_b, -1, axis + 1)
  return out_b.reshape(x.shape).astype(dtype)


def rht(x: jax.Array, axis: int = -1, signs=None) -> jax.Array:
  """Random Hadamard transform of 16-wide blocks along `axis` (in FP32; returns x.dtype)."""
  return _apply(x, axis, rht_matrix(signs))


def inverse_rht(x: jax.Array, axis: int = -1, signs=None) -> jax.Array:
  """Inverse of `rht` (Tᵀ, as T is orthonormal)."""
  return _apply(x, axis, rht_matrix(signs).T.copy())
