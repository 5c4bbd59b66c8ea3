"""Spec-exact NVFP4 (docs/reference.md §2): fake_quant equals the exact-rounding Fraction reference
(tests/quant_reference.py) bit for bit on random FP32/BF16 inputs, ties, near-ties, zeros,
NaN/Inf and saturation; the exact-division helpers against Fraction arithmetic."""
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrl.quant import QuantConfig, dequantize, fake_quant, quantize
from lowrl.quant import exact
from lowrl.quant.formats import E2M1, E4M3
from quant_reference import ceil_grid, ceil_f32, exact_fake_quant, rne_f32

f32 = np.float32
CFGS = [QuantConfig("nvfp4"), QuantConfig("nvfp4", per_token=True),
        QuantConfig("nvfp4", four_over_six=True),
        QuantConfig("nvfp4", per_token=True, four_over_six=True, four_over_six_metric="mae")]
IDS = ["tensor", "per_token", "4o6", "per_token_4o6_mae"]


def _same(a, b):
  a, b = np.asarray(a, f32), np.asarray(b, f32)
  diff = (a.view(np.uint32) != b.view(np.uint32)) & ~(np.isnan(a) & np.isnan(b))
  assert not diff.any(), f"{diff.sum()} mismatches at {np.argwhere(diff)[:4].tolist()}: " \
                         f"{a[diff][:4]} vs {b[diff][:4]}"


def _check(x, cfg, **kw):
  # One rounding of the exact value to x's dtype (BF16 too: no FP32 rounding first).
  want = exact_fake_quant(np.asarray(x, f32), cfg, dtype=x.dtype, **kw)
  got = fake_quant(x, cfg, **kw)
  _same(np.asarray(got, f32), want)
  # jit (inlined inside an outer program) and the quantize/dequantize pair give the same bits.
  _same(jax.jit(lambda v: fake_quant(v, cfg, **kw))(x), got)
  _same(dequantize(quantize(x, cfg, **kw), x.dtype), got)


@pytest.mark.parametrize("cfg", CFGS, ids=IDS)
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_random_inputs_match_exact_reference(cfg, dtype):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((16, 64)) * np.exp2(rng.integers(-6, 7, (16, 1)))
  x[rng.random(x.shape) < 0.05] = 0.0
  _check(x.astype(dtype), cfg)


def _tie_tensor():
  """Blocks built so that element quotients land exactly on E2M1 midpoints and block-scale ratios
  on E4M3 midpoints (amax = 2688 gives s_global = 1 exactly), plus FP32 neighbours (near-ties)."""
  rows = []
  # s_global = 1, block max 6 * s_block: elements = midpoint * s_block for s_block = 1 and 2.
  mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
  for sb in (1.0, 2.0):
    vals = np.concatenate([[6 * sb], mids * sb, np.nextafter(mids * sb, 0),
                           np.nextafter(mids * sb, 10)])[:16]
    rows.append(np.concatenate([vals, -vals[::-1], vals, -vals])[:64])
  # Block-scale ratio amax_b / 6 exactly on an E4M3 midpoint (336 between 320 and 352; 17 between
  # 16 and 18) and just beside it.
  for ratio in (336.0, 17.0, 0.0029296875):  # last: 1.5 * 2**-9, E4M3 subnormal midpoint
    for amax_b in (6 * ratio, np.nextafter(f32(6 * ratio), 0), np.nextafter(f32(6 * ratio), 1e9)):
      rows.append(np.full(64, f32(amax_b)) * np.resize([1, -0.5, 0.25, 0.75], 64))
  x = np.stack(rows).astype(f32)
  x[0, 0] = 2688.0  # pins the tensor amax: s_global = 1
  return x


@pytest.mark.parametrize("cfg", CFGS[:2], ids=IDS[:2])
def test_ties_and_near_ties(cfg):
  _check(_tie_tensor(), cfg)


def test_known_cases_from_the_issue():
  # x / S = 5 exactly rounds half to even: 4, not 6 (S = 1 here: amax 2688 -> s_global 1,
  # block max 6 -> s_block 1).
  x = np.zeros((1, 16), f32)
  x[0, :3] = [6.0, 5.0, -3.5]
  x2 = np.zeros((1, 32), f32)
  x2[0, :16] = x[0]
  x2[0, 16] = 2688.0
  out = np.asarray(fake_quant(x2, QuantConfig("nvfp4")))
  assert out[0, 1] == 4.0 and out[0, 2] == -4.0  # 3.5 is the 3/4 midpoint: even is 4


