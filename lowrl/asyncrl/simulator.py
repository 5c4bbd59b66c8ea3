"""A fast asynchronous-RL simulator: all the policy updates of a run are one jitted `lax.scan`.

The pieces are the real loop's (lowrl.training.loop), called from inside the scan: the decoder
(`lowrl.models.transformer`) under the sampler's and the trainer's precision policies
(`lowrl.precision`, quantized through `lowrl.quant`), the sampler's prefill + decode
(`lowrl.sampling.generate_in_jit`, exact mode re-scoring included), the loop's RL step
(`lowrl.training.step.make_step`: overlong penalty, group advantages, dynamic sampling, the drift
decomposition and the pure update with its losses, TIS/MIS corrections, KL to a reference and
optimizer), the supervised step of the loop's base (`lowrl.training.sft.make_sft_step`) and the
staleness schedule (`AsyncSchedule`). What is small is the rest:
a tiny decoder on a synthetic sequential task whose reward is computed in JAX (`SequenceTask`),
so nothing leaves the device between updates and thousands of updates run per minute on a CPU.

Asynchrony inside the scan: the VersionBuffer becomes a ring of parameter slots (a stacked
pytree). `AsyncSchedule.ring_plan` says, per step, whether the current params are synced into a
slot and which slot holds the version that samples the step's batch; the version number stored
with each slot is logged (`sampler_version`), so a test can check that the scan sampled with
exactly `AsyncSchedule.sampler_version(t)`.

A run (`simulate`, one program per seed, the same for every seed): `initial_params` (random init + optional supervised warm
start), greedy `evaluate` in the trainer's precision on the held-out split (`SequenceTask.prompts`:
problems training never draws), the training scan (`make_train`), `evaluate` again. Step t of the scan (its keys from fold_in(k_steps, t)):
  1. sync: if t % sync_every == 0, params (version t) go into their ring slot;
  2. sample: the ring's version sampler_version(t), in the sampler's precision, generates
     group_size completions for each of num_prompts prompts (temperature 1);
  3. reward in JAX;
  4. the trainer scores the batch with the sampler's (stale) weights and with the current
     weights (pi_old), both in the trainer's precision, and the current weights are scored in the
     sampler's precision (the fourth score of the order-symmetric drift split, lowrl.rl.drift;
     with identical recipes it is pi_old itself);
  5. the loop's RL step: batch (advantages), drift (quantization / staleness / total parts), the
     pure update (correction, KL to the starting policy when rl.kl_coef > 0, mu x
     num_minibatches optimizer steps).
Every step's scalar metrics come back as [steps] arrays.

Schedules (`async_rl.schedule`): fifo (default), independent and length change only the ring plan
(which slot samples step t); pipeline (PipelineSchedule) draws completion token j from the slot
`token_read_slot[t, j]` (`pipeline_rollout`) and takes each token's stale score from the trainer's
scores under every slot. lag='auto' and the run's clock come from lowrl.asyncrl.timing.
The pieces live by concern: `task` (SequenceTask), `setup` (SCHEMA, SimSetup, build, the lag and
schedule of a setting), `scan` (the jitted run: rollouts, calibration, evaluate, warm start,
make_train); this module compiles them (one cache per program) and runs a setting over seeds
(`simulate`), and re-exports their public names.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# The public names of the simulator's pieces (task, setting, one run), so callers import one module.
from lowrl.asyncrl.scan import (  # noqa: F401
    calib_key, calibrate, eval_key, evaluate, initial_params, make_rl_step, make_train,
    pipeline_rollout, reset_plan, rollout, sampled_correct, sampler_score,
    sampler_scores_are_trainers, warm_start)
from lowrl.asyncrl.setup import (ACT_CALIBRATIONS, AUTO, RECIPE_COMPONENTS,  # noqa: F401
                                 SCHEDULE_KINDS, SCHEMA, SimSetup, build, default_config, lag_of,
                                 schedule_of)
from lowrl.asyncrl.task import REWARD_KINDS, SPLITS, TASK_KINDS, SequenceTask  # noqa: F401
from lowrl.rl.corrections import CorrectionConfig
from lowrl.rl.losses import LossConfig
from lowrl.training.rl_update import UpdateConfig
from lowrl.training.schedule import AsyncSchedule, PipelineSchedule

_LIVE_PROGRAMS = 4  # compiled programs of each kind kept alive (see _init_eval)


@dataclasses.dataclass(frozen=True)
class SimResult:
  """One setting's runs. `metrics`: numpy [S, steps] per-step scalars and [S] eval scalars."""

  params: Any  # final params, stacked over seeds
  metrics: dict[str, np.ndarray]
  compile_s: float  # 0 when the programs were already compiled
  run_s: float

  @property
  def updates_per_minute(self) -> float:
    seeds, steps = self.metrics["reward/mean"].shape
    return 60.0 * seeds * steps / max(self.run_s, 1e-9)


