"""The workdir's disk, checked before anything is compiled, and a full disk met mid-run.

Before compiling: the workdir must be writable (one line naming the directory otherwise) and its
filesystem must have room for the checkpoints the run still has to write (the loop's count).
Mid-run, a write that fails for lack of space (orbax's background save, metrics.jsonl, a JSON
file) stops the run with one line (`DiskFullError`); checkpoints already committed are intact,
since orbax writes into a tmp directory and renames it only when complete.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator

import numpy as np

from lowrl.training.checkpointing import verify_manifest
from lowrl.training.run_logs import WorkdirError

# Room for the log files besides the checkpoints (metrics.jsonl, TensorBoard, JSON files).
LOG_SLACK = 1 << 20
NEARLY_FULL = 64 << 10
_NO_SPACE = ("No space left on device", "ENOSPC", "Disk quota exceeded")


class DiskFullError(RuntimeError):
  """The workdir's disk filled up during the run; the message names what was kept."""


def needed_bytes(num_params: int, ckpt_dir: str, *, master_dtype: str,
                 reference_storage: str | None, version_storage: str, versions: int) -> int:
  """Free bytes a run needs: the checkpoints it holds at once (2 kept + 1 in flight) less those
  already in `ckpt_dir`, plus the logs. A checkpoint: the params (`master_dtype`), Adam's two FP32
  moments, the reference (stored as `reference_storage`; None = no reference) and `versions`
  parameter copies of the schedule (stored as `version_storage`)."""
  def size(storage: str) -> int:
    return 2 if storage == "bfloat16" else np.dtype(master_dtype).itemsize
  per_param = size("param") + 8
  if reference_storage is not None:
    per_param += size(reference_storage)
  per_param += versions * size(version_storage)
  kept = len([d for d in os.listdir(ckpt_dir) if d.isdigit()]) if os.path.isdir(ckpt_dir) else 0
  return num_params * per_param * max(1, 3 - kept) + LOG_SLACK


def check_workdir(workdir: str, need_bytes: int) -> None:
  """Raises WorkdirError (one line) if `workdir` cannot be created or written, or its disk has
  less than `need_bytes` free."""
  try:
    os.makedirs(workdir, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=workdir, prefix=".lowrl-write-test-"):
      pass
  except OSError as e:
    raise WorkdirError(f"--workdir={workdir} is not writable ({e.strerror or e}); fix its "
                       "permissions or use another --workdir.") from None
  free = shutil.disk_usage(workdir).free
  if free < need_bytes:
    raise WorkdirError(
        f"--workdir={workdir}: its disk has {_mb(free)} free but the run's checkpoints need "
        f"about {_mb(need_bytes)}; free space, or use a --workdir on a larger disk.")


def writable(workdir: str) -> bool:
  """Whether `workdir` (or, when it does not exist yet, its nearest existing parent) is
  writable by this process."""
  path = os.path.abspath(workdir)
  while not os.path.exists(path) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  return os.access(path, os.W_OK | os.X_OK)


def full_message(workdir: str, ckpt_dir: str) -> str:
  """The one line a run stopped by a full disk ends with: what is free, what was kept."""
  steps = (sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())
           if os.path.isdir(ckpt_dir) else [])
  intact = [s for s in steps if verify_manifest(os.path.join(ckpt_dir, str(s))) is None]
  kept = (f"the intact checkpoints (steps {intact}) are kept; re-run the same command to resume "
          f"from step {intact[-1]}" if intact else "no checkpoint had been completed yet")
  return (f"the disk of --workdir={workdir} is full ({_mb(shutil.disk_usage(workdir).free)} "
          f"free): the run stopped; {kept} once space is freed (or move the workdir to a "
          "larger disk).")


def is_disk_full(exc: BaseException, workdir: str | None = None) -> bool:
  """Whether `exc` (or an exception it was raised from) is a write that found no space: an
  OSError ENOSPC/EDQUOT, or a library's error whose text says so (orbax wraps tensorstore's);
  or, with `workdir`, an OSError while its disk has less than NEARLY_FULL free (a library whose
  error names only the failed write, not its cause)."""
  if (workdir is not None and isinstance(exc, OSError) and os.path.isdir(workdir)
      and shutil.disk_usage(workdir).free < NEARLY_FULL):
    return True
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
      return True
    if any(s in str(exc) for s in _NO_SPACE):
      return True
    exc = exc.__cause__ or exc.__context__
  return False


def _mb(n: float) -> str:
  return f"{n / 2**20:.1f} MiB"


def _abandoned_loop(exc: BaseException) -> bool:
  """Whether `exc` is a late result's delivery to an event loop already closed: orbax runs a save
  in a fresh loop awaiting tensorstore writes (and `asyncio.to_thread` jobs); when one write
  fails (a full disk) the save fails and its loop is closed while the other writes still run.
  Each that ends then calls the closed loop's `call_soon_threadsafe` from its done-callback:
  tensorstore reports the RuntimeError through `sys.unraisablehook` (a bare traceback),
  concurrent.futures through logging. It says nothing of its own: the save's failure is reported
  where it is waited for."""
  return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


def _dropped(exc: BaseException | None) -> bool:
  """Whether a background report of `exc` is dropped during a run (the loop reports it once)."""
  return exc is not None and (is_disk_full(exc) or _abandoned_loop(exc))


class _DropDiskFull(logging.Filter):
  """Drops log records of failed writes for lack of space (orbax logs each of its background
  threads' with a traceback), and of late results sent to a failed save's closed event loop."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (any(s in record.getMessage() for s in _NO_SPACE)
                or _dropped(record.exc_info[1] if record.exc_info else None))


@contextlib.contextmanager
def one_line_when_full() -> Iterator[None]:
  """For the block: background threads' reports of a full disk (log records, uncaught thread
  exceptions, unraisable exceptions) and of a failed save's closed event loop are dropped; the
  loop reports the full disk once (DiskFullError). Other errors pass."""
  handlers, drop = logging.getLogger().handlers, _DropDiskFull()
  for h in handlers:
    h.addFilter(drop)
  previous, previous_unraisable = threading.excepthook, sys.unraisablehook

  def hook(args):
    if not _dropped(args.exc_value):
      previous(args)

  def unraisable_hook(args):
    if not _dropped(args.exc_value):
      previous_unraisable(args)

  threading.excepthook, sys.unraisablehook = hook, unraisable_hook
  try:
    yield
  finally:
    threading.excepthook, sys.unraisablehook = previous, previous_unraisable
    for h in handlers:
      h.removeFilter(drop)
