"""The task registry (lowrl.tasks.registry): names, construction, unknown names and kwargs."""

import pytest

from lowrl.tasks.base import Task
from lowrl.tasks.countdown import CountdownTask
from lowrl.tasks.registry import TASKS, make_task, task_names

PROCEDURAL = ["addition", "sorting", "reversal", "countdown"]


def test_registry():
  assert task_names() == ["addition", "countdown", "jsonl", "reversal", "runlength", "sorting"]
  for name in PROCEDURAL:
    task = make_task(name)
    assert isinstance(task, TASKS[name]) and isinstance(task, Task) and task.name == name
  assert make_task("addition", num_digits=5).num_digits == 5
  assert isinstance(make_task("countdown", num_numbers=4), CountdownTask)
  with pytest.raises(ValueError, match=r"Unknown task 'mult'; valid tasks are \['addition', 'count"):
    make_task("mult")
  with pytest.raises(ValueError, match=r"does not take \['digits'\]; it accepts \['num_digits'"):
    make_task("addition", digits=3)
