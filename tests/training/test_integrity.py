"""Run integrity: checksummed checkpoints with fallback, the non-finite guard, config checks and
the workdir's config, log files (JSONL, ETA). The end-to-end loop checks are in
test_integrity_loop.py; the command line in test_cli.py."""
import glob
import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
import tiny

from lowrl.models import layout
from lowrl import precision
from lowrl.models import init
from lowrl.models.config import ModelConfig
from lowrl.rl.corrections import CorrectionConfig
from lowrl.rl.losses import LossConfig
from lowrl.tasks.jsonl import JsonlTask
from lowrl.training import run_config, run_logs
from lowrl.training.setup import build
from lowrl.training import checkpointing
from lowrl.training.checkpointing import (MANIFEST, CheckpointError, Checkpointer, abstract_like,
                                          verify_manifest)
from lowrl.training.rl_update import UpdateConfig, make_logprob_fn, make_rl_update
from lowrl.training.batch import RLBatch


def _tree(step: int):
  return {"w": jnp.arange(6.0).reshape(2, 3) * step, "opt": {"count": jnp.array(step, jnp.int32),
                                                            "mu": jnp.full((5,), 0.5 * step)}}


def _save(directory, steps, max_to_keep=2):
  ckpt = Checkpointer(str(directory), every=1, max_to_keep=max_to_keep)
  for s in steps:
    ckpt.save(s, _tree(s), {"step": s})
  return ckpt


def _flip(path: str, offset: int = -3) -> None:
  data = bytearray(open(path, "rb").read())
  data[offset] ^= 0x5A
  with open(path, "wb") as f:
    f.write(bytes(data))


def _files(step_dir: str) -> list[str]:
  return sorted(p for p in glob.glob(os.path.join(step_dir, "**", "*"), recursive=True)
                if os.path.isfile(p) and not p.endswith("lowrl_manifest.json"))


def test_every_flipped_byte_is_detected(tmp_path):
  ckpt = _save(tmp_path / "c", [1])
  step_dir = ckpt.step_dir(1)
  assert verify_manifest(step_dir) is None
  files = _files(step_dir)
  assert any("/d/" in f for f in files)  # the array data files are among them
  for f in files:
    # orbax's bookkeeping is left out of the digests (orbax rewrites it after the manifest)
    if os.path.getsize(f) == 0 or os.path.basename(f) in checkpointing._UNDIGESTED:
      continue
    _flip(f)
    assert "changed" in verify_manifest(step_dir), f
    _flip(f)  # restore
  assert verify_manifest(step_dir) is None


