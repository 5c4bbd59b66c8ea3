"""The binaries' command line: --help (exit 0), one-line config errors (exit 2), --print_config.

Each case is a subprocess (imports jax) but fails or exits before anything compiles.
"""
import ast
import os
import subprocess
import sys

import pytest

import tiny
from lowrl import precision
from lowrl.training import cli

REPO = str(tiny.REPO)


def _run(command, cwd):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _train(args, cwd=REPO):
  """The README's command: `python -m experiments.train ...` from the repository root."""
  return _run([sys.executable, "-m", "experiments.train", *args], cwd)


@pytest.mark.parametrize("module, own_flag", [
    ("train", "--[no]allow_config_change"),
    ("simulate", "--workdir: Sweep directory"),
])
def test_help_prints_usage_and_exits_0(module, own_flag):
  out = _run([sys.executable, "-m", f"experiments.{module}", "--help"], cwd=REPO)
  assert out.returncode == 0, out.stderr[-2000:]
  with open(os.path.join(REPO, "experiments", f"{module}.py")) as f:  # importing defines flags
    doc = ast.get_docstring(ast.parse(f.read()))
  assert out.stdout.startswith(doc.splitlines()[0])  # the binary's purpose
  for flag in ("--config:", "--workdir:", "--[no]print_config:", own_flag):
    assert flag in out.stdout, flag
  text = " ".join(out.stdout.split())
  assert "--print_config lists them" in text and "Try --helpfull" not in text


def test_unknown_recipe_names_the_recipes(tmp_path):
  out = _train(["--config=configs/nope.py", f"--workdir={tmp_path / 'run'}"])
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.strip() == (
      "error: --config=configs/nope.py: no config file 'configs/nope.py' in the working directory; "
      "a recipe is configs/<name>.py or configs/base.py:<name> with <name> one "
      f"of {', '.join(precision.RECIPES)} (this binary's default: configs/default.py).")
  assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("args, message", [
    (["--config.rl.los=dapo"],
     "error: unknown flag --config.rl.los (did you mean --config.rl.loss?); --print_config lists "
     "every --config.* key."),
    (["--config=configs/bf16.py", "--config.rl.loss=ppo2"],
     "error: --config.rl.loss='ppo2': use one of 'grpo', 'dapo', 'gspo', 'cispo'."),
    # ml_collections folds the recipe's ValueError into a traceback; only its last line is shown.
    (["--config=configs/base.py:nope"],
     f"error: --config=configs/base.py:nope: Unknown precision recipe 'nope'; use one of "
     f"{precision.RECIPES}."),
    # A config file of one's own that does not parse (the rest of the line is Python's wording).
    (["--config={tmp}/broken.py"], "error: --config={tmp}/broken.py: SyntaxError: "),
])
def test_config_error_is_one_line_with_exit_2(args, message, tmp_path):
  (tmp_path / "broken.py").write_text("def get_config(:\n")
  args, message = [a.format(tmp=tmp_path) for a in args], message.format(tmp=tmp_path)
  out = _train(args + [f"--workdir={tmp_path / 'run'}"])
  assert out.returncode == 2, out.stderr[-2000:]
  line = out.stderr.strip()
  assert (line.startswith(message) and "\n" not in line) if message.endswith(" ") else line == message
  assert not os.path.exists(tmp_path / "run")  # refused before anything was written


def test_print_config_lists_every_knob(tmp_path):
  out = _train(["--config=configs/base.py:bf16", "--config.rl.steps=7", "--print_config"])
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


def test_error_line_keeps_the_last_line_of_a_folded_traceback():
  folded = ValueError("Error whilst parsing config file:\n\nTraceback (most recent call last):\n"
                      "  File \"x.py\", line 3, in get_config\n    raise KeyError(1)\n"
                      "KeyError: 'lr'")
  assert cli.error_line(folded) == "KeyError: 'lr'"
  assert cli.error_line(ValueError("bad\n  value")) == "bad value"
  assert cli.error_line(NameError("name 'x' is not defined")) == "NameError: name 'x' is not defined"
  # A config file run outside the repository root, where `configs` is not importable.
  line = cli.error_line(ModuleNotFoundError("No module named 'configs'", name="configs"))
  assert "\n" not in line and "run the binary from the repository root" in line
