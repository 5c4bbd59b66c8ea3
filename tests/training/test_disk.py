"""The workdir's disk, checked before anything is compiled: a read-only filesystem and one with
too little free space for the run's checkpoints are refused in one line (real small tmpfs mounts;
the full-disk-mid-run case is in test_resume_kill.py); during a run, a failed save's late
reports are dropped."""
import asyncio
import concurrent.futures
import logging
import os
import sys

import pytest
import small_fs
import tensorstore as ts
import tiny

from lowrl.training import disk, loop
from lowrl.training.run_logs import WorkdirError


def test_a_read_only_workdir_is_refused_in_one_line(tmp_path):
  with small_fs.tmpfs(str(tmp_path / "ro"), "1m") as mnt:
    small_fs.remount_read_only(mnt)
    with pytest.raises(WorkdirError) as e:
      loop.run(tiny.loop_config("fp32", str(tmp_path / "base")), os.path.join(mnt, "run"),
               log=lambda _: None)
  msg = str(e.value)
  assert msg.startswith(f"--workdir={mnt}/run is not writable (Read-only file system)"), msg
  assert "\n" not in msg


def test_too_little_free_disk_for_the_checkpoints_is_refused_in_one_line(tmp_path):
  cfg = tiny.loop_config("fp32", str(tmp_path / "base"))
  with small_fs.tmpfs(str(tmp_path / "small"), "64k") as mnt:
    with pytest.raises(WorkdirError) as e:
      loop.run(cfg, os.path.join(mnt, "run"), log=lambda _: None)
    assert os.listdir(os.path.join(mnt, "run")) == []  # nothing written, nothing compiled
  msg = str(e.value)
  # 3 checkpoints (2 kept + 1 in flight) of 21,760 FP32 params with Adam's moments, + 1 MiB
  assert "free but the run's checkpoints need about 1.7 MiB" in msg and "\n" not in msg, msg


class _Records(logging.Handler):
  def __init__(self):
    super().__init__()
    self.records = []

  def emit(self, record):
    self.records.append(record)


def _late_writes_to_a_closed_loop() -> None:
  """What a failed orbax save's writes still in flight do when they end: the save's loop is
  closed, and each write's done-callback calls its `call_soon_threadsafe`. A tensorstore write
  reports the RuntimeError as unraisable; an `asyncio.to_thread` job that found the loop still
  open just before (asyncio.futures checks `is_closed()` first) is logged by concurrent.futures."""
  promise, write = ts.Promise.new()
  loop_ = asyncio.new_event_loop()

  async def save():
    next(write.__await__())  # awaited (its callback holds the loop), then the save fails
    raise OSError(28, "No space left on device")

  with pytest.raises(OSError):
    loop_.run_until_complete(save())
  loop_.close()
  promise.set_result(None)
  job = concurrent.futures.Future()
  job.add_done_callback(lambda _: loop_.call_soon_threadsafe(lambda: None))
  job.set_exception(OSError(28, "No space left on device"))


def test_a_failed_saves_late_writes_to_its_closed_event_loop_are_not_reported_during_a_run(
    monkeypatch):
  records, unraisable = _Records(), []
  monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(u.exc_value))
  logging.getLogger().addHandler(records)
  try:
    with disk.one_line_when_full():
      _late_writes_to_a_closed_loop()
    assert records.records == [] and unraisable == []
    _late_writes_to_a_closed_loop()  # outside a run they are reported as before
    assert [str(r.exc_info[1]) for r in records.records] == ["Event loop is closed"]
    assert [str(e) for e in unraisable] == ["Event loop is closed"]
  finally:
    logging.getLogger().removeHandler(records)
