"""Asynchronous checkpoint saves (the loop's): the manifest is written into the save's tmp
directory once orbax finished its files and before it commits (a step never appears without one),
rotation still counts only verified checkpoints, and every save restores intact."""
import os

import jax.numpy as jnp
import numpy as np

from lowrl.training import checkpointing
from lowrl.training.checkpointing import MANIFEST, Checkpointer, abstract_like, verify_manifest


def _tree(step: int):
  return {"w": jnp.arange(6.0).reshape(2, 3) * step, "count": jnp.array(step, jnp.int32)}


def test_async_saves_are_finalized_before_the_next_and_restore_intact(tmp_path, monkeypatch):
  ckpt = Checkpointer(str(tmp_path / "c"), every=1, max_to_keep=2, async_save=True)
  finalized = []
  real_write = checkpointing.write_manifest

  def write(step_dir):  # orbax's files are complete, not yet renamed into place
    name = os.path.basename(step_dir)
    assert name.endswith(".orbax-checkpoint-tmp")
    assert os.path.exists(os.path.join(step_dir, "state"))
    step = int(name.split(".")[0])
    assert not os.path.exists(ckpt.step_dir(step))
    finalized.append(step)
    real_write(step_dir)

  monkeypatch.setattr("lowrl.training.checkpointing.write_manifest", write)
  for step in (1, 2, 3):
    tree = _tree(step)
    assert ckpt.save(step, tree, {"step": step})
    del tree  # the caller may drop (or donate) the arrays once save() returned
    for done in os.listdir(tmp_path / "c"):  # whatever orbax committed has its manifest already
      if done.isdigit():
        assert os.path.exists(os.path.join(ckpt.step_dir(int(done)), MANIFEST))
  ckpt.wait()
  assert finalized == [1, 2, 3]
  assert ckpt.all_steps() == [2, 3]  # rotation after verification: the newest 2 intact
  for step in (2, 3):
    assert verify_manifest(ckpt.step_dir(step)) is None
    assert os.path.exists(os.path.join(ckpt.step_dir(step), MANIFEST))
    state, meta, _ = ckpt.restore(abstract_like(_tree(step)), step)
    np.testing.assert_array_equal(state["w"], _tree(step)["w"])
    assert meta == {"step": step}
  # A new checkpointer (a restart) sees the same verified steps.
  assert Checkpointer(str(tmp_path / "c"), every=1).all_steps() == [2, 3]


def test_a_pending_save_is_finalized_before_a_restore(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "c"), every=1, async_save=True)
  ckpt.save(1, _tree(1), {"step": 1})
  state, _, step = ckpt.restore(abstract_like(_tree(1)))
  assert step == 1 and verify_manifest(ckpt.step_dir(1)) is None
  np.testing.assert_array_equal(state["count"], 1)
