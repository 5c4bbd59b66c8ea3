"""The store of mid-trained bases, shared by runs: one base per fingerprint, published atomically.

A base is determined by its fingerprint (`sft.fingerprint`: task, model, SFT settings and seed;
not where it is stored), so every run that asks for the same base can reuse one copy.
`sft.base_dir` says where the store is:
  ''      the shared store, `<user cache>/bases` (lowrl.user_cache.root(): $LOWRL_CACHE_DIR,
          $XDG_CACHE_HOME/lowrl or ~/.cache/lowrl), the default;
  'none'  the run's own `<workdir>/base` (nothing shared);
  a path  that directory (e.g. one per experiment).

The store's key is the fingerprint plus `environment_key()`: a hash of lowrl's sources, the
jax/jaxlib/numpy versions, the backend and device kind and XLA_FLAGS. A base from other code or
another compiler setting (whose SFT could round differently) is then another entry, never reused
by mistake: a run that reuses a base is bit for bit the run that trained it.

Safe across concurrent runs: a run that has to train the base saves it into a temporary
directory of its own in the store, verifies it (the checkpoint's SHA-256 manifest), then renames
it to `<store>/<fingerprint>` in one step; a reader never sees a half-written base, and when two
runs train the same base the second rename fails and that run keeps what it trained (the same
numbers: training is deterministic in the fingerprint's seed). A stored base is used only if its
checksums match, its record names the key it is stored under and the SFT step count asked for (an
entry copied, renamed or synced in under another base's key is not that base), and it restores
with finite values; otherwise it is moved aside to `<store>/<fingerprint>.damaged-<id>` (never
deleted) and trained again, not used.

A publisher holds an exclusive lock (`flock`) on `<tmp>.lock` beside its temporary directory
from before the directory exists until it is renamed or removed. Every run that opens the store
first removes the temporary directories whose lock no process holds (their run died, e.g. killed
mid-publish: the kernel drops the lock with the process), never one whose owner is alive. A
temporary directory without a lock file (a publish of a lowrl from before the locks) is removed
once nothing in it changed for `STALE_UNLOCKED_S`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import os
import shutil
import time
import uuid
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from lowrl import distributed, sharding, user_cache
from lowrl.checkpoints import hf
from lowrl.models import init
from lowrl.models.config import ModelConfig
from lowrl.tasks.base import Task
from lowrl.training import outliers, sft
from lowrl.training.checkpointing import (Checkpointer, CheckpointError, _barrier, all_finite,
                                          read_meta, verify_manifest)

SHARED, PRIVATE = "", "none"
_TMP = ".tmp-"
_DAMAGED = ".damaged-"
_LOCK = ".lock"  # `<tmp>.lock`: held by the publisher writing `<tmp>`
# A temporary directory with no lock file is a publish of a lowrl from before the locks: with no
# way to tell whether it is alive, it counts as dead once nothing in it changed for a day (a
# publish writes its files within minutes of creating the directory).
STALE_UNLOCKED_S = 24 * 3600


def store_dir(base_dir: str, workdir: str) -> str:
  """The store of a run's `sft.base_dir` (see the module docstring)."""
  if base_dir == SHARED:
    return os.path.join(user_cache.root(), "bases")
  if base_dir == PRIVATE:
    return os.path.join(workdir, "base")
  return base_dir


@functools.lru_cache(maxsize=1)
def environment_key() -> str:
  """8 hex digits of everything besides the fingerprint that could change a trained base."""
  h = hashlib.sha256()
  package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for root, dirs, files in os.walk(package):
    dirs.sort()
    for name in sorted(f for f in files if f.endswith(".py")):
      path = os.path.join(root, name)
      h.update(os.path.relpath(path, package).encode())
      with open(path, "rb") as f:
        h.update(hashlib.sha256(f.read()).digest())
  import jaxlib  # noqa: PLC0415
  device = jax.devices()[0]
  # The fake CPU device count changes no program the base is trained with.
  xla_flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
               if not f.startswith("--xla_force_host_platform_device_count")]
  h.update(repr((jax.__version__, jaxlib.__version__, np.__version__, device.platform,
                 device.device_kind, sorted(xla_flags))).encode())
  return h.hexdigest()[:8]


def _run_id() -> str:
  """A name part unique to this run, the same on every process (they save together)."""
  token = np.frombuffer(uuid.uuid4().bytes[:8], np.int32).copy()
  return "".join(f"{int(v) & 0xFFFFFFFF:08x}" for v in distributed.broadcast_from_primary(token))


