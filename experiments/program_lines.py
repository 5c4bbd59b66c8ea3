r"""StableHLO size and compile time of the main job's forward+grad program, per recipe.

  python -m experiments.program_lines                         # bf16 and nvfp4_recipe, lines
  python -m experiments.program_lines --recipes=nvfp4_recipe --compile

The program: the gradient of the summed per-token logprobs (`logprobs.token_logprobs`, the
trainer's scoring forward) with respect to every parameter, for the main job's model, precision
recipe and rollout batch ([rl.num_prompts x rl.group_size, prompt + max_new_tokens] tokens,
abstract: nothing is computed). Lines are those of `jax.jit(...).lower(...).as_text()` without
debug info; `--compile` also compiles it and prints the XLA compile seconds (best of
--compile_repeats fresh compiles, persistent cache off: compare programs within one process, at
one load). Sources on PYTHONPATH decide what is measured, so one command measures two checkouts.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from absl import app, flags

_RECIPES = flags.DEFINE_list("recipes", ["bf16", "nvfp4_recipe"], "Recipes of lowrl/recipes.py.")
_COMPILE = flags.DEFINE_bool("compile", False, "Also compile each program and time it.")
_REPEATS = flags.DEFINE_integer("compile_repeats", 1, "Fresh compiles per program (the best).")


def forward_grad(recipe: str):
  """(the jitted forward+grad function, its abstract arguments) for the main job under recipe."""
  from configs import base as base_config  # noqa: PLC0415
  from lowrl.models import init, logprobs  # noqa: PLC0415
  from lowrl.training.setup import build  # noqa: PLC0415

  s = build(base_config.get_config(recipe))
  cfg, policy = s.model_cfg, s.trainer_policy
  rows = s.batch_size
  length = s.task.max_prompt_len + s.sampling.max_new_tokens

  def loss(params, tokens, mask, key):
    return jnp.sum(logprobs.token_logprobs(params, tokens, cfg, policy, mask_BT=mask,
                                           quant_key=policy.quant_key(key)))

  args = (init.param_shapes(cfg), jax.ShapeDtypeStruct((rows, length), jnp.int32),
          jax.ShapeDtypeStruct((rows, length), jnp.bool_), jax.random.key(0))
  return jax.jit(jax.grad(loss)), args


def main(argv):
  del argv
  jax.config.update("jax_enable_compilation_cache", False)
  for recipe in _RECIPES.value:
    fn, args = forward_grad(recipe)
    t0 = time.perf_counter()
    lowered = fn.lower(*args)
    lower_s = time.perf_counter() - t0
    lines = len(lowered.as_text(debug_info=False).splitlines())
    row = f"{recipe:<16} {lines:6d} StableHLO lines, traced+lowered in {lower_s:.1f}s"
    if _COMPILE.value:
      best = float("inf")
      for _ in range(_REPEATS.value):
        t0 = time.perf_counter()
        fn.lower(*args).compile()
        best = min(best, time.perf_counter() - t0)
      row += f", compiled in {best:.1f}s (best of {_REPEATS.value})"
    print(row, flush=True)


if __name__ == "__main__":
  app.run(main)
