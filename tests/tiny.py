"""Tiny models and training-loop configs shared by the tests (each test model defined once).

`loop_config(recipe)` is the model and task alone (for build-time checks); with a `base_dir` it is
a whole runnable tiny run: a short SFT base cached in `base_dir`, a few RL steps, a checkpoint per
step, data parallel only (the tiny widths can't be split into NVFP4 blocks across a model axis),
no reference params.
"""
from __future__ import annotations

import ml_collections

import pathlib

from configs import base as base_config
from lowrl.models.config import ModelConfig, preset

REPO = pathlib.Path(__file__).resolve().parents[1]

# The loop's 2-layer test model (its vocabulary comes from the task's tokenizer).
TINY_MODEL = dict(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)
# That model on a 16-token vocabulary, for tests that build it without a task.
LOOP_MODEL = ModelConfig(vocab_size=16, max_seq_len=16, **TINY_MODEL)
# The library's tiny preset: V=64, D=32, L=2, H=4, K=2, hd=8, F=64.
TINY = preset("tiny")
# Every optional feature at once (Qwen3 qk-norm, Qwen2 biases, tied head, Llama 3 RoPE scaling).
FULL = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                   d_ff=64, qk_norm=True, qkv_bias=True, tie_embeddings=True, rope_theta=500.0,
                   max_seq_len=128, rope_llama3_scaling=(8.0, 1.0, 4.0, 16))
# 8 layers: deep enough for the BF16 tail (the last 15% = 1 layer) and for scanned groups.
DEEP = ModelConfig(vocab_size=64, d_model=32, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=8,
                   d_ff=64, max_seq_len=64)
# Widths that split over a (4, 2) / (2, 4) mesh: 8 heads, 4 kv heads, d_ff 128.
SHARDABLE = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4,
                        head_dim=8, d_ff=128, max_seq_len=64)
# Mixture of experts: 4 experts, top-2, renormalised, with a Qwen2-MoE shared expert.
MOE = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                  d_ff=64, n_experts=4, n_experts_per_tok=2, moe_d_ff=32, norm_topk_prob=True,
                  shared_expert_d_ff=16, max_seq_len=64)


def loop_config(recipe: str = "fp32", base_dir: str | None = None, *, steps: int = 4,
                num_prompts: int = 2, sft_steps: int = 5,
                sft_batch_size: int = 16) -> ml_collections.ConfigDict:
  """The 2-layer model on 1-digit addition under `recipe`; runnable when `base_dir` is given."""
  c = base_config.get_config(recipe)
  c.task.name = "addition"
  c.task.kwargs = ml_collections.ConfigDict({"num_digits": 1})
  c.model.update(**TINY_MODEL)
  if base_dir is None:
    return c
  c.sft.steps, c.sft.batch_size, c.sft.base_dir = sft_steps, sft_batch_size, base_dir
  c.rl.update(steps=steps, num_prompts=num_prompts, group_size=4, max_new_tokens=4)
  c.eval_num_prompts = 8
  c.eval_samples = 1
  c.checkpoint_every = 1
  c.num_text_samples = 0
  c.mesh.rules = ()
  c.rl.log_kl_ref = False
  return c


def sgd_gradient(update, params, ref_params, batch):
  """One jitted RL update built with `optax.sgd(1.0)`: (params - new params = the gradient, as
  float64 leaves (up to the subtraction's rounding); its metrics as floats)."""
  import jax
  import numpy as np
  import optax
  new, _, m = update(params, optax.sgd(1.0).init(params), ref_params, batch, jax.random.key(0))
  g = [np.asarray(a, np.float64) - np.asarray(b, np.float64)
       for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new))]
  return g, {k: float(v) for k, v in m.items()}


def assert_build_rejects(c, path: str, value, match: str) -> None:
  """`build(c)` with `c`'s `section.knob` at `path` set to `value` raises a one-line ValueError
  matching `match`."""
  import pytest
  from lowrl.training.setup import build
  section, knob = path.split(".")
  c[section][knob] = value
  with pytest.raises(ValueError, match=match) as e:
    build(c)
  assert "\n" not in str(e.value)
