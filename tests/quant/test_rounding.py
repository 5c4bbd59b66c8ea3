"""Stochastic rounding: unbiasedness as a statistical test with bounds from the Bernoulli variance,
support (only the two neighbouring grid points), saturation, determinism; sr_cast_bf16."""
import dataclasses
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrl.quant import (E2M1, E4M3, E5M2, QuantConfig, dequantize, fake_quant, quantize,
                         sr_cast_bf16)
from lowrl.quant.rounding import random_bits, stochastic_round_to_grid
from quant_reference import grid_neighbours, rne_f32, sr_nvfp4_scales

f32 = np.float32
N_DRAWS = 4096
Z = 5.0  # standard errors; a false failure has probability ~6e-7 per value


def _check_unbiased(draws, x, lo, hi):
  """draws: [N, n] samples of SR(x); lo/hi: grid neighbours of x. Checks support and that the
  sample mean is within Z standard errors of x, the SE from p = (x - lo) / (hi - lo)."""
  draws = np.asarray(draws, np.float64)
  x, lo, hi = (np.asarray(v, np.float64) for v in (x, lo, hi))
  assert np.all((draws == lo) | (draws == hi)), "SR produced a value other than the two neighbours"
  width = np.where(hi > lo, hi - lo, 1.0)
  p = np.where(hi > lo, (x - lo) / width, 0.0)
  se = width * np.sqrt(p * (1 - p) / draws.shape[0])
  dev = np.abs(draws.mean(0) - x)
  assert np.all(dev <= Z * se + 1e-12 * np.abs(x)), (dev / np.maximum(se, 1e-300)).max()
  # Power check: with fractional positions present, the draws really do vary.
  if np.any((p > 0.05) & (p < 0.95)):
    assert np.any(draws.std(0) > 0)


def _probe(fmt):
  """Values inside the grid: subnormal region, normal binades, next to max, negative, on-grid."""
  g = fmt.grid()
  near_max = (g[-2] + g[-1]) / 2 + (g[-1] - g[-2]) / 8
  pts = [g[1] * 0.3, g[1] * 1.7, near_max, 1.1, 1.0, 0.77 * fmt.max_normal, g[2] * 0.999,
         fmt.min_subnormal / 1024]
  pts = np.asarray(pts, f32)
  return np.concatenate([pts, -pts])


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=lambda f: f.name)
def test_stochastic_round_to_grid_is_unbiased(fmt):
  x = _probe(fmt)
  draws = jax.jit(stochastic_round_to_grid, static_argnums=1)(
      jnp.broadcast_to(x, (N_DRAWS, x.size)), fmt, jax.random.key(0))
  lo, hi = grid_neighbours(x, fmt)
  _check_unbiased(draws, x, lo, hi)


def test_stochastic_rounding_saturates_and_keeps_specials():
  y = jnp.asarray([7.5, -100.0, 6.0, 0.0, -0.0, jnp.nan], jnp.float32)
  out = np.asarray(stochastic_round_to_grid(jnp.broadcast_to(y, (64, 6)), E2M1, jax.random.key(1)))
  assert np.all(out[:, 0] == 6.0) and np.all(out[:, 1] == -6.0) and np.all(out[:, 2] == 6.0)
  assert np.all(out[:, 3] == 0) and np.all(np.signbit(out[:, 4])) and np.all(np.isnan(out[:, 5]))


SR_CONFIGS = [QuantConfig("fp8_e4m3", stochastic_rounding=True),
              QuantConfig("mxfp8_e5m2", stochastic_rounding=True),
              QuantConfig("mxfp4", stochastic_rounding=True),
              QuantConfig("nvfp4", stochastic_rounding=True, per_token=True)]


@pytest.mark.parametrize("cfg", SR_CONFIGS, ids=lambda c: c.fmt)
def test_fake_quant_with_sr_is_unbiased(cfg):
  """Rows are identical copies of one 32-vector, so every row gets the same scales (amax is the
  same) and independent rounding draws: the mean over rows estimates E[fake_quant(x)] = x, in the
  element domain y = x * fl(1/S) (clipped at max_normal: only per-tensor FP8's x * fl(1/s) can exceed it, by 1 ulp)."""
  row = np.asarray(jax.random.normal(jax.random.key(5), (32,)), f32)
  row = row * np.exp2(np.arange(32) % 5 - 2).astype(f32)
  q_sr = quantize(np.broadcast_to(row, (N_DRAWS, 32)), cfg, jax.random.key(6))
  codes = np.asarray(q_sr.codes.astype(jnp.float32), np.float64)  # exact grid values
  # Decode scale S per element: dequantize the SR QTensor with every code 1 (rows share scales).
  s = np.asarray(dequantize(dataclasses.replace(q_sr, codes=jnp.ones_like(q_sr.codes))))[0]
  fmt = {"mxfp4": E2M1, "nvfp4": E2M1}.get(cfg.fmt, E5M2 if "e5m2" in cfg.fmt else E4M3)
  y = np.clip(row * (f32(1) / s), -fmt.max_normal, fmt.max_normal)
  lo, hi = grid_neighbours(y, fmt)
  _check_unbiased(codes, y, lo, hi)
  # fake_quant is the same draw times S (fake_quant == dequantize(quantize) is tested elsewhere).
  np.testing.assert_array_equal(
      np.asarray(fake_quant(np.broadcast_to(row, (N_DRAWS, 32)), cfg, jax.random.key(6))),
      np.asarray(dequantize(q_sr)))


