"""TensorBoard event writer on tensorboardX (no TensorFlow import; see docs/reference.md §7).

Values may be Python, NumPy or JAX scalars/arrays; they are pulled to host here. `NullWriter` has the
same interface and does nothing: use it in tests and on non-zero processes (`create_writer`).
"""
from __future__ import annotations

import errno
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np


class Writer(Protocol):
  """What the training loop may call on a writer."""

  def scalars(self, step: int, values: Mapping[str, Any]) -> None: ...
  def histograms(self, step: int, arrays: Mapping[str, Any]) -> None: ...
  def texts(self, step: int, texts: Mapping[str, str]) -> None: ...
  def image(self, step: int, name: str, image_HWC: Any) -> None: ...
  def hparams(self, values: Mapping[str, Any], metric_tags: Sequence[str]) -> None: ...
  def custom_scalars(self, layout: Mapping[str, Mapping[str, Sequence[Any]]]) -> None: ...
  def flush(self) -> None: ...
  def close(self) -> None: ...


def _to_float(name: str, value: Any) -> float:
  arr = np.asarray(value)
  if arr.size != 1:
    raise ValueError(f"Scalar {name!r} has shape {arr.shape}; log arrays with histograms().")
  return float(arr.reshape(()))


def _check_image(name: str, image_HWC: Any) -> np.ndarray:
  img = np.asarray(image_HWC)
  if img.dtype != np.uint8 or img.ndim != 3 or img.shape[-1] not in (1, 3, 4):
    raise ValueError(f"Image {name!r} must be a uint8 [H, W, C] array with C in (1, 3, 4); "
                     f"got dtype {img.dtype}, shape {img.shape}.")
  return img


