"""The simulator's synthetic sequential task: transform a random sequence, reward in JAX.

Small enough that a tiny decoder learns it in a few hundred updates on a CPU, with a held-out split
(problems training never draws) for the greedy evaluation.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

TASK_KINDS = ("sort", "reverse", "copy")
REWARD_KINDS = ("per_token", "exact")
SPLITS = ("train", "eval")


@dataclasses.dataclass(frozen=True)
class SequenceTask:
  """Transform a random sequence: prompt [bos, x_1..x_L], target f(x) of L tokens.

  Attributes:
    kind: "sort" (ascending), "reverse" or "copy".
    num_symbols: symbols 0..num_symbols-1; the bos id is num_symbols (vocab num_symbols + 1).
    length: L, prompt symbols = completion tokens (the horizon).
    reward: "per_token" (fraction of positions right, in [0, 1]) or "exact" (1 iff all right).
  """

  kind: str = "sort"
  num_symbols: int = 8
  length: int = 6
  reward: str = "per_token"

  def __post_init__(self):
    if self.kind not in TASK_KINDS:
      raise ValueError(f"task.kind={self.kind!r}; use one of {TASK_KINDS}.")
    if self.reward not in REWARD_KINDS:
      raise ValueError(f"task.reward={self.reward!r}; use one of {REWARD_KINDS}.")
    if self.num_symbols < 2 or self.length < 1:
      raise ValueError(f"task needs num_symbols >= 2 and length >= 1, got {self.num_symbols}, "
                       f"{self.length}.")

  @property
  def bos_id(self) -> int:
    return self.num_symbols

  @property
  def vocab_size(self) -> int:
    return self.num_symbols + 1

  def prompts(self, key: jax.Array, n: int, split: str = "train") -> jax.Array:
    """[n, L + 1] int32 prompts (bos first), uniform over the problems of `split`.

    The split is disjoint by construction: a problem is held out ("eval") iff the sum of its
    symbols is 0 mod num_symbols (a property of the multiset, so the permutations of one sort
    problem share a split; about 1 / num_symbols of the problems). Sampling stays uniform on each
    side: the first L - 1 symbols are free, the last is the one value that puts the sum in the
    eval class, or uniform over the num_symbols - 1 values that keep it out.
    """
    if split not in SPLITS:
      raise ValueError(f"split={split!r}; use one of {SPLITS}.")
    k_head, k_last = jax.random.split(key)
    s = self.num_symbols
    head_NL = jax.random.randint(k_head, (n, self.length - 1), 0, s, jnp.int32)
    eval_last_N = (-jnp.sum(head_NL, axis=1)) % s
    if split == "eval":
      last_N = eval_last_N
    else:  # skip the eval value: uniform over the other s - 1 symbols
      offset_N = jax.random.randint(k_last, (n,), 1, s, jnp.int32)
      last_N = (eval_last_N + offset_N) % s
    x_NL = jnp.concatenate([head_NL, last_N[:, None]], axis=1)
    return jnp.concatenate([jnp.full((n, 1), self.bos_id, jnp.int32), x_NL], axis=1)

  def targets(self, prompt_BP: jax.Array) -> jax.Array:
    """[B, L] the reference completion of each prompt."""
    x_BL = prompt_BP[:, 1:]
    if self.kind == "sort":
      return jnp.sort(x_BL, axis=-1)
    if self.kind == "reverse":
      return x_BL[:, ::-1]
    return x_BL

  def rewards(self, prompt_BP: jax.Array, completion_BL: jax.Array
              ) -> tuple[jax.Array, jax.Array]:
    """(reward_B, exact_B), float32: the training reward and the exact-match indicator."""
    right_BL = (completion_BL == self.targets(prompt_BP)).astype(jnp.float32)
    exact_B = jnp.all(right_BL > 0, axis=-1).astype(jnp.float32)
    reward_B = jnp.mean(right_BL, axis=-1) if self.reward == "per_token" else exact_B
    return reward_B, exact_B
