"""Orbax checkpoints of the training state: verified, resumable, restorable onto any mesh.

A checkpoint holds one pytree of arrays (params, optimizer state, RNG key, ...) plus a small JSON
record (step, data position, anything else JSON-able). Restoring takes an abstract tree
(`jax.ShapeDtypeStruct`s with shardings), so a state saved on one mesh restores onto another.

Integrity: orbax keeps no checksums (flipped array bytes restore silently as wrong values), so
each step holds `<step>/lowrl_manifest.json`, the SHA-256 of every file of the step but orbax's
own bookkeeping (`_CHECKPOINT_METADATA`, `commit_success.txt`, which orbax rewrites after the
commit); a restore checks it first. An asynchronous save on one process writes it from orbax's
post-finalization callback, into the step's tmp directory before orbax renames it into place: the
manifest and the checkpoint appear together. Otherwise (a synchronous save, several processes)
process 0 writes it right after the save completes; a step found without one (killed in that
gap, or saved before checksums) is restored only if its recorded step matches and its values are
finite, and the restore says so in one line. Rotation (`max_to_keep`) is ours, not orbax's: an
older checkpoint is deleted only once `max_to_keep` newer ones verify, so a damaged newer one
never rotates the last intact one away. A damaged checkpoint is moved (never deleted) to
`<directory>.damaged/`, and `restore_newest_intact` falls back to the next older one.

Asynchronous saves (`async_save=True`, the training loop's): `save` returns once orbax has the
arrays on the host, and the files are written while training continues. The save is finalized
(waited for, the rotation run) at the next `save`, `wait` or restore. A kill before orbax
commits leaves only its tmp directory (never restorable; the next run in the workdir removes it,
`remove_unfinished`).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from lowrl import distributed
from lowrl.training.optimizer import tree_all_finite

MANIFEST = "lowrl_manifest.json"
_TMP_MARK = ".orbax-checkpoint-tmp"
# Files the digests leave out: the manifest, and orbax's bookkeeping, which orbax rewrites (step
# metadata) or adds (commit marker) after its post-finalization callback (measured, orbax 0.12).
_UNDIGESTED = (MANIFEST, MANIFEST + ".tmp", "_CHECKPOINT_METADATA", "commit_success.txt")


class CheckpointError(RuntimeError):
  """A checkpoint exists but cannot be read; the message names the fix."""


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs (with shardings, where the leaves have them) for `tree`."""
  def leaf(x):
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  return jax.tree.map(leaf, tree)


_all_finite = jax.jit(tree_all_finite)


