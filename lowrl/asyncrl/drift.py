"""Decomposition of the sampler -> trainer drift over the sampled tokens.

Three logprobs of the same sampled tokens:
  logp_sampler: the sampler's version of the weights in the sampler's precision (what it sampled with),
  logp_stale:   the same weights in the trainer's precision,
  logp_now:     the current trainer weights in the trainer's precision.
Then, per token, (sampler - now) = (sampler - stale) + (stale - now): the quantization part plus the
staleness part. The k1 estimates (masked means of the differences) add up exactly (up to FP32
rounding); k3, max |dlogp| and ESS are reported per part but are not additive.
"""
from __future__ import annotations

from typing import Any, Callable

import jax

from lowrl.rl.mismatch import mismatch_metrics

DRIFT_PARTS = ("quantization", "staleness", "total")
_REPORTED = ("mismatch_kl", "mismatch_kl_k3", "abs_dlogp_max", "ess")


def drift_metrics(logp_sampler_BT: jax.Array, logp_stale_BT: jax.Array, logp_now_BT: jax.Array,
                  mask_BT: jax.Array) -> dict[str, jax.Array]:
  """`drift/<part>/<metric>` for part in DRIFT_PARTS; metric k1 (`mismatch_kl`), k3, max |dlogp|, ESS."""
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
