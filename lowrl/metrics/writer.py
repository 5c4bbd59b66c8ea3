"""TensorBoard event writer on tensorboardX's event format (no TensorFlow import; see
docs/reference.md §7).

Values may be Python, NumPy or JAX scalars/arrays; they are pulled to host here. `NullWriter` has the
same interface and does nothing: use it in tests and on non-zero processes (`create_writer`).
"""
from __future__ import annotations

import os
import time
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
  """Writes scalars, histograms, texts and images to a TensorBoard event file under `logdir`.

  Synchronous: each event is appended in the caller's thread, so a write that fails (a full disk)
  raises its OSError there. tensorboardX's SummaryWriter hands events to a thread through a
  bounded queue; when that thread dies of a failed write, the next `put` on the full queue blocks
  forever (and checking the thread before each put cannot close the race). Events are built with
  tensorboardX's summary functions and framed by its EventsWriter (TFRecord with CRCs).
  """

  def __init__(self, logdir: str, flush_secs: int = 30, purge_step: int | None = None,
               tags: Callable[[str], str] | None = None):
    """`flush_secs`: the file is flushed (and fsynced) at the first write this long after the
    last flush (and by `flush()`/`close()`). `purge_step`: a resumed run's first new step;
    TensorBoard then drops the points at steps >= purge_step that earlier event files hold
    (logged before an interruption). `tags`: maps each scalar/histogram name (and hparams metric
    tag) to its TensorBoard tag (e.g. lowrl.metrics.layout.tag); None = the names as given."""
    # Imported here so NullWriter users never pay for (or need) tensorboardX.
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto.event_pb2 import Event, SessionLog
    self._logdir, self._flush_secs = str(logdir), flush_secs
    self._tag = tags or (lambda name: name)
    self._event = Event
    os.makedirs(self._logdir, exist_ok=True)
    # Event files are named by the second they were opened in: a count suffix keeps a writer
    # opened in the same second as an earlier one (a quick resume) from truncating its file.
    existing = len(os.listdir(self._logdir))
    self._file = EventsWriter(os.path.join(self._logdir, "events"), f".{existing}")
    self._failed: OSError | None = None
    self._closed = False
    self._last_flush = time.monotonic()
    if purge_step is not None:  # what SummaryWriter(purge_step=...) writes first
      self._append(Event(step=purge_step, file_version="brain.Event:2"))
      self._append(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

  @property
  def logdir(self) -> str:
    """Directory the event files go to."""
    return self._logdir

  def _raise_if_failed(self) -> None:
    if self._failed is not None:  # the file's tail is unknown after a failed write
      raise OSError(self._failed.errno, f"TensorBoard's event file in {self._logdir} had a "
                                        f"failed write earlier ({self._failed.strerror})")

  def _append(self, event) -> None:
    if self._closed:
      raise ValueError(f"the TensorBoard writer for {self._logdir} is closed")
    event.wall_time = time.time()
    self._io(lambda: self._file.write_event(event))
    if time.monotonic() - self._last_flush >= self._flush_secs:
      self.flush()

  def _io(self, write: Callable[[], Any]) -> None:
    """Runs `write` on the event file; a failure is kept, so every later write raises too."""
    self._raise_if_failed()
    try:
      write()
    except OSError as e:
      self._failed = e
      raise

  def _summary(self, step: int, summary) -> None:
    self._append(self._event(step=int(step), summary=summary))

  def scalars(self, step: int, values: Mapping[str, Any]) -> None:
    """One scalar per tag; each value must hold exactly one number."""
    from tensorboardX.summary import scalar
    for name, value in values.items():
      self._summary(step, scalar(self._tag(name), _to_float(name, value)))

  def histograms(self, step: int, arrays: Mapping[str, Any]) -> None:
    """One histogram per tag over all elements of the array.

    Non-finite entries are dropped (tensorboardX can't bin them; log a NaN count as a scalar if it
    matters); an array with no finite entry is skipped. Bins: NumPy's "auto" over the values'
    range (TensorFlow's default buckets are 10% of the value wide: values within a few percent of
    each other, like the weight quantization errors, fall into one bucket and show as a block).
    """
    from tensorboardX.summary import histogram
    for name, arr in arrays.items():
      values = np.asarray(arr, dtype=np.float64).reshape(-1)
      values = values[np.isfinite(values)]
      if values.size:
        self._summary(step, histogram(self._tag(name), values, bins="auto"))

  def texts(self, step: int, texts: Mapping[str, str]) -> None:
    """One (markdown) text per tag."""
    from tensorboardX.summary import text
    for name, value in texts.items():
      if not isinstance(value, str):
        raise ValueError(f"Text {name!r} must be a str, got {type(value).__name__}.")
      self._summary(step, text(name, value))

  def hparams(self, values: Mapping[str, Any], metric_tags: Sequence[str]) -> None:
    """The run's hyperparameters (TensorBoard's HPARAMS tab) in this run's own event file.

    Values that are not bool/int/float/str (tuples, None) are written as their repr;
    `metric_tags` are scalar tags the tab shows against them.
    """
    from tensorboardX.summary import hparams
    plain = {k: v if isinstance(v, (bool, int, float, str)) else repr(v)
             for k, v in values.items()}
    for summary in hparams(plain, {self._tag(tag): 0.0 for tag in metric_tags}):
      self._append(self._event(summary=summary))

  def custom_scalars(self, layout: Mapping[str, Mapping[str, Sequence[Any]]]) -> None:
    """The CUSTOM SCALARS dashboard's layout: {category: {chart: ["Multiline", [tag regexes]]
    or ["Margin", [value, lower, upper tags]]}} (tensorboardX's add_custom_scalars format)."""
    from tensorboardX.summary import custom_scalars
    self._append(self._event(
        summary=custom_scalars({c: dict(charts) for c, charts in layout.items()})))

  def image(self, step: int, name: str, image_HWC: Any) -> None:
    """A uint8 [H, W, C] image (C = 1, 3 or 4)."""
    from tensorboardX.summary import image
    self._summary(step, image(name, _check_image(name, image_HWC), dataformats="HWC"))

  def flush(self) -> None:
    """Write everything logged so far to disk (flush and fsync) before returning."""
    self._io(self._file.flush)  # file flush + fsync
    self._last_flush = time.monotonic()

  def close(self) -> None:
    """Flush and close the event file. After a failed write nothing is flushed and nothing is
    raised (the failure was raised where it happened); closing twice is a no-op."""
    if self._closed:
      return
    self._closed = True
    try:
      self._file.close()  # flush, fsync, close
    except OSError:
      if self._failed is None:
        raise

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
