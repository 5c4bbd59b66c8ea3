"""experiments/bench_rollout.py's pooled ratio: the ratio over all rounds' tokens, not a mean of
per-round ratios."""
from __future__ import annotations

import numpy as np

from experiments.bench_rollout import pooled, row_tokens


def test_pooled_per_token_counts_equal_the_ratio_of_total_row_tokens():
  rng = np.random.default_rng(0)
  rounds = [np.minimum(rng.geometric(1 / 60, size=16), 256) for _ in range(5)]
  sizes = (16, 8, 4)
  before, after, useful = [], [], []
  for lengths in rounds:
    u = int(lengths.sum())
    useful.append(u)
    before.append(row_tokens(lengths, 13, 1, (16,)) / u)
    after.append(row_tokens(lengths, 13, 8, sizes) / u)
  total_before = sum(row_tokens(l, 13, 1, (16,)) for l in rounds)
  total_after = sum(row_tokens(l, 13, 8, sizes) for l in rounds)
  assert np.isclose(pooled(after, before, useful), total_after / total_before, rtol=1e-12)
  # Unweighted, a round of short completions counts as much as one of long ones: not the same.
  assert not np.isclose(pooled(after, before), total_after / total_before, rtol=1e-6)


def test_pooled_times_are_a_ratio_of_sums():
  assert pooled([1.0, 3.0], [2.0, 2.0]) == 1.0
  assert pooled([1.0, 3.0], [4.0, 4.0], [3.0, 1.0]) == 6.0 / 16.0


def test_pooled_interval_brackets_the_pooled_ratio_and_is_a_point_without_spread():
  from experiments.bench_rollout import pooled_interval
  num, den = [1.0, 2.0, 4.0, 3.0], [2.0, 3.0, 5.0, 7.0]
  lo, hi = pooled_interval(num, den)
  assert lo <= pooled(num, den) <= hi and lo < hi
  assert pooled_interval([2.0] * 5, [4.0] * 5) == (0.5, 0.5)
