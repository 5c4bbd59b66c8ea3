"""Held-out accuracy (lowrl.training.evaluation): pass@1 and greedy, and their interval over the
prompts against scipy's t interval of the per-prompt solved fractions."""
import numpy as np
import pytest
from scipy import stats as scipy_stats

from lowrl.training.evaluation import eval_metrics, solved_ci


def test_the_interval_is_the_t_interval_of_the_per_prompt_solved_fractions():
  rng = np.random.default_rng(0)
  rewards_PN = (rng.uniform(size=(64, 4)) < rng.uniform(size=(64, 1))).astype(np.float32)
  rewards_PN[:3] = 0.5  # partial credit is not solved
  rates = (rewards_PN >= 1).mean(axis=1)
  lo, hi = solved_ci(rewards_PN)
  want = scipy_stats.t.interval(0.95, len(rates) - 1, loc=rates.mean(),
                                scale=scipy_stats.sem(rates))
  assert (lo, hi) == pytest.approx(want, rel=1e-9)  # both FP64 closed forms of the same bound
  pass_at_1 = float(eval_metrics(rewards_PN[:, 0], rewards_PN.reshape(-1))["pass_at_1"])
  assert pass_at_1 == pytest.approx(rates.mean(), abs=1e-7)  # FP32 mean of 256 0/1 values
  assert lo < pass_at_1 < hi
  assert solved_ci(np.ones((8, 1))) == (1.0, 1.0)  # no spread: the mean itself
