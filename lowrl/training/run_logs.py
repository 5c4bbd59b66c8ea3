"""The run's log files in its workdir: metrics.jsonl lines, resume trimming, moving old logs aside.

Logs are never overwritten silently: a run that starts from step 0 in a workdir holding logs of
an earlier attempt (no intact checkpoint to resume from) moves them to `<workdir>/previous/<k>/`
and says so.
"""
from __future__ import annotations

import contextvars
import functools
import json
import math
import os
import shutil
import time
from typing import Any, Callable

from lowrl.training.checkpointing import MANIFEST, read_meta, verify_manifest

METRICS = "metrics.jsonl"
EVAL_START = "eval_start.json"
SUMMARY = "summary.json"
TB_DIR = "tb"
EVAL_START_FIX = ("it holds the step-0 evaluation a resume reports: restore it, or start afresh in "
                  "a new --workdir.")
_LOG_FILES = (METRICS, EVAL_START, SUMMARY, TB_DIR, "config.json")


class WorkdirError(RuntimeError):
  """The workdir cannot be used as it is (a damaged bookkeeping file, another run holding it,
  no write access or space); raised before anything is compiled, the message names the fix and
  nothing was overwritten."""


def metrics_line(step: int, metrics: dict[str, float]) -> str:
  """One JSON line; non-finite values are written as null (bare NaN is not JSON)."""
  def value(v):
    v = float(v)
    return round(v, 6) if math.isfinite(v) else None
  return json.dumps({"step": step, **{k: value(v) for k, v in metrics.items()}}, allow_nan=False)


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """The complete lines of metrics.jsonl (a line cut short by a kill is dropped); WorkdirError
  naming the line for one that is not a JSON object with a step, or whose step does not
  increase."""
  path = os.path.join(workdir, METRICS)
  if not os.path.exists(path):
    return []
  out = []
  with open(path, errors="replace") as f:
    for n, line in enumerate(f, 1):
      if not line.endswith("\n"):
        continue
      try:
        m = json.loads(line)
        int(m["step"])
      except (ValueError, KeyError, TypeError):
        raise WorkdirError(
            f"{path} line {n} is not a metrics line ({line.strip()[:60]!r}); delete that line "
            "(the lines after the resumed checkpoint are rewritten), or start afresh in a new "
            "--workdir.") from None
      if out and m["step"] <= out[-1]["step"]:  # two writers, or pasted lines
        raise WorkdirError(
            f"{path} line {n} is step {m['step']} after step {out[-1]['step']} (steps must "
            "increase); delete the repeated lines, or start afresh in a new --workdir.")
      out.append(m)
  return out


def read_json(workdir: str, name: str, fix: str) -> Any:
  """A JSON bookkeeping file of the workdir; WorkdirError naming it and `fix` if it is missing
  or unreadable (the file is left as it is)."""
  path = os.path.join(workdir, name)
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    problem = "is missing"
  except (OSError, ValueError) as e:
    problem = f"is unreadable ({type(e).__name__}: {str(e)[:80]})"
  raise WorkdirError(f"{path} {problem}; {fix}")


def check_resumable(workdir: str) -> None:
  """The files a resume reads, checked before anything is compiled (WorkdirError if damaged)."""
  read_metrics(workdir)
  read_json(workdir, EVAL_START, EVAL_START_FIX)


def trim_metrics(workdir: str, last_step: int) -> None:
  """Keeps the lines of steps <= `last_step` (those after the resumed checkpoint run again)."""
  path = os.path.join(workdir, METRICS)
  if os.path.exists(path):
    kept = [m for m in read_metrics(workdir) if m["step"] <= last_step]
    with open(path + ".tmp", "w") as f:
      f.writelines(json.dumps(m) + "\n" for m in kept)
    os.replace(path + ".tmp", path)


def has_logs(workdir: str) -> bool:
  """Whether `workdir` holds logs of an earlier run (an empty metrics.jsonl does not count)."""
  for name in _LOG_FILES:
    path = os.path.join(workdir, name)
    if os.path.isdir(path) and os.listdir(path):
      return True
    if os.path.isfile(path) and os.path.getsize(path) > 0:
      return True
  return False


