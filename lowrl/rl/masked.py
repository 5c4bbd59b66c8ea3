"""Masked reductions over per-token arrays: the one place the project sums and averages under a mask.

Masks are float32 weights, normally 1.0 on tokens that count and 0.0 on padding/prompt. Values at
mask == 0 are *selected away* (not multiplied by 0), so NaN/Inf garbage on padding never leaks into a
result or a gradient. An empty mask gives `empty` (a documented constant), never NaN.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

Axis = int | tuple[int, ...] | None


def masked_sum(x: jax.Array, mask: jax.Array, axis: Axis = None) -> jax.Array:
  """Sum of `x * mask` over `axis` (all axes if None); entries with mask == 0 are ignored."""
  x, mask = jnp.asarray(x, jnp.float32), jnp.asarray(mask, jnp.float32)
  # `where` instead of a bare product: 0 * NaN would be NaN.
  return jnp.sum(jnp.where(mask != 0, x * mask, 0.0), axis=axis)


def masked_count(mask: jax.Array, axis: Axis = None) -> jax.Array:
  """Total mask weight over `axis` (the number of counted tokens for a 0/1 mask)."""
  return jnp.sum(jnp.asarray(mask, jnp.float32), axis=axis)


def safe_divide(num: jax.Array, den: jax.Array, empty: float = 0.0) -> jax.Array:
  """`num / den` where den != 0, else `empty`; NaN-free in value and gradient."""
  ok = den != 0
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), empty)


def masked_mean(x: jax.Array, mask: jax.Array, axis: Axis = None, empty: float = 0.0) -> jax.Array:
  """Mask-weighted mean of `x` over `axis`; `empty` where the mask sums to zero."""
  return safe_divide(masked_sum(x, mask, axis), masked_count(mask, axis), empty)


def masked_max(x: jax.Array, mask: jax.Array, axis: Axis = None, empty: float = 0.0) -> jax.Array:
  """Max of `x` over entries with mask != 0; `empty` where there are none."""
  x, mask = jnp.asarray(x, jnp.float32), jnp.asarray(mask, jnp.float32)
  m = jnp.max(jnp.where(mask != 0, x, -jnp.inf), axis=axis)
  return jnp.where(jnp.any(mask != 0, axis=axis), m, empty)