class MetricWriter:
  """Writes scalars, histograms, texts and images to TensorBoard event files under `logdir`."""

  def __init__(self, logdir: str, flush_secs: int = 30, purge_step: int | None = None,
               tags: Callable[[str], str] | None = None):
    """`purge_step`: a resumed run's first new step; TensorBoard then drops the points at
    steps >= purge_step that earlier event files hold (logged before an interruption).
    `tags`: maps each scalar/histogram name (and hparams metric tag) to its TensorBoard tag
    (e.g. lowrl.metrics.layout.tag); None = the names as given."""
    self._logdir, self._flush_secs = str(logdir), flush_secs
    self._tag = tags or (lambda name: name)
    self._writer = self._open(purge_step)

  def _open(self, purge_step: int | None):
    # Imported here so NullWriter users never pay for (or need) tensorboardX.
    from tensorboardX import SummaryWriter
    # Event files are named by the second they were opened in: a count suffix keeps a writer
    # opened in the same second as an earlier one (a quick resume) from truncating its file.
    existing = len(os.listdir(self._logdir)) if os.path.isdir(self._logdir) else 0
    return SummaryWriter(logdir=self._logdir, flush_secs=self._flush_secs, purge_step=purge_step,
                         filename_suffix=f".{existing}")

  @property
  def logdir(self) -> str:
    """Directory the event files go to."""
    return self._writer.logdir

  def _writing(self) -> bool:
    """Whether tensorboardX's writer thread still runs. It ends on a failed write (e.g. a full
    disk), and its bounded queue then blocks the next event (or the close) forever."""
    event_writer = getattr(self._writer.file_writer, "event_writer", None)
    worker = getattr(event_writer, "_worker", None)
    return worker is None or worker.is_alive()

  def _check_writing(self) -> None:
    if not self._writing():
      raise OSError(errno.EIO, f"TensorBoard's event writer for {self._logdir} stopped after a "
                               "failed write (e.g. a full disk)")

  def scalars(self, step: int, values: Mapping[str, Any]) -> None:
    """One scalar per tag; each value must hold exactly one number."""
    step = int(step)
    for name, value in values.items():
      self._check_writing()
      self._writer.add_scalar(self._tag(name), _to_float(name, value), global_step=step)

  def histograms(self, step: int, arrays: Mapping[str, Any]) -> None:
    """One histogram per tag over all elements of the array.

    Non-finite entries are dropped (tensorboardX can't bin them; log a NaN count as a scalar if it
    matters); an array with no finite entry is skipped. Bins: NumPy's "auto" over the values'
    range (TensorFlow's default buckets are 10% of the value wide: values within a few percent of
    each other, like the weight quantization errors, fall into one bucket and show as a block).
    """
    self._check_writing()
    step = int(step)
    for name, arr in arrays.items():
      values = np.asarray(arr, dtype=np.float64).reshape(-1)
      values = values[np.isfinite(values)]
      if values.size:
        self._writer.add_histogram(self._tag(name), values, global_step=step, bins="auto")

  def texts(self, step: int, texts: Mapping[str, str]) -> None:
    """One (markdown) text per tag."""
    self._check_writing()
    step = int(step)
    for name, text in texts.items():
      if not isinstance(text, str):
        raise ValueError(f"Text {name!r} must be a str, got {type(text).__name__}.")
      self._writer.add_text(name, text, global_step=step)

  def hparams(self, values: Mapping[str, Any], metric_tags: Sequence[str]) -> None:
    """The run's hyperparameters (TensorBoard's HPARAMS tab) in this run's own event file.

    Values that are not bool/int/float/str (tuples, None) are written as their repr;
    `metric_tags` are scalar tags the tab shows against them.
    """
    from tensorboardX.summary import hparams
    plain = {k: v if isinstance(v, (bool, int, float, str)) else repr(v)
             for k, v in values.items()}
    file_writer = self._writer._get_file_writer()  # pylint: disable=protected-access
    for summary in hparams(plain, {self._tag(tag): 0.0 for tag in metric_tags}):
      file_writer.add_summary(summary)

  def custom_scalars(self, layout: Mapping[str, Mapping[str, Sequence[Any]]]) -> None:
    """The CUSTOM SCALARS dashboard's layout: {category: {chart: ["Multiline", [tag regexes]]
    or ["Margin", [value, lower, upper tags]]}} (tensorboardX's add_custom_scalars format)."""
    from tensorboardX.summary import custom_scalars
    self._check_writing()
    self._writer._get_file_writer().add_summary(  # pylint: disable=protected-access
        custom_scalars({c: dict(charts) for c, charts in layout.items()}))

  def image(self, step: int, name: str, image_HWC: Any) -> None:
    """A uint8 [H, W, C] image (C = 1, 3 or 4)."""
    self._writer.add_image(name, _check_image(name, image_HWC), global_step=int(step),
                           dataformats="HWC")

  def flush(self) -> None:
    """Write everything logged so far to disk before returning (then continue in a new file).

    tensorboardX's own flush() only flushes the file: events still queued for its writer thread
    are not yet in it, so a kill right after a checkpoint could lose them. Closing joins the
    thread after it has written every queued event.
    """
    self._check_writing()
    self._writer.close()
    self._writer = self._open(purge_step=None)

  def close(self) -> None:
    """Flush and close the event file (after a failed write there is nothing left to flush)."""
    if self._writing():
      self._writer.close()

  def __enter__(self) -> MetricWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class NullWriter:
  """A writer that accepts everything and writes nothing."""

  def scalars(self, step: int, values: Mapping[str, Any]) -> None:
    """No-op."""
    del step, values

  def histograms(self, step: int, arrays: Mapping[str, Any]) -> None:
    """No-op."""
    del step, arrays

  def texts(self, step: int, texts: Mapping[str, str]) -> None:
    """No-op."""
    del step, texts

  def image(self, step: int, name: str, image_HWC: Any) -> None:
    """No-op."""
    del step, name, image_HWC

  def hparams(self, values: Mapping[str, Any], metric_tags: Sequence[str]) -> None:
    """No-op."""
    del values, metric_tags

  def custom_scalars(self, layout: Mapping[str, Mapping[str, Sequence[Any]]]) -> None:
    """No-op."""
    del layout

  def flush(self) -> None:
    """No-op."""

  def close(self) -> None:
    """No-op."""

  def __enter__(self) -> NullWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def create_writer(logdir: str | None, enabled: bool = True, purge_step: int | None = None,
                  tags: Callable[[str], str] | None = None) -> MetricWriter | NullWriter:
  """A MetricWriter, or a NullWriter when disabled (e.g. `jax.process_index() != 0`) or no logdir."""
  if not enabled or logdir is None:
    return NullWriter()
  return MetricWriter(logdir, purge_step=purge_step, tags=tags)
