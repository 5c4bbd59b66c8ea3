"""Held-out accuracy from the rewards of generated completions, shared by the loop and the
simulator (they differ only in the reward: the loop's host verifier, the simulator's JAX one)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lowrl.analysis import stats


def eval_metrics(greedy_rewards_B: jax.Array,
                 sampled_rewards_B: jax.Array | None = None) -> dict[str, jax.Array]:
  """Accuracy metrics (FP32 scalars) of one evaluation; a reward >= 1 counts as solved.

  greedy: the solved fraction under temperature-0 decoding; greedy_reward: its mean reward.
  With `sampled_rewards_B` (n samples per prompt at the rollout temperature) also pass_at_1,
  the unbiased estimate of one sample's success rate (the solved fraction of all samples, as RL
  papers report it), and reward, the samples' mean reward.
  """
  def solved(r):
    return jnp.mean((jnp.asarray(r, jnp.float32) >= 1.0).astype(jnp.float32))

  out = {"greedy": solved(greedy_rewards_B),
         "greedy_reward": jnp.mean(jnp.asarray(greedy_rewards_B, jnp.float32))}
  if sampled_rewards_B is not None:
    out["pass_at_1"] = solved(sampled_rewards_B)
    out["reward"] = jnp.mean(jnp.asarray(sampled_rewards_B, jnp.float32))
  return out


def solved_ci(rewards_PN: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
  """The t interval of the solved fraction over the prompts: rewards_PN holds each held-out
  prompt's rewards in a row (its samples; one column for greedy), a reward >= 1 counts as solved,
  and the prompts are the units (lowrl.analysis.stats.paired_t of the per-prompt solved
  fractions: a one-sample t interval). Its mean is `eval_metrics`' pass_at_1 / greedy."""
  rates = (np.asarray(rewards_PN, np.float64) >= 1.0).mean(axis=1)
  r = stats.paired_t(rates, confidence=confidence)
  return r.ci_low, r.ci_high
