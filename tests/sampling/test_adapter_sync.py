"""A LoRA run's weight sync (lowrl/sampling/adapter_sync.py): the base packed once, then only the
adapters move; the refit check covers both."""
import dataclasses

import jax
import numpy as np
import tiny

from lowrl import precision
from lowrl.models import init, layout, lora, transformer
from lowrl.sampling import weights
from lowrl.sampling.adapter_sync import AdapterRefitter

MODEL = dataclasses.replace(tiny.TINY, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128)


def _policy(cfg):
  return lora.adapter_policy(precision.policy_for("nvfp4_recipe", layout.matmuls(MODEL)), cfg)


def _with_b(params, seed):
  return jax.tree_util.tree_map_with_path(
      lambda kp, x: 0.05 * jax.random.normal(jax.random.key(seed), x.shape)
      if kp[-1].key == lora.B else x, params)


def test_first_sync_packs_everything_later_ones_move_only_the_adapters():
  cfg = lora.LoraConfig(rank=4, alpha=8.0)
  policy = _policy(cfg)
  base = init.init_params(MODEL, jax.random.key(0))
  params = lora.merge(base, lora.init_adapters(cfg, MODEL, jax.random.key(1)))
  logs = []
  refit = AdapterRefitter(MODEL, policy, lambda p: None, check_every=1, log=logs.append)
  held0, m0 = refit(params, 0)
  assert weights.is_packed(held0.weights)
  assert m0["refit/mismatched_tensors"] == 0.0
  adapter_bytes = lora.tree_bytes(lora.split(params)[1])
  assert m0["refit/sync_bytes"] > 4 * adapter_bytes  # the packed base, once

  params1 = _with_b(params, 2)
  held1, m1 = refit(params1, 1)
  assert m1["refit/sync_bytes"] == adapter_bytes
  assert m1["refit/mismatched_tensors"] == 0.0 and not logs
  # The sampler computes from the held weights what the trainer's tree computes.
  tokens = jax.random.randint(jax.random.key(3), (2, 8), 0, MODEL.vocab_size)
  w, pol = weights.dequantize_packed(held1.weights, MODEL, policy)
  np.testing.assert_array_equal(
      np.asarray(transformer.forward(w, tokens, MODEL, pol)),
      np.asarray(transformer.forward(params1, tokens, MODEL, policy)))

  # A base that moved (the update never writes it) is caught by the check, naming the tensor.
  moved = jax.tree_util.tree_map_with_path(
      lambda kp, x: x * 1.5 if [k.key for k in kp][-3:] == ["attn", "q_proj", "kernel"] else x,
      params1)
  _, m2 = refit(moved, 2)
  assert m2["refit/mismatched_tensors"] > 0 and "q_proj" in logs[-1]
