"""A binary's expected failures end in one line and their status, with no traceback after the line
even while a background thread is still at work (lowrl.training.exits). Real processes: the
traceback this guards against is printed by the interpreter's own exit."""
import subprocess
import sys

import pytest

import multiprocess

# A library's background thread, still working when the main thread fails: in 0.5 s it hands
# work to a thread pool (what orbax's clean-up and save threads do), then records that it ran.
_SCRIPT = r"""
import concurrent.futures, sys, threading, time
from lowrl.training import exits, loop, preemption, run_logs
from lowrl.training.checkpointing import CheckpointError

def background():
  time.sleep(0.5)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    pool.submit(print, "background work done", flush=True).result()

threading.Thread(target=background).start()
errors = {
    "refusal": run_logs.WorkdirError("DIR/eval_start.json is missing; restore it."),
    "preempted": preemption.Preempted("SIGTERM", 4, "DIR"),
    "mid_run": CheckpointError("Checkpoint step 4 in DIR is damaged."),
    "bug": KeyError("not an expected failure"),
}
with exits.one_line_exits():
  raise errors[sys.argv[1]]
"""


def _run(case: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", _SCRIPT, case], cwd=multiprocess.REPO,
                        env=multiprocess.child_env(1), capture_output=True, text=True, timeout=300)


def test_a_refusal_waits_for_the_background_thread_and_prints_only_its_line():
  out = _run("refusal")
  assert out.returncode == 2, out.stderr
  # Without the join the thread's submit fails after the exit hooks ran ("cannot schedule new
  # futures after interpreter shutdown"): a traceback after the line, the work lost.
  assert out.stderr.splitlines() == ["error: DIR/eval_start.json is missing; restore it."]
  assert out.stdout == "background work done\n"


@pytest.mark.parametrize("case, status, line", [
    ("preempted", 75, "[signal] stopped on SIGTERM: checkpointed step 4 in DIR;"),
    ("mid_run", 1, "error: Checkpoint step 4 in DIR is damaged."),
])
def test_a_stop_or_a_mid_run_failure_leaves_at_once_in_one_line(case, status, line):
  out = _run(case)
  assert out.returncode == status, out.stderr
  assert len(out.stderr.splitlines()) == 1 and out.stderr.startswith(line), out.stderr


def test_anything_else_is_a_bug_and_keeps_its_traceback():
  out = _run("bug")
  assert out.returncode == 1 and "Traceback" in out.stderr and "KeyError" in out.stderr


@pytest.mark.parametrize("args, line", [
    (["experiments.simulate", "--workdir={w}", "--config.seeds=(1,1)"],
     "error: config.seeds=(1, 1) must be distinct ints, at least one."),
    (["experiments.simulate", "--workdir={w}", "--report_only"],
     "error: {w}/results.jsonl holds no setting of this config yet; run the sweep first"),
    (["experiments.report", "--workdir={w}", "--out={w}/r.md"],
     "error: {w}/results.jsonl line 1 is not JSON (Expecting value); repair or delete that line"),
])
def test_binaries_report_a_bad_grid_or_results_file_in_one_line(tmp_path, args, line):
  """Errors that were tracebacks: a bad sweep grid, a report of a sweep that has not run, a
  damaged results file."""
  w = str(tmp_path)
  if args[0] == "experiments.report":
    (tmp_path / "results.jsonl").write_text("garbage\n")
  out = subprocess.run([sys.executable, "-m", *(a.format(w=w) for a in args)],
                       cwd=multiprocess.REPO, env=multiprocess.child_env(1), capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 2, out.stderr[-3000:]
  lines = out.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith(line.format(w=w)), out.stderr[-3000:]