@pytest.mark.parametrize("cfg", CFGS[:3], ids=IDS[:3])
def test_specials_zeros_saturation(cfg):
  rng = np.random.default_rng(3)
  x = rng.standard_normal((4, 64)).astype(f32)
  x[1] = 0.0
  x[2, :16] = -0.0
  x[2, 16:] = 1e-30  # tiny block beside others
  x[3, 5] = 1e-40  # FP32 subnormal element: flushed (documented), sign kept
  _check(x, cfg)
  y = x.copy()
  y[0, 3] = np.nan
  out = np.asarray(fake_quant(y, cfg))
  if cfg.per_token:
    assert np.isnan(out[0]).all() and not np.isnan(out[1:]).any()
  else:
    assert np.isnan(out).all()
  y[0, 3] = np.inf
  assert np.isnan(np.asarray(fake_quant(y, cfg))[0]).all()


def test_static_amax_saturation_matches_reference():
  x = np.random.default_rng(4).standard_normal((8, 64)).astype(f32) * 10
  x[0, 0] = np.inf
  for amax in (0.0, 0.5, 3.0, 1e4):  # 0: scale 0, everything (the inf element too) -> 0
    _check(x, QuantConfig("nvfp4"), tensor_amax=f32(amax))


def test_div_rn_is_correctly_rounded():
  rng = np.random.default_rng(5)
  num = np.concatenate([rng.uniform(0, 1, 2000).astype(f32) * np.exp2(rng.integers(-90, 100, 2000)),
                        np.arange(1, 2000, dtype=f32) * 2688 / 4096,  # quotient with few bits
                        [0.0, 2688.0, 1536.0, np.finfo(f32).max]]).astype(f32)
  for den in (2688.0, 1536.0):
    got = np.asarray(jax.jit(lambda n: exact.div_rn(n, den))(num))
    want = np.array([rne_f32(Fraction(float(n)) / Fraction(den)) for n in num], f32)
    _same(got, want)
    # round_up: the exact ceiling (stochastic rounding's outer scale).
    got = np.asarray(jax.jit(lambda n: exact.div_rn(n, den, round_up=True))(num))
    want = np.array([float(ceil_f32(Fraction(float(n)) / Fraction(den))) if n else 0.0
                     for n in num], f32)
    _same(got, want)


def test_div_rn_edges():
  """div_rn is integer arithmetic on the bit pattern: significands at the ends of [1, 2) (the
  int32 quotient's range), results at the FP32 normal limit (below it they flush to 0, like the
  reference), subnormal and zero numerators (0), and the divisor 6 (the TE convention's)."""
  ends = np.array([1.0, np.nextafter(f32(1), f32(2)), np.nextafter(f32(2), f32(1)), 1.5, 1.3125],
                  f32)
  num = np.concatenate([ends * f32(2.0**e) for e in (-126, -125, -116, -115, -114, -113, -112, -1,
                                                       0, 11, 12, 126, 127)]
                       + [[0.0, 1e-40, 1.4e-45, np.finfo(f32).max, 2688 * 2.0**-126,
                           2688 * 2.0**-127 * 3]]).astype(f32)
  for den in (2688.0, 1536.0, 6.0):
    got = np.asarray(jax.jit(lambda n: exact.div_rn(n, den))(num))
    want = np.array([rne_f32(Fraction(float(n)) / Fraction(den)) for n in num], f32)
    _same(got, want)
    got = np.asarray(jax.jit(lambda n: exact.div_rn(n, den, round_up=True))(num))
    want = [float(ceil_f32(Fraction(float(n)) / Fraction(den))) if n else 0.0 for n in num]
    _same(got, np.array([w if w >= 2.0**-126 else 0.0 for w in want], f32))  # flushed


