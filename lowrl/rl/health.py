"""Run-health metrics of one RL step, the ones peer frameworks' dashboards show (docs/sampling.md).

With d = logp_sampler - logp_trainer on the counted tokens (the mask, minus tokens one side gives
probability 0: `mismatch.in_support`; `mismatch/outside_support_frac` counts those) and the
per-token importance weight w = pi_trainer / pi_sampler = exp(-d):

  dlogp_gt_ln2_frac  share of tokens with |d| > ln 2, i.e. w > 2 or w < 1/2: one side gives the
                     token more than twice the other's probability.
  is_chi2            mean(w^2) - 1 over the tokens: the per-token chi-square divergence
                     chi2(pi_trainer || pi_sampler) = E_sampler[w^2] - 1 = Var_sampler(w) (E[w] =
                     1 under the sampler), estimated on the sampled tokens. It is the variance of
                     the importance weights: chi2 ~ 1 / ess - 1 for the ESS `mismatch/ess`
                     (Kong 1992; Agapiou et al. 2017, "Importance sampling: intrinsic dimension and
                     computational cost", Statist. Sci. 32(3), section 2). 0 when sampler = trainer;
                     it can be negative on a finite sample (mean(w) < 1), and overflows to +inf for a
                     token with d < -44 (w^2 beyond FP32).
  zero_spread_group_frac  share of groups whose task rewards are all equal: under group-relative
                     advantages they carry no gradient (what DAPO's dynamic sampling drops).

An all-zero mask gives 0 for the token metrics (no evidence of mismatch), no NaN.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from lowrl.rl.advantages import group_has_signal
from lowrl.rl.masked import masked_mean
from lowrl.rl.mismatch import in_support

LN2 = math.log(2.0)
HEALTH_METRICS = ("dlogp_gt_ln2_frac", "is_chi2", "zero_spread_group_frac")


def health_metrics(logp_sampler_BT: jax.Array, logp_trainer_BT: jax.Array, mask_BT: jax.Array,
                   rewards_B: jax.Array, group_size: int) -> dict[str, jax.Array]:
  """FP32 scalar run-health metrics (module docstring); no gradient. `rewards_B`: the task
  rewards, group-contiguous rows of `group_size`."""
  if logp_sampler_BT.shape != logp_trainer_BT.shape or logp_sampler_BT.shape != mask_BT.shape:
    raise ValueError(f"Shape mismatch: sampler {logp_sampler_BT.shape}, trainer "
                     f"{logp_trainer_BT.shape}, mask {mask_BT.shape}.")
  logp_s = jax.lax.stop_gradient(jnp.asarray(logp_sampler_BT, jnp.float32))
  logp_t = jax.lax.stop_gradient(jnp.asarray(logp_trainer_BT, jnp.float32))
  mask_BT = jnp.where(in_support(logp_s) & in_support(logp_t),
                      jnp.asarray(mask_BT, jnp.float32), 0.0)
  d_BT = jnp.where(mask_BT != 0, logp_s - logp_t, 0.0)  # 0 off the mask: no overflow below
  chi2 = masked_mean(jnp.exp(-2.0 * d_BT) - 1.0, mask_BT)
  no_signal_B = 1.0 - group_has_signal(rewards_B, group_size).astype(jnp.float32)
  return {
      "dlogp_gt_ln2_frac": masked_mean((jnp.abs(d_BT) > LN2).astype(jnp.float32), mask_BT),
      "is_chi2": chi2,
      # Groups have equal sizes, so the share of rows is the share of groups.
      "zero_spread_group_frac": jnp.mean(no_signal_B),
  }
