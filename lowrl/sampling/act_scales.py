"""Which activation scales a sampler can use: row-local ones, or static calibrated amaxes.

What a sampler records must be the distribution it sampled from, so its activation scales must be
row-local (`precision.activation_scaling`): per-token / MX scales are; a per-tensor activation
scale is only with a static calibrated amax (`act_amax`, `calibration.calibrate_act_amax`), as
inference engines do it. Computed from the data, the scale of a decode step spans the other rows,
and a full-sequence rescore spans the later tokens too, so neither is a distribution of one row's
prefix. A quantized KV cache (`PrecisionPolicy.kv_cache`) reads static K/V amaxes from the same
mapping (`calibration_paths`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from lowrl.models import blocks, decoder, kv_cache, layout
from lowrl.models.config import ModelConfig
from lowrl.precision import PrecisionPolicy


def check_row_local(policy: PrecisionPolicy, model_cfg: ModelConfig,
                    act_amax: blocks.ActAmax | None) -> None:
  """Raises ValueError unless `policy` with `act_amax` computes every activation scale within one
  token's row (what a decoder sees token by token), naming the fix."""
  tiles = policy.act_paths(layout.matmuls(model_cfg), "tile")
  if tiles:
    raise ValueError(f"Precision policy {policy.name!r} quantizes the activations of {tiles[:2]}"
                     f"{'...' if len(tiles) > 2 else ''} in 2-D blocks spanning several tokens, "
                     "which no sampler can reproduce token by token; use 1-D activation blocks "
                     "(block_2d on weights only).")
  tensor = policy.act_paths(layout.matmuls(model_cfg), "tensor")
  if tensor and act_amax is None:
    raise ValueError(
        f"Precision policy {policy.name!r} scales the activations of {len(tensor)} matmuls "
        f"({tensor[0]}, ...) per tensor: computed from the batch, that scale depends on the other "
        "rows (and, re-scored, on later tokens), so the logprobs would not be those of the "
        "distribution sampled from. Pass static calibrated scales, act_amax="
        "calibration.calibrate_act_amax(params, tokens, model_cfg, trainer_policy, "
        "policy.act_paths(layout.matmuls(model_cfg), 'tensor')) (as inference engines do), or use row-local "
        "scaling (--config.precision.act_per_token=True, or an MX format).")
  kv_cache.check_mode(policy.kv_cache, model_cfg.head_dim)
  if kv_cache.quantized(policy.kv_cache) and act_amax is None:
    raise ValueError(f"Precision policy {policy.name!r} quantizes the KV cache "
                     f"({policy.kv_cache}) with static K/V scales: pass act_amax="
                     "calibration.calibrate_act_amax(params, tokens, model_cfg, trainer_policy, "
                     "act_scales.calibration_paths(policy, model_cfg)).")
  decoder.check_act_amax(policy, model_cfg, act_amax)


def calibration_paths(policy: PrecisionPolicy, model_cfg: ModelConfig) -> tuple[str, ...]:
  """The static amaxes sampling under `policy` reads: its tensor-scaled activations' and its
  quantized KV cache's (`calibrate_act_amax`'s `paths`); () when it reads none."""
  return (policy.act_paths(layout.matmuls(model_cfg), "tensor")
          + kv_cache.kv_paths(policy.kv_cache, model_cfg.n_layers))


def used_act_amax(policy: PrecisionPolicy, model_cfg: ModelConfig,
                  act_amax: blocks.ActAmax | None) -> dict[str, jax.Array] | None:
  """The entries of `act_amax` the policy reads, as FP32 (a plain dict: one pytree structure per
  policy, hence one compile); None when it reads none."""
  if act_amax is None:
    return None
  paths = calibration_paths(policy, model_cfg)
  return {p: jnp.asarray(act_amax[p], jnp.float32) for p in paths} if paths else None
