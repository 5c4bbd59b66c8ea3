"""Tiny training-loop configs shared by the tests (one definition of the 2-layer test model).

`loop_config(recipe)` is the model and task alone (for build-time checks); with a `base_dir` it is
a whole runnable tiny run: a short SFT base cached in `base_dir`, a few RL steps, a checkpoint per
step, data parallel only (the tiny widths can't be split into NVFP4 blocks across a model axis),
no reference params.
"""
from __future__ import annotations

import ml_collections

from configs import base as base_config

TINY_MODEL = dict(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64)


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
