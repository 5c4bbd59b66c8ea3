"""Orbax checkpoints of the training state, resumable and restorable onto any mesh.

A checkpoint holds one pytree of arrays (params, optimizer state, RNG key, ...) plus a small JSON
record (step, data position, anything else JSON-able). Restoring takes an abstract tree
(`jax.ShapeDtypeStruct`s with shardings), so a state saved on one mesh restores onto another.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp


class CheckpointError(RuntimeError):
  """A checkpoint exists but cannot be read; the message names the fix."""


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs (with shardings, where the leaves have them) for `tree`."""
  def leaf(x):
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  return jax.tree.map(leaf, tree)


class Checkpointer:
  """Saves every `every` steps into `directory`, keeps the newest `max_to_keep`."""

  def __init__(self, directory: str, every: int, max_to_keep: int = 2):
    if every <= 0:
      raise ValueError(f"checkpoint interval must be > 0 steps, got {every}.")
    self.directory = os.path.abspath(directory)
    self.every = every
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, save_interval_steps=every,
        # Synchronous saves: a run killed right after a save must find it complete.
        enable_async_checkpointing=False)
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, meta: dict[str, Any], force: bool = False) -> bool:
    """Saves if `step` is due (or `force`); returns whether it saved."""
    # Our own interval test: orbax's should_save also fires on the first step it ever sees.
    if not force and step % self.every:
      return False
    return self._manager.save(
        step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                      meta=ocp.args.JsonSave(meta)), force=True)

  def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any], int]:
    """Restores (state, meta, step) of `step` (default: the latest) onto `abstract_state`'s shardings."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f"No checkpoint in {self.directory}.")
    try:
      out = self._manager.restore(
          step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                        meta=ocp.args.JsonRestore()))
    except Exception as e:  # Orbax raises many types for unreadable / mismatched data.
      raise CheckpointError(
          f"Checkpoint step {step} in {self.directory} cannot be restored ({type(e).__name__}: "
          f"{str(e)[:300]}). Nothing was deleted. To resume from an earlier checkpoint, move "
          f"{os.path.join(self.directory, str(step))} aside; to start afresh, use a new --workdir; "
          "if the model or optimizer config changed since it was saved, restore the old config."
      ) from e
    return out.state, dict(out.meta), step

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()
