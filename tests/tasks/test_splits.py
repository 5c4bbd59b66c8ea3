"""Train/eval splits by problem key (`lowrl.tasks.splits`): a small problem space partitioned with
commuted pairs together, splits that nest across eval fractions and ignore size knobs, an empty
split refused."""
import itertools

import numpy as np
import pytest

from lowrl.tasks import splits
from lowrl.tasks.addition import AdditionTask


def test_split_exhaustive_on_a_small_space():
  """1-digit addition has 100 prompts: train and eval partition them; commuted pairs stay together."""
  task = AdditionTask(num_digits=1, eval_fraction=0.3)
  rng = np.random.default_rng(0)
  train = {e.prompt for e in task.sample(rng, 3000, "train")}
  evals = {e.prompt for e in task.sample(rng, 3000, "eval")}
  assert train | evals == {f"{a}+{b}=" for a, b in itertools.product(range(10), repeat=2)}
  assert not train & evals
  assert 10 <= len(evals) <= 60
  for p in evals:
    a, b = p[:-1].split("+")
    assert f"{b}+{a}=" in evals


def test_split_ignores_size_knobs_and_nests():
  small, large = AdditionTask(num_digits=2), AdditionTask(num_digits=3, min_digits=2)
  for e in small.sample(np.random.default_rng(0), 300, "eval"):
    if len(str(e.metadata["a"])) == 2 and len(str(e.metadata["b"])) == 2:
      assert large.split_of(e) == "eval"
  keys = [f"k{i}" for i in range(2000)]
  eval_05 = {k for k in keys if splits.split_of(k, 0.05) == "eval"}
  eval_20 = {k for k in keys if splits.split_of(k, 0.2) == "eval"}
  assert eval_05 < eval_20
  assert 0.1 < len(eval_20) / len(keys) < 0.3


def test_empty_split_raises():
  pairs = {tuple(sorted(p)) for p in itertools.product(range(10), repeat=2)}
  smallest = min(splits.hash_unit(f"addition|{a}+{b}") for a, b in pairs)
  task = AdditionTask(num_digits=1, eval_fraction=smallest / 2)  # below every key: eval is empty
  with pytest.raises(ValueError, match="problem space is too small"):
    task.sample(np.random.default_rng(0), 1, "eval")
