"""SIGTERM / SIGINT during a run: stop at the next step boundary with everything saved.

A cluster scheduler (or a TPU preemption notice) sends SIGTERM first and SIGKILL a grace period
later; Ctrl-C sends SIGINT. The first signal only sets a flag: the loop finishes the step it is in,
checkpoints it (whatever `checkpoint_every` says), waits for the save and its manifest, flushes
the logs and raises `Preempted`; the binary prints one line and exits with `EXIT_PREEMPTED`.
Re-running the same command resumes from that step. With several processes, process 0's signal
decides (broadcast each step), so all stop at the same step. A second signal exits at once
(status 128 + signal number, as the shell reports a signal death) without waiting for anything:
a save in flight is then lost (orbax never commits half a checkpoint), earlier ones are intact.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

import jax
import numpy as np

from lowrl import distributed

# 75 is EX_TEMPFAIL (sysexits.h): "try again later", what a requeue wrapper looks for.
EXIT_PREEMPTED = 75
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
  """The run stopped on a signal after checkpointing step `step` (re-run to resume)."""

  def __init__(self, signame: str, step: int | None, workdir: str):
    self.signame, self.step = signame, step
    where = (f"checkpointed step {step}" if step is not None else
             "before the first RL step (nothing new to checkpoint)")
    super().__init__(f"stopped on {signame}: {where} in {workdir}; re-run the same command to "
                     "resume.")


class StopFlag:
  """Set by the first SIGTERM/SIGINT; read by the loop at step boundaries."""

  def __init__(self):
    self.signame: str | None = None

  def __bool__(self) -> bool:
    return self.signame is not None


def agreed(flag: "StopFlag | None") -> bool:
  """Whether to stop now: the flag, or with several processes process 0's flag, broadcast (every
  process must stop at the same step: the checkpoint is collective)."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(distributed.broadcast_from_primary(np.array(bool(flag))))


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
  """Installs the handlers for the block (main thread only; elsewhere the flag never sets) and
  restores the previous ones after it. The handlers write with os.write: a print from a handler
  that interrupted a print raises (a buffered stream is not reentrant)."""
  flag = StopFlag()
  if threading.current_thread() is not threading.main_thread():
    yield flag
    return

  def handle(signum, frame):
    del frame
    name = signal.Signals(signum).name
    if flag:
      # Straight to the OS: no cleanup, no atexit (orbax's threads must not run on).
      os.write(2, f"[signal] second {name}: exiting now, without waiting for the save in "
                  "flight.\n".encode())
      os._exit(128 + signum)
    flag.signame = name
    os.write(1, f"[signal] {name}: finishing this step, then checkpointing it and exiting "
                "(send it again to exit at once).\n".encode())

  previous = {s: signal.signal(s, handle) for s in _SIGNALS}
  try:
    yield flag
  finally:
    for s, h in previous.items():
      signal.signal(s, h)
    sys.stdout.flush()
