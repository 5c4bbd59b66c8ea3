"""A training run SIGKILLed mid-way and resumed from its workdir equals an uninterrupted run."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import multiprocess
import tiny

REPO = str(tiny.REPO)
STEPS = 6
FLAGS = [
    "--config=configs/fp32.py",
    "--config.model.d_model=32", "--config.model.n_layers=2", "--config.model.n_heads=2",
    "--config.model.n_kv_heads=1", "--config.model.head_dim=16", "--config.model.d_ff=64",
    "--config.sft.steps=5", f"--config.rl.steps={STEPS}", "--config.rl.num_prompts=4",
    "--config.rl.group_size=4", "--config.eval_num_prompts=8", "--config.eval_samples=1",
    "--config.checkpoint_every=2",
]


def _train(workdir: str) -> subprocess.Popen:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             XLA_FLAGS=multiprocess.xla_flags(1))
  return subprocess.Popen([sys.executable, "-m", "experiments.train", f"--workdir={workdir}",
                           *FLAGS], cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> str:
  out = proc.communicate(timeout=600)[0]
  assert proc.returncode == 0, out[-3000:]
  return out


def _metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path):
  full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
  _finish(_train(full))

  proc = _train(killed)
  first_ckpt = os.path.join(killed, "checkpoints", "2")
  deadline = time.time() + 600
  while not os.path.isdir(first_ckpt) and proc.poll() is None and time.time() < deadline:
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.communicate()
  assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
  done_at_kill = [m["step"] for m in _metrics(killed)]
  assert done_at_kill and max(done_at_kill) < STEPS  # killed mid-way, not after the end

  out = _finish(_train(killed))
  assert "[resume] from step" in out
  assert _metrics(killed) == _metrics(full)
  with open(os.path.join(full, "summary.json")) as f, open(os.path.join(killed,
                                                                         "summary.json")) as g:
    assert json.load(f)["eval_end"] == json.load(g)["eval_end"]
  # TensorBoard: one point per step (those flushed before the kill were replaced on resume).
  acc = EventAccumulator(os.path.join(killed, "tb"), size_guidance={"scalars": 0})
  acc.Reload()
  assert [e.step for e in acc.Scalars("reward/mean")] == list(range(1, STEPS + 1))
  assert [e.step for e in acc.Scalars("eval/pass_at_1")] == [0, STEPS]
