"""TransformerEngine's NVFP4 arithmetic, bit for bit: QuantConfig(scale_convention="te" | "te_v2_13").

Read from TE's source (NVIDIA/TransformerEngine), FP32 arithmetic, each step rounded:

  "te" (TE main, commit d0067d0da6cb01811b8072a7d304f0e00344ce2b of 2026-08-22; the block-scale
  change is 523801df70c6598e6cee0e9197134b08d4b230b9, 2026-03-16, in v2.14 and later):
    transformer_engine/common/cast/nvfp4/core_nvfp4.cuh
      compute_global_encode_scaling_factor_FP4<E>: S_enc = fl(E * 6 / amax), fminf FLT_MAX; 1 if
        amax == 0 or S_enc == 0 (E = 448, or 256 for 4over6 with nvfp4_4over6_e4m3_use_256,
        the recipe's default "all")
      compute_decoding_scaling_factor: s_b = e4m3(fl(amax_b * fl(S_enc * fl(1/6))))
    transformer_engine/pytorch/custom_recipes/reference_nvfp4.py (the pure-PyTorch reference,
      NVFP4QuantizerRef._quantize_blockwise_reference; row_scaled_nvfp4: one amax per row):
      S_dec = fl(1 / S_enc); coeff = fminf(fl(1 / fl(s_b * S_dec)), FLT_MAX);
      code = e2m1(satfinite(fl(x * coeff)))
    4over6 (_quantize_blockwise_4over6_reference; common/cast/nvfp4/quantize_4over6_nvfp4.cuh
      compute_scale_pair / accumulate_dequant_error, the non-fast-math error path):
      base = fl(fl(amax_b / 6) * S_enc) (this kernel keeps the older order); s6 = e4m3(min(base,
      448)), s4 = e4m3(min(fl(base * 1.5), 448)); each candidate's codes as above; its error sums,
      in FP32, in element order from 0, err += fl(d * d) (MSE) or |d| (MAE) with
      d = fl(fl(fl(fl(code * s) * amax) / (6 E)) - x); 4 iff err4 < err6 (ties keep 6).
    dequantize_nvfp4.cuh dequantize_fp4_kernel: out = OType(code * fl(fl(s_b * amax) *
      fl(1 / (6 E)))) (one FP32 product, then the cast to the output type).
  "te_v2_13" (TE v2.10 - v2.13): s_b = e4m3(fl(fl(amax_b / 6) * S_enc)); per-tensor, no 4over6
    (TE had neither row-scaled NVFP4 nor 4over6 then); the rest as above.

The stored `outer` is the FP32 amax (per tensor, or per row), which TE's dequantization reads.
Divisions by constants go through exact.div_rn (XLA turns them into reciprocal multiplies under
jit); per-block values are materialized, so XLA cannot reassociate them into element products.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lowrl.quant import exact
from lowrl.quant.config import QuantConfig
from lowrl.quant.formats import E2M1, E4M3
from lowrl.quant.rounding import round_to_grid

_F32_MAX = np.float32(np.finfo(np.float32).max)


def e4m3_max(cfg: QuantConfig) -> float:
  """E, the E4M3 maximum of the outer-scale denominator 6 * E (256 for 4over6)."""
  return 256.0 if cfg.four_over_six else 448.0


def encode_scale(amax: jax.Array, cfg: QuantConfig) -> jax.Array:
  """S_enc = fl(6 E / amax), at most FLT_MAX; 1 where amax is 0 or S_enc is 0 (amax = inf)."""
  s_enc = jnp.minimum(np.float32(6.0 * e4m3_max(cfg)) / amax, _F32_MAX)
  return exact.materialize(jnp.where((amax == 0) | (s_enc == 0), np.float32(1.0), s_enc))


def _div6(amax_b: jax.Array) -> jax.Array:
  """fl(amax_b / 6) (IEEE division; inf and NaN pass through)."""
  finite = jnp.isfinite(amax_b)
  return jnp.where(finite, exact.div_rn(jnp.where(finite, amax_b, 0.0), 6.0), amax_b)


def _codes(x_f32: jax.Array, s_b: jax.Array, s_dec: jax.Array) -> jax.Array:
  """e2m1(satfinite(fl(x * coeff))), coeff = fminf(fl(1 / fl(s_b * S_dec)), FLT_MAX) per block."""
  coeff = exact.materialize(jnp.minimum(np.float32(1.0) / (s_b * s_dec), _F32_MAX))
  return round_to_grid(x_f32 * coeff, E2M1)


def _errors(x_f32, codes, s_b, amax, cfg: QuantConfig, axis: int) -> jax.Array:
  """TE's 4over6 error of one candidate per block (keepdims on `axis`), summed in FP32 in element
  order. Each step is one FP32 rounding: `opaque` keeps code * s_b (exact) from being
  reassociated with amax and the squares from being contracted into the sums (FMA)."""
  v = exact.opaque(codes * s_b) * amax
  finite = jnp.isfinite(v)
  q = exact.div_rn(jnp.where(finite, jnp.abs(v), 0.0), 6.0 * e4m3_max(cfg))
  val = jnp.where(finite, jnp.copysign(q, v), v)
  d = val - x_f32
  e = exact.opaque(d * d) if cfg.four_over_six_metric == "mse" else jnp.abs(d)
  err = jnp.zeros_like(lax.index_in_dim(e, 0, axis))
  for i in range(e.shape[axis]):
    err = err + lax.index_in_dim(e, i, axis)
  return err


def quantize_blocked(x_b: jax.Array, amax_b: jax.Array, amax: jax.Array, cfg: QuantConfig,
                     axis: int) -> tuple[jax.Array, jax.Array]:
  """(E2M1 grid values, FP32 E4M3 block scales (keepdims)) of the blocked input x_b, given the
  block amaxes (FP32, keepdims on the block axis `axis`) and the tensor or row amax."""
  s_enc = encode_scale(amax, cfg)
  s_dec = exact.materialize(np.float32(1.0) / s_enc)
  x_f32 = x_b.astype(jnp.float32)
  if cfg.four_over_six:
    base = exact.materialize(_div6(amax_b) * s_enc)
    s6 = exact.materialize(round_to_grid(base, E4M3))
    s4 = exact.materialize(round_to_grid(base * np.float32(1.5), E4M3))
    c6, c4 = _codes(x_f32, s6, s_dec), _codes(x_f32, s4, s_dec)
    use4 = _errors(x_f32, c4, s4, amax, cfg, axis) < _errors(x_f32, c6, s6, amax, cfg, axis)
    return jnp.where(use4, c4, c6), exact.materialize(jnp.where(use4, s4, s6))
  if cfg.scale_convention == "te_v2_13":
    s_dec_b = _div6(amax_b) * s_enc
  else:
    s_dec_b = amax_b * exact.materialize(s_enc * np.float32(1.0 / 6.0))
  s_b = exact.materialize(round_to_grid(jnp.minimum(s_dec_b, _F32_MAX), E4M3))  # satfinite RNE
  return _codes(x_f32, s_b, s_dec), s_b


def decode_scale(s_b: jax.Array, amax: jax.Array, cfg: QuantConfig) -> jax.Array:
  """fl(fl(s_b * amax) * fl(1 / (6 E))) per block: dequantized = fl(code * this)."""
  return exact.materialize(exact.materialize(s_b * amax) * np.float32(1.0 / (6.0 * e4m3_max(cfg))))
