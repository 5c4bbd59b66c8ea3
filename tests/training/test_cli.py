"""The training binary's command line: one-line config errors (exit 2), --print_config, any cwd.

Each case is a subprocess (imports jax) but fails or exits before anything compiles.
"""
import os
import subprocess
import sys

import pytest

import tiny
from lowrl import precision

REPO = str(tiny.REPO)


def _train(args, cwd):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, os.path.join(REPO, "experiments", "train.py"), *args],
                        cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, message", [
    (["--config.rl.los=dapo"],
     "error: unknown flag --config.rl.los (did you mean --config.rl.loss?); --print_config lists "
     "every --config.* key."),
    (["--config=configs/bf16.py", "--config.rl.loss=ppo2"],
     "error: --config.rl.loss='ppo2': use one of 'grpo', 'dapo', 'gspo', 'cispo'."),
])
def test_config_error_is_one_line_with_exit_2(args, message, tmp_path):
  # From another directory: the config path resolves against the repository.
  out = _train(args + [f"--workdir={tmp_path / 'run'}"], cwd=str(tmp_path))
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.strip() == message
  assert not os.path.exists(tmp_path / "run")  # refused before anything was written


def test_print_config_lists_every_knob(tmp_path):
  out = _train(["--config=configs/base.py:bf16", "--config.rl.steps=7", "--print_config"],
               cwd=str(tmp_path))
  assert out.returncode == 0, out.stderr[-2000:]
  knobs = dict(line.partition("  # ")[::2] for line in out.stdout.splitlines())  # knob: meaning
  assert {"--config.rl.steps=7", "--config.precision.name='bf16'", "--config.task.path=''",
          "--config.max_skipped_steps=3"} <= set(knobs)
  # Every knob has a meaning; a choice knob's lists its choices.
  assert all(knobs.values()), [k for k, v in knobs.items() if not v]
  assert knobs["--config.optimizer.master_dtype='float32'"] == "master-weight dtype: float32 | bfloat16"
  assert knobs["--config.rl.loss='grpo'"] == "policy loss: grpo | dapo | gspo | cispo"
  assert knobs["--config.precision.four_over_six=False"] == precision.KNOBS["four_over_six"]
  assert not any(k.startswith("--config.recipe") for k in knobs)  # no knob without effect
