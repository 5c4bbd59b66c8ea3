"""The RL update and the exact re-score compiled on a background thread
(lowrl.training.precompile): the run calls the executables compiled there (nothing traced,
lowered or compiled for them on the main thread), with metrics byte-identical to a run that
compiles them when first called; a failed or mismatched background compile falls back to the
ordinary call with one logged line; no thread outlives it."""
import importlib
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny
from jax import monitoring

from lowrl.training import loop, precompile

_WORKER = "lowrl-precompile"
_events: list[tuple[str, str, str]] = []  # (thread name, event, function name)


def _listen(event: str, duration: float, fun_name: str = "?", **_):
  del duration
  if event.startswith("/jax/core/compile/"):
    _events.append((threading.current_thread().name, event, str(fun_name)))


@pytest.fixture
def compile_events():
  """JAX's compile events, recorded while the test runs."""
  monitoring.register_event_duration_secs_listener(_listen)
  yield
  monitoring.unregister_event_duration_listener(_listen)
  _events.clear()


def _config(base_dir, precompiled: bool):
  c = tiny.loop_config("bf16", str(base_dir), steps=2)
  c.rl.pack_tokens, c.rl.pack_rows = 18, 4  # packed inside the update: shapes known up front
  c.precompile = precompiled
  return c


def _run(base_dir, workdir, precompiled: bool) -> tuple[bytes, list[str], set[str]]:
  """A tiny packed run on a stored base: its metrics.jsonl, its log lines, and the names of the
  programs whose compile events (tracing, lowering, XLA) ran on the main thread."""
  c = _config(base_dir, precompiled)
  # A fresh re-score program per run, as in a process of its own (the lru cache would hand the
  # second run the first one's, compiled already).
  importlib.import_module("lowrl.sampling.rescore")._scoring_program.cache_clear()
  lines: list[str] = []
  _events.clear()
  loop.run(c, str(workdir), log=lines.append)
  main = {name for thread, _, name in _events if thread == threading.main_thread().name}
  assert not [t for t in threading.enumerate() if t.name.startswith(_WORKER)]
  with open(os.path.join(workdir, "metrics.jsonl"), "rb") as f:
    return f.read(), lines, main


def test_the_run_calls_the_update_compiled_ahead_with_byte_identical_metrics(tmp_path,
                                                                             compile_events):
  loop.load_base(_config(tmp_path / "base", False), str(tmp_path / "sft"))  # SFT's `step` too
  ordinary, _, main_ordinary = _run(tmp_path / "base", tmp_path / "ordinary", False)
  ahead, lines, main_ahead = _run(tmp_path / "base", tmp_path / "ahead", True)
  assert ahead == ordinary and ahead.count(b"\n") == 2
  ahead_names = {"step", "jit(step)", "_score", "jit(_score)"}  # the update, the re-score
  assert ahead_names <= main_ordinary  # the control: compiled where first called
  assert not ahead_names & main_ahead  # ...here on the worker thread only
  assert not [line for line in lines if "[precompile]" in line]


def _double(x):
  return x * 2.0 + 1.0


def _fails_on_odd(x):
  if x.shape[0] % 2:
    raise ValueError("odd rows")
  return x * 2.0 + 1.0


def test_a_failed_background_compile_falls_back_and_is_reported():
  lines: list[str] = []
  x = jnp.arange(4, dtype=jnp.float32)
  with precompile.Precompiler(lines.append) as pre:
    fails = jax.jit(_fails_on_odd)
    pre.submit("fails", fails, jax.ShapeDtypeStruct((3,), jnp.float32))
    assert pre.wait("fails", (x,)) is False
    assert len(lines) == 1 and "fails: the background compile failed (ValueError: odd rows)" \
        in lines[0]
    np.testing.assert_array_equal(fails(x), _double(x))  # the ordinary call compiles it
    with pytest.raises(ValueError, match="odd rows"):  # and a genuine error raises there
      fails(jnp.arange(3, dtype=jnp.float32))

    other = jax.jit(_double)  # compiled for (3,), called with (4,)
    pre.submit("other", other, jax.ShapeDtypeStruct((3,), jnp.float32))
    assert pre.wait("other", (x,)) is False
    assert "other: the call's arguments differ" in lines[1]
    np.testing.assert_array_equal(other(x), _double(x))

    same = jax.jit(_double)
    pre.submit("same", same, x)
    assert pre.wait("same", (x,)) is True and len(lines) == 2
    assert pre.wait("same", (x,)) is False  # waited for once; later calls are ordinary
    np.testing.assert_array_equal(same(x), _double(x))

    pre.submit("unused", jax.jit(_fails_on_odd), jax.ShapeDtypeStruct((5,), jnp.float32))
  assert "unused: the background compile failed, unused (ValueError: odd rows)" in lines[2]
  assert not [t for t in threading.enumerate() if t.name.startswith(_WORKER)]
