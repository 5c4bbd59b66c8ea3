"""Quantized KV cache: what the attention stores for its keys and values (`PrecisionPolicy.kv_cache`).

Modes (`KV_CACHE_MODES`):
  none            K and V in the policy's compute dtype (the default; no quantizer).
  fp8_per_tensor  FP8 E4M3, one static FP32 scale per layer and tensor (K, V): s = amax / 448.
  fp8_per_head    FP8 E4M3, one static scale per layer, tensor and kv head: s_h = amax_h / 448.
  nvfp4           NVFP4 (docs/reference.md section 2): 16-element blocks along head_dim, E4M3 block scales,
                  one static FP32 global scale per layer and tensor from amax / (6 * 448).

The quantizers are `lowrl.quant.fake_quant` with a static `tensor_amax` (elements beyond the
calibrated amax saturate), applied to K after RoPE (and QK-norm) and to V, before they enter the
cache: what an engine's cache stores (vLLM quantizes the post-RoPE key). The cache holds the
dequantized values in the compute dtype (`fake_quant`'s output dtype), i.e. what an attention that
dequantizes the codes to the compute dtype reads; the memory an engine saves by storing codes is not
modelled (`lowrl.memory` counts the compute dtype).

Scales are static and calibrated, as engines do it (a scale from the batch would depend on the
other rows and, re-scored, on later tokens): the amax of K and V per kv head, max |x| over the real
tokens of a calibration batch (`calibration.calibrate_act_amax`, which records them under
`kv_paths`; the training loop recalibrates them with the activation amaxes at every weight sync).
They travel in the same `act_amax` mapping, keyed "layers_{i}/attn/k_cache" and ".../v_cache",
each an FP32 [n_kv_heads] vector; per-tensor modes use its max. A full-sequence forward under a
policy with a quantized KV cache quantizes K and V the same way, so exact mode (the sampler's
logprobs re-scored by its own policy) stays bit-identical to a trainer that scores with the same
quantized KV; a trainer in another policy scores with unquantized K and V.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from lowrl.precision import KV_CACHE_MODES
from lowrl.quant.config import QuantConfig
from lowrl.quant.quantize import fake_quant
# Block paths (inside a layer) of the static K / V amaxes, like the matmuls' "attn/q_proj".
K_PATH, V_PATH = "attn/k_cache", "attn/v_cache"
BLOCK_KV_PATHS = (K_PATH, V_PATH)
NVFP4_BLOCK = 16

_CONFIGS = {"fp8_per_tensor": QuantConfig("fp8_e4m3"), "fp8_per_head": QuantConfig("fp8_e4m3"),
            "nvfp4": QuantConfig("nvfp4", axis=-1)}


def check_mode(mode: str, head_dim: int | None = None) -> None:
  """Raises ValueError (one line, naming the fix) for an unknown mode or an NVFP4 cache whose
  head_dim is not a multiple of 16."""
  if mode not in KV_CACHE_MODES:
    raise ValueError(f"kv_cache={mode!r}: use one of {', '.join(KV_CACHE_MODES)} "
                     "(--config.sampler_precision.kv_cache).")
  if mode == "nvfp4" and head_dim is not None and head_dim % NVFP4_BLOCK:
    raise ValueError(f"kv_cache=nvfp4 needs head_dim % {NVFP4_BLOCK} == 0 (blocks run along "
                     f"head_dim), got head_dim={head_dim}; use fp8_per_tensor or fp8_per_head.")


def quantized(mode: str) -> bool:
  return mode != "none"


def kv_paths(mode: str, n_layers: int) -> tuple[str, ...]:
  """Full paths of the static K / V amaxes a cache in `mode` reads ("layers_0/attn/k_cache",
  ...); () when the cache is unquantized."""
  if not quantized(mode):
    return ()
  return tuple(f"layers_{i}/{p}" for i in range(n_layers) for p in BLOCK_KV_PATHS)


def block_kv_paths(mode: str) -> tuple[str, ...]:
  """The block paths of `kv_paths` (what one layer's `act_amax` holds)."""
  return BLOCK_KV_PATHS if quantized(mode) else ()


def record_amax(x_BTKH: jax.Array) -> jax.Array:
  """The calibration record of K or V: max |x| over head_dim, FP32 [B, T, K]."""
  return jnp.max(jnp.abs(x_BTKH.astype(jnp.float32)), axis=-1)


def quantize(x_BTKH: jax.Array, amax_K: jax.Array, mode: str) -> jax.Array:
  """K or V [B, T, K, hd] as the cache stores them under `mode` (dequantized, in x's dtype);
  `amax_K`: the static FP32 amax per kv head ([K]; per-tensor modes take its max)."""
  check_mode(mode, x_BTKH.shape[-1])
  if not quantized(mode):
    return x_BTKH
  amax_K = jnp.asarray(amax_K, jnp.float32)
  if amax_K.shape != (x_BTKH.shape[2],):
    raise ValueError(f"static KV amax has shape {amax_K.shape}, expected ({x_BTKH.shape[2]},) "
                     "(one per kv head); calibrate it with calibration.calibrate_act_amax.")
  cfg = _CONFIGS[mode]
  if mode == "fp8_per_head":  # one scale per head: the heads quantized one by one
    per_head = jax.vmap(lambda x, a: fake_quant(x, cfg, tensor_amax=a), in_axes=(2, 0),
                        out_axes=2)
    return per_head(x_BTKH, amax_K)
  return fake_quant(x_BTKH, cfg, tensor_amax=jnp.max(amax_K))


def quantize_kv(k_BTKH: jax.Array, v_BTKH: jax.Array, mode: str,
                act_amax: Mapping[str, Any] | None) -> tuple[jax.Array, jax.Array]:
  """(K, V) as the cache stores them; `act_amax`: one layer's static amaxes (block paths)."""
  if not quantized(mode):
    return k_BTKH, v_BTKH
  if act_amax is None or K_PATH not in act_amax or V_PATH not in act_amax:
    raise ValueError(f"kv_cache={mode} needs static K/V amaxes in act_amax ({K_PATH!r}, "
                     f"{V_PATH!r} per layer): calibrate them with calibration.calibrate_act_amax("
                     "..., paths=act_scales.calibration_paths(policy, model_cfg)).")
  return quantize(k_BTKH, act_amax[K_PATH], mode), quantize(v_BTKH, act_amax[V_PATH], mode)
