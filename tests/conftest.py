"""Test setup: 8 fake CPU devices for multi-device tests, deterministic, one compilation cache.

XLA_FLAGS must be set before jax is imported anywhere, so it lives here (pytest imports
conftest.py first).

Matmul precision is left at JAX's default, as production runs it. The suite runs on the CPU
(JAX_PLATFORMS=cpu below), where FP32 dots are computed in FP32: tests whose reference is a closed
form in FP32 or float64 derive their tolerance from that (see each test); on an accelerator's
default (TF32 / BF16-pass) dots those tolerances would not hold.
"""
import os
import pathlib

import file_durations  # noqa: E402  (tests/ is on the path: pyproject's pythonpath)
import multiprocess  # noqa: E402
import run_count  # noqa: E402

for _flag in multiprocess.xla_flags(8).split():
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache for the whole test run: test modules that build the same tiny
# model, sampler or update compile it once. It lives in the (git-ignored) pytest cache folder, so a
# second local run reuses it too; LOWRL_TEST_JAX_CACHE overrides the folder ("" disables it).
# The processes a test launches (the training binary, two-process runs, a killed and resumed run)
# get a cache of their own through JAX's environment variables, shared among them: a program one
# child compiled is not compiled again by the next. It is kept apart from the test workers' because
# children run other XLA clients (1 device, or 2 processes of 4) and JAX's cache key leaves the
# fake device count out: no executable crosses between differently configured clients.
_CACHE_MAX_BYTES = 16 << 30
_cache_dir = os.environ.get(
    "LOWRL_TEST_JAX_CACHE",
    # "jax-lru": a folder of its own for the size-limited (locked) cache, whose eviction reads an
    # access-time file beside every entry; a cache the unlimited one wrote has none.
    str(pathlib.Path(__file__).resolve().parent.parent / ".pytest_cache" / "jax-lru"))
# The binaries' user cache (lowrl.user_cache: their shared mid-trained bases; the compilation cache
# is the one above) also stays in the pytest cache folder, out of the user's ~/.cache. A stored base
# is keyed by lowrl's sources and the XLA flags too, so a later run never reuses a stale one.
os.environ.setdefault("LOWRL_CACHE_DIR", str(
    pathlib.Path(__file__).resolve().parent.parent / ".pytest_cache" / "lowrl"))
if not _cache_dir:
  os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # launched binaries: no cache either
if _cache_dir:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(_cache_dir, "launched")
  # Only programs that take 0.2 s or more to compile: op-by-op (eager) programs compile in
  # milliseconds, and caching them made every process read and write thousands of tiny entries
  # concurrently, for nothing.
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.2"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
  # Processes share each cache folder, and JAX's default (no size limit) reads and writes entries
  # without any lock, writing in place (jax/_src/lru_cache.py, LRUCache.put: `exists()`, then
  # `write_bytes`): a worker can read an entry another is still writing, and two writers of one
  # key truncate each other's file (zlib's checks catch a torn entry in Python, so JAX recompiles;
  # docs/integrity.md). A size limit turns on JAX's own file lock (filelock) around every read
  # and write; 16 GiB is never reached by the suite, so nothing is evicted.
  os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(_CACHE_MAX_BYTES)

import jax  # noqa: E402

import fusion_emitters  # noqa: E402

fusion_emitters.install()

if _cache_dir:  # the workers' own cache (the variables above are what launched processes read)
  jax.config.update("jax_compilation_cache_dir", os.path.join(_cache_dir, "workers"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  jax.config.update("jax_compilation_cache_max_size", _CACHE_MAX_BYTES)

from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


# Test files longest first (tests/file_durations.py: the measured seconds per file in
# tests/data/durations.json, and the command that regenerates it). A file the table lacks runs
# after those it has, in its usual order.
_FILE_SECONDS = file_durations.load()


def pytest_collection_modifyitems(config, items):
  """Reorders test files longest first (a stable sort: tests in a file keep their order)."""
  del config
  items.sort(key=lambda item: -_FILE_SECONDS.get(item.nodeid.split("::", 1)[0], 0.0))


def pytest_configure(config):
  """A run in which collected tests never ran (a crashed worker) fails, naming them."""
  run_count.register(config)
