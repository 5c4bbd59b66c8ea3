"""How a binary ends on an expected failure: one line on stderr and an exit status, no traceback.

The statuses (docs/integrity.md): 2 a config or workdir problem found before compiling; 1 a
failure mid-run (a damaged checkpoint, a full disk, repeated non-finite updates); 75 stopped by
SIGTERM/SIGINT after checkpointing (re-run to resume); 128+N a second signal N
(lowrl.training.preemption exits on its own).

Nothing may print after the line. Python's exit runs its exit hooks (which shut the thread pools
down) before it joins the threads still running, so a library thread still at work then (orbax's
save or clean-up threads, a writer's executor) fails with `cannot schedule new futures after
interpreter shutdown` and prints a traceback. A refusal (status 2) therefore joins the live
threads first and exits normally; a mid-run failure or a preemption, after which the loop has
waited for its saves and flushed its logs, leaves at once (os._exit): a failed save's threads may
still be failing (a full disk's, `lowrl.training.disk`).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Iterator, NoReturn

from lowrl import grid
from lowrl.training import disk, loop, preemption, run_config
from lowrl.training.checkpointing import CheckpointError
from lowrl.training.run_logs import WorkdirError

USAGE = 2  # a config or workdir problem, found before compiling
FAILED = 1  # a failure mid-run


def join_background_threads() -> None:
  """Waits for every live non-daemon thread but the caller's and the main one (what the
  interpreter's exit waits for anyway, but here before its exit hooks shut the pools down)."""
  skip = {threading.current_thread(), threading.main_thread()}
  while True:
    live = [t for t in threading.enumerate() if t not in skip and not t.daemon and t.is_alive()]
    if not live:
      return
    for t in live:  # a thread may start another before it ends: look again
      t.join()


def exit_with_line(line: str, status: int) -> NoReturn:
  """Prints `line` on stderr and exits with `status` once the background threads are done."""
  print(line, file=sys.stderr, flush=True)
  sys.stdout.flush()
  join_background_threads()
  sys.exit(status)


def exit_now(line: str, status: int) -> NoReturn:
  """Prints `line` on stderr and leaves at once: no exit hooks, no thread joined (the caller has
  waited for what must finish)."""
  print(line, file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(status)


def error_line(message: str) -> str:
  """`error: message` on one line."""
  return f"error: {' '.join(message.split())}"


@contextlib.contextmanager
def one_line_exits() -> Iterator[None]:
  """For a binary's whole run (`loop.run`, a grid of them): each expected failure becomes its
  line and status (the module docstring); background threads' reports of a full disk are dropped
  until the process exits (`disk.one_line_when_full`: a failed save's writes in flight end after
  the run). Anything else is a bug and keeps its traceback."""
  with disk.one_line_when_full():
    try:
      yield
    except (run_config.ConfigError, WorkdirError, grid.ResultsFileError) as e:
      exit_with_line(error_line(str(e)), USAGE)
    except preemption.Preempted as e:
      exit_now(f"[signal] {e}", preemption.EXIT_PREEMPTED)
    except (CheckpointError, loop.NonFiniteError, disk.DiskFullError) as e:
      exit_now(f"error: {e}", FAILED)