def test_damaged_newest_falls_back_to_intact_and_keeps_everything(tmp_path):
  ckpt = _save(tmp_path / "c", [1, 2, 3])
  assert ckpt.all_steps() == [2, 3]  # max_to_keep = 2
  data = [f for f in _files(ckpt.step_dir(3)) if "/d/" in f]
  _flip(data[0])
  with pytest.raises(CheckpointError, match="step 3 .* damaged .*Nothing was deleted"):
    ckpt.restore(abstract_like(_tree(0)))

  logs = []
  state, meta, step = ckpt.restore_newest_intact(lambda s: abstract_like(_tree(0)), logs.append)
  assert step == 2 and meta == {"step": 2}
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(_tree(2)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert len(logs) == 1 and "step 3 is damaged" in logs[0] and "falling back to step 2" in logs[0]
  moved = str(tmp_path / "c.damaged" / "3")
  assert os.path.isdir(moved) and ckpt.all_steps() == [2]  # moved aside, not deleted
  ckpt.save(3, _tree(3), {"step": 3})  # the run redoes step 3
  assert ckpt.all_steps() == [2, 3]


def test_rotation_never_deletes_the_last_intact_checkpoint(tmp_path):
  ckpt = _save(tmp_path / "c", [1, 2])
  _flip([f for f in _files(ckpt.step_dir(2)) if "/d/" in f][0])
  ckpt.save(3, _tree(3), {"step": 3})
  # 3 and 1 are the two newest intact ones: the damaged 2 does not push 1 out.
  assert ckpt.all_steps() == [1, 2, 3]
  ckpt.save(4, _tree(4), {"step": 4})
  assert ckpt.all_steps() == [3, 4]


def test_all_damaged_raises_and_moves_nothing(tmp_path):
  ckpt = _save(tmp_path / "c", [1, 2])
  for s in (1, 2):
    _flip([f for f in _files(ckpt.step_dir(s)) if "/d/" in f][0])
  with pytest.raises(CheckpointError, match="No intact checkpoint.*step 2.*step 1"):
    ckpt.restore_newest_intact(lambda s: abstract_like(_tree(0)), print)
  assert ckpt.all_steps() == [1, 2] and not os.path.exists(str(tmp_path / "c.damaged"))


def test_non_finite_state_is_never_checkpointed(tmp_path):
  ckpt = _save(tmp_path / "c", [2])
  bad = _tree(4)
  bad["opt"]["mu"] = bad["opt"]["mu"].at[1].set(jnp.inf)
  with pytest.raises(CheckpointError, match="non-finite.*last good checkpoint is step 2"):
    ckpt.save(4, bad, {"step": 4})
  assert ckpt.all_steps() == [2]


def test_unfinished_saves_are_reported_and_not_counted(tmp_path):
  directory = tmp_path / "c"
  _save(directory, [1, 2])
  os.makedirs(directory / "3.orbax-checkpoint-tmp-1234")
  ckpt = Checkpointer(str(directory), every=1)
  assert ckpt.unfinished == ["3.orbax-checkpoint-tmp-1234"]
  assert ckpt.all_steps() == [1, 2]
  ckpt.save(3, _tree(3), {"step": 3})
  assert ckpt.all_steps() == [2, 3] and sorted(os.listdir(directory)) == ["2", "3"]


# -- the update's guard ----------------------------------------------------------------------

def test_update_skips_a_non_finite_new_state():
  """lr = inf: loss and gradient are finite, the new parameters are not -> the step is skipped."""
  model = ModelConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1,
                      head_dim=16, d_ff=64, max_seq_len=16)
  params = init.init_params(model, jax.random.key(0))
  logprob_fn = make_logprob_fn(model, precision.policy_for("fp32", layout.matmuls(model)))
  cfg = UpdateConfig(loss=LossConfig(), correction=CorrectionConfig(), mu=2)
  tx = optax.sgd(float("inf"))
  b, t = 4, 10
  batch = RLBatch(tokens_BT=jax.random.randint(jax.random.key(1), (b, t), 3, 16),
                  input_mask_BT=jnp.ones((b, t)), loss_mask_BT=jnp.ones((b, t)).at[:, :5].set(0),
                  logp_sampler_BT=jnp.zeros((b, t)), adv_B=jnp.linspace(-1, 1, b))
  new, _, m = jax.jit(make_rl_update(logprob_fn, tx, cfg))(params, tx.init(params), None, batch,
                                                          jax.random.key(2))
  assert float(m["skipped_updates"]) == 2 and float(m["grad_norm"]) > 0
  for a, b_ in zip(jax.tree.leaves(new), jax.tree.leaves(params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))


# -- config checks, fingerprint, the workdir's copy -------------------------------------------

def _tiny_config():
  return tiny.loop_config("fp32")


@pytest.mark.parametrize("path, value", [
    ("optimizer.lr", float("inf")), ("optimizer.lr", float("nan")), ("rl.clip_eps_low", float("inf")),
    ("rl.loss", "ppo2"), ("rl.correction", "foo"), ("rl.kl_estimator", "k9"),
    ("async_rl.lag", -1), ("rl.top_p", 1.5), ("max_skipped_steps", 0),
    ("task.path", "x.jsonl"),  # only for task.name=jsonl
])
def test_bad_values_name_their_flag(path, value):
  c = _tiny_config()
  run_config.set_path(c, path, value)
  with pytest.raises(ValueError, match=f"--config.{path}"):
    build(c)


def test_jsonl_task_from_flags_checks_both_splits_before_compile(tmp_path):
  path = tmp_path / "one.jsonl"
  path.write_text('{"prompt": "1+1=", "answer": "2"}\n')
  c = _tiny_config()
  c.task.name, c.task.kwargs, c.task.path = "jsonl", ml_collections.ConfigDict({}), str(path)
  c.task.verifier = "numeric"
  with pytest.raises(ValueError, match="'eval' split .* is empty"):
    build(c)
  c.task.path = ""
  with pytest.raises(ValueError, match="needs --config.task.path"):
    build(c)


