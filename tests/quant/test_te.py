"""QuantConfig(scale_convention="te" | "te_v2_13"): TransformerEngine's NVFP4 arithmetic, bit for
bit, against a NumPy float32 transcription of TE's own pure-PyTorch reference quantizer (each
NumPy float32 operation is one IEEE round-to-nearest step, like torch's float32 CPU ops):

  NVIDIA/TransformerEngine at d0067d0da6cb01811b8072a7d304f0e00344ce2b (main, 2026-08-22),
  transformer_engine/pytorch/custom_recipes/reference_nvfp4.py:
    NVFP4QuantizerRef._quantize_blockwise_reference (non-4over6 path):
      S_enc = min(fl(448 * 6 / amax), FLT_MAX), 1 if S_enc == 0; S_dec = fl(1 / S_enc)
      s_b = e4m3(clamp(min(fl(amax_b * fl(S_enc * fl(1/6))), FLT_MAX), +-448))
      encode = min(fl(1 / fl(s_b * S_dec)), FLT_MAX); code = cast_to_fp4x2(clamp(fl(x * encode), +-6))
      row_scaled_nvfp4: amax per row.
    NVFP4QuantizerRef._quantize_blockwise_4over6_reference (nvfp4_e4m3_max = 256, the recipe's
      default NVTE_NVFP4_4OVER6_E4M3_USE_256="all"; err_use_fast_math False):
      base = fl(fl(amax_b / 6) * S_enc); s4 = e4m3(clamp(fl(base * 1.5))), s6 = e4m3(clamp(base));
      per candidate: err = sum over idx = 0..15 in order of fl(d * d) (MSE) or |d| (MAE),
      d = fl(fl(fl(fl(code * s) * amax) / 1536) - x); pick 4 iff err4 < err6 (ties keep 6).
  TE v2.13 (before 523801df70c6598e6cee0e9197134b08d4b230b9, 2026-03-16, quantization_nvfp4.py):
      s_b = e4m3(clamp(fl(fl(amax_b / 6) * S_enc)))   ("te_v2_13")
  transformer_engine/common/cast/nvfp4/dequantize_nvfp4.cuh dequantize_fp4_kernel:
      out = OType(code * fl(fl(s_b * amax) * fl(1 / (6 * E)))), E = 448 or 256.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from lowrl.quant import QuantConfig, dequantize, fake_quant, quantize

f32 = np.float32
TE = QuantConfig("nvfp4", scale_convention="te")
TE_OLD = QuantConfig("nvfp4", scale_convention="te_v2_13")
FLT_MAX = np.finfo(f32).max


def _cast_to_fp4(y):
  """reference_nvfp4.cast_to_fp4x2's intervals (round half to even), as signed grid values."""
  a = np.abs(y)
  mag = np.select([a <= 0.25, a < 0.75, a <= 1.25, a < 1.75, a <= 2.5, a < 3.5, a <= 5.0],
                  [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0], 6.0).astype(f32)
  return np.where(y < 0, -mag, mag).astype(f32)


def _e4m3(v):
  return np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(f32)