def test_round_quotient_at_the_subnormal_boundary():
  """E4M3's grid step changes at 2**-6 (2**emin): quotients just below it, whose `approx + 2**emin`
  rounds up to 2**-5, and around its grid points and midpoints, with a low-by-2**-21 approximation
  too (the neighbouring interval), and far below the smallest subnormal (0)."""
  g = f32(1.0 + 2.0**-2 + 2.0**-13 + 2.0**-23)
  g_hi, g_lo = exact.split12(jnp.float32(g))
  den = f32(6.0)
  grid = E4M3.grid()
  pts = np.concatenate([grid[:12], (grid[:11] + grid[1:12]) / 2, [2.0**-6 * (1 - 2.0**-24),
                                                                  2.0**-6 * (1 - 2.0**-23)]])
  num = np.array([float(Fraction(float(p)) * 6 * Fraction(float(g))) for p in pts], f32)
  num = np.concatenate([num, np.nextafter(num, 0), np.nextafter(num, np.inf), [1e-30, 2.0**-40]])
  num = num.astype(f32)
  grid_f = [Fraction(float(v)) for v in grid]
  for scale in (1.0, 1 - 2.0**-21, 1 + 2.0**-21):
    approx = jnp.asarray(num) / (den * g) * f32(scale)
    got = np.asarray(exact.round_quotient(jnp.asarray(num), den, g_hi, g_lo, approx, E4M3))
    for n, o in zip(num, got):
      t = Fraction(float(n)) / (Fraction(float(den)) * Fraction(float(g)))
      i = max(k for k in range(len(grid_f)) if grid_f[k] <= t)
      mid = (grid_f[i] + grid_f[i + 1]) / 2
      want = grid_f[i] if t < mid or (t == mid and i % 2 == 0) else grid_f[i + 1]
      assert Fraction(float(o)) == want, (n, scale, o, float(want))


def test_ceil_quotient_is_the_exact_ceiling():
  """E4M3 ceilings of num / (6 g): grid points times 6g exactly (-> that point), their FP32
  neighbours (-> it or the next), and random values, g with many significant bits."""
  g = f32(1.0 + 2.0**-2 + 2.0**-13 + 2.0**-23)
  g_hi, g_lo = exact.split12(jnp.float32(g))
  grid = [Fraction(float(v)) for v in E4M3.grid()]
  den = Fraction(6) * Fraction(float(g))
  on = np.array([float(v * den) for v in grid], f32)
  rng = np.random.default_rng(6)
  # (on[1:]: the neighbour above 0 is an FP32 subnormal, which XLA CPU flushes to 0)
  num = np.concatenate([on, np.nextafter(on, 0), np.nextafter(on[1:], np.inf),
                        rng.uniform(0, 3000, 500).astype(f32), [0.0, 1e30]]).astype(f32)
  got = np.asarray(jax.jit(lambda n: exact.ceil_quotient(n, 6.0, g_hi, g_lo, n / (6 * g), E4M3))(
      jnp.asarray(num)))
  want = np.array([float(ceil_grid(Fraction(float(n)) / den, grid)) for n in num], f32)
  _same(got, want)


@pytest.mark.parametrize("fmt", [E2M1, E4M3], ids=["e2m1", "e4m3"])
def test_round_quotient_on_midpoints(fmt):
  """num = mid * den * g exactly (ties) and its FP32 neighbours, g with many significant bits."""
  g = f32(1.0 + 2.0**-3 + 2.0**-12 + 2.0**-23)
  g_hi, g_lo = exact.split12(jnp.float32(g))
  grid = fmt.grid()
  mids = (grid[1:] + grid[:-1]) / 2
  den = f32(1.5)  # <= 4 significant bits
  exact_num = [Fraction(float(m)) * Fraction(float(den)) * Fraction(float(g)) for m in mids]
  num = np.array([float(v) for v in exact_num], f32)  # FP32 nearest: ties only if representable
  num = np.concatenate([num, np.nextafter(num, 0), np.nextafter(num, np.inf), [0.0, 1e30]])
  approx = jnp.asarray(num) / (den * g)
  got = np.asarray(exact.round_quotient(jnp.asarray(num), den, g_hi, g_lo, approx, fmt))
  if fmt is E2M1:  # the E2M1 fast path gives the same bits
    s_hi, s_lo = den * g_hi, den * g_lo  # exact: 1.5 has 2 significant bits
    _same(np.asarray(exact.round_e2m1_quotient(jnp.asarray(num), s_hi, s_lo, approx)), got)
  grid_f = [Fraction(float(v)) for v in grid]
  for n, o in zip(num, got):
    t = Fraction(float(n)) / (Fraction(float(den)) * Fraction(float(g)))
    if t >= grid_f[-1]:
      assert o == grid[-1]
      continue
    i = max(k for k in range(len(grid_f)) if grid_f[k] <= t)
    mid = (grid_f[i] + grid_f[i + 1]) / 2
    want = grid_f[i] if t < mid or (t == mid and i % 2 == 0) else grid_f[i + 1]
    assert Fraction(float(o)) == want, (n, o, float(want))