def _specs(setup: SimSetup):
  key = jax.eval_shape(lambda: jax.random.key(0))
  return key, jax.eval_shape(functools.partial(initial_params, setup), key)


def _eval_view(setup: SimSetup) -> SimSetup:
  """The setup with the fields initial_params and evaluate do not read made canonical, so that
  settings differing only there share those compiled programs."""
  return dataclasses.replace(setup, sampler_policy=setup.trainer_policy,
                             update_cfg=UpdateConfig(LossConfig(), CorrectionConfig()), steps=1,
                             num_prompts=1, group_size=2, advantage="grpo", sampler_exact=False,
                             std_ddof=0, batch_cfg=None, eval_every=0, pass_eval_every=0)


# One program per seed, the same for every seed and every number of seeds: a seed is a unit, so
# seeds 0-2 alone give bit for bit what they give inside a 10-seed run. (A vmap over seeds made
# one program per seed count, and XLA rounds a batched program differently: seed 0's base and
# outcome changed with the number of seeds beside it. experiments/bench_seeds.py measures both.)
#
# Few live programs: each compiled whole-run program holds thousands of LLVM JIT memory mappings,
# and a sweep holding ~26 of them aborted twice at Linux's vm.max_map_count (65,530) with
# "LLVM ERROR: Unable to allocate section memory" (docs/integrity.md). Settings that share a
# program run consecutively, and a program evicted and needed again loads from the persistent
# compilation cache.
@functools.lru_cache(maxsize=_LIVE_PROGRAMS)
def _init_eval(setup: SimSetup) -> tuple[Any, Any, float]:
  """Compiled one-seed initial_params and evaluate, and how long compiling took."""
  t0 = time.perf_counter()
  key, params = _specs(setup)
  init = jax.jit(functools.partial(initial_params, setup)).lower(key).compile()
  ev = jax.jit(lambda p, k: evaluate(setup, p, eval_key(k))).lower(params, key)
  return init, ev.compile(), time.perf_counter() - t0


@functools.lru_cache(maxsize=_LIVE_PROGRAMS)
def _pass_eval(setup: SimSetup) -> tuple[Any, float]:
  """Compiled one-seed sampled_correct on the eval key, and how long compiling took."""
  t0 = time.perf_counter()
  key, params = _specs(setup)
  pe = jax.jit(lambda p, k: sampled_correct(setup, p, eval_key(k)))
  return pe.lower(params, key).compile(), time.perf_counter() - t0


@functools.lru_cache(maxsize=_LIVE_PROGRAMS)
def _train(setup: SimSetup, num_slots: int, resets: bool = False) -> tuple[Any, float]:
  """The compiled one-seed training scan, and how long compiling took."""
  t0 = time.perf_counter()
  key, params = _specs(setup)
  plan = {"write": jax.ShapeDtypeStruct((setup.steps,), jnp.bool_),
          "write_slot": jax.ShapeDtypeStruct((setup.steps,), jnp.int32),
          "read_slot": jax.ShapeDtypeStruct((setup.steps,), jnp.int32)}
  if resets:
    plan["ref_reset"] = jax.ShapeDtypeStruct((setup.steps,), jnp.bool_)
  if setup.pipeline:
    plan["token_read_slot"] = jax.ShapeDtypeStruct((setup.steps, setup.task.length), jnp.int32)
  train = jax.jit(make_train(setup, num_slots)).lower(params, key, plan).compile()
  return train, time.perf_counter() - t0


