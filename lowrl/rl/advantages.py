"""Group-relative advantages (GRPO / Dr.GRPO / RLOO) and DAPO's reward shaping helpers.

Batches are group-contiguous: sequence i belongs to prompt i // group_size, so a [B] array reshapes
to [B // G, G]. `group_size` and `mode` are static (Python values) under jit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

ADVANTAGE_MODES = ("grpo", "drgrpo", "rloo")
STD_DDOFS = (0, 1)  # GRPO group std: population (0) or sample (1) standard deviation


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
                       eps: float = 1e-6, std_ddof: int = 0) -> jax.Array:
  """Per-sequence advantages [B] from per-sequence rewards [B].

  grpo:    (R_i - mean_g R) / (std_g R + eps); std_ddof 0 = the population std (the GRPO paper's
           formula as written), 1 = the sample std (Bessel-corrected, as TRL, verl and tunix).
  drgrpo:  R_i - mean_g R (Dr.GRPO drops the std division).
  rloo:    R_i - mean of the other G-1 rewards of the group (= G/(G-1) * (R_i - mean_g R)).
  A group whose rewards are all equal gets advantage exactly 0 in every mode (also when the
  reward, e.g. 2.9 or 4/6, is not exact in float32 and the float32 mean would leave a residual).
  """
  if mode not in ADVANTAGE_MODES:
    raise ValueError(f"Unknown advantage mode {mode!r}; use one of {ADVANTAGE_MODES}.")
  if mode == "rloo" and group_size < 2:
    raise ValueError("RLOO needs group_size >= 2 (the baseline is the mean of the *other* samples).")
  if eps < 0:
    raise ValueError(f"eps must be >= 0, got {eps}.")
  validate_std_ddof(std_ddof)
  if mode == "grpo" and std_ddof == 1 and group_size < 2:
    raise ValueError("std_ddof=1 (sample std) needs group_size >= 2; use std_ddof=0.")
  r_PG = _grouped(jnp.asarray(rewards_B, jnp.float32), group_size)
  # Structural zero for groups without signal: mean() of G equal float32 values is not always that
  # value (sum rounding), so R_i - mean would be a same-sign residual amplified by 1/(std + eps).
  signal_P1 = jnp.max(r_PG, axis=1, keepdims=True) > jnp.min(r_PG, axis=1, keepdims=True)
  centered_PG = jnp.where(signal_P1, r_PG - jnp.mean(r_PG, axis=1, keepdims=True), 0.0)
  if mode == "grpo":
    std_P1 = jnp.std(r_PG, axis=1, keepdims=True, ddof=std_ddof)
    # `where` keeps eps=0 well defined: 0 / 0 would be NaN for a group without signal.
    adv_PG = jnp.where(signal_P1, centered_PG / (std_P1 + eps), 0.0)
  elif mode == "drgrpo":
    adv_PG = centered_PG
  else:
    # R_i - (sum - R_i)/(G-1) rewritten as a multiple of the centred reward.
    adv_PG = centered_PG * (group_size / (group_size - 1))
  return adv_PG.reshape(-1)


def validate_std_ddof(std_ddof: int) -> None:
  """Raise ValueError unless `std_ddof` is one of STD_DDOFS."""
  if std_ddof not in STD_DDOFS or isinstance(std_ddof, bool):
    raise ValueError(f"rl.std_ddof={std_ddof!r}; use 0 (population std) or 1 (sample std).")


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