def _four_six_near_ties(metric):
  """Rows whose second block (max 24, s_global = 1: s_block 4 for 6, 6 for 4) has 4/6 errors
  equal up to a few FP32 ulps, or exactly equal. Only two elements differ between the candidates:
  x = 7 + eps (6: grid 6|8 -> 8; 4: grid 6|9 -> 6) and x = 8.5 + eta (6: -> 8; 4: -> 9), so
  mse D = err4 - err6 = 4 eps - 2 eta and mae D = 2 eps - 2 eta (a few 2**-20, ~2**-29 of the block
  max squared: far below any fixed-point resolution of the errors). Returns (x, [6 wins?])."""
  u = 2.0**-21  # ulp of 7; ulp of 8.5 is 2 u
  if metric == "mse":
    pairs = [(u, 2 * u), (2 * u, 2 * u), (0.0, 2 * u), (u, 0.0), (3 * u, 6 * u), (3 * u, 8 * u)]
    six = [4 * e - 2 * h >= 0 for e, h in pairs]
  else:
    pairs = [(2 * u, 2 * u), (4 * u, 2 * u), (2 * u, 4 * u), (0.0, 0.0), (6 * u, 4 * u)]
    six = [2 * e - 2 * h >= 0 for e, h in pairs]
  rows = []
  for eps, eta in pairs:
    blk = np.zeros(16)
    blk[:6] = [24.0, 7.0 + eps, 8.5 + eta, 12.0, -12.0, -24.0]
    rows.append(np.concatenate([[1536.0], np.zeros(15), blk]))  # amax 1536: s_global = 1
  return np.asarray(rows, f32), six


@pytest.mark.parametrize("metric", ["mse", "mae"])
def test_four_over_six_near_ties_are_exact(metric):
  x, six = _four_six_near_ties(metric)
  cfg = QuantConfig("nvfp4", four_over_six=True, four_over_six_metric=metric)
  _check(x, cfg)
  out = np.asarray(fake_quant(x, cfg))
  assert [bool(o == 8.0) for o in out[:, 17]] == six  # 7 + eps -> 8 with scale 6, 6 with 4
  assert any(six) and not all(six)


@pytest.mark.parametrize("cfg", [CFGS[1], CFGS[3]], ids=[IDS[1], IDS[3]])
def test_bf16_outputs_round_once_from_the_exact_value(cfg):
  """dequantize(q, bfloat16) of an FP32 input rounds code * s_block * s_global to BF16 once (the
  reference's RNE_bf16 of the exact product), not to FP32 and then to BF16; the codes and scales
  (the 4/6 choice included) do not depend on the output dtype. The input (BF16 values with per-row
  magnitudes) makes the two roundings differ on some elements."""
  rng = np.random.default_rng(7)
  x = rng.standard_normal((16, 128)) * np.exp2(rng.integers(-6, 7, (16, 1)))
  x = x.astype(jnp.bfloat16).astype(f32)  # BF16 values (amaxes of 8 bits), stored as FP32
  q = quantize(x, cfg)
  want = exact_fake_quant(x, cfg, dtype=jnp.bfloat16)
  _same(dequantize(q, jnp.bfloat16), want)
  _same(jax.jit(lambda v: dequantize(quantize(v, cfg), jnp.bfloat16))(x), want)
  twice = np.asarray(dequantize(q, jnp.float32)).astype(jnp.bfloat16).astype(f32)
  assert (twice != want).any()  # double rounding would fail this test
