"""A training run interrupted from outside resumes to exactly the uninterrupted result: SIGKILL,
SIGTERM (checkpoints the step, exits 75), SIGINT twice (exits at once, 130), a second process on
the same workdir (refused in one line naming the holder), a disk that fills up mid-run (stops in
one line keeping the intact checkpoints), a killed run's workdir missing a bookkeeping file
(refused in one line, no traceback after it). Real processes, real signals, a real small
filesystem."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import multiprocess
import small_fs
import tiny
from lowrl.metrics import layout
from lowrl.training import preemption
from lowrl.training.checkpointing import verify_manifest

REPO = str(tiny.REPO)
STEPS = 6
# 1-digit addition after 50 SFT steps: the tiny base scores (rewards above 0, so non-zero
# advantages and updates that train). On the default sorting task it scores 0: every advantage
# is 0 and only weight decay moves the parameters, so a resume that lost training state (the
# optimizer's moments, say) would log nearly the same numbers.
FLAGS = [
    "--config=configs/fp32.py", "--config.task.name=addition",
    "--config.task.kwargs={'num_digits': 1}",
    "--config.model.d_model=32", "--config.model.n_layers=2", "--config.model.n_heads=2",
    "--config.model.n_kv_heads=1", "--config.model.head_dim=16", "--config.model.d_ff=64",
    "--config.sft.steps=50", f"--config.rl.steps={STEPS}", "--config.rl.num_prompts=4",
    "--config.rl.group_size=4", "--config.eval_num_prompts=8", "--config.eval_samples=1",
    "--config.checkpoint_every=2",
]


def _train(workdir: str, *extra: str, stderr=subprocess.STDOUT) -> subprocess.Popen:
  """The binary on FLAGS + `extra`; a --config=FILE in `extra` replaces FLAGS' config file."""
  env = multiprocess.child_env(1, PYTHONUNBUFFERED="1")
  file = [f for f in extra if f.startswith("--config=")] or FLAGS[:1]  # before its overrides
  flags = [*file, *(f for f in (*FLAGS, *extra) if not f.startswith("--config="))]
  return subprocess.Popen([sys.executable, "-m", "experiments.train", f"--workdir={workdir}",
                           *flags], cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=stderr, text=True)


def _finish(proc: subprocess.Popen, status: int = 0) -> str:
  out = proc.communicate(timeout=600)[0]
  assert proc.returncode == status, out[-3000:]
  return out


def _metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _wait_for(path: str, proc: subprocess.Popen) -> None:
  deadline = time.time() + 600
  while not os.path.exists(path) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  assert proc.poll() is None, "the run finished (or died) before the fault: " + proc.stdout.read()


def _at_checkpoint_2(workdir: str, *extra: str) -> subprocess.Popen:
  """A run started in `workdir`, once its step-2 checkpoint is committed (it trains on)."""
  proc = _train(workdir, *extra)
  _wait_for(os.path.join(workdir, "checkpoints", "2"), proc)
  return proc


def _same_result(workdir: str, full: str) -> None:
  assert _metrics(workdir) == _metrics(full)
  with open(os.path.join(full, "summary.json")) as f, open(os.path.join(workdir,
                                                                         "summary.json")) as g:
    assert json.load(f)["eval_end"] == json.load(g)["eval_end"]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
  """The uninterrupted run every interrupted one is compared with."""
  workdir = str(tmp_path_factory.mktemp("full"))
  _finish(_train(workdir))
  rows = _metrics(workdir)
  # It trains after step 2 (where the faults strike): updates on groups that score apart.
  assert any(r["reward/mean"] > 0 for r in rows)
  assert any(r["grad_norm"] > 0 and r["health/zero_spread_group_frac"] < 1 and
             not r["skipped_updates"] for r in rows if r["step"] > 2), rows
  return workdir


@pytest.mark.slow
def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path, full):
  killed = str(tmp_path / "killed")
  proc = _at_checkpoint_2(killed)
  proc.send_signal(signal.SIGKILL)
  proc.communicate()
  assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
  done_at_kill = [m["step"] for m in _metrics(killed)]
  assert done_at_kill and max(done_at_kill) < STEPS  # killed mid-way, not after the end

  out = _finish(_train(killed))
  assert "[resume] from step" in out
  assert "[lock] took over the lock of a run that is no longer running (pid" in out
  _same_result(killed, full)
  # TensorBoard: one point per step (those flushed before the kill were replaced on resume).
  acc = EventAccumulator(os.path.join(killed, "tb", layout.RL_RUN), size_guidance={"scalars": 0})
  acc.Reload()
  assert [e.step for e in acc.Scalars(layout.tag("reward/mean"))] == list(range(1, STEPS + 1))
  assert [e.step for e in acc.Scalars(layout.tag("eval/pass_at_1"))] == [0, STEPS]


