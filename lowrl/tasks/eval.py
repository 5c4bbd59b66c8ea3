"""pass@k: the unbiased estimator of Chen et al. 2021 (HumanEval paper), and its use on reward groups.

With n samples of which c are correct, pass@k = 1 - C(n-c, k) / C(n, k): the probability that a
random size-k subset of the n samples holds at least one correct one. It is computed as the
product 1 - prod_{i=n-c+1}^{n} (1 - k/i), which needs no huge binomials.
"""
from __future__ import annotations

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k from n samples with c correct (requires 0 <= c <= n, 1 <= k <= n)."""
  for name, v in (("n", n), ("c", c), ("k", k)):
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
      raise ValueError(f"{name}={v!r}; pass@k needs integer counts.")
  if not 0 <= c <= n:
    raise ValueError(f"c={c} correct out of n={n}; need 0 <= c <= n.")
  if not 1 <= k <= n:
    raise ValueError(f"k={k} with n={n} samples; need 1 <= k <= n "
                     "(draw at least k samples per problem).")
  if n - c < k:
    return 1.0  # every size-k subset holds a correct sample
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_k_from_rewards(rewards_NG: np.ndarray, k: int, threshold: float = 1.0) -> float:
  """Mean pass@k over N problems with G samples each; a sample is correct if reward >= threshold."""
  rewards_NG = np.asarray(rewards_NG)
  if rewards_NG.ndim != 2 or rewards_NG.shape[1] == 0:
    raise ValueError("rewards_NG must be [N problems, G samples] with G >= 1, "
                     f"got shape {rewards_NG.shape}.")
  if rewards_NG.shape[0] == 0:
    raise ValueError("rewards_NG has no problems; pass at least one row.")
  n = rewards_NG.shape[1]
  correct = (rewards_NG >= threshold).sum(axis=1)
  return float(np.mean([pass_at_k(n, int(c), k) for c in correct]))