def te_reference(x, convention="te", per_token=False, four_over_six=False, metric="MSE",
                 amax=None):
  """(codes, block scales, dequantized FP32) of a 2-D x, 16-element blocks along the last axis."""
  x = np.asarray(x, f32)
  m, n = x.shape
  e4m3_max = f32(256 if four_over_six else 448)
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    if amax is not None:
      g_amax = np.full((m, 1, 1), f32(amax), f32)
    elif per_token:
      g_amax = np.max(np.abs(x), axis=1).astype(f32).reshape(m, 1, 1)
    else:
      g_amax = np.full((m, 1, 1), np.max(np.abs(x)), f32)
    s_enc = np.minimum((e4m3_max * f32(6)) / g_amax, FLT_MAX).astype(f32)
    s_enc = np.where(s_enc == 0, f32(1), s_enc).astype(f32)
    s_dec = (f32(1) / s_enc).astype(f32)
    xb = x.reshape(m, n // 16, 16)
    vec_max = np.max(np.abs(xb), axis=-1, keepdims=True).astype(f32)

    def codes_of(s_b):
      enc = np.minimum(f32(1) / (s_b * s_dec), FLT_MAX).astype(f32)
      return _cast_to_fp4(np.clip((xb * enc).astype(f32), -6, 6))

    if four_over_six:
      base = ((vec_max / f32(6)).astype(f32) * s_enc).astype(f32)
      s4, s6 = _e4m3((base * f32(1.5)).astype(f32)), _e4m3(base)
      c4, c6 = codes_of(s4), codes_of(s6)

      def err(c, s):
        total = np.zeros((m, n // 16), f32)
        for i in range(16):
          val = (c[..., i] * s[..., 0]).astype(f32)
          val = (val * g_amax[..., 0]).astype(f32)
          val = (val / f32(6 * 256)).astype(f32)
          d = (val - xb[..., i]).astype(f32)
          total = (total + ((d * d).astype(f32) if metric == "MSE" else np.abs(d))).astype(f32)
        return total

      pick4 = (err(c4, s4) < err(c6, s6))[..., None]
      codes, s_b = np.where(pick4, c4, c6), np.where(pick4, s4, s6)
    else:
      if convention == "te_v2_13":
        s_dec_b = ((vec_max / f32(6)).astype(f32) * s_enc).astype(f32)
      else:
        s_dec_b = (vec_max * (s_enc * (f32(1) / f32(6))).astype(f32)).astype(f32)
      s_b = _e4m3(np.minimum(s_dec_b, FLT_MAX))
      codes = codes_of(s_b)
    final = ((s_b * g_amax).astype(f32) * f32(1.0 / (6.0 * float(e4m3_max)))).astype(f32)
    dq = (codes * final).astype(f32)
  return codes.reshape(x.shape), s_b[..., 0], dq.reshape(x.shape)


def _separating_blocks(rng, amax):
  """Block maxima (FP32) on which fl(fl(a / 6) * S) and fl(a * fl(S * fl(1/6))) round to
  different E4M3 values, S = fl(2688 / amax): near E4M3 midpoints, found by search."""
  s_enc = f32(2688) / f32(amax)
  mids = (_e4m3_grid()[1:] + _e4m3_grid()[:-1]) / 2
  cand = (mids[rng.integers(8, len(mids), 20000)] * 6 / s_enc).astype(f32)
  cand = (cand.view(np.int32) + rng.integers(-3, 4, cand.shape).astype(np.int32)).view(f32)
  cand = cand[(cand > 0) & (cand < amax)]
  old = _e4m3((cand / f32(6)).astype(f32) * s_enc)
  new = _e4m3(cand * (s_enc * (f32(1) / f32(6))).astype(f32))
  return cand[old != new]


def _e4m3_grid():
  return np.unique(np.abs(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
                          .astype(np.float64)))[:-1]


def _inputs(dtype=np.float32):
  """Random blocks of many magnitudes, zero / tiny blocks, and (FP32) blocks whose maxima separate
  TE's two block-scale orders."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((24, 64)) * np.exp2(rng.integers(-8, 5, (24, 1)))
  x[0, :16] = 0.0  # zero block
  x[1, :16] *= 1e-6  # tiny block: E4M3 subnormal / flushed scale
  x[2, 5] = 0.0
  x[2, 0] = 100.3  # the tensor amax (an S_enc for which separating blocks exist)
  x[3] = np.resize([6.0, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25], 64) * 3.0  # E2M1 midpoints
  x = x.astype(f32)
  if dtype == np.float32:
    amax = f32(np.max(np.abs(x)))
    sep = _separating_blocks(rng, amax)[:32]
    assert len(sep) >= 16
    blocks = x[8:16].reshape(-1, 16)  # 32 blocks: scale each to a separating maximum
    blocks = blocks / np.max(np.abs(blocks), axis=1, keepdims=True) * sep[:, None]
    blocks[np.arange(32), np.argmax(np.abs(blocks), axis=1)] = sep  # the maximum exactly
    x[8:16] = blocks.reshape(8, 64).astype(f32)
  return x.astype(dtype)


def _assert_matches(x, cfg, want_codes, want_scales, want_dq):
  q = quantize(x, cfg)
  np.testing.assert_array_equal(np.asarray(q.codes.astype(jnp.float32)), want_codes)
  np.testing.assert_array_equal(np.asarray(q.scale.astype(jnp.float32)), want_scales)
  want = want_dq.astype(x.dtype).astype(f32)  # TE casts its FP32 product to the output type
  np.testing.assert_array_equal(np.asarray(dequantize(q, x.dtype), f32), want)
  np.testing.assert_array_equal(np.asarray(fake_quant(x, cfg), f32), want)
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: fake_quant(v, cfg))(x), f32), want)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("convention", ["te", "te_v2_13"])
def test_te_conventions_match_te_reference(convention, dtype):
  x = _inputs(dtype)
  codes, s_b, dq = te_reference(np.asarray(x, f32), convention)
  cfg = QuantConfig("nvfp4", scale_convention=convention)
  _assert_matches(x, cfg, codes, s_b, dq)
  assert float(quantize(x, cfg).outer) == float(np.max(np.abs(np.asarray(x, f32))))  # the amax


def test_the_two_te_orders_differ_on_separating_blocks():
  """The input is built so that TE's v2.13 and current block-scale orders disagree (the test
  above checks each against its own reference on it)."""
  x = _inputs()
  old = np.asarray(quantize(x, TE_OLD).scale.astype(jnp.float32))
  new = np.asarray(quantize(x, TE).scale.astype(jnp.float32))
  assert (old != new).sum() >= 16


def _four_over_six_inputs():
  """BF16 activations-like rows (outlier channels), plus blocks whose candidates tie exactly
  (values both scales reproduce) and blocks with E2M1 / E4M3 midpoints."""
  rng = np.random.default_rng(1)
  x = rng.standard_normal((32, 128)) * np.exp2(rng.integers(-4, 5, (32, 1)))
  x[:, 7] *= 30  # an outlier channel
  x[0, :16] = np.resize([24, 18, 18, 15, 8], 16)
  x[1, :16] = 0.0
  x[1, :5] = [1536, 1024, 512, 256, 0]  # exact under both candidates: a tie keeps 6
  x[2] = np.resize([6.0, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25], 128) * 3.0
  return x.astype(jnp.bfloat16)


@pytest.mark.parametrize("per_token", [False, True], ids=["tensor", "per_token"])
@pytest.mark.parametrize("metric", ["mse", "mae"])
def test_te_four_over_six_chooses_as_te(per_token, metric):
  x = _four_over_six_inputs()
  cfg = QuantConfig("nvfp4", scale_convention="te", per_token=per_token, four_over_six=True,
                    four_over_six_metric=metric)
  codes, s_b, dq = te_reference(np.asarray(x, f32), "te", per_token, True, metric.upper())
  _assert_matches(x, cfg, codes, s_b, dq)
  if per_token:  # TE's row amax (stored with the block axis kept as 1)
    np.testing.assert_array_equal(np.asarray(quantize(x, cfg).outer)[:, 0],
                                  np.max(np.abs(np.asarray(x, f32)), axis=1))


def test_te_per_token_without_four_over_six():
  x = _inputs()
  cfg = QuantConfig("nvfp4", scale_convention="te", per_token=True)
  _assert_matches(x, cfg, *te_reference(x, "te", per_token=True))


def test_te_convention_static_amax_zero_tensor_and_difference_from_exact():
  x = _inputs()
  for amax in (f32(3.0), f32(1e4)):
    want = te_reference(x, "te", amax=amax)[2]
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
  for conv in ("te", "te_v2_13"):
    for kw in (dict(stochastic_rounding=True), dict(block_2d=True)):
      with pytest.raises(ValueError, match=f"scale_convention='{conv}'"):
        QuantConfig("nvfp4", scale_convention=conv, **kw)
    with pytest.raises(ValueError, match=f"scale_convention='{conv}'"):
      QuantConfig("mxfp4", scale_convention=conv)
  for kw in (dict(per_token=True), dict(four_over_six=True)):
    with pytest.raises(ValueError, match="te_v2_13"):
      QuantConfig("nvfp4", scale_convention="te_v2_13", **kw)
  with pytest.raises(ValueError, match="scale_convention"):
    QuantConfig("nvfp4", scale_convention="cublas")
