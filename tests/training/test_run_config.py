"""The run's config record (lowrl.training.run_config): dotted paths and the digest, the workdir's
config.json on resume (cosmetic changes accepted, a changed config refused naming the changes unless
allowed), did-you-mean for an unknown flag."""
import hashlib
import json
import re

import pytest

from configs import base
from lowrl.asyncrl import simulator
from lowrl.training import run_config
from test_integrity import _tiny_config  # shared with the config checks there

_set = run_config.set_path


def test_resume_with_changed_config_is_refused_unless_allowed(tmp_path):
  c = _tiny_config()
  assert run_config.check_or_write(str(tmp_path), c, resuming=False, allow_change=False) == []
  saved = json.load(open(tmp_path / "config.json"))
  assert saved["fingerprint"] == run_config.fingerprint(c) and saved["config"]["seed"] == c.seed
  c2 = _tiny_config()
  c2.log_every, c2.num_text_samples = 5, 0  # cosmetic: same fingerprint, accepted
  assert run_config.fingerprint(c2) == run_config.fingerprint(c)
  assert run_config.check_or_write(str(tmp_path), c2, resuming=True, allow_change=False) == []
  saved = json.load(open(tmp_path / "config.json"))
  assert saved["config"]["log_every"] == 5
  c2.optimizer.lr, c2.rl.num_prompts = 1e-3, 16
  assert run_config.fingerprint(c2) != run_config.fingerprint(c)
  # The message names each change as old -> new (the old values are this config's, whatever the
  # defaults are).
  lr, prompts = c.optimizer.lr, c.rl.num_prompts
  assert (lr, prompts) != (1e-3, 16)
  names = re.escape(f"optimizer.lr: {lr!r} -> 0.001; rl.num_prompts: {prompts!r} -> 16")
  with pytest.raises(run_config.ConfigChangedError, match=names + ".*--allow_config_change"):
    run_config.check_or_write(str(tmp_path), c2, resuming=True, allow_change=False)
  assert json.load(open(tmp_path / "config.json")) == saved  # refused: the old copy stays
  changes = run_config.check_or_write(str(tmp_path), c2, resuming=True, allow_change=True)
  assert len(changes) == 2
  assert json.load(open(tmp_path / "config.json"))["fingerprint"] == run_config.fingerprint(c2)


def test_did_you_mean():
  c = _tiny_config()
  assert run_config.did_you_mean("rl.los", c) == " (did you mean --config.rl.loss?)"
  assert run_config.did_you_mean("task.kwargs.path", c) == " (did you mean --config.task.path?)"
  assert run_config.did_you_mean("zzzzzz", c) == ""


def test_dotted_paths_and_digest():
  c = base.get_config("bf16")
  _set(c, "rl.loss", "dapo")
  _set(c, "seed", 3)
  assert (c.rl.loss, c.seed, run_config.get_path(c, "precision.format")) == ("dapo", 3, "none")
  with pytest.raises(TypeError):
    _set(c, "rl.steps", "many")  # the config file's type holds
  with pytest.raises(KeyError):
    run_config.get_path(c, "rl.nope.x")
  lag = simulator.default_config()
  _set(lag, "async_rl.lag", "auto", ignore_type=True)
  assert lag.async_rl.lag == "auto"
  # sha256 of the sorted JSON text, written out here.
  text = '{"a": [1, 2], "b": "x"}'
  assert run_config.digest({"b": "x", "a": (1, 2)}, 12) == hashlib.sha256(
      text.encode()).hexdigest()[:12]


def test_a_knob_added_later_is_off_in_a_config_saved_without_it(tmp_path):
  """model.eos_token (an OFF_UNLESS_SET knob): a workdir whose config.json predates it resumes
  unchanged under the same fingerprint; setting it is a change."""
  c = _tiny_config()
  run_config.check_or_write(str(tmp_path), c, resuming=False, allow_change=False)
  saved = json.load(open(tmp_path / "config.json"))
  del saved["config"]["model"]["eos_token"]  # as written before the knob existed
  json.dump(saved, open(tmp_path / "config.json", "w"))
  assert run_config.check_or_write(str(tmp_path), c, resuming=True, allow_change=False) == []
  fp = run_config.fingerprint(c)  # (the default config's is pinned: test_schema.py)
  c.model.eos_token = "</s>"
  assert run_config.check_or_write(str(tmp_path), c, resuming=True, allow_change=True) == [
      "model.eos_token: '' -> '</s>'"]
  assert run_config.fingerprint(c) != fp
