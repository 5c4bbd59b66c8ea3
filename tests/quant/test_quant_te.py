"""QuantConfig(scale_convention="te"): TransformerEngine's NVFP4 scale arithmetic, bit for bit,
against a NumPy float32 reference written step by step from TE's source (each NumPy float32
operation is one IEEE round-to-nearest step, like the CUDA code's):

  transformer_engine/common/cast/nvfp4/core_nvfp4.cuh
    compute_global_encode_scaling_factor_FP4: S_enc = 448 * 6 / amax, fminf FLT_MAX, 1 if amax == 0
      or S_enc == 0
    quantization_and_transposition_SF::compute_decoding_scaling_factor: e4m3(fminf(amax_b / 6 *
      S_enc, FLT_MAX)) (a saturating, round-to-nearest cast)
  tests/cpp/operator/test_cast_nvfp4_transpose.cu compute_scaling_coefficient (not fast math):
    S_dec = 1 / S_enc; coeff = fminf(1 / (s_b * S_dec), FLT_MAX); element = e2m1(x * coeff)
  transformer_engine/common/cast/nvfp4/dequantize_nvfp4.cuh dequantize_fp4_kernel:
    out = code * (s_b * amax * (float)(1.0 / (6.0 * 448.0)))
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from lowrl.quant import QuantConfig, dequantize, fake_quant, quantize

f32 = np.float32
TE = QuantConfig("nvfp4", scale_convention="te")
FLT_MAX = np.finfo(f32).max


def _te_reference(x, amax=None):
  """(codes, block scales, dequantized) of a 2-D x with 16-element blocks along the last axis."""
  x = np.asarray(x, f32)
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    amax = np.max(np.abs(x)) if amax is None else f32(amax)
    s_enc = np.minimum(f32(448.0) * f32(6.0) / amax, FLT_MAX)
    if amax == 0 or s_enc == 0:
      s_enc = f32(1.0)
    xb = x.reshape(x.shape[0], -1, 16)
    amax_b = np.max(np.abs(xb), axis=-1, keepdims=True)
    s_dec_b = np.minimum(amax_b / f32(6.0) * s_enc, FLT_MAX).astype(f32)
    s_b = np.clip(s_dec_b, 0, 448).astype(ml_dtypes.float8_e4m3fn).astype(f32)
    s_dec = f32(1.0) / s_enc
    coeff = np.minimum(f32(1.0) / (s_b * s_dec), FLT_MAX).astype(f32)
    y = (xb * coeff).astype(f32)
    codes = np.clip(y, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(f32)
    final = ((s_b * amax).astype(f32) * f32(1.0 / (6.0 * 448.0))).astype(f32)
    dq = (codes * final).astype(f32)
  return codes.reshape(x.shape), s_b[..., 0], dq.reshape(x.shape)


def _inputs():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((16, 64)) * np.exp2(rng.integers(-8, 9, (16, 1)))
  x[0, :16] = 0.0  # zero block
  x[1, :16] *= 1e-6  # tiny block: E4M3 subnormal / flushed scale
  x[2, 5] = 0.0
  # Values whose quotients land near E2M1 / E4M3 midpoints under TE's roundings.
  x[3] = np.resize([6.0, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25], 64) * 3.0
  return x.astype(f32)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_te_convention_matches_reference(dtype):
  x = _inputs().astype(dtype)
  codes, s_b, dq = _te_reference(np.asarray(x, f32))
  q = quantize(x, TE)
  np.testing.assert_array_equal(np.asarray(q.codes.astype(jnp.float32)), codes)
  np.testing.assert_array_equal(np.asarray(q.scale.astype(jnp.float32)), s_b)
  assert float(q.outer) == float(np.max(np.abs(np.asarray(x, f32))))  # TE stores the amax
  want = dq.astype(dtype).astype(f32)
  np.testing.assert_array_equal(np.asarray(dequantize(q, x.dtype), f32), want)
  np.testing.assert_array_equal(np.asarray(fake_quant(x, TE), f32), want)
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: fake_quant(v, TE))(x), f32), want)


def test_te_convention_static_amax_zero_tensor_and_difference_from_exact():
  x = _inputs()
  for amax in (f32(3.0), f32(1e4)):
    want = _te_reference(x, amax)[2]
    np.testing.assert_array_equal(np.asarray(fake_quant(x, TE, tensor_amax=amax)), want)
  z = np.zeros((2, 32), f32)
  np.testing.assert_array_equal(np.asarray(fake_quant(z, TE)), z)
  # The two conventions round the same recipe differently: on random data they pick the same
  # codes and scales here, and the dequantized values differ only by the decode scale's rounding
  # (TE: fl(fl(s_b * amax) * fl(1/2688)); exact: fl(s_b * s_global), s_global = RNE(amax/2688)):
  # TE rounds 4 times (fl(1/2688), two products, code * final), exact 2 times (s_global, the
  # last product) from code * s_b * amax / 2688: <= 6 * 2**-24 relative apart.
  rng = np.random.default_rng(1)
  y = (rng.standard_normal((64, 64)) * 3).astype(f32)
  te, ex = np.asarray(fake_quant(y, TE)), np.asarray(fake_quant(y, QuantConfig("nvfp4")))
  np.testing.assert_allclose(te, ex, rtol=6 * 2.0**-24, atol=0)
  assert np.any(te != ex)


def test_te_convention_rejects_unsupported_options():
  for kw in (dict(per_token=True), dict(four_over_six=True), dict(stochastic_rounding=True)):
    with pytest.raises(ValueError, match="scale_convention='te'"):
      QuantConfig("nvfp4", scale_convention="te", **kw)
  with pytest.raises(ValueError, match="scale_convention='te'"):
    QuantConfig("mxfp4", scale_convention="te")
  with pytest.raises(ValueError, match="scale_convention"):
    QuantConfig("nvfp4", scale_convention="cublas")
