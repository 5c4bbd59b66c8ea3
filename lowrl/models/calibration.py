"""Static activation amaxes (`act_amax`): one calibration forward records max |input| of every
matmul (and |K|, |V| of the KV cache) over a batch's real tokens; a sampler or an export then
scales those activations with the recorded amaxes (causal, row-local) instead of each tensor's
own amax.
"""
from __future__ import annotations

import dataclasses

from flax import traverse_util
import jax
import jax.numpy as jnp

from lowrl.models.blocks import CALIB
from lowrl.models.config import ModelConfig
from lowrl.models.decoder import Transformer
from lowrl.models.transformer import Params, check_key, model_inputs
from lowrl.precision import PrecisionPolicy


def calibrate_act_amax(params: Params, tokens_BT: jax.Array, model_cfg: ModelConfig,
                       policy: PrecisionPolicy, paths: tuple[str, ...], *,
                       mask_BT: jax.Array | None = None, positions_BT: jax.Array | None = None,
                       quant_key: jax.Array | None = None) -> dict[str, jax.Array]:
  """Static activation amaxes: {path: max |input| of that matmul over the real tokens} (FP32).

  One full forward of a calibration batch under `policy` (the trainer's precision: an inference
  engine's calibration pass on the rollout weights); padding positions (mask 0) are excluded, as
  their activations are garbage. `paths` are full matmul paths, e.g. a sampler policy's
  `act_paths(layout.matmuls(model_cfg), "tensor")`, and "layers_{i}/attn/k_cache" / "v_cache":
  max |K| (after RoPE) and |V| per kv head ([n_kv_heads]), read with an unquantized cache
  (lowrl.models.kv_cache). Jittable; no gradient.
  """
  check_key(policy, quant_key)
  policy = dataclasses.replace(policy, kv_cache="none")  # K/V amaxes of the unquantized cache
  mask_BT, positions_BT = model_inputs(tokens_BT, mask_BT, positions_BT)
  _, state = Transformer(model_cfg, policy).apply(
      {"params": jax.lax.stop_gradient(params)}, tokens_BT, positions_BT, mask_BT,
      quant_key=quant_key, mutable=[CALIB])
  # Flattened names: ".../q_proj/amax" for a QDense, "lm_head" for a tied head.
  recorded = {k.removesuffix("/amax"): v[0] for k, v in
              traverse_util.flatten_dict(state[CALIB], sep="/").items()}
  unknown = [p for p in paths if p not in recorded]
  if unknown:
    raise ValueError(f"calibrate_act_amax: no matmul {unknown}; paths are "
                     f"{sorted(recorded)}.")
  # Max over the real tokens ([B, T] of each record; K/V records keep their heads).
  real = lambda r: mask_BT.reshape(mask_BT.shape + (1,) * (r.ndim - 2))  # noqa: E731
  return {p: jnp.max(jnp.where(real(recorded[p]), recorded[p], 0.0), axis=(0, 1))
          for p in paths}
