"""One live run per workdir: a second process is refused in one line naming the holder, before
anything is compiled; the lock of a process that died is taken over (and said so)."""
import os
import signal
import subprocess
import sys

import pytest
import tiny

from lowrl.training import loop
from lowrl.training.run_logs import WorkdirError
from lowrl.training.workdir_lock import LOCK_FILE, WorkdirLock

_HOLD = ("import sys, time\n"
         "from lowrl.training.workdir_lock import WorkdirLock\n"
         "with WorkdirLock(sys.argv[1]):\n"
         "  print('held', flush=True)\n"
         "  time.sleep(600)\n")


def test_a_second_process_is_refused_and_a_dead_holders_lock_is_taken_over(tmp_path):
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  holder = subprocess.Popen([sys.executable, "-c", _HOLD, workdir], cwd=str(tiny.REPO),
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(WorkdirError) as e:
      loop.run(tiny.loop_config("fp32", str(tmp_path / "base")), workdir, log=lambda _: None)
    msg = str(e.value)
    assert f"in use by another run (pid {holder.pid} on host" in msg and "\n" not in msg
    assert os.listdir(workdir) == [LOCK_FILE]  # nothing else touched
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  logs = []
  with WorkdirLock(workdir, logs.append):
    assert len(logs) == 1 and f"no longer running (pid {holder.pid} on host" in logs[0]
  with WorkdirLock(workdir, logs.append):  # released cleanly: nothing stale the next time
    assert len(logs) == 1
