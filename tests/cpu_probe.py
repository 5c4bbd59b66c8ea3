"""A small dot-heavy program whose output bits the cross-CPU tests compare between processes
(tests/test_cross_cpu.py): prints one hex digest of a train step's loss and gradients (a 2-layer
decoder, forward + backward, under the recipe named by argv[1]) and a BF16 and an FP32 GEMM.

  python tests/cpu_probe.py nvfp4_recipe
"""
import hashlib
import sys

import lowrl  # noqa: F401  (its XLA flags, before JAX starts)
import jax
import jax.numpy as jnp
import numpy as np

from lowrl import precision
from lowrl.models import init, layout, logprobs
from lowrl.models.config import ModelConfig

# Widths past YNNPACK's small-dot cut-off and NVFP4's blocks of 16.
MODEL = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, head_dim=8,
                    d_ff=128, max_seq_len=64)


def digest(recipe: str) -> str:
  policy = precision.policy_for(recipe, layout.matmuls(MODEL))
  params = init.init_params(MODEL, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (8, 32), 0, MODEL.vocab_size)
  loss_fn = lambda p: -jnp.mean(logprobs.token_logprobs(p, tokens, MODEL, policy))  # noqa: E731
  loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
  a = jax.random.normal(jax.random.key(2), (96, 256), jnp.float32)
  b = jax.random.normal(jax.random.key(3), (256, 160), jnp.float32)
  gemms = jax.jit(lambda a, b: (a @ b, (a.astype(jnp.bfloat16) @ b.astype(jnp.bfloat16))))(a, b)
  h = hashlib.sha256()
  for x in jax.tree.leaves((loss, grads, gemms)):
    h.update(np.asarray(x).tobytes())
  return h.hexdigest()


if __name__ == "__main__":
  print(digest(sys.argv[1] if len(sys.argv) > 1 else "nvfp4_recipe"))