@pytest.mark.slow
def test_sigterm_checkpoints_the_step_and_a_second_process_is_refused(tmp_path, full):
  workdir = str(tmp_path / "term")
  proc = _train(workdir)
  _wait_for(os.path.join(workdir, "eval_start.json"), proc)  # the live run holds the workdir
  # Stopped (holding its lock) while the second process starts and is refused: running, it
  # could finish all its steps before the refusal, leaving nothing to stop with SIGTERM.
  proc.send_signal(signal.SIGSTOP)
  try:
    second = _train(workdir)
    out2 = _finish(second, status=2)
  finally:
    proc.send_signal(signal.SIGCONT)
  assert f"in use by another run (pid {proc.pid} on host" in out2, out2
  assert "Traceback" not in out2
  _wait_for(os.path.join(workdir, "checkpoints", "2"), proc)
  proc.send_signal(signal.SIGTERM)
  out = _finish(proc, status=preemption.EXIT_PREEMPTED)
  assert "Traceback" not in out
  stopped = [line for line in out.splitlines() if line.startswith("[signal] stopped on SIGTERM")]
  assert len(stopped) == 1, out[-2000:]
  step = int(stopped[0].split("checkpointed step ")[1].split()[0])
  assert 2 <= step < STEPS
  # The step it stopped at is saved (whatever checkpoint_every says) and verified.
  assert verify_manifest(os.path.join(workdir, "checkpoints", str(step))) is None
  assert max(m["step"] for m in _metrics(workdir)) == step  # every finished step logged
  out = _finish(_train(workdir))
  assert f"[resume] from step {step}" in out
  _same_result(workdir, full)


@pytest.mark.slow
def test_a_second_sigint_exits_at_once_keeping_the_checkpoints(tmp_path):
  workdir = str(tmp_path / "int")
  proc = _at_checkpoint_2(workdir)
  proc.send_signal(signal.SIGINT)
  time.sleep(0.2)  # the first is handled (the run finishes its step), then the second
  proc.send_signal(signal.SIGINT)
  out = _finish(proc, status=128 + signal.SIGINT)
  assert "second SIGINT: exiting now" in out and "Traceback" not in out, out[-2000:]
  # What was committed is intact (resuming from it is the kill -9 test's case).
  steps = [d for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit()]
  assert "2" in steps
  assert all(verify_manifest(os.path.join(workdir, "checkpoints", s)) is None for s in steps)


@pytest.mark.slow
def test_a_disk_that_fills_mid_run_stops_in_one_line_keeping_the_checkpoints(tmp_path, full):
  # The base comes from the shared store (the uninterrupted run's), off the small disk.
  with small_fs.tmpfs(str(tmp_path / "disk"), "3m") as disk:
    workdir = os.path.join(disk, "run")
    proc = _at_checkpoint_2(workdir)
    filler = os.path.join(disk, "filler")
    try:  # another process takes the rest of the disk (unless the run has filled it already)
      with open(filler, "wb") as f:
        while True:
          f.write(b"\0" * 4096)
          f.flush()
    except OSError:
      pass
    out = _finish(proc, status=1)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is full" in errors[0], out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    kept = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
    assert kept and all(verify_manifest(os.path.join(workdir, "checkpoints", str(s))) is None
                        for s in kept)
    assert f"steps {kept}" in errors[0]
    if os.path.exists(filler):
      os.remove(filler)
    _finish(_train(workdir))
    _same_result(workdir, full)


def _files(workdir: str) -> dict[str, bytes | None]:
  """Every file (its bytes) and directory (None) under `workdir`, the lock file aside."""
  out: dict[str, bytes | None] = {}
  for root, dirs, files in os.walk(workdir):
    for d in dirs:
      out[os.path.relpath(os.path.join(root, d), workdir)] = None
    for f in files:
      if f != ".lowrl.lock":
        with open(os.path.join(root, f), "rb") as fh:
          out[os.path.relpath(os.path.join(root, f), workdir)] = fh.read()
  return out


@pytest.mark.slow
def test_a_refused_resume_is_one_line_with_no_traceback_and_touches_nothing(tmp_path):
  """A killed run's workdir without eval_start.json: the re-run's refusal is the only line on
  stderr. Unfinished saves (the killed run's, and many more) are what orbax used to clean up on a
  background thread that the exit met mid-way (`RuntimeError: cannot schedule new futures after
  shutdown`, a traceback after the line, every time with this many); a refused run leaves them."""
  workdir = str(tmp_path / "killed")
  proc = _at_checkpoint_2(workdir)
  proc.send_signal(signal.SIGKILL)
  proc.communicate()
  os.remove(os.path.join(workdir, "eval_start.json"))
  for step in range(100, 400):
    os.makedirs(os.path.join(workdir, "checkpoints", f"{step}.orbax-checkpoint-tmp", "state"))
  before = _files(workdir)
  refused = _train(workdir, stderr=subprocess.PIPE)
  _, err = refused.communicate(timeout=600)
  assert refused.returncode == 2, err[-3000:]
  lines = err.splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"error: {workdir}/eval_start.json "), err[-3000:]
  assert _files(workdir) == before
