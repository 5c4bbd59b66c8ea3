"""A resumable grid: jobs -> one results JSONL line per finished job.

The ablation (experiments/ablate.py: settings x seeds of the training loop) and a simulator sweep
(settings, all seeds in one program) are the same bookkeeping: a list of jobs, each named by a
key (e.g. {"setting": "bf16", "seed": 0}) and carrying the fingerprint of its config; a job whose
key already has a complete line is skipped; a line whose fingerprint differs from the job's is an
error (a changed config is never mixed with old results silently); an interrupted write leaves a
cut-short last line that is dropped and rewritten. `run` does the work of one job and returns its
numbers; the line is {**key, "fingerprint": ..., **numbers}.

A leaf module (imports nothing from lowrl): the job's work is the caller's.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

Log = Callable[[str], None]


class ResultsFileError(ValueError):
  """The results file cannot be used as it is (a line not JSON, a line of another config); the
  message names the file and the fix. A binary reports it in one line."""


@dataclasses.dataclass(frozen=True)
class Job:
  """One point of a grid: `key` names its line, `fingerprint` its config; `payload` is whatever
  the runner needs (a setting, a config)."""

  key: tuple[tuple[str, Any], ...]
  fingerprint: str
  payload: Any = None

  @staticmethod
  def of(key: Mapping[str, Any], fingerprint: str, payload: Any = None) -> "Job":
    """A Job from a key dict (its order is the line's field order)."""
    return Job(tuple(key.items()), fingerprint, payload)

  @property
  def label(self) -> str:
    return " ".join(f"{k}={v}" for k, v in self.key)


def _key_of(row: Mapping[str, Any], fields: Iterable[str]) -> tuple[tuple[str, Any], ...]:
  return tuple((f, row[f]) for f in fields)


def read_results(path: str) -> list[dict[str, Any]]:
  """The complete lines of a results JSONL (a last line cut short by a kill is dropped; a
  complete line that is not JSON is an error naming the file)."""
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for i, line in enumerate(f, 1):
      if not line.endswith("\n"):
        break
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError as e:
        raise ResultsFileError(f"{path} line {i} is not JSON ({e.msg}); repair or delete that "
                               "line (its job then runs again).") from None
  return out


def append_line(path: str, row: Mapping[str, Any]) -> None:
  """Appends one line and syncs it to disk (a finished job is never lost to a later crash)."""
  with open(path, "a") as f:
    f.write(json.dumps(row) + "\n")
    f.flush()
    os.fsync(f.fileno())


_AFRESH = "use a new workdir or delete that file to start afresh."


def check_done(jobs: Sequence[Job], done: Mapping[tuple, Mapping[str, Any]], path: str, *,
               fix: str = _AFRESH) -> None:
  """Raises ValueError when two jobs share a key, ResultsFileError when a finished line's
  fingerprint is not its job's (before anything runs); `fix` ends the latter's message."""
  seen = set()
  for j in jobs:
    if j.key in seen:
      raise ValueError(f"two jobs of the grid are named {j.label}; names must be unique")
    seen.add(j.key)
    prev = done.get(j.key)
    if prev is not None and prev.get("fingerprint") != j.fingerprint:
      raise ResultsFileError(f"{path} holds {j.label} from another config (fingerprint "
                       f"{prev.get('fingerprint')} != {j.fingerprint}); {fix}")


def _fields(jobs: Sequence[Job]) -> list[str]:
  if not jobs:
    raise ValueError("the grid is empty")
  fields = [k for k, _ in jobs[0].key]
  if any([k for k, _ in j.key] != fields for j in jobs):
    raise ValueError(f"every job's key must have the fields {fields}")
  return fields


def finished(jobs: Sequence[Job], path: str, *, fix: str = _AFRESH
             ) -> dict[tuple[tuple[str, Any], ...], dict[str, Any]]:
  """The complete lines of `path` that finish a job of `jobs`, by job key, checked as `run`
  checks them (check_done): for a report of a grid still running or cut short."""
  fields = _fields(jobs)
  done = {_key_of(r, fields): r for r in read_results(path) if all(f in r for f in fields)}
  check_done(jobs, done, path, fix=fix)
  keys = {j.key for j in jobs}
  return {k: r for k, r in done.items() if k in keys}


def run(jobs: Sequence[Job], path: str, work: Callable[[Job], Mapping[str, Any]], *,
        log: Log = print, tag: str = "grid") -> list[dict[str, Any]]:
  """Runs every job of `jobs` without a line in `path` (JSONL), appending a line per finished
  job; returns the lines of all `jobs`, in job order (lines of jobs no longer in the grid stay in
  the file and are not returned)."""
  fields = _fields(jobs)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  lines = read_results(path)
  done = {_key_of(r, fields): r for r in lines if all(f in r for f in fields)}
  check_done(jobs, done, path)
  # Rewrite the file from its complete lines: a cut-short line must not prefix the next one.
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in lines)
  todo = [j for j in jobs if j.key not in done]
  log(f"[{tag}] {len(jobs)} jobs, {len(jobs) - len(todo)} already done, {len(todo)} to run "
      f"-> {path}")
  t0 = time.time()
  for i, j in enumerate(todo):
    result = dict(work(j))
    clash = set(result) & ({"fingerprint"} | set(fields))
    if clash:
      raise ValueError(f"job {j.label}: its result may not set {sorted(clash)}")
    row = {**dict(j.key), "fingerprint": j.fingerprint, **result}
    append_line(path, row)
    done[j.key] = row
    elapsed = time.time() - t0
    log(f"[{tag}] {i + 1}/{len(todo)} {j.label} done; elapsed {elapsed:.0f}s, eta "
        f"{elapsed / (i + 1) * (len(todo) - i - 1):.0f}s")
  return [done[j.key] for j in jobs]