def _identity_problem(saved: dict[str, Any], key: str, meta: dict[str, Any]) -> str | None:
  """Why the record `saved` of an entry stored under `key` is not the base asked for (`meta`:
  what that base's record holds besides its key), or None."""
  wrong = sorted(k for k in meta if saved.get(k) != meta[k])
  if saved.get("fingerprint") == key and not wrong:
    return None
  recorded = saved.get("fingerprint")
  theirs = ", ".join(f"{k} {saved.get(k)}" for k in wrong)
  ours = ", ".join(f"{k} {meta[k]}" for k in wrong)
  return (f"its record names {f'base {recorded}' if recorded else 'no base'}"
          f"{f' ({theirs})' if wrong else ''}, not {key}{f' ({ours})' if wrong else ''}: another "
          "base's entry under this key")


def _find(path: str, abstract: Any, key: str, meta: dict[str, Any]
          ) -> tuple[Any, dict[str, Any]] | str:
  """(params, meta) of the base published at `path` under `key`, or why it cannot be used (one
  line); `meta`: the record the base asked for was saved with (`_identity_problem`)."""
  ckpt = Checkpointer(path, every=1, max_to_keep=1)
  step = ckpt.latest_step()
  if step is None:
    return "no complete checkpoint in it"
  problem = verify_manifest(ckpt.step_dir(step))
  if problem is not None:
    return problem
  # Checked before the restore (nothing read or compiled yet), and again on the restored record
  # in case the file could not be read directly.
  saved = read_meta(ckpt.step_dir(step))
  if saved is not None and (problem := _identity_problem(saved, key, meta)) is not None:
    return problem
  try:
    out, saved, _ = ckpt.restore({"params": abstract}, step=step)
  except CheckpointError as e:
    return str(e.__cause__ or e)[:200]
  if (problem := _identity_problem(saved, key, meta)) is not None:
    return problem
  if not all_finite(out):  # the tree `Checkpointer.save` checked: the same (cached) program
    return "it holds non-finite values"
  return out["params"], saved


def _move_aside(path: str, run_id: str) -> str:
  dest = path + _DAMAGED + run_id
  if distributed.is_primary():
    try:
      os.rename(path, dest)
    except FileNotFoundError:  # another run moved it first
      pass
  _barrier(f"lowrl_base_aside_{run_id}")
  return dest


def _age_s(path: str) -> float:
  """Seconds since anything under `path` last changed (its newest modification time)."""
  newest = 0.0
  for root, dirs, files in os.walk(path):
    for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
      with contextlib.suppress(OSError):  # removed meanwhile
        newest = max(newest, os.lstat(name).st_mtime)
  return time.time() - newest if newest else 0.0


def remove_stale_publishes(store: str) -> list[str]:
  """Removes the temporary publishes in `store` that no live process owns (the module docstring);
  returns their names. A live publisher's lock is never taken, so its directory stays."""
  try:
    names = os.listdir(store)
  except OSError:  # no store yet
    return []
  tmps = sorted({n.removesuffix(_LOCK) for n in names if n.startswith(_TMP)})
  removed = []
  for name in tmps:
    tmp = os.path.join(store, name)
    try:
      fd = os.open(tmp + _LOCK, os.O_RDONLY)  # flock needs no write access
    except FileNotFoundError:  # a lowrl from before the locks, or published meanwhile
      if os.path.isdir(tmp) and _age_s(tmp) > STALE_UNLOCKED_S and _remove(tmp):
        removed.append(name)
      continue
    except OSError:  # unreadable: not ours to judge
      continue
    try:
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:  # its publisher is alive
        continue
      # Ours now: its publisher died (or finished, and `tmp` is gone).
      if _remove(tmp):
        with contextlib.suppress(OSError):
          os.unlink(tmp + _LOCK)
        removed.append(name)
    finally:
      os.close(fd)
  return removed


def _remove(path: str) -> bool:
  """Deletes the tree `path` if it can; whether it is gone."""
  shutil.rmtree(path, ignore_errors=True)
  return not os.path.lexists(path)


@contextlib.contextmanager
def _owned(tmp: str):
  """Holds `<tmp>.lock` while `tmp` is written and published (the primary process's); on the
  way out a `tmp` still there (not renamed: a failed save) is removed, then the lock file."""
  if not distributed.is_primary():
    yield
    return
  fd = os.open(tmp + _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX)  # a new name: nothing else holds it
    yield
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp + _LOCK)
    os.close(fd)


