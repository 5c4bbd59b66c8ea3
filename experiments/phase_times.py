r"""An RL run of experiments/train.py with the wall time of each phase of every step recorded.

  python -m experiments.phase_times --phase_out=/tmp/phases.json -- \
      --config=configs/smollm2.py --workdir=/tmp/smollm2

Everything after `--` is experiments.train's command line; the run is that binary's, unchanged,
except that `Trainer.rollout` (sampling, the trainer's scoring, rewards on the host),
`Trainer.score` (the trainer's scoring passes inside it), the jitted RL step (`Trainer.step`:
batch, drift, update) and `Trainer.evaluate` wait for their results before returning, so each
call's wall time is its own (a run otherwise overlaps dispatch with the host's work; the
difference is the host's share, small next to a step here). Written to --phase_out after every
call: per call the phase and its seconds, in order, and per phase the median over its calls
after the first (the first compiles).
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable

import jax
import numpy as np

from lowrl.training import trainer as trainer_mod

_OUT_FLAG = "--phase_out="


def _summary(calls: list[tuple[str, float]]) -> dict[str, Any]:
  out = {}
  for phase in dict.fromkeys(p for p, _ in calls):
    t = [s for p, s in calls if p == phase]
    later = t[1:] or t
    out[phase] = {"calls": len(t), "first_s": t[0], "median_after_first_s":
                  float(np.median(later)), "min_s": float(min(later)), "max_s": float(max(later))}
  return out


def install(path: str) -> list[tuple[str, float]]:
  """Wraps the Trainer's phases (module docstring); returns the list the calls go to."""
  calls: list[tuple[str, float]] = []

  def save():
    with open(path, "w") as fh:
      json.dump({"calls": calls, "phases": _summary(calls)}, fh, indent=1)

  def timed(phase: str, fn: Callable, ready: Callable[[Any], Any] = lambda out: out):
    def wrapper(*args, **kwargs):
      t0 = time.perf_counter()
      out = fn(*args, **kwargs)
      jax.block_until_ready(ready(out))
      calls.append((phase, time.perf_counter() - t0))
      save()
      return out
    return wrapper

  cls = trainer_mod.Trainer
  init = cls.__init__

  def init_timed(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self.step = timed("update", self.step)

  cls.__init__ = init_timed
  cls.rollout = timed("rollout", cls.rollout, ready=lambda out: out[0])
  cls.score = timed("score", cls.score)
  cls.evaluate = timed("evaluate", cls.evaluate, ready=lambda out: None)
  return calls


def main():
  args = sys.argv[1:]
  out = [a for a in args if a.startswith(_OUT_FLAG)]
  if len(out) != 1 or "--" not in args:
    sys.exit(f"usage: python -m experiments.phase_times {_OUT_FLAG}FILE -- <experiments.train "
             "flags>")
  install(out[0][len(_OUT_FLAG):])
  from experiments import train  # after the patch: the loop builds its Trainer from the class
  sys.argv = [sys.argv[0], *args[args.index("--") + 1:]]
  train.run_main()


if __name__ == "__main__":
  main()
