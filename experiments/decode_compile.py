r"""Compile seconds of the main job's rollout decode program per decode-compaction setting.

  python -m experiments.decode_compile                       # min_rows 16 vs 0, 2 rounds
  python -m experiments.decode_compile --min_rows=16,64,0 --rounds=3

Per round, for each `--min_rows` value m in turn (the order rotates by one each round, so no
setting always compiles first): a `Trainer` of configs/default.py with
`sampler_decode_min_rows = m`, in-memory caches cleared and the persistent compilation cache off,
samples step 0's rollout from one random-init policy (the same for every m). JAX's compile events
of the `_decode` program (tracing, lowering, XLA compilation) are summed; the rollout's tokens
are compared with the first setting's, bit for bit. Reported: decode compile seconds per setting
(median over rounds, range), each setting over the first per round (median, range), and the
decode buckets. One process and interleaved rounds, so load changes hit every setting alike:
compare the ratios, not seconds across runs.
"""
from __future__ import annotations

import importlib
import os

import jax
import numpy as np
from absl import app, flags
from jax import monitoring

_MIN_ROWS = flags.DEFINE_list("min_rows", ["16", "0"], "sampler_decode_min_rows values; the "
                              "first is the baseline of the ratios.")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Interleaved rounds (every setting once each).")

_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
           "/jax/core/compile/jaxpr_to_mlir_module_duration",
           "/jax/core/compile/backend_compile_duration")


def _decode_seconds() -> dict[str, float]:
  """A dict that a registered listener fills with the `_decode` program's compile seconds."""
  got = {"s": 0.0}

  def listen(event: str, duration: float, fun_name: str = "?", **_):
    if event in _EVENTS and str(fun_name) in ("_decode", "jit(_decode)"):
      got["s"] += duration
  monitoring.register_event_duration_secs_listener(listen)
  return got


def one(min_rows: int, got: dict[str, float]) -> tuple[float, np.ndarray, tuple[int, ...]]:
  """(decode compile seconds, the rollout's tokens, the decode buckets) of one fresh compile."""
  from configs import default  # noqa: PLC0415
  from lowrl.models import init  # noqa: PLC0415
  # The module (the package exports a function of the same name).
  generate = importlib.import_module("lowrl.sampling.generate")
  from lowrl.training import optimizer  # noqa: PLC0415
  from lowrl.training.setup import build  # noqa: PLC0415
  from lowrl.training.trainer import Trainer  # noqa: PLC0415

  jax.clear_caches()
  generate._decode_program.cache_clear()  # noqa: SLF001 - a fresh program, not the lru's
  c = default.get_config()
  c.sampler_decode_min_rows = min_rows
  setup = build(c)
  trainer = Trainer(setup, log=lambda _: None)
  params = trainer.place(optimizer.to_master(init.init_params(setup.model_cfg, jax.random.key(0)),
                                             c.optimizer.master_dtype))
  got["s"] = 0.0
  rollout, _ = trainer.rollout(params, params, 0, jax.random.key(1), stale=False)
  buckets = generate.bucket_sizes(setup.batch_size, setup.plan.batch_shards,
                                  generate.decode_min_rows(min_rows, setup.sampler_policy))
  return got["s"], np.asarray(rollout.out.tokens), buckets


def main(argv):
  del argv
  jax.config.update("jax_enable_compilation_cache", False)
  got = _decode_seconds()
  settings = [int(m) for m in _MIN_ROWS.value]
  secs = {m: [] for m in settings}
  ratios = {m: [] for m in settings}
  buckets = {}
  for r in range(_ROUNDS.value):
    order = settings[r % len(settings):] + settings[:r % len(settings)]
    this, tokens = {}, {}
    for m in order:
      this[m], tokens[m], buckets[m] = one(m, got)
      print(f"round {r}: min_rows {m}: decode compiled in {this[m]:.1f}s "
            f"(load {os.getloadavg()[0]:.1f})", flush=True)
    for m in settings:
      secs[m].append(this[m])
      ratios[m].append(this[m] / this[settings[0]])
      if not np.array_equal(tokens[m], tokens[settings[0]]):
        raise SystemExit(f"min_rows {m} sampled other tokens than min_rows {settings[0]}")
  print(f"\nmain job's rollout decode program, {_ROUNDS.value} rounds, {os.cpu_count()} cores; "
        "tokens identical across settings in every round")
  for m in settings:
    print(f"  min_rows {m:<4} buckets {buckets[m]}: {np.median(secs[m]):7.1f}s (range "
          f"{min(secs[m]):.1f}-{max(secs[m]):.1f}); / min_rows {settings[0]}: "
          f"{np.median(ratios[m]):.3f} (range {min(ratios[m]):.3f}-{max(ratios[m]):.3f})")


if __name__ == "__main__":
  app.run(main)
