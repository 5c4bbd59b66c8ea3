"""Group-relative advantages (GRPO / Dr.GRPO / RLOO) and DAPO's reward shaping helpers.

Batches are group-contiguous: sequence i belongs to prompt i // group_size, so a [B] array reshapes
to [B // G, G]. `group_size` and `mode` are static (Python values) under jit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

ADVANTAGE_MODES = ("grpo", "drgrpo", "rloo")


def _grouped(x_B: jax.Array, group_size: int) -> jax.Array:
  """[B] -> [B // G, G], with a clear error when B is not a whole number of groups."""
  if not isinstance(group_size, int) or group_size < 1:
    raise ValueError(f"group_size must be a positive int, got {group_size!r}.")
  if x_B.ndim != 1:
    raise ValueError(f"Expected a [B] array, got shape {x_B.shape}.")
  if x_B.shape[0] % group_size:
    raise ValueError(f"Batch size {x_B.shape[0]} is not a multiple of group_size={group_size}; "
                     "the batch must hold whole groups (num_prompts * group_size sequences).")
  return x_B.reshape(-1, group_size)


def compute_advantages(rewards_B: jax.Array, group_size: int, mode: str = "grpo",
                       eps: float = 1e-6) -> jax.Array:
  """Per-sequence advantages [B] from per-sequence rewards [B].

  grpo:    (R_i - mean_g R) / (std_g R + eps), std the population std (ddof=0) of the group.
  drgrpo:  R_i - mean_g R (Dr.GRPO drops the std division).
  rloo:    R_i - mean of the other G-1 rewards of the group (= G/(G-1) * (R_i - mean_g R)).
  A group with identical rewards gets advantage 0 in every mode.
  """
  if mode not in ADVANTAGE_MODES:
    raise ValueError(f"Unknown advantage mode {mode!r}; use one of {ADVANTAGE_MODES}.")
  if mode == "rloo" and group_size < 2:
    raise ValueError("RLOO needs group_size >= 2 (the baseline is the mean of the *other* samples).")
  if eps < 0:
    raise ValueError(f"eps must be >= 0, got {eps}.")
  r_PG = _grouped(jnp.asarray(rewards_B, jnp.float32), group_size)
  centered_PG = r_PG - jnp.mean(r_PG, axis=1, keepdims=True)
  if mode == "grpo":
    adv_PG = centered_PG / (jnp.std(r_PG, axis=1, keepdims=True) + eps)
  elif mode == "drgrpo":
    adv_PG = centered_PG
  else:
    # R_i - (sum - R_i)/(G-1) rewritten so it is exact for identical rewards.
    adv_PG = centered_PG * (group_size / (group_size - 1))
  return adv_PG.reshape(-1)


def group_has_signal(rewards_B: jax.Array, group_size: int) -> jax.Array:
  """bool [B]: True where the sequence's group has non-identical rewards (DAPO dynamic sampling).

  Groups where every reward is equal carry no gradient under group-relative advantages; DAPO drops
  them (or, with static shapes, zeroes their mask).
  """
  r_PG = _grouped(jnp.asarray(rewards_B, jnp.float32), group_size)
  signal_P = jnp.max(r_PG, axis=1) > jnp.min(r_PG, axis=1)
  return jnp.repeat(signal_P, group_size)


def overlong_penalty(lengths_B: jax.Array, max_len: int, cache_len: int) -> jax.Array:
  """DAPO soft overlong punishment [B] float32, added to the task reward.

  0 for L <= max_len - cache_len; (max_len - cache_len - L) / cache_len on the ramp up to max_len
  (reaching -1 at L = max_len); -1 beyond max_len.
  """
  if not 0 < cache_len <= max_len:
    raise ValueError(f"Need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}.")
  length_B = jnp.asarray(lengths_B, jnp.float32)
  start = float(max_len - cache_len)
  ramp_B = (start - length_B) / float(cache_len)
  return jnp.where(length_B <= start, 0.0, jnp.where(length_B <= max_len, ramp_B, -1.0))