def move_aside(workdir: str) -> str:
  """Moves the log files of an earlier attempt to `<workdir>/previous/<k>/`; returns that dir."""
  k = 0
  while os.path.exists(os.path.join(workdir, "previous", str(k))):
    k += 1
  dest = os.path.join(workdir, "previous", str(k))
  os.makedirs(dest)
  for name in _LOG_FILES:
    if os.path.exists(os.path.join(workdir, name)):
      shutil.move(os.path.join(workdir, name), os.path.join(dest, name))
  return dest


def remove_temp_files(workdir: str) -> list[str]:
  """Deletes the `<file>.tmp` of the bookkeeping files (written as temp file + rename) that a
  kill mid-write left; returns their names. Only for the run holding the workdir's lock, their
  only writer."""
  removed = []
  for name in (METRICS, EVAL_START, SUMMARY, "config.json"):
    try:
      os.remove(os.path.join(workdir, name + ".tmp"))
    except FileNotFoundError:
      continue
    removed.append(name + ".tmp")
  return removed


def write_json(workdir: str, name: str, obj: Any) -> None:
  """Writes `obj` atomically (temp file + rename): a kill leaves the old file or the new one."""
  path = os.path.join(workdir, name)
  with open(path + ".tmp", "w") as f:
    json.dump(obj, f, indent=2)
  os.replace(path + ".tmp", path)


def finished_summary(workdir: str, steps: int) -> dict[str, Any] | None:
  """The summary of a run of `steps` steps that already finished in `workdir` (its newest
  checkpoint is the verified end, summary.json is there); reads only, so it also works in a
  read-only workdir. WorkdirError for a summary.json that cannot be read."""
  ckpt_dir = os.path.join(workdir, "checkpoints")
  done = [int(d) for d in os.listdir(ckpt_dir) if d.isdigit()] if os.path.isdir(ckpt_dir) else []
  if not done or max(done) != steps or not os.path.exists(os.path.join(workdir, SUMMARY)):
    return None
  end = os.path.join(ckpt_dir, str(steps))
  problem = verify_manifest(end)
  # A damaged end resumes; one without a manifest (saved before checksums) counts as finished
  # when its record says it is the end (else every re-run would evaluate it again).
  if problem is not None and not (problem.startswith(f"no {MANIFEST}")
                                  and (read_meta(end) or {}).get("step") == steps):
    return None
  fix = "move it aside and re-run: the final evaluation of the finished run runs again and " \
        "rewrites it."
  summary = read_json(workdir, SUMMARY, fix)
  if not isinstance(summary, dict) or "eval_end" not in summary:
    raise WorkdirError(f"{os.path.join(workdir, SUMMARY)} is not a run summary; {fix}")
  return summary


# The run's one clock: the `elapsed` of the [sft] and [rl] progress lines and the final line's
# count seconds from the start of `loop.run` (set there by `run_clock`), so they add up.
_RUN_START: contextvars.ContextVar[float | None] = contextvars.ContextVar("lowrl_run_start",
                                                                         default=None)


def run_clock(fn: Callable[..., Any]) -> Callable[..., Any]:
  """Decorates a run's entry point: during the call, `run_started()` is its start time."""
  @functools.wraps(fn)
  def timed(*args, **kwargs):
    token = _RUN_START.set(time.time())
    try:
      return fn(*args, **kwargs)
    finally:
      _RUN_START.reset(token)
  return timed


def run_started() -> float | None:
  """time.time() at the start of the run in progress (None outside `run_clock`)."""
  return _RUN_START.get()


class Eta:
  """Remaining-time estimate from steady-state step times (the first step, which compiles,
  is left out). `elapsed` counts from the run's start inside a run (`run_clock`), else from
  the Eta's creation (or always from there with a `clock` of its own)."""

  def __init__(self, total: int, start: int = 0, clock: Callable[[], float] | None = None):
    self.total, self.clock = total, clock or time.time
    started = run_started() if clock is None else None
    self.t0 = self.clock() if started is None else started
    self._first: tuple[int, float] | None = None  # (step, time) after the first timed step

  def update(self, done: int) -> str:
    """Call after step `done`; returns e.g. 'elapsed 12s eta 30s' ('eta ?' until known)."""
    now = self.clock()
    text = f"elapsed {now - self.t0:.0f}s"
    if self._first is None:
      self._first = (done, now)
      return text + " eta ?"
    steps = done - self._first[0]
    if steps <= 0:
      return text + " eta ?"
    per_step = (now - self._first[1]) / steps
    return text + f" eta {per_step * (self.total - done):.0f}s"
