"""Countdown: verifier strictness, partial credit, generator solvability, config errors."""
import collections

import numpy as np
import pytest

from lowrl.tasks.base import Example
from lowrl.tasks.countdown import FORMAT_CREDIT, CountdownTask
from lowrl.tasks.expressions import parse_expression

TASK = CountdownTask()


def _cd(numbers, target):
  prompt = f"cd:{','.join(map(str, numbers))}>{target}="
  return Example(prompt, "", {"numbers": numbers, "target": target})


@pytest.mark.parametrize("completion,expected", [
    ("3*7+20", 1.0), ("20+7*3", 1.0), (" 20 + 3*7 \n", 1.0), ("(3*7)+20", 1.0),
    ("3*7+20=41", 0.0),        # extra text
    ("the answer is 3*7+20", 0.0),
    ("41", 0.0),               # 41 is not one of the numbers
    ("20+20+1", 0.0),          # 20 reused, 1 not given
    ("3*7*1+20", 0.0),         # 1 not given
    ("3*7+21", 0.0),           # 21 not given
    ("7*7-8", 0.0),
    ("3*7+20+0", 0.0),         # 0 not given
    ("3*7+20-", 0.0), ("3×7+20", 0.0), ("", 0.0)])
def test_countdown_reward(completion, expected):
  assert TASK.reward(completion, _cd([3, 7, 20], 41)) == expected


def test_countdown_duplicates_and_division_by_zero():
  ex = _cd([5, 5, 2, 20], 10)
  assert TASK.reward("5+5", ex) == 1.0  # both 5s given
  assert TASK.reward("2*5", ex) == 1.0  # numbers may go unused
  assert TASK.reward("5+5+5-5", ex) == 0.0  # a third 5 is not given
  assert TASK.reward("20/2", ex) == 1.0
  assert TASK.reward("20/(5-5)+10", ex) == 0.0
  assert TASK.reward("20/(5-5)", ex) == 0.0
  # Exact rational arithmetic: non-integer intermediates are fine, no float rounding.
  assert TASK.reward("5/2*2*5-20+5", _cd([5, 2, 2, 5, 20, 5], 10)) == 1.0


def test_countdown_partial_reward():
  ex = _cd([3, 7, 20], 41)
  assert TASK.partial_reward("3*7+20", ex) == 1.0
  assert TASK.partial_reward("3+7", ex) == FORMAT_CREDIT
  assert TASK.partial_reward("3+3", ex) == 0.0
  assert TASK.partial_reward("3+", ex) == 0.0


@pytest.mark.parametrize("kwargs", [
    {}, {"num_numbers": 4, "max_number": 50}, {"num_numbers": 2, "max_target": 30},
    {"num_numbers": 6, "max_number": 9, "max_target": 999}])
def test_generator_guarantees_solvability(kwargs):
  task = CountdownTask(**kwargs)
  used_sizes = collections.Counter()
  examples = task.sample(np.random.default_rng(0), 300)
  examples += task.sample(np.random.default_rng(1), 30, "eval")
  for e in examples:
    nums, target = e.metadata["numbers"], e.metadata["target"]
    assert len(nums) == task.num_numbers
    assert all(task.min_number <= v <= task.max_number for v in nums)
    assert 1 <= target <= task.max_target and target not in nums
    assert e.prompt == f"cd:{','.join(map(str, nums))}>{target}="
    value, used = parse_expression(e.answer)
    assert value == target and not collections.Counter(used) - collections.Counter(nums)
    assert task.reward(e.answer, e) == 1.0
    used_sizes[len(used)] += 1
  assert set(used_sizes) == set(range(2, task.num_numbers + 1))  # every subset size occurs


def test_split_key_ignores_number_order():
  a, b = _cd([3, 7, 20], 41), _cd([20, 3, 7], 41)
  assert TASK._key(a) == TASK._key(b) and TASK.split_of(a) == TASK.split_of(b)
  assert TASK._key(a) != TASK._key(_cd([3, 7, 20], 40))


def test_countdown_config_errors():
  with pytest.raises(ValueError, match="num_numbers"):
    CountdownTask(num_numbers=1)
  with pytest.raises(ValueError, match="widen max_target"):
    CountdownTask(num_numbers=2, min_number=1, max_number=1, max_target=1)
  with pytest.raises(ValueError, match="min <= max"):
    CountdownTask(min_number=0)
