"""Where lowrl keeps what outlives a run, and the persistent JAX compilation cache of the binaries.

The user cache root is `$LOWRL_CACHE_DIR`, else `$XDG_CACHE_HOME/lowrl`, else `~/.cache/lowrl`.
Under it: `jax/` (the compilation cache every binary in `experiments/` turns on) and `bases/`
(the shared mid-trained bases, `lowrl.training.base_store`).

Why a cache cannot change a result: JAX keys an entry by the program's HLO, the compile options,
the XLA flags, the devices and the jax/jaxlib version, and an entry is the executable XLA built
for that key, loaded back as is. A cached run runs the very machine code the uncached run
compiled, so its numbers are bit-identical (tests/training/test_repeat_run.py checks
`metrics.jsonl` byte for byte).

Binaries: `define_compile_cache_flag()` at import (beside the other flags), then
`enable_compile_cache()` at the top of `main`, before anything compiles.
"""
from __future__ import annotations

import os
import sys

import jax
from absl import flags

ENV_ROOT = "LOWRL_CACHE_DIR"
DISABLED = "none"
# Every program is written (JAX's default skips those under 1 s): a run of the main job compiles
# about 50 programs, and on a loaded machine the small ones are most of a repeat run's compiling.
MIN_COMPILE_SECS = 0.0
_FLAG = "compile_cache"


def root() -> str:
  """The user cache root: $LOWRL_CACHE_DIR, $XDG_CACHE_HOME/lowrl or ~/.cache/lowrl."""
  if os.environ.get(ENV_ROOT):
    return os.path.abspath(os.path.expanduser(os.environ[ENV_ROOT]))
  xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(os.path.abspath(xdg), "lowrl")


def default_compile_cache() -> str:
  """The compilation cache of the binaries when neither the flag nor JAX's variable says."""
  return os.path.join(root(), "jax")


def define_compile_cache_flag(module_name: str | None = None) -> flags.FlagHolder:
  """Defines `--compile_cache` (idempotent: binaries that share a module may both call it);
  `module_name`: the binary whose --help lists it (default: the calling module)."""
  if _FLAG in flags.FLAGS:
    return flags.FlagHolder(flags.FLAGS, flags.FLAGS[_FLAG])
  if module_name is None:
    caller = sys._getframe(1).f_globals  # noqa: SLF001 - the binary defining its flags
    module_name = sys.argv[0] if caller["__name__"] == "__main__" else caller["__name__"]
  return flags.DEFINE_string(
      _FLAG, "", "Persistent JAX compilation cache directory ('none' disables it). Default: "
      "$JAX_COMPILATION_CACHE_DIR if set, else <user cache>/jax, the user cache being "
      "$LOWRL_CACHE_DIR, $XDG_CACHE_HOME/lowrl or ~/.cache/lowrl. Cached programs are the same "
      "executables: results are bit-identical with or without it.", module_name=module_name)


def enable_compile_cache(where: str | None = None) -> str | None:
  """Turns the persistent compilation cache on (or off); returns its directory (None: off).

  `where`: a directory, 'none' (off), or '' / None = `--compile_cache` when that flag is defined
  and parsed, else what JAX was already told ($JAX_COMPILATION_CACHE_DIR, e.g. by the tests, or
  $JAX_ENABLE_COMPILATION_CACHE=false), else `default_compile_cache()`. Call before the first
  compile.
  """
  if not where and _FLAG in flags.FLAGS and flags.FLAGS.is_parsed():
    where = flags.FLAGS[_FLAG].value
  if where == DISABLED:
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  if not where and not jax.config.jax_enable_compilation_cache:
    return None  # turned off by the caller ($JAX_ENABLE_COMPILATION_CACHE=false)
  if not where and jax.config.jax_compilation_cache_dir:
    return jax.config.jax_compilation_cache_dir  # set up by the caller: keep its settings
  path = os.path.abspath(os.path.expanduser(where or default_compile_cache()))
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", path)
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
  return path