def load_or_train(store: str, fingerprint: str, abstract: Any, train: Callable[[], Any],
                  meta: dict[str, Any], log: Callable[[str], None]) -> Any:
  """The base `fingerprint` (its store key) from `store` (restored onto `abstract`'s shardings),
  or `train()`'s, published there. `train` is called on every process (it returns the global params);
  `meta` is saved with it, and a stored base whose record differs from it (or names another key)
  is not used. Stale temporary publishes are removed first (`remove_stale_publishes`)."""
  path = os.path.join(store, fingerprint)
  run_id = _run_id()
  if distributed.is_primary():
    stale = remove_stale_publishes(store)
    if stale:
      log(f"[sft] removed {len(stale)} temporary publish(es) of runs that are no longer running "
          f"from {store}: {', '.join(stale)}")
  _barrier(f"lowrl_base_stale_{run_id}")
  if os.path.isdir(path):
    found = _find(path, abstract, fingerprint, meta)
    if not isinstance(found, str):
      params, saved = found
      log(f"[sft] reusing base {fingerprint} from {store} (trained {saved.get('sft_steps')} "
          "steps)")
      return params
    dest = _move_aside(path, run_id)
    log(f"[warn] base {fingerprint} in {store} is damaged ({found}); moved to {dest} (not "
        "deleted); training it again")
  params = train()
  os.makedirs(store, exist_ok=True)
  tmp = os.path.join(store, _TMP + fingerprint + "-" + run_id)
  published = True
  with _owned(tmp):
    ckpt = Checkpointer(tmp, every=1, max_to_keep=1)
    ckpt.save(0, {"params": params}, {**meta, "fingerprint": fingerprint}, force=True)
    ckpt.close()  # the save is complete and its manifest written
    if distributed.is_primary():
      try:
        os.rename(tmp, path)  # atomic; fails if another run published this base meanwhile
      except OSError:
        published = False  # `_owned` removes `tmp`
    _barrier(f"lowrl_base_publish_{run_id}")
  if published:
    log(f"[sft] saved base {fingerprint} to {store}")
  else:
    log(f"[sft] base {fingerprint} was published to {store} by another run meanwhile; this run "
        "keeps the one it trained (the same numbers)")
  return params


@dataclasses.dataclass(frozen=True)
class BaseConfig:
  """Where a run's base comes from (built once by `lowrl.training.setup.build`)."""

  hf_checkpoint: str  # model.hf_checkpoint: '' = the mid-trained base of `sft`
  param_dtype: str  # model.param_dtype: the checkpoint's params' dtype
  base_dir: str  # sft.base_dir (`store_dir`)
  sft: sft.SFTConfig
  seed: int  # sft.seed, or the run's seed when it is -1
  fingerprint: str  # sft.fingerprint of the run's task, model, sft section and `seed`
  outliers: tuple[int, float] = (0, 1.0)  # sft.outlier_channels, sft.outlier_gain (`outliers`)


def load_base(base: BaseConfig, task: Task, model_cfg: ModelConfig, plan: sharding.ShardingPlan,
              workdir: str, log: Callable[[str], None],
              on_sft_loss: Callable[[int, float], None] | None = None) -> Any:
  """A run's base params: with `base.hf_checkpoint` the checkpoint's, placed with the mesh's
  parameter shardings (each process reads only the slices its devices hold); otherwise the
  mid-trained base from the store of `base.base_dir` (`load_mid_trained`)."""
  shapes = init.param_shapes(model_cfg)
  if base.hf_checkpoint:
    log(f"[base] loading {base.hf_checkpoint} ({base.param_dtype}, sharded)")
    params = hf.load_hf_params(base.hf_checkpoint, model_cfg, dtype=jnp.dtype(base.param_dtype),
                               shardings=plan.param_shardings(shapes))
  else:
    params = load_mid_trained(store_dir(base.base_dir, workdir), task, base, model_cfg, plan,
                              log, on_sft_loss)
  if base.outliers[0]:
    log(f"[base] {base.outliers[0]} outlier channels planted, gain {base.outliers[1]:g}")
    params = outliers.plant(params, model_cfg, *base.outliers)
  return params


def load_mid_trained(store: str, task: Task, base: BaseConfig, model_cfg: ModelConfig,
                     plan: sharding.ShardingPlan, log: Callable[[str], None],
                     on_sft_loss: Callable[[int, float], None] | None = None) -> Any:
  """The training loop's base (`sft.train_base` of the run's task, `base.sft` and `base.seed`)
  from `store`, replicated over `plan`'s mesh; trained and published if missing or damaged.

  A stored base is restored onto this run's mesh, whichever topology saved it. With several
  processes orbax must see global arrays, so process 0 trains the base (SFT is not sharded) and
  broadcasts it before it is saved.
  """
  shapes = init.param_shapes(model_cfg)
  repl = jax.tree.map(lambda _: plan.replicated, shapes)

  def train():
    if jax.process_count() == 1:
      return sft.train_base(task, model_cfg, base.sft, base.seed, log, on_sft_loss)
    if distributed.is_primary():
      params = jax.tree.map(np.asarray, sft.train_base(task, model_cfg, base.sft, base.seed, log,
                                                       on_sft_loss))
    else:
      params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    return plan.put(distributed.broadcast_from_primary(params), repl)

  key = f"{base.fingerprint}-{environment_key()}"
  return load_or_train(store, key, sharding.abstract(shapes, repl), train,
                       {"sft_steps": int(base.sft.steps)}, log)
