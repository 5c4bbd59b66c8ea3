"""Sorting and reversal (lowrl.tasks.strings.StringTask): rewards, samples, split keys."""

import numpy as np
import pytest

from lowrl.tasks.base import Example
from lowrl.tasks.strings import ReversalTask, SortingTask


@pytest.mark.parametrize("completion,expected,partial", [
    ("abcd", 1.0, 1.0), ("  abcd\n", 1.0, 1.0), ("abdc", 0.0, 0.5), ("a b c d", 0.0, 1 / 7),
    ("abcdd", 0.0, 0.8), ("abc", 0.0, 0.75), ("dcba", 0.0, 0.0), ("", 0.0, 0.0)])
def test_sorting_reward(completion, expected, partial):
  task = SortingTask()
  ex = Example("sort:dbca=", "abcd", {"items": "dbca"})
  assert task.reward(completion, ex) == expected
  assert task.partial_reward(completion, ex) == pytest.approx(partial)


def test_sorting_samples_are_sorted_with_repeats_allowed():
  exs = SortingTask(alphabet="digits", min_len=5, max_len=5).sample(np.random.default_rng(1), 300)
  for e in exs:
    items = e.metadata["items"]
    assert e.answer == "".join(sorted(items)) and e.prompt == f"sort:{items}="
  assert any(len(set(e.answer)) < 5 for e in exs)


@pytest.mark.parametrize("completion,expected", [
    ("edcba", 1.0), ("edcba\n", 1.0), ("abcde", 0.0), ("edcb", 0.0), ("edcba.", 0.0),
    ("e d c b a", 0.0)])
def test_reversal_reward(completion, expected):
  task = ReversalTask()
  assert task.reward(completion, Example("rev:abcde=", "edcba", {"text": "abcde"})) == expected


def test_reversal_string_and_its_reverse_share_a_split():
  task = ReversalTask()
  for e in task.sample(np.random.default_rng(4), 200, "eval"):
    mirrored = Example(f"rev:{e.answer}=", e.metadata["text"], {"text": e.answer})
    assert task.split_of(mirrored) == "eval"


def test_sorting_permutations_share_a_split():
  task = SortingTask()
  rng = np.random.default_rng(5)
  for e in task.sample(rng, 200, "eval"):
    shuffled = "".join(rng.permutation(list(e.metadata["items"])))
    assert task.split_of(Example(f"sort:{shuffled}=", e.answer, {"items": shuffled})) == "eval"


def test_rewards_batch():
  task = ReversalTask()
  exs = task.sample(np.random.default_rng(0), 3)
  r = task.rewards([exs[0].answer, "zz", exs[2].answer], exs)
  assert r.dtype == np.float32 and r.tolist() == [1.0, 0.0, 1.0]
  with pytest.raises(ValueError, match="one per example"):
    task.rewards(["a"], exs)
