"""The checkpointed state tree of an RL run: its entries, the parameter versions a checkpoint at a
step holds, the initial state (from the base or the newest intact checkpoint) and the final
params of a finished run.

The tree is {"params", "opt_state", "rng" (the run key's data), "ref_params" (when the run keeps a
reference), "versions" ({str(version): params} the schedule still needs, the newest excluded: it
is "params")}; orbax stores no None leaves, so absent entries are left out.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import ml_collections

from lowrl import sharding
from lowrl.models import lora
from lowrl.training import base_store, optimizer, storage
from lowrl.training.checkpointing import Checkpointer
from lowrl.training.schedule import AsyncSchedule, VersionBuffer
from lowrl.training.setup import build
from lowrl.training.trainer import Log, Trainer

CHECKPOINTS = "checkpoints"  # the run's checkpoint directory under its workdir


def state_tree(params, opt_state, rng, ref_params, versions: dict[str, Any]) -> dict[str, Any]:
  """The checkpointed tree; absent entries are left out (orbax stores no None leaves)."""
  state = {"params": params, "opt_state": opt_state, "rng": rng}
  if ref_params is not None:
    state["ref_params"] = ref_params
  if versions:
    state["versions"] = versions
  return state


def state_at(state: dict[str, Any], schedule: AsyncSchedule, step: int) -> dict[str, Any]:
  """The tree a checkpoint at `step` holds (which old versions it has depends on the step), with
  every version shaped as `state["params"]`."""
  buf = VersionBuffer(schedule)
  for v in range(step + 1):
    buf.put(v, state["params"])
  buf.evict_before(step)
  old = {str(v): state["params"] for v in buf.versions() if v != step}
  return state_tree(state["params"], state["opt_state"], state["rng"], state.get("ref_params"),
                    old)


def initial_state(trainer: Trainer, ckpt: Checkpointer, base, resuming: bool, workdir: str,
                  log: Log) -> tuple[int, dict[str, Any], VersionBuffer]:
  """(start step, state tree, version buffer): from the base, or from the newest intact
  checkpoint when resuming; on the mesh (a host-stored reference stays on the host)."""
  setup = trainer.setup
  knobs = setup.loop
  base = trainer.place(optimizer.to_master(trainer.with_adapters(base), knobs.master_dtype))
  # The update donates `params`: the reference needs buffers of its own (`storage.keep`).
  ref = storage.keep(base, knobs.ref_storage) if knobs.keep_reference else None
  state = state_tree(base, trainer.init_opt_state(base),
                     jax.random.key_data(jax.random.key(knobs.seed)), ref, {})
  host_ref = knobs.ref_storage == "host" and ref is not None
  state = trainer.place({k: v for k, v in state.items() if not (host_ref and k == "ref_params")})
  if host_ref:  # `place` would move it to device memory
    state["ref_params"] = ref
  start = 0
  if resuming:
    def abstract_for(step: int):
      # A LoRA run's checkpoint holds the adapters alone (Trainer.checkpointed).
      shapes = jax.eval_shape(lambda: trainer.checkpointed(state_at(state, setup.schedule, step)))
      # Restores onto this run's mesh, whatever mesh saved it.
      return sharding.abstract(shapes, trainer.state_shardings(shapes))
    frozen = lora.split(state["params"])[0]  # a LoRA run's base, placed (unused otherwise)
    state, meta, start = ckpt.restore_newest_intact(abstract_for, log)
    # The reference and the versions are copied below (storage.keep): only params keeps `frozen`.
    state = trainer.restored(state, frozen)
    log(f"[resume] from step {start} (data position {meta['data_position']}) in {workdir}")
    if "ref_params" in state:  # restored onto the devices: back where the run keeps it
      state["ref_params"] = storage.keep(state["ref_params"], knobs.ref_storage)
  versions = VersionBuffer(setup.schedule)
  for v, p in state.get("versions", {}).items():
    versions.put(int(v), storage.keep(p, knobs.version_storage))
  return start, state, versions


def final_params(cfg: ml_collections.ConfigDict, workdir: str, trainer: Trainer | None = None
                 ) -> Any:
  """The policy params of the finished run of `cfg` in `workdir` (its step-`rl.steps`
  checkpoint, checksums verified), on `trainer`'s mesh (a Trainer of `cfg` built if None)."""
  return params_at(cfg, workdir, None, trainer)


def params_at(cfg: ml_collections.ConfigDict, workdir: str, step: int | None,
              trainer: Trainer | None = None) -> Any:
  """The policy params of the step-`step` checkpoint (None = rl.steps) of the run of `cfg` in
  `workdir` (checksums verified; a step the run kept: checkpoint_keep_fractions), on
  `trainer`'s mesh (a Trainer of `cfg` built if None)."""
  trainer = trainer or Trainer(build(cfg), log=lambda _: None)
  knobs = trainer.setup.loop
  step = knobs.steps if step is None else step
  params = jax.eval_shape(lambda p: optimizer.to_master(p, knobs.master_dtype),
                          trainer.param_shapes)
  state = jax.eval_shape(lambda p: state_tree(
      p, trainer.opt_init(p), jax.random.key_data(jax.random.key(0)),
      p if knobs.keep_reference else None, {}), params)
  state = trainer.checkpointed(state_at(state, trainer.setup.schedule, step))
  ckpt = Checkpointer(os.path.join(workdir, CHECKPOINTS), every=knobs.checkpoint_every)
  restored, _, _ = ckpt.restore(sharding.abstract(state, trainer.state_shardings(state)),
                                step=step)
  if trainer.setup.lora is not None:  # the checkpoint holds the adapters: + the run's base
    setup = trainer.setup
    base = base_store.load_base(setup.base, setup.task, setup.model_cfg, setup.plan, workdir,
                                log=lambda _: None)
    restored = trainer.restored(restored, trainer.place(optimizer.to_master(
        base, knobs.master_dtype)))
  return restored["params"]
