"""Decomposition of the sampler -> trainer drift over the sampled tokens.

Three logprobs of the same sampled tokens:
  logp_sampler: the sampler's version of the weights in the sampler's precision (what it sampled with),
  logp_stale:   the same weights in the trainer's precision,
  logp_now:     the current trainer weights in the trainer's precision.
Then, per token, (sampler - now) = (sampler - stale) + (stale - now): the quantization part plus the
staleness part. The k1 estimates (masked means of the differences) add up exactly (up to FP32
rounding); k3, max |dlogp|, ESS and the importance weights are reported per part but are not
additive.

`is_weight_mean` of the total part, the mean of pi_now / pi_sampler over the sampled tokens, is 1 in
expectation when logp_sampler is the log-probability of the distribution the tokens were drawn
from (E_q[p / q] = 1 token by token): its departure from 1 beyond sampling noise is a recording
bug, not drift.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from lowrl.rl.mismatch import mismatch_metrics

DRIFT_PARTS = ("quantization", "staleness", "total")
_REPORTED = ("mismatch_kl", "mismatch_kl_k3", "abs_dlogp_max", "ess", "is_weight_mean",
             "is_weight_std")


def drift_metrics(logp_sampler_BT: jax.Array, logp_stale_BT: jax.Array, logp_now_BT: jax.Array,
                  mask_BT: jax.Array) -> dict[str, jax.Array]:
  """`drift/<part>/<metric>` for part in DRIFT_PARTS; metric k1 (`mismatch_kl`), k3, max |dlogp|,
  ESS, and the mean and std of the importance weight exp(b - a) of the pair (a, b)."""
  pairs = {"quantization": (logp_sampler_BT, logp_stale_BT),
           "staleness": (logp_stale_BT, logp_now_BT),
           "total": (logp_sampler_BT, logp_now_BT)}
  out = {}
  for part, (a, b) in pairs.items():
    m = mismatch_metrics(a, b, mask_BT)
    out.update({f"drift/{part}/{k}": m[k] for k in _REPORTED})
  return out


def sampler_trainer_drift(logprob_fn: Callable[..., tuple[jax.Array, jax.Array]],
                          sampler_params: Any, params: Any, batch: dict[str, jax.Array],
                          logp_sampler_BT: jax.Array, mask_BT: jax.Array,
                          quant_key: jax.Array | None) -> dict[str, jax.Array]:
  """`drift_metrics` of a sampled batch, scoring it with the trainer's `logprob_fn`.

  `logprob_fn(params, batch, quant_key) -> (logp_BT, entropy_BT)` is the trainer's
  (`lowrl.training.rl_update.make_logprob_fn`); the stale and current scores share `quant_key`, so
  with lag 0 the staleness part is exactly 0.
  """
  logp_stale_BT = logprob_fn(sampler_params, batch, quant_key)[0]
  logp_now_BT = logprob_fn(params, batch, quant_key)[0]
  return drift_metrics(logp_sampler_BT, logp_stale_BT, logp_now_BT, mask_BT)


def version_distance(sampler_params: Any, params: Any) -> jax.Array:
  """Relative RMS distance ||sampler - now|| / ||now|| over every parameter, in FP32.

  How far the sampler's weight version is from the trainer's current one: exactly 0 iff every
  parameter is bit-identical (then the rollout used the current policy), growing with staleness.
  """
  diff_sq = sum(jnp.sum(jnp.square(a.astype(jnp.float32) - b.astype(jnp.float32)))
                for a, b in zip(jax.tree.leaves(sampler_params), jax.tree.leaves(params),
                                strict=True))
  norm_sq = sum(jnp.sum(jnp.square(b.astype(jnp.float32))) for b in jax.tree.leaves(params))
  return jnp.sqrt(diff_sq / jnp.maximum(norm_sq, jnp.finfo(jnp.float32).tiny))
