"""NVFP4's per-block E2M1 thresholds (lowrl.quant.nvfp4).

References are exact (Fraction) roundings from the definition: T_i is the smallest FP32 value whose
exact quotient by S = s_block * G rounds (RNE, ties to even) above the i-th E2M1 grid value.
"""
from fractions import Fraction

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from lowrl.quant import QuantConfig, dequantize, fake_quant, nvfp4, quantize
from quant_reference import _grid, _rne_grid

f32 = np.float32
E2M1_GRID = _grid("nvfp4")
# G with many significant bits (the split into 12-bit halves matters), 1, and just below 2.
GS = [f32(1.0 + 2.0**-3 + 2.0**-12 + 2.0**-23), f32(1.0), f32(np.nextafter(f32(2.0), f32(0.0))),
      f32(1.7320508)]


def _e4m3_positive() -> np.ndarray:
  vals = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(f32)
  return np.unique(vals[np.isfinite(vals) & (vals > 0)])


def _code(v: float, s: float, g: float) -> Fraction:
  return _rne_grid(Fraction(float(v)) / (Fraction(float(s)) * Fraction(float(g))), E2M1_GRID)


def _seven(s, g, jit):
  fn = lambda s_: jnp.stack(nvfp4._seven(nvfp4.thresholds(s_, nvfp4._outer_parts(  # noqa: E731
      jnp.float32(g)))))
  return np.asarray((jax.jit(fn) if jit else fn)(jnp.asarray(s)))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_thresholds_are_the_smallest_passing_fp32_values(jit):
  """Every positive E4M3 block scale: T_i passes the i-th midpoint exactly, its FP32 predecessor
  does not (so v >= T_i is the exact rounding decision for every FP32 v)."""
  s = _e4m3_positive()
  for g in GS:
    thr = _seven(s, g, jit)  # [7, n]
    for i in range(7):
      for k in range(len(s)):
        t = thr[i, k]
        assert _code(t, s[k], g) > E2M1_GRID[i], (g, s[k], i)
        assert _code(np.nextafter(t, f32(0)), s[k], g) <= E2M1_GRID[i], (g, s[k], i)


def test_codes_match_exact_rounding_on_ties_and_neighbours():
  """Codes from the thresholds against Fraction rounding: exact midpoint products (ties where
  representable), their FP32 neighbours, random values, 0, inf; saturation at 6."""
  rng = np.random.default_rng(0)
  s = _e4m3_positive()[::7]
  for g in GS:
    mids = [Fraction(float(m)) for m in nvfp4._MIDPOINTS]
    v = np.array([[float(m * Fraction(float(sk)) * Fraction(float(g))) for m in mids]
                  for sk in s], f32)  # FP32 nearest of each exact midpoint product
    v = np.concatenate([v, np.nextafter(v, f32(0)), np.nextafter(v, f32(np.inf)),
                        (rng.uniform(0, 7.5, (len(s), 16)) * s[:, None] * g).astype(f32),
                        np.tile(f32([0.0, np.inf]), (len(s), 1))], axis=1)
    thr = jnp.asarray(_seven(s, g, False))[:, :, None]
    got = np.asarray(jax.jit(lambda v_, t_: nvfp4._codes(v_, list(t_)))(jnp.asarray(v), thr))
    for k in range(len(s)):
      for j in range(v.shape[1]):
        want = E2M1_GRID[-1] if np.isinf(v[k, j]) else _code(v[k, j], s[k], g)
        assert Fraction(float(got[k, j])) == want, (g, s[k], v[k, j])


def test_code_thresholds_of_zero_and_nan_blocks():
  """Blocks whose scale is 0 or NaN: finite values code to 0, inf (and NaN, read as inf) to 4."""
  s = jnp.asarray(f32([0.0, np.nan]))
  thr = nvfp4._code_thresholds(s, nvfp4.thresholds(s, nvfp4._outer_parts(jnp.float32(1.5))))
  v = jnp.asarray(f32([[0.0, 1.0, 3e38, np.inf]] * 2)).T[..., None]  # [4, 2, 1]
  got = np.asarray(nvfp4._codes(v, list(thr[:, None, :, None])))[..., 0]
  np.testing.assert_array_equal(got, f32([[0, 0], [0, 0], [0, 0], [4, 4]]))


def test_fake_quant_is_dequantize_of_quantize_on_special_blocks():
  """The fused fake_quant path (codes of zero/NaN blocks not stored) against quantize +
  dequantize, bit for bit, for every float dtype: NaN, inf, zero and tiny blocks, a zero row,
  and a static tensor_amax of 0 (outer scale 0) or below the data (saturation)."""
  rng = np.random.default_rng(1)
  x = rng.standard_normal((16, 64)).astype(f32) * 4
  x[0, :16] = 0
  x[1, 3], x[2, 7], x[2, 9], x[3, :] = np.nan, np.inf, -np.inf, 0
  x[4, :16] *= 1e-6
  x[5, 20] = -0.0
  for dtype in [jnp.float32, jnp.bfloat16, jnp.float16]:
    xd = jnp.asarray(x).astype(dtype)
    for cfg, amax in [(QuantConfig("nvfp4"), None), (QuantConfig("nvfp4"), 0.0),
                      (QuantConfig("nvfp4"), 2.0),
                      (QuantConfig("nvfp4", per_token=True, four_over_six=True), None),
                      (QuantConfig("nvfp4", four_over_six=True, four_over_six_metric="mae",
                                   block_2d=True), None)]:
      kw = {} if amax is None else {"tensor_amax": jnp.float32(amax)}
      want = dequantize(quantize(xd, cfg, **kw), dtype)
      for got in (fake_quant(xd, cfg, **kw), jax.jit(lambda v: fake_quant(v, cfg, **kw))(xd)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                      np.asarray(want).view(np.uint8), err_msg=f"{cfg} {dtype}")
