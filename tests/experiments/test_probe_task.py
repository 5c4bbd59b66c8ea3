"""experiments.probe_task's summary (experiments/probe_summary.py) of sampled rewards over keys, prompts and samples, on numbers
built by hand."""
import math

import numpy as np
import pytest

from experiments import probe_summary as probe_task
from lowrl.analysis import stats


def test_summary_pools_keys_and_clusters_the_interval_by_prompt():
  # 2 keys x 3 prompts x 2 samples; prompt 0 always solved, prompt 2 never.
  r = np.array([[[1, 1], [1, 0], [0, 0]],
                [[1, 1], [0, 0], [0, 0]]], np.float32)
  s = probe_task.summary(r)
  assert s["pass_at_1"] == pytest.approx(5 / 12)
  assert s["per_key"] == pytest.approx([3 / 6, 2 / 6])
  assert s["key_sd"] == pytest.approx(np.std([0.5, 1 / 3], ddof=1))
  # The units are the prompts' solved fractions over both keys: 1, 1/4, 0.
  t = stats.paired_t([1.0, 0.25, 0.0])
  assert (s["ci_low"], s["ci_high"]) == pytest.approx((t.ci_low, t.ci_high))
  assert s["ci_low"] < s["pass_at_1"] < s["ci_high"]


def test_summary_counts_partial_rewards_as_unsolved_and_one_key_has_no_spread():
  s = probe_task.summary(np.array([[[0.5, 1.0], [1.0, 1.0]]]))
  assert s["pass_at_1"] == pytest.approx(3 / 4)
  assert math.isnan(s["key_sd"])


def test_summary_refuses_a_flat_array():
  with pytest.raises(ValueError, match=r"\[keys, prompts, samples\]"):
    probe_task.summary(np.ones((4, 2)))
