"""TensorBoard writer: event files are written and read back with TensorBoard's EventAccumulator."""
import os

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lowrl.metrics.writer import MetricWriter, NullWriter, create_writer


def _read(logdir):
  acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0,
                                                     "images": 0})
  acc.Reload()
  return acc


def test_roundtrip(tmp_path):
  img = np.zeros((4, 6, 3), np.uint8)
  img[1, 2] = [255, 0, 0]
  with MetricWriter(tmp_path) as w:
    w.scalars(1, {"loss": jnp.float32(0.5), "rl/kl": np.float64(1e-3), "count": 3})
    w.scalars(jnp.int32(2), {"loss": jnp.array([0.25])})  # one-element arrays are scalars too
    w.histograms(2, {"logp": jnp.arange(10.0), "w": np.array([1.0, np.nan, 3.0, np.inf])})
    w.texts(3, {"sample": "2 + 2 = **4**"})
    w.image(4, "attn", img)
    w.flush()
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path))

  acc = _read(tmp_path)
  loss = acc.Scalars("loss")
  assert [(e.step, e.value) for e in loss] == [(1, 0.5), (2, 0.25)]
  assert acc.Scalars("rl/kl")[0].value == pytest.approx(1e-3)
  assert acc.Scalars("count")[0].value == 3.0

  h = acc.Histograms("logp")[0]
  assert h.step == 2
  assert (h.histogram_value.num, h.histogram_value.sum) == (10, 45.0)
  assert (h.histogram_value.min, h.histogram_value.max) == (0.0, 9.0)
  hw = acc.Histograms("w")[0].histogram_value  # non-finite entries dropped
  assert (hw.num, hw.sum) == (2, 4.0)

  text = acc.Tensors("sample/text_summary")[0]
  assert text.step == 3 and text.tensor_proto.string_val == [b"2 + 2 = **4**"]

  im = acc.Images("attn")[0]
  assert (im.step, im.height, im.width) == (4, 4, 6)


def test_invalid_values(tmp_path):
  with MetricWriter(tmp_path) as w:
    with pytest.raises(ValueError, match="histograms"):
      w.scalars(0, {"v": np.ones(3)})
    with pytest.raises(ValueError, match="str"):
      w.texts(0, {"t": 3})
    with pytest.raises(ValueError, match="uint8"):
      w.image(0, "x", np.zeros((4, 4, 3), np.float32))
    with pytest.raises(ValueError, match=r"\[H, W, C\]"):
      w.image(0, "x", np.zeros((4, 4), np.uint8))


def test_null_writer_writes_nothing(tmp_path):
  for w in (NullWriter(), create_writer(str(tmp_path), enabled=False), create_writer(None)):
    assert isinstance(w, NullWriter)
    with w:
      w.scalars(0, {"a": 1.0})
      w.histograms(0, {"h": np.ones(3)})
      w.texts(0, {"t": "x"})
      w.image(0, "i", np.zeros((2, 2, 3), np.uint8))
      w.flush()
  assert os.listdir(tmp_path) == []
  real = create_writer(str(tmp_path / "run"))
  assert isinstance(real, MetricWriter)
  real.close()


def test_purge_step_replaces_points_logged_before_an_interruption(tmp_path):
  with MetricWriter(tmp_path) as w:  # the first attempt logged steps 1..3, then stopped
    for step in (1, 2, 3):
      w.scalars(step, {"r": float(step)})
  with MetricWriter(tmp_path, purge_step=3) as w:  # resumed from a checkpoint at step 2
    for step in (3, 4):
      w.scalars(step, {"r": 10.0 * step})
  assert [(e.step, e.value) for e in _read(tmp_path).Scalars("r")] == [
      (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_hparams_go_to_the_runs_own_event_file(tmp_path):
  from tensorboard.plugins.hparams import plugin_data_pb2
  with MetricWriter(tmp_path) as w:
    w.hparams({"optimizer.lr": 2e-4, "rl.loss": "grpo", "mesh.shape": (-1, 1), "x": None},
              ["eval/pass_at_1"])
    w.scalars(0, {"eval/pass_at_1": 0.5})
  assert len(os.listdir(tmp_path)) == 1  # no extra run directory
  content = _read(tmp_path).SummaryMetadata("_hparams_/session_start_info").plugin_data.content
  info = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
  assert info.hparams["optimizer.lr"].number_value == pytest.approx(2e-4)
  assert info.hparams["rl.loss"].string_value == "grpo"
  assert info.hparams["mesh.shape"].string_value == "(-1, 1)"


def test_flush_puts_every_logged_point_on_disk(tmp_path):
  """After flush() returns, the event files on disk hold every point logged so far (what the loop
  relies on before a checkpoint: a kill right after it must not lose them)."""
  w = MetricWriter(tmp_path, flush_secs=3600)  # no periodic flush can hide a missing one
  for step in range(1, 501):
    w.scalars(step, {"a": step, "b": -step})
  w.flush()
  acc = _read(tmp_path)  # read while the writer is still open
  assert [e.step for e in acc.Scalars("a")] == list(range(1, 501))
  assert [e.value for e in acc.Scalars("b")] == [-float(s) for s in range(1, 501)]
  w.scalars(501, {"a": 501})  # the writer keeps working after a flush
  w.close()
  assert [e.step for e in _read(tmp_path).Scalars("a")][-1] == 501


def test_a_full_disk_raises_in_the_caller_and_never_blocks(tmp_path):
  """A write that finds no space raises OSError(ENOSPC) from the logging call itself; every later
  call raises at once (no queue to a dead thread to block on: the CI hang of stop 34), and
  close() after it returns without raising. Points flushed before the failure stay readable."""
  import errno

  import small_fs
  with small_fs.tmpfs(str(tmp_path / "disk"), "256k") as disk:
    logdir = os.path.join(disk, "tb")
    w = MetricWriter(logdir, flush_secs=0)  # every write reaches the disk
    w.scalars(1, {"a": 1.0})
    w.flush()
    with open(os.path.join(disk, "filler"), "wb", buffering=0) as f:  # another process fills it
      try:
        while True:
          f.write(b"\0" * 4096)
      except OSError:
        pass
    with pytest.raises(OSError) as failed:
      for step in range(2, 100_000):
        w.texts(step, {"t": "x" * 4096})
    assert failed.value.errno == errno.ENOSPC
    for call in (lambda: w.scalars(9, {"a": 9.0}), w.flush):
      with pytest.raises(OSError, match="failed write earlier"):
        call()
    w.close()
    w.close()
    os.remove(os.path.join(disk, "filler"))
    assert [e.step for e in _read(logdir).Scalars("a")] == [1]
