"""Exported weights get a normal file's mode (0666 less the umask), not the 0600 of the
temporary file safetensors writes through: a serving process of another user can read them."""
import os
import stat

import jax
import pytest

import tiny
from lowrl import precision
from lowrl.checkpoints import hf_quantized, save_hf_checkpoint
from lowrl.models import init, layout


@pytest.fixture(params=[0o022, 0o027])
def umask(request):
  old = os.umask(request.param)
  yield request.param
  os.umask(old)


def _modes(path) -> dict[str, int]:
  return {name: stat.S_IMODE(os.stat(os.path.join(path, name)).st_mode)
          for name in sorted(os.listdir(path))}


def test_plain_and_sharded_exports_honour_the_umask(tmp_path, umask):
  params = init.init_params(tiny.TINY, jax.random.key(0))
  want = 0o666 & ~umask  # what open() gives config.json beside them
  save_hf_checkpoint(tmp_path / "one", tiny.TINY, params)
  save_hf_checkpoint(tmp_path / "shards", tiny.TINY, params, max_shard_bytes=20_000)
  one, shards = _modes(tmp_path / "one"), _modes(tmp_path / "shards")
  assert one == {"config.json": want, "model.safetensors": want}
  assert len(shards) > 3 and set(shards.values()) == {want}


def test_the_quantized_export_honours_the_umask(tmp_path, umask):
  params = init.init_params(tiny.TINY, jax.random.key(0))
  policy = precision.policy_for("mxfp8", layout.matmuls(tiny.TINY))
  hf_quantized.save_quantized_checkpoint(tmp_path, tiny.TINY, params, "mxfp8", policy=policy,
                                         act_amax=None)
  assert _modes(tmp_path)["model.safetensors"] == 0o666 & ~umask
