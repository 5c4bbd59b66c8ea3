"""A JSONL task chosen by flags: file errors name --config.task.path and the fix, and the run's
setup prints the file's train/eval split sizes (all before any compile)."""
import json
import os

import ml_collections
import pytest

from configs import base as base_config
from lowrl.training.reporting import log_setup
from lowrl.training.setup import build


def _config(path: str) -> ml_collections.ConfigDict:
  c = base_config.get_config("fp32")
  c.task.name, c.task.path = "jsonl", path
  c.eval_num_prompts = 8
  return c


def _write(path, n: int) -> None:
  with open(path, "w") as f:
    for i in range(n):
      f.write(json.dumps({"prompt": f"{i}+{i}=", "answer": 2 * i}) + "\n")


def test_a_missing_file_names_the_flag_and_the_fix(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError) as e:
    build(_config("data/missing.jsonl"))
  text = str(e.value)
  assert text.startswith("--config.task.path=data/missing.jsonl: Cannot read JSONL file "
                         "'data/missing.jsonl': No such file or directory; pass the path of an "
                         "existing file (a relative path is read from the current directory "
                         f"{os.getcwd()})"), text
  assert "\n" not in text


def test_an_empty_eval_split_names_the_flag(tmp_path):
  path = str(tmp_path / "one.jsonl")
  _write(path, 1)  # one prompt: one split is empty, whichever the hash picks
  with pytest.raises(ValueError, match=rf"^--config.task.path={path}: The '(train|eval)' split "
                                       "of .* is empty"):
    build(_config(path))


def test_the_setup_prints_the_split_sizes(tmp_path):
  path = str(tmp_path / "sums.jsonl")
  _write(path, 60)
  setup = build(_config(path))
  n_train, n_eval = (len(setup.task.examples(s)) for s in ("train", "eval"))
  assert n_train + n_eval == 60 and 0 < n_eval < n_train
  lines = []
  log_setup(setup, str(tmp_path), lines.append)
  assert (f"[setup] {path}: {n_train} train / {n_eval} eval examples (eval_fraction 0.1 of the "
          "distinct prompts, by prompt hash); the held-out evaluation draws eval_num_prompts=8 "
          f"of the {n_eval} (with replacement)") in lines
