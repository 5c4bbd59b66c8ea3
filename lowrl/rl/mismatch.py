"""Sampler/trainer mismatch metrics, logged every step (docs/reference.md §3).

Tokens are sampled from the sampler, so with d = logp_sampler - logp_trainer on masked tokens:
  mismatch_kl     = mean(d)                  k1 estimate of KL(sampler || trainer)
  mismatch_kl_k3  = mean(w - log w - 1)      k3 estimate of the same KL, w = exp(-d); >= 0 per token
  abs_dlogp_mean, abs_dlogp_max = mean and max of |d|
  is_weight_mean, is_weight_std = mean and population std of w (w = pi_trainer / pi_sampler)
  ess             = (sum w)^2 / (N sum w^2)  in (0, 1]; 1 when all weights are equal
  outside_support_frac = share of masked tokens one side gives probability 0 (top-k / top-p)
Such a token makes the KL infinite and carries no importance weight, so every other metric is over
the tokens both distributions support; outside_support_frac says how many were left out.
An all-zero mask means "no evidence of mismatch": KLs, |d| stats and the weight std are 0, the weight
mean and ESS are 1. No NaN either way.

Tokens drawn from another distribution r (the drift decomposition's parts, lowrl.rl.drift): with
`log_weight_BT` = log pi_sampler - log r per token, every mean above except the |d| stats becomes
the self-normalised importance-weighted mean sum(m v f) / sum(m v), v = exp(log_weight), an
estimate under pi_sampler; ess becomes (E[w])^2 / E[w^2] under pi_sampler. |d| stats stay over the
drawn tokens.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from lowrl.rl.kl import k3_from_log_ratio
from lowrl.rl.masked import masked_count, masked_max, masked_mean, masked_sum, safe_divide

# A log-probability at or below half of this is a token outside its distribution's support
# (top-k / top-p give it probability 0): -inf in the sampler's scores, this value in the trainer's
# (lowrl.training.rl_update clamps there so that products with 0 stay 0, not NaN).
OUTSIDE_SUPPORT_LOGP = -1e30


def in_support(logp_BT: jax.Array) -> jax.Array:
  """True where a log-probability is a token inside its distribution's support."""
  return logp_BT > OUTSIDE_SUPPORT_LOGP / 2


def mismatch_metrics(logp_sampler_BT: jax.Array, logp_trainer_BT: jax.Array,
                     mask_BT: jax.Array, log_weight_BT: jax.Array | None = None
                     ) -> dict[str, jax.Array]:
  """FP32 scalar mismatch metrics over the masked tokens (see module docstring); no gradient.

  `log_weight_BT`: None when the tokens were drawn from pi_sampler, else log(pi_sampler / r) of
  the distribution r they were drawn from (self-normalised importance weights).
  """
  if logp_sampler_BT.shape != logp_trainer_BT.shape or logp_sampler_BT.shape != mask_BT.shape:
    raise ValueError(f"Shape mismatch: sampler {logp_sampler_BT.shape}, trainer "
                     f"{logp_trainer_BT.shape}, mask {mask_BT.shape}.")
  logp_sampler_BT = jax.lax.stop_gradient(jnp.asarray(logp_sampler_BT, jnp.float32))
  logp_trainer_BT = jax.lax.stop_gradient(jnp.asarray(logp_trainer_BT, jnp.float32))
  mask_BT = jnp.asarray(mask_BT, jnp.float32)
  support_BT = in_support(logp_sampler_BT) & in_support(logp_trainer_BT)
  outside_support_frac = masked_mean(1.0 - support_BT.astype(jnp.float32), mask_BT)
  mask_BT = jnp.where(support_BT, mask_BT, 0.0)
  # Zero on padding so exp() below can't overflow on garbage logprobs.
  d_BT = jnp.where(mask_BT != 0, logp_sampler_BT - logp_trainer_BT, 0.0)
  w_BT = jnp.exp(-d_BT)
  abs_d_BT = jnp.abs(d_BT)
  # The weights of the means: the mask itself, or mask x importance weight (normalised by the
  # largest, which the self-normalised means do not see, so that exp() cannot overflow).
  mean_mask_BT = mask_BT
  if log_weight_BT is not None:
    log_v_BT = jnp.where(mask_BT != 0, jax.lax.stop_gradient(
        jnp.asarray(log_weight_BT, jnp.float32)), 0.0)
    mean_mask_BT = mask_BT * jnp.exp(log_v_BT - masked_max(log_v_BT, mask_BT))

  w_mean = masked_mean(w_BT, mean_mask_BT, empty=1.0)
  w_var = masked_mean(jnp.square(w_BT - w_mean), mean_mask_BT)
  # ESS is scale-invariant: normalise by the largest weight so the sums can't overflow.
  log_w_BT = -d_BT
  u_BT = jnp.exp(log_w_BT - masked_max(log_w_BT, mask_BT))
  sum_u = masked_sum(u_BT, mean_mask_BT)
  sum_u2 = masked_sum(jnp.square(u_BT), mean_mask_BT)
  return {
      "mismatch_kl": masked_mean(d_BT, mean_mask_BT),
      # w - log w - 1 with log w = -d.
      "mismatch_kl_k3": masked_mean(k3_from_log_ratio(-d_BT), mean_mask_BT),
      "abs_dlogp_mean": masked_mean(abs_d_BT, mask_BT),
      "abs_dlogp_max": masked_max(abs_d_BT, mask_BT),
      "is_weight_mean": w_mean,
      "is_weight_std": jnp.sqrt(w_var),
      "ess": safe_divide(jnp.square(sum_u), masked_count(mean_mask_BT) * sum_u2, empty=1.0),
      "outside_support_frac": outside_support_frac,
  }
