"""One live run per workdir: an exclusive lock on `<workdir>/.lowrl.lock`, held for the run.

The lock is the kernel's (fcntl.flock on the open file): it goes away with the process that held
it, however it died, so a lock left by a killed run is never mistaken for a live one. The file
also records the holder (pid, host, start time) so a refused second process can name it, and a
run that finds a record but no lock says it took over a stale one. The file is emptied, never
deleted, on release: deleting it would let two processes lock two different files of one name.
Only process 0 of a multi-process run takes it.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from lowrl.training.run_logs import WorkdirError

LOCK_FILE = ".lowrl.lock"


class WorkdirLock:
  """Context manager: holds the workdir's lock, or raises WorkdirError naming the holder."""

  def __init__(self, workdir: str, log=print):
    self.path = os.path.join(workdir, LOCK_FILE)
    self.log = log
    self._fd: int | None = None

  def __enter__(self) -> "WorkdirLock":
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _describe(_read(fd))
      os.close(fd)
      raise WorkdirError(
          f"{os.path.dirname(self.path)} is in use by another run ({holder}); wait for it to "
          f"finish or stop it, or use another --workdir (lock file {self.path}).") from None
    stale = _read(fd)
    if stale:
      self.log(f"[lock] took over the lock of a run that is no longer running "
               f"({_describe(stale)}).")
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                              "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
    self._fd = fd
    return self

  def __exit__(self, *exc) -> None:
    if self._fd is not None:
      try:
        os.ftruncate(self._fd, 0)
      except OSError:  # e.g. a full disk: the kernel's lock still goes with the descriptor
        pass
      os.close(self._fd)  # releases the flock
      self._fd = None


def _read(fd: int) -> dict | None:
  data = os.pread(fd, 4096, 0)
  if not data:
    return None
  try:
    return json.loads(data)
  except ValueError:
    return {"record": data[:80].decode(errors="replace")}


def _describe(rec: dict | None) -> str:
  if not rec:
    return "holder unknown"
  if "pid" in rec:
    return f"pid {rec['pid']} on host {rec.get('host', '?')}, started {rec.get('started', '?')}"
  return f"record {rec.get('record')!r}"
