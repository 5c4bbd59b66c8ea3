"""Decomposition of the sampler -> trainer drift over the sampled tokens.

Four logprobs of the same tokens, drawn from the sampler (d):
  d  logp_sampler:     the sampler's (stale) weights in the sampler's precision: what it sampled with,
  c  logp_stale:       the same weights in the trainer's precision,
  a  logp_now:         the current trainer weights in the trainer's precision,
  b  logp_now_sampler: the current weights in the sampler's precision.
Per token the total d - a splits into a quantization part Q and a staleness part S, each the
average over the two orders of taking the steps (the Shapley value of the two-player game):
  Q = ((d - c) + (b - a)) / 2     quantization error at the stale and at the current weights
  S = ((d - b) + (c - a)) / 2     staleness in the sampler's and in the trainer's precision
so Q + S = d - a exactly per token, and neither depends on an order. Without the fourth score
(b = None, the host loop) the split is the ordered one: Q = d - c (at the stale weights), S = c - a
(in the trainer's precision).

Reported per part (`drift/<part>/<metric>`, part in DRIFT_PARTS):
  mismatch_kl (k1)  the masked mean of the part's per-token difference over the sampled tokens:
                    its share of the total's k1 = E_d[log d - log a], so the parts add up exactly
                    (up to FP32 rounding of the sums);
  abs_dlogp_max     the largest |per-token difference| (the total's is <= the parts' sum);
  mismatch_kl_k3, ess, is_weight_mean, is_weight_std: the average over the part's two pairs (x, y)
                    of the mismatch metrics of y against x *under x*, the distribution the pair
                    refers to: k3 = E_x[w - 1 - log w], ESS = E_x[w]^2 / E_x[w^2], w = p_y / p_x.
                    Tokens come from d, so each mean is importance-weighted with the per-token
                    weight p_x / p_d = exp(x - d), self-normalised (lowrl.rl.mismatch); the weight
                    is 1 for the pairs whose x is d. The estimand is the per-token (conditional)
                    KL averaged over the sampler's prefixes.
The total (d, a) is the plain mismatch of the sampler against the current trainer.
Under top-k / top-p one score can give a sampled token probability 0 (its KL is infinite): such
tokens are left out of every part, so the parts still add up, and `drift/outside_support_frac` is
their share of the sampled tokens.

`is_weight_mean` of the total part, the mean of pi_now / pi_sampler over the sampled tokens, is 1 in
expectation when logp_sampler is the log-probability of the distribution the tokens were drawn
from (E_q[p / q] = 1 token by token): its departure from 1 beyond sampling noise is a recording
bug, not drift.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from lowrl.rl.masked import masked_max, masked_mean
from lowrl.rl.mismatch import in_support, mismatch_metrics

DRIFT_PARTS = ("quantization", "staleness", "total")
_AVERAGED = ("mismatch_kl_k3", "ess", "is_weight_mean", "is_weight_std")
_REPORTED = ("mismatch_kl", *_AVERAGED[:1], "abs_dlogp_max", *_AVERAGED[1:])


def _part_metrics(pairs: list[tuple[jax.Array, jax.Array]], logp_sampler_BT: jax.Array,
                  mask_BT: jax.Array) -> dict[str, jax.Array]:
  """One part: k1 and max of the pairs' averaged difference, the rest averaged over the pairs
  (each under its first distribution, importance-weighted from the sampler's tokens)."""
  per_pair = [mismatch_metrics(x, y, mask_BT,
                               None if x is logp_sampler_BT else x - logp_sampler_BT)
              for x, y in pairs]
  if len(pairs) == 1 and pairs[0][0] is logp_sampler_BT:  # the plain sampler-side mismatch
    return {k: per_pair[0][k] for k in _REPORTED}
  diff_BT = sum(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32)
                for x, y in pairs) / len(pairs)
  diff_BT = jnp.where(mask_BT != 0, diff_BT, 0.0)  # garbage off the mask stays out
  out = {"mismatch_kl": masked_mean(diff_BT, mask_BT),
         "abs_dlogp_max": masked_max(jnp.abs(diff_BT), mask_BT)}
  out.update({k: sum(m[k] for m in per_pair) / len(pairs) for k in _AVERAGED})
  return out


def drift_metrics(logp_sampler_BT: jax.Array, logp_stale_BT: jax.Array, logp_now_BT: jax.Array,
                  mask_BT: jax.Array, logp_now_sampler_BT: jax.Array | None = None
                  ) -> dict[str, jax.Array]:
  """`drift/<part>/<metric>` for part in DRIFT_PARTS (module docstring): k1 (`mismatch_kl`), k3,
  max |dlogp|, ESS, and the mean and std of the importance weight. `logp_now_sampler_BT` (the
  current weights in the sampler's precision) gives the order-symmetric split; None the ordered
  one."""
  d, c, a, b = logp_sampler_BT, logp_stale_BT, logp_now_BT, logp_now_sampler_BT
  if b is None:
    parts = {"quantization": [(d, c)], "staleness": [(c, a)]}
  else:
    parts = {"quantization": [(d, c), (b, a)], "staleness": [(d, b), (c, a)]}
  parts["total"] = [(d, a)]
  # One token set for every part, so that they still add up: the tokens all four scores support.
  support_BT = in_support(d) & in_support(c) & in_support(a)
  if b is not None:
    support_BT &= in_support(b)
  out = {"drift/outside_support_frac":
         masked_mean(1.0 - support_BT.astype(jnp.float32), jnp.asarray(mask_BT, jnp.float32))}
  mask_BT = jnp.where(support_BT, jnp.asarray(mask_BT, jnp.float32), 0.0)
  for part, pairs in parts.items():
    out.update({f"drift/{part}/{k}": v
                for k, v in _part_metrics(pairs, d, mask_BT).items()})
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
