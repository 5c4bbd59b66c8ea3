"""Task registry: make_task(name, **kwargs)."""
from __future__ import annotations

import inspect

from lowrl.tasks.addition import AdditionTask
from lowrl.tasks.base import Task
from lowrl.tasks.countdown import CountdownTask
from lowrl.tasks.jsonl import JsonlTask
from lowrl.tasks.runlength import RunLengthTask
from lowrl.tasks.strings import ReversalTask, SortingTask

TASKS: dict[str, type[Task]] = {
    "addition": AdditionTask,
    "sorting": SortingTask,
    "reversal": ReversalTask,
    "runlength": RunLengthTask,
    "countdown": CountdownTask,
    "jsonl": JsonlTask,
}


def task_names() -> list[str]:
  """Registered task names, sorted."""
  return sorted(TASKS)


def make_task(name: str, **kwargs) -> Task:
  """Builds the task registered as `name` with the given constructor keyword arguments."""
  if name not in TASKS:
    raise ValueError(f"Unknown task {name!r}; valid tasks are {task_names()}.")
  cls = TASKS[name]
  params = inspect.signature(cls.__init__).parameters
  accepted = [p for p in params if p != "self"]
  unknown = sorted(set(kwargs) - set(accepted))
  if unknown:
    raise ValueError(f"Task {name!r} does not take {unknown}; it accepts {accepted}.")
  return cls(**kwargs)
