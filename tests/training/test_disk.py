"""The workdir's disk, checked before anything is compiled: a read-only filesystem and one with
too little free space for the run's checkpoints are refused in one line (real small tmpfs mounts;
the full-disk-mid-run case is in test_resume_kill.py)."""
import os

import pytest
import small_fs
import tiny

from lowrl.training import loop
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
