"""Quantized KV cache (lowrl.models.kv_cache): the stored K/V against independent references, the
calibrated K/V amaxes, and the one-line errors.

References: FP8 E4M3 from NumPy + ml_dtypes (x / s saturated at 448, then the ml_dtypes RNE cast,
times s) with explicit power-of-two scales, so that x / s and lowrl's x * fl(1/s) are the same
real number and any difference is a real disagreement; NVFP4 from the spec-exact rational
reference `tests/quant_reference.exact_fake_quant` (any amax: lowrl's NVFP4 is spec-exact).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import quant_reference
from lowrl import precision
from lowrl.models import calibration, init, kv_cache, layout, transformer
from lowrl.models.config import ModelConfig
from lowrl.quant.config import QuantConfig

# Two kv heads of head_dim 16 (one NVFP4 block), so per-head scales and NVFP4 both apply.
KV16 = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   d_ff=64, max_seq_len=32)
BF16 = precision.policy_for("bf16", layout.matmuls(KV16))


def _fp8_ref(x, scale):
  """E4M3 of x / scale (saturating at 448), times scale, in float64 -> x's dtype."""
  x64 = np.asarray(x, np.float64)
  q = np.clip(x64 / scale, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
  return (q * scale).astype(np.float32)


def _x(seed, shape=(2, 5, 2, 16)):
  x = np.asarray(jax.random.normal(jax.random.key(seed), shape, jnp.float32)) * 3.0
  x[0, 0, 0, :4] = [0.0, -0.0, 1e-30, 100.0]  # zeros, an FP32 value below any code, saturation
  x[-1, 2, 1, 5] = -np.inf  # saturates (FP8: at -448 s)
  return x


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_fp8_per_head_is_e4m3_of_x_over_its_heads_scale(jit, dtype):
  x = _x(0).astype(dtype)
  amax = np.array([448 * 2.0 ** -6, 448 * 2.0 ** -4], np.float32)  # s = 2^-6, 2^-4: exact 1/s
  fn = functools.partial(kv_cache.quantize, mode="fp8_per_head")
  got = (jax.jit(fn) if jit else fn)(jnp.asarray(x), jnp.asarray(amax))
  assert got.dtype == x.dtype
  ref = np.stack([_fp8_ref(x[:, :, h].astype(np.float32), amax[h] / 448) for h in range(2)], 2)
  np.testing.assert_array_equal(np.asarray(got, np.float32), ref.astype(dtype).astype(np.float32))
  # The outliers saturate at each head's 448 s.
  assert float(got[0, 0, 0, 3]) == 448 * 2.0 ** -6 and float(got[-1, 2, 1, 5]) == -448 * 2.0 ** -4


def test_fp8_per_tensor_uses_the_largest_head_amax_and_nan_stays_nan():
  x = _x(1)
  x[1, 1, 0, 7] = np.nan
  amax = np.array([448 * 2.0 ** -5, 448 * 2.0 ** -3], np.float32)
  got = np.asarray(kv_cache.quantize(jnp.asarray(x), jnp.asarray(amax), "fp8_per_tensor"))
  ref = _fp8_ref(x, 2.0 ** -3)
  np.testing.assert_array_equal(got, ref)
  assert np.isnan(got).sum() == 1 and np.isnan(got[1, 1, 0, 7])  # NaN stays NaN, alone


@pytest.mark.parametrize("jit", [False, True])
def test_nvfp4_blocks_run_along_head_dim_with_a_static_global_scale(jit):
  x = _x(2, (1, 3, 2, 32))  # two 16-element blocks per head
  amax = np.array([2.7, 5.3], np.float32)  # any amax: the global scale is RNE(5.3 / (6 * 448))
  fn = functools.partial(kv_cache.quantize, mode="nvfp4")
  got = np.asarray((jax.jit(fn) if jit else fn)(jnp.asarray(x), jnp.asarray(amax)))
  ref = quant_reference.exact_fake_quant(x, QuantConfig("nvfp4", axis=-1),
                                         tensor_amax=np.float32(5.3))
  np.testing.assert_array_equal(got, ref)


def test_unquantized_cache_is_the_identity_and_bad_settings_fail_in_one_line():
  x = jnp.asarray(_x(3))
  assert kv_cache.quantize(x, jnp.ones(2), "none") is x
  with pytest.raises(ValueError, match=r"^kv_cache='fp9': use one of none, fp8_per_tensor"):
    dataclasses.replace(BF16, kv_cache="fp9")
  with pytest.raises(ValueError, match="head_dim % 16 == 0.*fp8_per_tensor or fp8_per_head"):
    kv_cache.check_mode("nvfp4", 8)
  with pytest.raises(ValueError, match="one per kv head"):
    kv_cache.quantize(x, jnp.ones(()), "fp8_per_head")
  with pytest.raises(ValueError, match="needs static K/V amaxes"):
    kv_cache.quantize_kv(x, x, "nvfp4", None)


@functools.lru_cache(maxsize=None)
def _params():
  return init.init_params(KV16, jax.random.key(0))


TOKENS = jax.random.randint(jax.random.key(1), (4, 9), 0, 64)
MASK = jnp.arange(9)[None, :] < jnp.array([9, 6, 3, 1])[:, None]  # right-padded rows


def _prefill(policy, act_amax=None, model_cfg=KV16, logits=False):
  cache = transformer.init_cache(model_cfg, 4, 9, jnp.bfloat16)
  out, cache = jax.jit(transformer.forward_with_cache,
                       static_argnames=("model_cfg", "policy"))(
      _params(), TOKENS, cache, model_cfg, policy, mask_BT=MASK, act_amax=act_amax)
  return (out, cache) if logits else cache


def _calibrate(mode, model_cfg=KV16):
  paths = kv_cache.kv_paths(mode, KV16.n_layers)
  return jax.jit(calibration.calibrate_act_amax, static_argnames=("model_cfg", "policy", "paths"))(
      _params(), TOKENS, model_cfg, BF16, paths, mask_BT=MASK)


def test_calibration_is_the_masked_per_head_max_of_the_cached_keys_and_values():
  amax = _calibrate("fp8_per_head")
  cache = _prefill(BF16)
  m = np.asarray(MASK)[:, :, None, None]
  for i in range(KV16.n_layers):
    for name, path in (("k", kv_cache.K_PATH), ("v", kv_cache.V_PATH)):
      stored = np.abs(np.asarray(cache["layers"][i][name], np.float32))
      ref = np.max(np.where(m, stored, 0.0), axis=(0, 1, 3))
      np.testing.assert_array_equal(np.asarray(amax[f"layers_{i}/{path}"]), ref)


@pytest.mark.parametrize("mode", ["fp8_per_head", "nvfp4"])
def test_the_cache_stores_the_reference_quantization_of_the_layers_keys_and_values(mode):
  # Layer 0's K and V do not depend on the cache's format (no attention upstream of them), so the
  # quantized prefill's layer-0 cache is the reference quantization of the unquantized one.
  amax = {k: v for k, v in _calibrate(mode).items()}
  # Power-of-two FP8 scales (the reference then divides exactly); NVFP4 takes the calibrated ones.
  if mode.startswith("fp8"):
    amax = {k: 448 * 2.0 ** jnp.ceil(jnp.log2(v / 448)) for k, v in amax.items()}
  policy = dataclasses.replace(BF16, kv_cache=mode)
  plain, quant = _prefill(BF16), _prefill(policy, amax)
  for name, path in (("k", kv_cache.K_PATH), ("v", kv_cache.V_PATH)):
    x = np.asarray(plain["layers"][0][name], np.float32)
    a = np.asarray(amax[f"layers_0/{path}"])
    if mode == "nvfp4":
      ref = quant_reference.exact_fake_quant(x, QuantConfig("nvfp4", axis=-1),
                                             tensor_amax=a.max())
    else:
      ref = np.stack([_fp8_ref(x[:, :, h], a[h] / 448) for h in range(2)], 2)
    got = np.asarray(quant["layers"][0][name], np.float32)
    real = np.asarray(MASK)
    np.testing.assert_array_equal(got[real], ref.astype(ml_dtypes.bfloat16)
                                  .astype(np.float32)[real])
    assert np.mean(got[real] != x[real]) > 0.3  # the quantization is not a no-op here


def test_scanned_layers_calibrate_and_quantize_the_cache_as_the_unrolled_ones():
  # One program per side; the scan reads each layer's [K] amaxes from the stacked [L, K] ones and
  # writes the quantized K/V into its slice of the stacked cache.
  scanned = dataclasses.replace(KV16, scan_layers=True)
  amax = _calibrate("fp8_per_head")
  amax_scan = _calibrate("fp8_per_head", scanned)
  for k in amax:
    np.testing.assert_array_equal(np.asarray(amax[k]), np.asarray(amax_scan[k]))
  policy = dataclasses.replace(BF16, kv_cache="fp8_per_head")
  logits_a, cache_a = _prefill(policy, amax, logits=True)
  logits_b, cache_b = _prefill(policy, amax, scanned, logits=True)
  np.testing.assert_array_equal(np.asarray(logits_a), np.asarray(logits_b))
  for i in range(KV16.n_layers):
    for n in ("k", "v"):
      np.testing.assert_array_equal(np.asarray(cache_a["layers"][i][n], np.float32),
                                    np.asarray(cache_b["layers"][n][i], np.float32))