def _compiled(cache, *args) -> tuple[Any, float]:
  """`cache(*args)` without its seconds, and the compile seconds it cost now (0 on a hit)."""
  misses = cache.cache_info().misses
  *programs, seconds = cache(*args)
  fresh = cache.cache_info().misses > misses
  return (programs[0] if len(programs) == 1 else tuple(programs)), (seconds if fresh else 0.0)


def simulate(setup: SimSetup, schedule: AsyncSchedule, seeds: Sequence[int],
             num_slots: int | None = None,
             ref_reset_every: Sequence[int] | None = None) -> SimResult:
  """Runs one setting for every seed: one compiled program per (setup, slots), called per seed,
  so a seed's numbers do not depend on the other seeds of the call.

  Seed s runs from `jax.random.key(s)` with `schedule` re-seeded by s (its lag draws). A fixed
  `num_slots` >= every schedule's `max_versions` lets settings that differ only in lag or sync
  interval share one compiled program; the results do not depend on it.

  `ref_reset_every` (one int per seed, needs rl.kl_coef > 0): steps between resets of the KL
  reference to the current params (`scan.reset_plan`; 0 = fixed), a runtime input, so runs with
  and without resets share one program (a seed may repeat, one run per period). None: the
  reference is fixed and the program is the plain one. With `setup.pass_eval_every`, the metrics
  add `eval/start/pass_correct` [S, eval_num_prompts] (the start params' `sampled_correct`).
  """
  if not seeds:
    raise ValueError("simulate needs at least one seed.")
  if setup.pass_eval_every and setup.pass_eval_samples < 1:
    raise ValueError(f"pass_eval_every={setup.pass_eval_every} needs pass_eval_samples >= 1 "
                     f"(completions per held-out prompt), got {setup.pass_eval_samples}.")
  if ref_reset_every is not None:
    if len(ref_reset_every) != len(seeds):
      raise ValueError(f"ref_reset_every has {len(ref_reset_every)} periods for {len(seeds)} "
                       "seeds; give one per seed (0 = a fixed reference).")
    if not setup.update_cfg.loss.kl_coef > 0:
      raise ValueError("ref_reset_every resets the KL reference; set rl.kl_coef > 0.")
  if setup.pipeline != isinstance(schedule, PipelineSchedule):
    raise ValueError("a setup built with async_rl.schedule=pipeline runs a PipelineSchedule, and "
                     "only it.")
  num_slots = schedule.max_versions if num_slots is None else num_slots
  keys_of_plan = ("write", "write_slot", "read_slot")
  if setup.pipeline:
    plans = [dataclasses.replace(schedule, seed=int(s)).token_ring_plan(
        setup.steps, setup.task.length, num_slots) for s in seeds]
    keys_of_plan += ("token_read_slot",)
  else:
    plans = [dataclasses.replace(schedule, seed=int(s)).ring_plan(setup.steps, num_slots)
             for s in seeds]
  resets = ref_reset_every is not None
  if resets:
    for p, every in zip(plans, ref_reset_every):
      p["ref_reset"] = reset_plan(setup.steps, every)
    keys_of_plan += ("ref_reset",)
  (init, ev), compile_s = _compiled(_init_eval, _eval_view(setup))
  train, seconds = _compiled(_train, setup, num_slots, resets)
  compile_s += seconds
  if setup.pass_eval_every:  # reads pass_eval_samples only
    pe, seconds = _compiled(_pass_eval, _eval_view(setup))
    compile_s += seconds
  t0 = time.perf_counter()
  runs = []
  for s, p in zip(seeds, plans):  # dispatched without waiting: the device queues the seeds
    key = jax.random.key(int(s))
    params = init(key)
    m = {f"eval/start/{k}": v for k, v in ev(params, key).items()}
    if setup.pass_eval_every:
      m["eval/start/pass_correct"] = pe(params, key)
    params, metrics = train(params, key, {k: jnp.asarray(p[k]) for k in keys_of_plan})
    m.update({f"eval/end/{k}": v for k, v in ev(params, key).items()})
    runs.append((params, {**metrics, **m}))
  params = jax.tree.map(lambda *x: jnp.stack(x), *(r[0] for r in runs))
  # np.asarray waits for the device.
  metrics = {k: np.stack([np.asarray(r[1][k]) for r in runs]) for k in runs[0][1]}
  return SimResult(params, metrics, compile_s, time.perf_counter() - t0)
