"""Checksummed checkpoints (`lowrl.training.checkpointing`): every flipped byte is detected, a
damaged newest step falls back to the newest intact one keeping everything, rotation never deletes
the last intact checkpoint, a non-finite state is never saved, unfinished saves are reported and not
counted."""
import glob
import os
import shutil
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrl.training import checkpointing
from lowrl.training.checkpointing import (MANIFEST, CheckpointError, Checkpointer, abstract_like,
                                          verify_manifest)


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


def test_unfinished_saves_are_reported_not_counted_and_removed_only_by_the_owner(tmp_path):
  directory = tmp_path / "c"
  _save(directory, [1, 2])
  os.makedirs(directory / "3.orbax-checkpoint-tmp-1234")
  threads = set(threading.enumerate())
  reader = Checkpointer(str(directory), every=1)  # e.g. an export next to a live run
  # A reader leaves them (one may be a live run's save in flight), and starts no thread that
  # would outlive it: orbax's own clean-up ran on one, which a quick exit met mid-way. orbax's
  # reads may leave a closed event loop's executor worker finishing (named asyncio_N): such a
  # thread ends by itself, so each new one gets time to end, and none may still be running.
  started = [t for t in set(threading.enumerate()) - threads if not t.daemon]
  for t in started:
    t.join(timeout=30)
  assert not [t for t in started if t.is_alive()]
  assert "3.orbax-checkpoint-tmp-1234" in os.listdir(directory)  # no clean-up ran meanwhile
  assert reader.unfinished == ["3.orbax-checkpoint-tmp-1234"]
  assert reader.all_steps() == [1, 2]
  reader.close()
  assert "3.orbax-checkpoint-tmp-1234" in os.listdir(directory)
  ckpt = Checkpointer(str(directory), every=1)
  assert ckpt.remove_unfinished() == ["3.orbax-checkpoint-tmp-1234"]
  ckpt.save(3, _tree(3), {"step": 3})
  assert ckpt.all_steps() == [2, 3] and sorted(os.listdir(directory)) == ["2", "3"]


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