def test_sr_is_deterministic_given_key():
  x = jax.random.normal(jax.random.key(7), (8, 32))
  cfg = QuantConfig("nvfp4", stochastic_rounding=True)
  a = fake_quant(x, cfg, jax.random.key(3))
  b = jax.jit(lambda x, k: fake_quant(x, cfg, k))(x, jax.random.key(3))
  c = fake_quant(x, cfg, jax.random.key(4))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.array_equal(np.asarray(a), np.asarray(c))
  # Raw uint32 keys work too.
  fake_quant(x, cfg, jax.random.PRNGKey(3))


def test_random_bits_are_uniform_and_decorrelated():
  """Each of the 32 bit positions is set with frequency 1/2 (within Z SE), neighbouring elements
  and neighbouring keys are uncorrelated (|r| within Z / sqrt(n))."""
  n = 1 << 16
  b = np.asarray(random_bits(jax.random.key(11), (n,)))
  freq = ((b[:, None] >> np.arange(32, dtype=np.uint32)) & 1).mean(0)
  assert np.all(np.abs(freq - 0.5) <= Z * 0.5 / np.sqrt(n))
  u = b / 2.0**32
  assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) <= Z / np.sqrt(n)
  k1, k2 = jax.random.split(jax.random.key(11))
  u1 = np.asarray(random_bits(k1, (n,))) / 2.0**32
  u2 = np.asarray(random_bits(k2, (n,))) / 2.0**32
  assert abs(np.corrcoef(u1, u2)[0, 1]) <= Z / np.sqrt(n)
  assert abs(u1.mean() - 0.5) <= Z * np.sqrt(1 / 12 / n)


# ---------------------------------------------------------------------------------------------
# sr_cast_bf16


def _bf16_neighbours(x):
  x = np.asarray(x, f32)
  down = (x.view(np.uint32) & 0xFFFF0000).view(f32)  # truncation = toward zero
  up = ((x.view(np.uint32) & 0xFFFF0000) + 0x10000).view(f32)
  exact = (x.view(np.uint32) & 0xFFFF) == 0
  up = np.where(exact, down, up)
  return np.minimum(down, up), np.maximum(down, up)


def test_sr_cast_bf16_is_unbiased():
  # A typical master-weight update: w + lr * g far below half a BF16 ulp (round-to-nearest would
  # erase it), values across binades and signs, a BF16 subnormal, and exact BF16 values.
  x = np.asarray([1.0 + 2.0**-12, -0.3, 3.14159, 1e-3 + 1e-9, 2.0**-130 * 1.3, 1.5, -2.0**-10,
                  65504.3], f32)
  draws = jax.jit(sr_cast_bf16)(jnp.broadcast_to(x, (N_DRAWS, x.size)), jax.random.key(2))
  assert draws.dtype == jnp.bfloat16
  lo, hi = _bf16_neighbours(x)
  _check_unbiased(np.asarray(draws).astype(np.float64), x, lo, hi)
  # Round-to-nearest loses the 2^-12 update entirely; SR keeps it on average (checked above).
  assert float(jnp.asarray(x[0]).astype(jnp.bfloat16)) == 1.0


def test_sr_cast_bf16_specials():
  x = jnp.asarray([jnp.nan, jnp.inf, -jnp.inf, 0.0, -0.0, 3.0], jnp.float32)
  out = np.asarray(sr_cast_bf16(x, jax.random.key(0))).astype(f32)
  assert np.isnan(out[0]) and out[1] == np.inf and out[2] == -np.inf
  assert out[3] == 0 and not np.signbit(out[3]) and out[4] == 0 and np.signbit(out[4])
  assert out[5] == 3.0
  # A signalling-NaN bit pattern must stay NaN (adding noise to it could reach the inf pattern).
  snan = jax.lax.bitcast_convert_type(jnp.uint32(0x7F800001), jnp.float32)
  assert np.isnan(float(sr_cast_bf16(snan, jax.random.key(0))))


# ---------------------------------------------------------------------------------------------
# Unbiased on every element: the SR scales leave every element inside the grid (no saturation).