def _barrier(name: str) -> None:
  """Every process waits here (files written by process 0 are then visible to all)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def all_finite(tree: Any) -> bool:
  """Whether every floating-point leaf of `tree` is finite (integer leaves, e.g. RNG keys, pass)."""
  return bool(_all_finite(tree))


def _file_digests(step_dir: str) -> dict[str, str]:
  """SHA-256 of every file under `step_dir` (the manifest itself excluded), by relative path."""
  out = {}
  for root, dirs, files in os.walk(step_dir):
    dirs.sort()
    for name in sorted(files):
      path = os.path.join(root, name)
      rel = os.path.relpath(path, step_dir)
      if name in _UNDIGESTED:
        continue
      h = hashlib.sha256()
      with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
          h.update(chunk)
      out[rel] = h.hexdigest()
  return out


def write_manifest(step_dir: str) -> None:
  """Records the digests of a completed save (written to a temp file, then renamed: atomic)."""
  tmp = os.path.join(step_dir, MANIFEST + ".tmp")
  with open(tmp, "w") as f:
    json.dump({"sha256": _file_digests(step_dir)}, f, indent=0, sort_keys=True)
  os.replace(tmp, os.path.join(step_dir, MANIFEST))


_NO_MANIFEST = f"no {MANIFEST}"


def _unverifiable(problem: str | None) -> bool:
  """True when `verify_manifest` found nothing wrong, or nothing to check against."""
  return problem is None or problem.startswith(_NO_MANIFEST)


def verify_manifest(step_dir: str) -> str | None:
  """None if every file of the step matches its manifest, else what is wrong (one line)."""
  try:
    with open(os.path.join(step_dir, MANIFEST)) as f:
      expected = json.load(f)["sha256"]
  except FileNotFoundError:
    return f"{_NO_MANIFEST} (the save did not complete, or predates checksums)"
  except (ValueError, KeyError, TypeError) as e:
    return f"{MANIFEST} is unreadable ({e})"
  actual = _file_digests(step_dir)
  expected = {p: d for p, d in expected.items()  # older manifests listed orbax's bookkeeping
              if os.path.basename(p) not in _UNDIGESTED}
  bad = sorted(p for p in expected if actual.get(p) != expected[p])
  extra = sorted(set(actual) - set(expected))
  if bad or extra:
    what = [f"{p} {'missing' if p not in actual else 'changed'}" for p in bad[:3]]
    what += [f"{p} unexpected" for p in extra[:3]]
    more = len(bad) + len(extra) - len(what)
    return "checksum mismatch: " + ", ".join(what) + (f" (+{more} more)" if more > 0 else "")
  return None


def _meta_problem(meta: dict[str, Any], step: int) -> str | None:
  """What is wrong with a restored record of `step` (another step's files moved in), or None."""
  recorded = meta.get("step")
  if recorded is not None and recorded != step:
    return f"its record says step {recorded}: another step's files"
  return None


def read_meta(step_dir: str) -> dict[str, Any] | None:
  """The JSON record of a step read straight from its files (no restore, nothing compiled);
  None when it is missing or unreadable (the restore then reports the damage)."""
  try:
    with open(os.path.join(step_dir, "meta", "metadata")) as f:
      meta = json.load(f)
  except (OSError, ValueError):
    return None
  return meta if isinstance(meta, dict) else None


class Checkpointer:
  """Saves every `every` steps into `directory`, keeps the newest `max_to_keep` intact ones
  (and the steps of `keep`, which `rotate` never deletes and which do not count among them)."""

  def __init__(self, directory: str, every: int, max_to_keep: int = 2, async_save: bool = False,
               keep: tuple[int, ...] = ()):
    if every <= 0:
      raise ValueError(f"checkpoint interval must be > 0 steps, got {every}.")
    if max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}.")
    self.directory = os.path.abspath(directory)
    self.every = every
    self.max_to_keep = max_to_keep
    self.keep = frozenset(keep)
    # Unfinished saves (orbax tmp dirs) found at start: never restorable. Only the directory's
    # owner removes them (`remove_unfinished`): a reader (an export, a report) must not delete a
    # live run's save in flight, and orbax's own clean-up runs on a background thread that a
    # one-line exit would meet mid-way (a traceback at interpreter shutdown).
    self.unfinished = (sorted(d for d in os.listdir(self.directory) if _TMP_MARK in d)
                       if os.path.isdir(self.directory) else [])
    self.async_save = async_save
    self._pending: int | None = None  # a saved step not finalized yet (rotation, manifest)
    # One process: the manifest goes into the tmp directory before orbax commits it. (With
    # several, each writes its own shards: process 0 writes it after the collective wait.)
    in_commit = async_save and jax.process_count() == 1
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None,  # rotation is ours (`_rotate`): only verified checkpoints count
        save_interval_steps=every, cleanup_tmp_directories=False,
        enable_async_checkpointing=async_save,
        async_options=(ocp.AsyncOptions(post_finalization_callback=self._manifest_before_commit)
                       if in_commit else None))
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("state", "meta"))

  def remove_unfinished(self) -> list[str]:
    """Deletes the unfinished saves found at construction (`unfinished`) and returns their names.
    Only for the directory's owner (the run holding the workdir's lock): nothing else writes
    there, so no save found at the start can still be in flight."""
    if distributed.is_primary():
      for name in self.unfinished:
        path = os.path.join(self.directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
          shutil.rmtree(path, ignore_errors=True)
    _barrier("lowrl_remove_unfinished")
    return self.unfinished

  def _manifest_before_commit(self) -> None:
    """orbax's post-finalization callback: the pending step's files are complete in its tmp
    directory, which orbax renames into place next."""
    tmp = os.path.join(self.directory, f"{self._pending}{_TMP_MARK}")
    if self._pending is not None and os.path.isdir(tmp):
      write_manifest(tmp)

  def latest_step(self) -> int | None:
    self.finalize()
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    """Finished checkpoints, oldest first."""
    return sorted(self._manager.all_steps())

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, state: Any, meta: dict[str, Any], force: bool = False) -> bool:
    """Saves if `step` is due (or `force`); returns whether it saved.

    Refuses (CheckpointError) a state with a non-finite floating-point leaf: such a checkpoint
    would rotate good ones away and poison every resume.
    """
    # Our own interval test: orbax's should_save also fires on the first step it ever sees.
    if not force and step % self.every:
      return False
    if not all_finite(state):
      raise CheckpointError(f"Refusing to checkpoint step {step}: the state has non-finite "
                            f"values. {self.last_good_hint()}")
    self.finalize()  # one save in flight at a time
    self._pending = step  # before the save: its callback may run before `save` returns
    try:
      saved = self._manager.save(
          step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                        meta=ocp.args.JsonSave(meta)), force=True)
    except BaseException:
      self._pending = None
      raise
    if not saved:
      self._pending = None
    elif not self.async_save:
      self.finalize()
    return saved

  def finalize(self) -> None:
    """Waits for the save in flight, if any, then writes its manifest and rotates."""
    if self._pending is None:
      return
    step = self._pending
    try:
      self._manager.wait_until_finished()
    finally:
      self._pending = None  # a failed save (e.g. a full disk) is not finalized twice
    if distributed.is_primary() and not os.path.exists(os.path.join(self.step_dir(step),
                                                                    MANIFEST)):
      write_manifest(self.step_dir(step))
    _barrier(f"lowrl_manifest_{step}")
    self._rotate()  # every process: orbax's delete is collective

  def _rotate(self) -> None:
    """Deletes checkpoints older than the newest `max_to_keep` that verify (never an intact one
    that is among them, whatever state newer damaged ones are in)."""
    intact = 0
    for step in reversed(self.all_steps()):
      if step in self.keep:
        continue
      if intact >= self.max_to_keep:
        self._manager.delete(step)
      elif verify_manifest(self.step_dir(step)) is None:
        intact += 1

  def last_good_hint(self) -> str:
    """One sentence naming the newest checkpoint on disk (for error messages)."""
    steps = self.all_steps()
    if not steps:
      return f"No checkpoint in {self.directory} yet."
    return f"The last good checkpoint is step {steps[-1]} in {self.step_dir(steps[-1])}."

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any], int]:
    """Restores (state, meta, step) of `step` (default: the latest) onto `abstract_state`'s shardings.

    Checks the step's checksums first; CheckpointError (nothing deleted) if it is damaged.
    """
    self.finalize()
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"No checkpoint in {self.directory}.")
    problem = verify_manifest(self.step_dir(step))
    if not _unverifiable(problem):
      raise CheckpointError(f"Checkpoint step {step} in {self.directory} is damaged ({problem}). "
                            f"Nothing was deleted. {self._fix_hint(step)}")
    return self._restore_verified(abstract_state, step)

  def _restore_verified(self, abstract_state: Any, step: int) -> tuple[Any, dict[str, Any], int]:
    """`restore` after the checksums were checked by the caller."""
    try:
      out = self._manager.restore(
          step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                        meta=ocp.args.JsonRestore()))
    except Exception as e:  # Orbax raises many types for unreadable / mismatched data.
      raise CheckpointError(
          f"Checkpoint step {step} in {self.directory} cannot be restored ({type(e).__name__}: "
          f"{str(e)[:300]}). Nothing was deleted. {self._fix_hint(step)}") from e
    return out.state, dict(out.meta), step

  def _fix_hint(self, step: int) -> str:
    return (f"To resume from an earlier checkpoint, move {self.step_dir(step)} aside; to start "
            "afresh, use a new --workdir; if the model or optimizer config changed since it was "
            "saved, restore the old config.")

  def restore_newest_intact(self, abstract_for_step: Callable[[int], Any],
                            log: Callable[[str], None]) -> tuple[Any, dict[str, Any], int] | None:
    """The newest checkpoint that verifies, restores and is finite; None if there is none.

    Each damaged newer one is reported through `log` and moved to `<directory>.damaged/` (the
    same step is saved again later). Raises CheckpointError, moving nothing, if checkpoints
    exist but none is intact; a restore that fails for a reason other than damage (e.g. a
    changed model config) raises at once.
    """
    self.finalize()
    steps = self.all_steps()
    damaged = []
    for step in reversed(steps):
      problem = verify_manifest(self.step_dir(step))
      if _unverifiable(problem):
        try:
          state, meta, _ = self._restore_verified(abstract_for_step(step), step)
        except CheckpointError as e:
          if problem is None:  # checksums match: the bytes are as saved, the config is not
            raise
          problem = f"unreadable: {str(e.__cause__ or e)[:200]}"
        else:
          problem = _meta_problem(meta, step) or (
              None if all_finite(state) else "restored state has non-finite values")
          if problem is None:
            for bad_step, why in damaged:
              log(f"[checkpoint] step {bad_step} is damaged ({why}); moved to "
                  f"{self._quarantine(bad_step)} (not deleted); falling back to step {step}.")
            if not os.path.exists(os.path.join(self.step_dir(step), MANIFEST)):
              log(f"[checkpoint] step {step} has no {MANIFEST} (saved before checksums, or "
                  "killed before it was written): restored without a checksum check; its "
                  "recorded step matches and its values are finite.")
            return state, meta, step
      damaged.append((step, problem))
    if damaged:
      lines = "; ".join(f"step {s}: {why}" for s, why in damaged)
      raise CheckpointError(f"No intact checkpoint in {self.directory} ({lines}). Nothing was "
                            "moved or deleted; to start afresh, use a new --workdir.")
    return None

  def _quarantine(self, step: int) -> str:
    dest_root = self.directory + ".damaged"
    os.makedirs(dest_root, exist_ok=True)
    dest, k = os.path.join(dest_root, str(step)), 1
    while os.path.exists(dest):
      dest, k = os.path.join(dest_root, f"{step}.{k}"), k + 1
    if distributed.is_primary():
      shutil.move(self.step_dir(step), dest)
    _barrier(f"lowrl_quarantine_{step}")
    self._manager.reload()
    return dest

  def wait(self) -> None:
    """Finishes (and verifies into a manifest) any save in flight."""
    self.finalize()
    self._manager.wait_until_finished()

  def close(self) -> None:
    self.finalize()
    self._manager.close()
