"""Per-token estimators of KL(pi_theta || pi_ref) from samples of pi_theta (docs/reference.md §3).

With r = logp_ref - logp:  k1 = -r,  k2 = r^2 / 2,  k3 = e^r - r - 1.
k1 is unbiased but can be negative per token; k2 and k3 are non-negative; k3 is unbiased.
No clamping: the caller sees exactly the estimator (an exploding k3 is a signal, not noise).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

KL_ESTIMATORS = ("k1", "k2", "k3")


def validate_kl_estimator(kind: str) -> None:
  """Raise ValueError unless `kind` is one of KL_ESTIMATORS."""
  if kind not in KL_ESTIMATORS:
    raise ValueError(f"Unknown KL estimator {kind!r}; use one of {KL_ESTIMATORS}.")


def kl_estimate(logp_BT: jax.Array, logp_ref_BT: jax.Array, kind: str = "k3") -> jax.Array:
  """Per-token KL estimate (same shape as the inputs, unmasked; reduce it with lowrl.rl.masked)."""
  validate_kl_estimator(kind)
  r_BT = jnp.asarray(logp_ref_BT, jnp.float32) - jnp.asarray(logp_BT, jnp.float32)
  if kind == "k1":
    return -r_BT
  if kind == "k2":
    return 0.5 * jnp.square(r_BT)
  return k3_from_log_ratio(r_BT)


def k3_from_log_ratio(r: jax.Array) -> jax.Array:
  """e^r - r - 1, accurate in float32 for tiny |r| too (where the naive form cancels to noise)."""
  r = jnp.asarray(r, jnp.float32)
  # Taylor series below 1e-2 (truncation error ~r^5/120); expm1 - r above (cancellation ~1e-5 rel).
  series = jnp.square(r) * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0)))
  return jnp.where(jnp.abs(r) < 1e-2, series, jnp.expm1(r) - r)


def exact_kl(logits_p_BTV: jax.Array, logits_q_BTV: jax.Array) -> jax.Array:
  """KL(p || q) per position over the whole vocabulary, [B, T], FP32: sum_v p_v (log p_v - log q_v)
  with p = softmax(logits_p), q = softmax(logits_q). Exact (no sampling), >= 0 up to rounding; a
  token q gives probability 0 where p does not makes it inf."""
  logp = jax.nn.log_softmax(jnp.asarray(logits_p_BTV, jnp.float32), axis=-1)
  logq = jax.nn.log_softmax(jnp.asarray(logits_q_BTV, jnp.float32), axis=-1)
  # p = 0 entries contribute 0 whatever log q is (0 * -inf would be NaN).
  return jnp.sum(jnp.where(logp > -jnp.inf, jnp.exp(logp) * (logp - logq), 0.0), axis=-1)
