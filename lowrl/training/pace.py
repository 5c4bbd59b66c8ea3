"""The run's pace, logged to TensorBoard at every logged RL step: the learning rate, the step's
wall time and its sampled tokens per second (tags `3_run/*`, lowrl.metrics.layout).

Only TensorBoard gets these: wall times differ between runs, and metrics.jsonl holds what a
resumed or repeated run reproduces bit for bit.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import ml_collections

from lowrl.training import optimizer


class Pace:
  """Times each RL step (`start` before it, `scalars` once its metrics are on the host)."""

  def __init__(self, lr_schedule: Callable[[int], Any], updates_per_step: int, rows: int,
               clock: Callable[[], float] = time.perf_counter):
    """`lr_schedule`: the optimizer's schedule, per update (`Setup.lr_schedule`: the very one the
    Trainer's optimizer follows); `updates_per_step` optimizer updates and `rows` completions per
    RL step."""
    self._clock = clock
    self._updates_per_step = updates_per_step
    self._schedule = lr_schedule
    self._rows = rows
    self._t0: float | None = None

  @classmethod
  def from_config(cls, cfg: ml_collections.ConfigDict,
                  clock: Callable[[], float] = time.perf_counter) -> "Pace":
    """The pace of a run of `cfg` (the schedule rebuilt from its optimizer section)."""
    rl = cfg.rl
    updates = rl.mu * rl.num_minibatches
    return cls(optimizer.make_schedule(cfg.optimizer, rl.steps * updates), updates,
               rl.num_prompts * rl.group_size, clock)

  def start(self) -> None:
    """Marks the start of a step."""
    self._t0 = self._clock()

  def lr(self, step: int) -> float:
    """The learning rate of RL step `step`'s (0-based) first optimizer update."""
    return float(self._schedule(step * self._updates_per_step))

  def scalars(self, step: int, response_length: float) -> dict[str, float]:
    """`run/lr`, `run/step_time_s` (since `start`) and `run/tokens_per_s` (sampled completion
    tokens of the step's rows per second of the step) of RL step `step` (0-based)."""
    if self._t0 is None:
      raise RuntimeError("Pace.scalars before Pace.start")
    dt = max(self._clock() - self._t0, 1e-9)
    return {"run/lr": self.lr(step), "run/step_time_s": dt,
            "run/tokens_per_s": response_length * self._rows / dt}
