"""Per-prompt success from n sampled completions per prompt: p_hat, the zero-success fraction and
pass@k (the unbiased estimator of Chen et al. 2021, `lowrl.tasks.eval.pass_at_k`).

A held-out prompt with c correct of n samples has p_hat = c / n (unbiased for its probability of
a correct answer) and pass@k = 1 - C(n - c, k) / C(n, k) (unbiased for 1 - (1 - p)^k). A prompt
with c = 0 has "collapsed": its probability is below about 3 / n (the 95% upper bound of a
binomial with no success), not necessarily 0.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from lowrl.tasks.eval import pass_at_k


def powers_of_two(n: int) -> tuple[int, ...]:
  """1, 2, 4, ... up to n (the k of a pass@k curve from n samples per prompt)."""
  if n < 1:
    raise ValueError(f"n={n}: need at least one sample per prompt.")
  return tuple(2**i for i in range(int(np.log2(n)) + 1))


def _counts(correct_P: Sequence[int], n: int) -> np.ndarray:
  c = np.asarray(correct_P)
  if c.ndim != 1 or c.size == 0:
    raise ValueError(f"correct_P: expected per-prompt counts [P], P >= 1, got shape {c.shape}.")
  if not np.issubdtype(c.dtype, np.integer):
    raise ValueError(f"correct_P: integer counts of correct samples, got dtype {c.dtype}.")
  if np.any((c < 0) | (c > n)):
    raise ValueError(f"correct_P: counts outside [0, n={n}]: {c[(c < 0) | (c > n)][:4].tolist()} "
                     "(a -1 marks a step without an eval: select the eval steps first).")
  return c


def pass_at_k_per_prompt(correct_P: Sequence[int], n: int, k: int) -> np.ndarray:
  """[P] float64 unbiased pass@k of each prompt (c_p correct of n samples)."""
  return np.array([pass_at_k(n, int(c), k) for c in _counts(correct_P, n)])


def success_summary(correct_P: Sequence[int], n: int,
                    ks: Sequence[int] | None = None) -> dict[str, float]:
  """Means over prompts: `p_hat` (= pass@1), `zero_frac` (fraction of prompts with no correct
  sample of n) and `pass@{k}` for k in `ks` (default: powers of two up to n)."""
  c = _counts(correct_P, n)
  out = {"p_hat": float(np.mean(c / n)), "zero_frac": float(np.mean(c == 0))}
  for k in (powers_of_two(n) if ks is None else ks):
    out[f"pass@{k}"] = float(np.mean(pass_at_k_per_prompt(c, n, int(k))))
  return out
