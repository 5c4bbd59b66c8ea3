"""Addition (lowrl.tasks.addition): rewards, the reversed-answer variant, lengths."""

import numpy as np
import pytest

from lowrl.tasks.addition import AdditionTask
from lowrl.tasks.base import Example


def _add(a, b, reverse=False):
  s = str(a + b)
  return Example(f"{a}+{b}=", s[::-1] if reverse else s, {"a": a, "b": b})


@pytest.mark.parametrize("completion,expected", [
    ("357", 1.0), (" 357\n", 1.0), ("357 ", 1.0),
    ("3 57", 0.0), ("0357", 0.0), ("+357", 0.0), ("357 is the answer", 0.0), ("357=", 0.0),
    ("358", 0.0), ("753", 0.0), ("", 0.0), ("three hundred", 0.0)])
def test_addition_reward(completion, expected):
  assert AdditionTask().reward(completion, _add(12, 345)) == expected


def test_addition_reversed_answer_and_partial_credit():
  task = AdditionTask(reverse_answer=True)
  ex = _add(12, 345, reverse=True)
  assert ex.answer == "753"
  assert task.reward("753", ex) == 1.0 and task.reward("357", ex) == 0.0
  # Partial credit is aligned at the units digit in both layouts.
  assert task.partial_reward("752", ex) == pytest.approx(2 / 3)
  plain = AdditionTask()
  assert plain.partial_reward("257", _add(12, 345)) == pytest.approx(2 / 3)
  assert plain.partial_reward("57", _add(12, 345)) == pytest.approx(2 / 3)  # dropped leading digit
  assert plain.partial_reward("1357", _add(12, 345)) == pytest.approx(3 / 4)  # extra digit costs
  assert plain.partial_reward("357", _add(12, 345)) == 1.0
  assert plain.partial_reward("abc", _add(12, 345)) == 0.0


def test_addition_sampling_covers_lengths():
  exs = AdditionTask(num_digits=4).sample(np.random.default_rng(0), 400)
  lengths = {len(str(e.metadata["a"])) for e in exs}
  assert lengths == {1, 2, 3, 4}
  for e in exs:
    a, b = e.metadata["a"], e.metadata["b"]
    assert e.prompt == f"{a}+{b}=" and int(e.answer) == a + b
