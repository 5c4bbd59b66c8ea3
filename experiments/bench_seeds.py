r"""How the simulator's seeds share a process: one vmapped program over S seeds (the old way),
one per-seed program called S times (`lowrl.asyncrl.simulator` now), or `lax.map` over seeds.

  python -m experiments.bench_seeds                          # main context, 30 updates, 3 seeds
  python -m experiments.bench_seeds --seeds=3 --wide=8 --steps=30 --repeats=5

The setting is configs/simulate.py's main context (naive NVFP4 sampler, BF16 trainer, lag 2,
8 prompts x 8 samples, horizon 6), its training scan (`scan.make_train`, the bulk of a run) with
`--steps` updates. Two parts:

1. Width invariance: seeds 0..S-1's metrics and final params in an S-seed program against the
   same seeds inside a `--wide`-seed one, bit for bit, per mode.
2. Cost: each mode runs the S seeds once per round, rounds interleaved (round r runs every mode
   before round r + 1) so load from other processes hits all modes alike; seconds per seed (median
   and min-max over rounds) and the per-round ratio mode / vmap (median, min-max). Compile seconds
   of each mode's program at S seeds (per_seed compiles once whatever S).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from configs import simulate as simulate_config
from lowrl.asyncrl import scan, simulator

_SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds of the narrow run (and timed per round).")
_WIDE = flags.DEFINE_integer("wide", 8, "Seeds of the wide run the narrow one is compared with.")
_STEPS = flags.DEFINE_integer("steps", 30, "Updates per run.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Interleaved timed rounds.")
_SAMPLER = flags.DEFINE_string("sampler", "nvfp4_naive", "Sampler recipe of the setting.")
_LAG = flags.DEFINE_integer("lag", 2, "The setting's lag.")
_MODES = flags.DEFINE_list("modes", ["vmap", "per_seed", "map"], "Modes to compare.")

MODES = ("vmap", "per_seed", "map")
_PER_SEED = {}  # (setup, num_slots) -> the compiled one-seed training scan


def _inputs(setup, schedule, seeds, num_slots):
  plans = [dataclasses.replace(schedule, seed=s).ring_plan(setup.steps, num_slots) for s in seeds]
  plan = {k: jnp.asarray(np.stack([p[k] for p in plans])) for k in ("write", "write_slot",
                                                                     "read_slot")}
  keys = jnp.stack([jax.random.key(s) for s in seeds])
  # Every mode starts from the same per-seed init (one program), so only the training scan's
  # batching differs between the narrow and the wide run.
  init = jax.jit(functools.partial(scan.initial_params, setup))
  params = jax.tree.map(lambda *x: jnp.stack(x), *(init(k) for k in keys))
  return params, keys, plan


def _program(mode: str, setup, num_slots: int, params, keys, plan):
  """(callable running every seed of the stacked inputs -> (params, metrics) stacked, compile s)."""
  train = scan.make_train(setup, num_slots)
  t0 = time.perf_counter()
  if mode == "vmap":
    f = jax.jit(jax.vmap(train)).lower(params, keys, plan).compile()
  elif mode == "map":
    f = jax.jit(lambda p, k, pl: jax.lax.map(lambda a: train(*a), (p, k, pl))).lower(
        params, keys, plan).compile()
  elif mode == "per_seed":  # one program whatever the number of seeds (compiled once)
    one = jax.tree.map(lambda x: x[0], (params, keys, plan))
    if (setup, num_slots) not in _PER_SEED:
      _PER_SEED[(setup, num_slots)] = jax.jit(train).lower(*one).compile()
    g = _PER_SEED[(setup, num_slots)]

    def f(p, k, pl):
      outs = [g(*jax.tree.map(lambda x, i=i: x[i], (p, k, pl))) for i in range(k.shape[0])]
      return jax.tree.map(lambda *xs: jnp.stack(xs), *outs)
  else:
    raise ValueError(f"--modes: {mode!r} is not one of {MODES}.")
  return f, time.perf_counter() - t0


def _leaves(tree) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def main(argv):
  del argv
  cfg = simulate_config.get_config()
  cfg.sim.rl.steps = _STEPS.value
  cfg.sim.sampler_recipe = _SAMPLER.value
  cfg.sim.async_rl.lag = _LAG.value
  cfg.sim.eval_every = 0
  setup = simulator.build(cfg.sim)
  schedule = simulator.schedule_of(cfg.sim)
  num_slots = schedule.max_versions
  narrow, wide = tuple(range(_SEEDS.value)), tuple(range(_WIDE.value))
  print(f"[bench_seeds] {_SAMPLER.value} sampler, lag {_LAG.value}, {_STEPS.value} updates; "
        f"narrow {len(narrow)} seeds, wide {len(wide)}; jax {jax.__version__}; "
        f"load {os.getloadavg()[0]:.1f}", flush=True)
  ins_n = _inputs(setup, schedule, narrow, num_slots)
  ins_w = _inputs(setup, schedule, wide, num_slots)
  programs, compile_s = {}, {}
  for mode in _MODES.value:
    programs[mode], compile_s[mode] = _program(mode, setup, num_slots, *ins_n)
    f_wide, _ = _program(mode, setup, num_slots, *ins_w)
    out_n = programs[mode](*ins_n)
    out_w = jax.tree.map(lambda x: x[:len(narrow)], f_wide(*ins_w))
    ln, lw = _leaves(out_n), _leaves(out_w)
    same = sum(np.array_equal(a, b) for a, b in zip(ln, lw))
    end_n, end_w = np.asarray(out_n[1]["reward/mean"]), np.asarray(out_w[1]["reward/mean"])
    print(f"[bench_seeds] {mode}: seeds {narrow} alone vs inside {len(wide)}: {same} of "
          f"{len(ln)} arrays bit-identical; last-step reward per seed {end_n[:, -1].round(4)} vs "
          f"{end_w[:, -1].round(4)}; compile {compile_s[mode]:.1f} s", flush=True)
    del f_wide
  secs = {m: [] for m in programs}
  for r in range(_REPEATS.value):
    for mode, f in programs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f(*ins_n))
      secs[mode].append((time.perf_counter() - t0) / len(narrow))
    print(f"[bench_seeds] round {r}: " + ", ".join(f"{m} {s[-1]:.2f} s/seed"
                                                    for m, s in secs.items()), flush=True)
  base = "vmap" if "vmap" in secs else next(iter(secs))
  print(f"\n| mode | s per seed (median, min-max) | / {base} per round (median, min-max) |")
  print("|---|---|---|")
  for m, s in secs.items():
    ratio = np.array(s) / np.array(secs[base])
    print(f"| {m} | {np.median(s):.2f} ({min(s):.2f}-{max(s):.2f}) | {np.median(ratio):.2f} "
          f"({ratio.min():.2f}-{ratio.max():.2f}) |")
  print(f"(load average at the end {os.getloadavg()[0]:.1f}; 2 CPU cores shared)")


if __name__ == "__main__":
  app.run(main)
