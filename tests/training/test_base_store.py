"""The shared store of mid-trained bases: atomic publish, reuse, damaged bases rebuilt, locations."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrl import user_cache
from lowrl.training import base_store, checkpointing
from lowrl.training.checkpointing import Checkpointer

FP = "0123456789ab"


def _params(v: float):
  return {"w": jnp.full((4, 8), v, jnp.float32), "b": jnp.arange(3, dtype=jnp.float32) + v}


ABSTRACT = jax.eval_shape(lambda: _params(0.0))


class Trainer:
  """A fake `train` that counts its calls."""

  def __init__(self, v: float):
    self.v, self.calls = v, 0

  def __call__(self):
    self.calls += 1
    return _params(self.v)


def _load(store, train, logs=None):
  return base_store.load_or_train(str(store), FP, ABSTRACT, train, {"sft_steps": 3},
                                  (logs if logs is not None else []).append)


def _equal(a, b):
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_trains_once_publishes_atomically_then_reuses(tmp_path):
  first, second = Trainer(1.5), Trainer(7.0)
  logs = []
  a = _load(tmp_path, first, logs)
  assert first.calls == 1 and any("saved base" in m for m in logs)
  # Only the published base is left: no temporary directory.
  assert os.listdir(tmp_path) == [FP]
  b = _load(tmp_path, second, logs)
  assert second.calls == 0 and any("reusing base" in m for m in logs)
  assert _equal(a, b) and _equal(b, _params(1.5))


def test_a_base_published_meanwhile_by_another_run_is_kept(tmp_path):
  class Racing(Trainer):
    def __call__(self):  # another run publishes while this one trains
      _load(tmp_path, Trainer(self.v))
      return super().__call__()

  logs = []
  out = _load(tmp_path, Racing(2.0), logs)
  assert any("by another run meanwhile" in m for m in logs)
  assert os.listdir(tmp_path) == [FP] and _equal(out, _params(2.0))


def _corrupt_first_array_file(step_dir: str) -> None:
  for root, _, files in sorted(os.walk(step_dir)):
    for name in sorted(files):
      # Not orbax's own bookkeeping, which the manifest leaves out (checkpointing._UNDIGESTED).
      if name not in checkpointing._UNDIGESTED and os.path.getsize(os.path.join(root, name)) > 16:
        with open(os.path.join(root, name), "r+b") as f:
          data = f.read()
          f.seek(0)
          f.write(bytes([data[0] ^ 0xFF]) + data[1:])
        return
  raise AssertionError("nothing to corrupt")


@pytest.mark.parametrize("damage", ["flip_bytes", "half_written"])
def test_a_damaged_base_is_moved_aside_and_rebuilt(tmp_path, damage):
  _load(tmp_path, Trainer(1.0))
  path = os.path.join(tmp_path, FP)
  if damage == "flip_bytes":
    _corrupt_first_array_file(Checkpointer(path, every=1).step_dir(0))
  else:  # e.g. an interrupted save of an older lowrl: no complete step
    for d in os.listdir(path):
      os.rename(os.path.join(path, d), os.path.join(path, d + ".orbax-checkpoint-tmp-1"))
  logs, again = [], Trainer(1.0)
  out = _load(tmp_path, again, logs)
  assert again.calls == 1, "a damaged base must not be used"
  assert any("damaged" in m for m in logs) and _equal(out, _params(1.0))
  names = sorted(os.listdir(tmp_path))
  assert names[0] == FP and len(names) == 2 and names[1].startswith(FP + ".damaged-")
  reused = Trainer(9.0)
  assert _equal(_load(tmp_path, reused), _params(1.0)) and reused.calls == 0


def test_store_locations(tmp_path, monkeypatch):
  monkeypatch.setenv("LOWRL_CACHE_DIR", str(tmp_path / "c"))
  assert base_store.store_dir("", "/w") == str(tmp_path / "c" / "bases")
  assert base_store.store_dir("none", "/w") == os.path.join("/w", "base")
  assert base_store.store_dir("/x/y", "/w") == "/x/y"
  monkeypatch.delenv("LOWRL_CACHE_DIR")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert user_cache.root() == str(tmp_path / "xdg" / "lowrl")
  assert user_cache.default_compile_cache() == str(tmp_path / "xdg" / "lowrl" / "jax")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert user_cache.root() == str(tmp_path / "home" / ".cache" / "lowrl")