def test_jsonl_non_utf8_names_file_and_line(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "caf\xe9", "answer": "3"}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:3: not valid UTF-8 \(byte 0xe9 at column 16\)"):
    JsonlTask(path)


def test_resume_with_changed_config_is_refused_unless_allowed(tmp_path):
  c = _tiny_config()
  assert run_config.check_or_write(str(tmp_path), c, resuming=False, allow_change=False) == []
  saved = json.load(open(tmp_path / "config.json"))
  assert saved["fingerprint"] == run_config.fingerprint(c) and saved["config"]["seed"] == 0
  c2 = _tiny_config()
  c2.log_every, c2.num_text_samples = 5, 0  # cosmetic: same fingerprint, accepted
  assert run_config.fingerprint(c2) == run_config.fingerprint(c)
  assert run_config.check_or_write(str(tmp_path), c2, resuming=True, allow_change=False) == []
  saved = json.load(open(tmp_path / "config.json"))
  assert saved["config"]["log_every"] == 5
  c2.optimizer.lr, c2.rl.num_prompts = 1e-3, 16
  assert run_config.fingerprint(c2) != run_config.fingerprint(c)
  with pytest.raises(run_config.ConfigChangedError,
                     match=r"optimizer.lr: 0.0002 -> 0.001; rl.num_prompts: 32 -> 16.*"
                           "--allow_config_change"):
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


# -- log files --------------------------------------------------------------------------------

def test_metrics_line_is_strict_json():
  line = run_logs.metrics_line(3, {"a": float("nan"), "b": float("inf"), "c": 0.1234567, "d": 2})

  def reject(name):
    raise AssertionError(f"bare {name} in {line}")
  assert json.loads(line, parse_constant=reject) == {"step": 3, "a": None, "b": None,
                                                     "c": 0.123457, "d": 2.0}


def test_eta_leaves_out_the_compiling_first_step():
  now = [0.0]
  eta = run_logs.Eta(total=10, clock=lambda: now[0])
  now[0] = 100.0  # step 1: compile
  assert eta.update(1) == "elapsed 100s eta ?"
  now[0] = 101.0  # steps 2, 3: 1 s each
  assert eta.update(2) == "elapsed 101s eta 8s"  # 8 steps left at 1 s
  now[0] = 102.0
  assert eta.update(3) == "elapsed 102s eta 7s"


def test_logs_of_an_earlier_attempt_are_moved_not_overwritten(tmp_path):
  (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
  (tmp_path / "eval_start.json").write_text("{}")
  assert run_logs.has_logs(str(tmp_path))
  dest = run_logs.move_aside(str(tmp_path))
  assert dest == str(tmp_path / "previous" / "0")
  assert (tmp_path / "previous" / "0" / "metrics.jsonl").read_text() == '{"step": 1}\n'
  assert not run_logs.has_logs(str(tmp_path))


def test_a_step_without_manifest_is_checked_by_its_record_and_reported(tmp_path):
  ckpt = _save(tmp_path / "c", [1, 2])
  os.remove(os.path.join(ckpt.step_dir(2), MANIFEST))  # killed between the save and its manifest
  # Another step's files moved in as step 3 (no manifest either): its record names step 1.
  shutil.copytree(ckpt.step_dir(1), ckpt.step_dir(3))
  os.remove(os.path.join(ckpt.step_dir(3), MANIFEST))
  ckpt = Checkpointer(str(tmp_path / "c"), every=1)
  logs = []
  state, meta, step = ckpt.restore_newest_intact(lambda s: abstract_like(_tree(0)), logs.append)
  assert step == 2 and meta == {"step": 2}
  np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(_tree(2)["w"]))
  assert len(logs) == 2, logs
  assert "step 3 is damaged (its record says step 1: another step's files)" in logs[0]
  assert logs[1].startswith(f"[checkpoint] step 2 has no {MANIFEST}")
  assert "restored without a checksum check" in logs[1]
