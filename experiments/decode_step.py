r"""One decode step of the main job's rollout: its time against its GEMMs alone, and the kernel
casts that `weights.cast_kernels` moves before the decode loop.

  python -m experiments.decode_step                    # B = the rollout's rows, 7 rounds
  python -m experiments.decode_step --rows=64 --rounds=5

Three jitted programs, compiled first, then timed in interleaved rounds (each round: every
program --calls times on the same inputs, seconds per call; the median over rounds, and the
range):
  step_cast   one decode step as the decode loop runs it (`transformer.forward_with_cache` of one
              token per row into a KV cache of P + N columns, positions at column P, the
              prequantized policy: the rollout's packed weights), kernels cast to the compute
              dtype before the call (`weights.cast_kernels`, as `generate` now does);
  step_fp32   the same step on the FP32 kernels, which it casts itself (the loop before the
              change, where XLA did not hoist the casts out of the loop);
  gemms       only the step's linear-layer GEMMs: [B, in] x [in, out] in each matmul's compute
              dtype, FP32 accumulation, the same shapes (attention's score / value products and
              everything else excluded), on the cast kernels.
Reported: seconds per call, step_fp32 / step_cast, and gemms / step_cast (the share of the step
the linear layers' GEMMs take; the rest is per-step work outside them). One process, one load:
compare ratios, not seconds across runs.
"""
from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

_RECIPE = flags.DEFINE_string("recipe", "nvfp4_recipe", "Recipe of the main job's config.")
_ROWS = flags.DEFINE_integer("rows", 0, "Decode rows (0 = the rollout's num_prompts x group_size).")
_ROUNDS = flags.DEFINE_integer("rounds", 7, "Interleaved timing rounds.")
_CALLS = flags.DEFINE_integer("calls", 20, "Calls per program per round.")


def programs(recipe: str, rows: int):
  """({name: a call of the program}, rows, cache columns, linear layers) (module docstring)."""
  from configs import base as base_config  # noqa: PLC0415
  from lowrl.models import init, layout, transformer  # noqa: PLC0415
  from lowrl.sampling import weights  # noqa: PLC0415
  from lowrl.training.setup import build  # noqa: PLC0415

  s = build(base_config.get_config(recipe))
  cfg = s.model_cfg
  params = init.init_params(cfg, jax.random.key(0))
  params, policy = weights.quantize_weights(params, cfg, s.sampler_policy)  # as packed weights
  cast = weights.cast_kernels(params, cfg, policy)
  b = rows or s.batch_size
  p, n = s.task.max_prompt_len, s.sampling.max_new_tokens
  cache = transformer.init_cache(cfg, b, p + n, policy.dtype)
  cache = {**cache, "index": jnp.int32(p), "mask": jnp.ones_like(cache["mask"]).at[:, p:].set(False)}
  tokens = jnp.ones((b, 1), jnp.int32)
  positions = jnp.full((b, 1), p, jnp.int32)

  def step(params, cache, tokens, positions):
    logits, cache = transformer.forward_with_cache(
        params, tokens, cache, cfg, policy, mask_BT=jnp.ones_like(tokens, bool),
        positions_BT=positions)
    return logits, cache

  mats = [m for m in layout.matmuls(cfg) if m.owns_kernel and not m.n_experts]
  kernels = [layout.get_param(cast, m.param_keys) for m in mats]
  xs = [jnp.ones((b, k.shape[0]), k.dtype) for k in kernels]

  def gemms(xs, kernels):
    return [jax.lax.dot_general(x, k, (((1,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32) for x, k in zip(xs, kernels)]

  # The cache donated and handed back, as the loop carries it (its writes in place; past the
  # last column the writes clamp to it, which costs the same).
  jstep = jax.jit(step, donate_argnums=1)

  def stepper(weights_):
    state = {"cache": jax.tree.map(jnp.copy, cache)}

    def run():
      logits, state["cache"] = jstep(weights_, state["cache"], tokens, positions)
      return logits
    return run

  jgemms = jax.jit(gemms)
  return ({"step_cast": stepper(cast), "step_fp32": stepper(params),
           "gemms": lambda: jgemms(xs, kernels)}, b, p + n, len(mats))


def main(argv):
  del argv
  progs, b, length, n_mats = programs(_RECIPE.value, _ROWS.value)
  for name, run in progs.items():
    t0 = time.perf_counter()
    jax.block_until_ready(run())
    print(f"{name}: compiled and ran once in {time.perf_counter() - t0:.1f}s", flush=True)
  times = {name: [] for name in progs}
  for _ in range(_ROUNDS.value):
    for name, run in progs.items():
      t0 = time.perf_counter()
      for _ in range(_CALLS.value):
        out = run()
      jax.block_until_ready(out)
      times[name].append((time.perf_counter() - t0) / _CALLS.value)
  med = {k: float(np.median(v)) for k, v in times.items()}
  print(f"\n{_RECIPE.value}, {b} rows, KV cache of {length} columns, {n_mats} linear layers; "
        f"load {os.getloadavg()[0]:.1f}; {_ROUNDS.value} rounds x {_CALLS.value} calls")
  for k, v in times.items():
    print(f"  {k:<10} {med[k] * 1e3:8.3f} ms/call (range {min(v) * 1e3:.3f}-{max(v) * 1e3:.3f})")
  for num, den in (("step_fp32", "step_cast"), ("gemms", "step_cast")):
    r = np.asarray(times[num]) / np.asarray(times[den])
    print(f"  {num} / {den}: {np.median(r):.3f} (per-round range {r.min():.3f}-{r.max():.3f})")


if __name__ == "__main__":
  app.run(main)