def _sr_row():
  """One 64-element row, 4 NVFP4 blocks, with the element classes SR used to bias:
  block 0 pins amax = 2688 (s_global = 1); block 1's max / 6 lies just above the E4M3 value 16 (an
  RNE scale rounds down to 16 and the max saturates: 96.09 -> 96) and holds elements near
  saturation (5.5 and 5.9 times 16); block 2 is tiny (an RNE scale 2**-12 flushes to 0); block 3 is
  ordinary (random normals, an on-grid value, a zero)."""
  rng = np.random.default_rng(21)
  b0 = rng.standard_normal(16) * 300
  b0[3] = 2688.0
  b1 = rng.standard_normal(16) * 16
  b1[:3] = [6 * 16 * (1 + 2.0**-10), 5.5 * 16, -5.9 * 16]
  b2 = rng.uniform(-1, 1, 16) * 6 * 2.0**-12
  b2[0] = 6 * 2.0**-12
  b3 = rng.standard_normal(16) * 40
  b3[:2] = [0.0, 48.0]
  return np.concatenate([b0, b1, b2, b3]).astype(f32)


def _grid_frac(fmt):
  return [Fraction(float(g)) for g in fmt.grid()]


def _check_unbiased_exact(draws, x, scale_of):
  """draws [N, n]; x [n] FP32; scale_of(j): the element scale S (Fraction) of element j. Every
  draw must be one of the two FP32 dequantized grid neighbours of x / S and the mean within Z
  standard errors (Bernoulli variance of that pair) of x, plus 2**-21 |x|: the FP32 rounding of
  the dequantized values (<= 2**-24 relative) and SR's probability taken from the FP32 quotient
  x * fl(1 / S) (relative error <= 3 * 2**-24) bound the remaining bias."""
  grid = _grid_frac(E2M1)
  n = draws.shape[0]
  for j, v in enumerate(x):
    s = scale_of(j)
    y = abs(Fraction(float(v))) / s
    assert y <= grid[-1], f"element {j}: x / S = {float(y)} > 6 saturates"
    lo = max(g for g in grid if g <= y)
    hi = min(g for g in grid if g >= y)
    sign = -1.0 if v < 0 else 1.0
    dq_lo, dq_hi = (sign * float(rne_f32(g * s)) for g in (lo, hi))
    col = np.asarray(draws[:, j], np.float64)
    assert np.all((col == dq_lo) | (col == dq_hi)), (j, float(v), np.unique(col)[:4], dq_lo, dq_hi)
    p = float((y - lo) / (hi - lo)) if hi > lo else 0.0
    se = abs(dq_hi - dq_lo) * np.sqrt(p * (1 - p) / n)
    assert abs(col.mean() - v) <= Z * se + 2.0**-21 * abs(v), (j, float(v), col.mean(), se)


@pytest.mark.parametrize("per_token", [False, True], ids=["tensor", "per_token"])
def test_nvfp4_sr_unbiased_per_element_class(per_token):
  cfg = QuantConfig("nvfp4", stochastic_rounding=True, per_token=per_token)
  row = _sr_row()
  # Power check: round-to-nearest scales do bias these classes (saturated max, flushed block).
  rne = np.asarray(fake_quant(row[None], QuantConfig("nvfp4", per_token=per_token)))[0]
  assert rne[16] < row[16] * (1 - 2.0**-12) and np.all(rne[32:48] == 0)
  x = np.broadcast_to(row, (N_DRAWS, 64))
  draws = np.asarray(fake_quant(x, cfg, jax.random.key(22)))
  scales = sr_nvfp4_scales(row[None], cfg)[0]
  _check_unbiased_exact(draws, row, lambda j: scales[j // 16][0] * scales[j // 16][1])


def test_mxfp4_sr_unbiased_per_element_class():
  """rceil MX scales: a block max of mantissa 1.875 (floor would put it at 7.5 > 6, saturating),
  elements near the top, ordinary ones. S = 2**e, e the smallest with amax / 2**e <= 6."""
  rng = np.random.default_rng(23)
  row = (rng.standard_normal(32) * 4).astype(f32)
  row[:3] = [7.5 * 4, 5.9 * 4, -6.9 * 4]
  e = int(np.ceil(np.log2(np.max(np.abs(row)) / 6.0)))
  draws = np.asarray(fake_quant(np.broadcast_to(row, (N_DRAWS, 32)),
                                QuantConfig("mxfp4", stochastic_rounding=True), jax.random.key(24)))
  _check_unbiased_exact(draws, row, lambda j: Fraction(2) ** e)


def test_sr_with_floor_mx_scales_is_rejected():
  with pytest.raises(ValueError, match="rceil"):
    QuantConfig("mxfp4", scale_rounding="floor", stochastic_rounding=True)
