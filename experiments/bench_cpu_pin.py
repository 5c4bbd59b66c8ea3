r"""What lowrl's cross-CPU pin (`lowrl.CROSS_CPU_FLAGS`) costs and changes on this CPU.

  python -m experiments.bench_cpu_pin                       # GEMMs + a train step of `small`
  python -m experiments.bench_cpu_pin --model=tiny --repeats=5

Each program is compiled twice in this one process, with the host's platform-dependent math
(XLA's default: YNNPACK picks its dot kernels from the host's instruction set) and with the pin
(`compiler_options`: xla_cpu_enable_platform_dependent_math true vs false; the ISA cap is set
per process, see `_options`), then timed interleaved round by
round (experiments/bench_gemm.compare: ratio = host time / pinned time per round, median
[min, max]; < 1 means the pin is slower). Also printed: whether the two programs' outputs are
bit-identical (they are not where the pin changes the numbers).
"""
from __future__ import annotations

import hashlib
import os

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

import lowrl
from experiments import bench_gemm
from lowrl import precision
from lowrl.models import config as model_config
from lowrl.models import init, layout, logprobs

_SIZES = flags.DEFINE_list("sizes", ["256x256x256", "1024x1024x1024"], "GEMMs MxKxN.")
_MODEL = flags.DEFINE_string("model", "small", f"Model preset: {model_config.preset_names()}.")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per train step.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 64, "Tokens per sequence.")
_RECIPES = flags.DEFINE_list("recipes", ["bf16", "nvfp4_recipe"], "Train-step recipes.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Interleaved timed rounds.")
_ITERS = flags.DEFINE_integer("iters", 3, "Calls per round.")

# XLA's defaults of the pinned flags (what a process without lowrl's pin compiles with).
HOST = {"xla_cpu_enable_platform_dependent_math": True}


def _options(pinned: bool) -> dict[str, bool]:
  """compiler_options of the pinned or the host variant. Only the platform-math flag: XLA reads
  `xla_cpu_max_isa` from XLA_FLAGS at start-up, not per program, so the ISA cap is the process's
  (lowrl's AVX2 on x86; LOWRL_CPU_PLATFORM_MATH=1 runs this bench without it)."""
  return {k: not pinned for k in HOST}


def _digest(tree) -> str:
  h = hashlib.sha256()
  for x in jax.tree.leaves(tree):
    h.update(np.asarray(x).tobytes())
  return h.hexdigest()[:12]


def _pair(name: str, fn, args: tuple) -> tuple[bench_gemm.Comparison, bool]:
  host, pinned = (jax.jit(fn).lower(*args).compile(compiler_options=_options(p))
                  for p in (False, True))
  same = _digest(host(*args)) == _digest(pinned(*args))
  return bench_gemm.compare(name, "host", (host, args), (pinned, args), repeats=_REPEATS.value,
                            iters=_ITERS.value), same


def main(argv):
  del argv
  rows = []
  for text in _SIZES.value:
    m, k, n = bench_gemm.parse_size(text)
    a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
    rows.append(_pair(f"f32 gemm {text}", lambda x, y: x @ y, (a, b)))
    rows.append(_pair(f"bf16 gemm {text}", lambda x, y: x @ y,
                      (a.astype(jnp.bfloat16), b.astype(jnp.bfloat16))))
  cfg = model_config.preset(_MODEL.value, max_seq_len=_SEQ_LEN.value)
  params = init.init_params(cfg, jax.random.key(0))
  tx = optax.adam(1e-4)
  tokens = jax.random.randint(jax.random.key(1), (_BATCH.value, _SEQ_LEN.value), 0,
                              cfg.vocab_size)
  for recipe in _RECIPES.value:
    policy = precision.policy_for(recipe, layout.matmuls(cfg))

    def step(params, opt_state, tokens, policy=policy):
      loss_fn = lambda p: -jnp.mean(logprobs.token_logprobs(p, tokens, cfg, policy))  # noqa: E731
      loss, grads = jax.value_and_grad(loss_fn)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    rows.append(_pair(f"train step {_MODEL.value} {recipe}", step,
                      (params, tx.init(params), tokens)))
  print(f"pin {dict(lowrl.CROSS_CPU_FLAGS)}; XLA_FLAGS {os.environ.get('XLA_FLAGS')}; {_REPEATS.value} rounds x {_ITERS.value} calls; "
        "ratio = host time / pinned time per round: median [min, max]")
  print(bench_gemm.HEADER + "  same bits")
  for r, same in rows:
    print(r.row() + f"  {'yes' if same else 'no'}")


if __name__ == "__main__":
  app.run(main)
