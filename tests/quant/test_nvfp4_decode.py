"""fake_quant's NVFP4 decoding paths (lowrl.quant.nvfp4): the plain FP32 product for BF16 output
where no product can round twice, per-block tables otherwise.

The reference is the exact product code * s_block * outer (float64: <= 6 + 24 significant bits,
so exact) rounded once to BF16 (round half to even, in float64 arithmetic).
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from lowrl.quant import QuantConfig, dequantize, fake_quant, nvfp4, quantize

f32 = np.float32
CODES = np.array([0.5, 1, 1.5, 2, 3, 4, 6])


def _e4m3_positive() -> np.ndarray:
  vals = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(f32)
  return np.unique(vals[np.isfinite(vals) & (vals > 0)])


def _rne_bf16(z: np.ndarray) -> np.ndarray:
  """RNE of float64 values (normal in BF16, <= 53 bits) to BF16's 8 significant bits."""
  m, e = np.frexp(z)  # z = m * 2**e, m in [0.5, 1)
  return np.ldexp(np.rint(m * 256.0), e - 8)  # m * 256 is exact; rint ties to even


def _products() -> np.ndarray:
  return (CODES[:, None] * _e4m3_positive()[None, :].astype(np.float64)).ravel()


def _midpoint_hit_outer() -> f32:
  """An outer scale o with fl32(3 * o) exactly the BF16 midpoint 1 + 2**-8 while 3 * o is above
  it: RNE_bf16(fl32(3 * o)) rounds that tie down to even (1), the exact product rounds up."""
  mid = 1.0 + 2.0**-8
  o = f32(mid / 3)
  for _ in range(64):
    y = float(f32(3) * o)
    if y == mid and 3.0 * float(o) > mid:
      return o
    o = np.nextafter(o, f32(1.0) if y <= mid else f32(0.0))
  raise AssertionError("no outer scale found")


def test_double_rounding_check_covers_every_product():
  """Where _bf16_double_rounding_free holds, fl32(cs * outer) rounded to BF16 is the exact
  product rounded once, for every code * E4M3 scale; the check rejects a constructed hit."""
  rng = np.random.default_rng(0)
  outers = (rng.uniform(1, 2, 400) * 2.0 ** rng.integers(-60, 60, 400)).astype(f32)
  outers = np.append(outers, _midpoint_hit_outer())
  free = np.asarray(jax.jit(jax.vmap(nvfp4._bf16_double_rounding_free))(jnp.asarray(outers)))
  assert not free[-1] and free[:-1].mean() > 0.9
  cs = _products()
  for o, ok in zip(outers, free):
    fast = (cs.astype(f32) * o).astype(ml_dtypes.bfloat16).astype(np.float64)
    exact = _rne_bf16(cs * np.float64(o))
    if ok:
      np.testing.assert_array_equal(fast, exact, err_msg=f"outer={o!r}")
    elif o == outers[-1]:
      assert (fast != exact).any()  # the hit is real: the product path would be wrong


def test_both_paths_match_dequantize_of_quantize():
  """fake_quant (BF16) through either path against quantize + dequantize (narrow_product per
  element), bit for bit: a tensor whose outer scale is the constructed hit (table path) and
  random ones (product path), per-tensor and per-token 4/6, jitted and not."""
  o = _midpoint_hit_outer()
  rng = np.random.default_rng(2)
  x = rng.standard_normal((8, 64)) * 2
  # amax / 2688 rounds to the hit outer scale o: one element at a search around o * 2688.
  amax = f32(float(o) * 2688)
  while nvfp4.exact.div_rn(jnp.float32(amax), 2688.0) != o:
    amax = np.nextafter(amax, f32(np.inf) if nvfp4.exact.div_rn(jnp.float32(amax), 2688.0) < o
                        else f32(0))
  x = np.clip(x, -float(amax), float(amax))
  x[0, 0] = amax
  xs = [jnp.asarray(x, jnp.float32).astype(jnp.bfloat16),
        jnp.asarray(rng.standard_normal((8, 64)) * 3, jnp.bfloat16)]
  cfgs = [QuantConfig("nvfp4"), QuantConfig("nvfp4", per_token=True, four_over_six=True)]
  for i, xd in enumerate(xs):
    for cfg in cfgs:
      want = np.asarray(dequantize(quantize(xd, cfg), jnp.bfloat16)).view(np.uint16)
      for got in (fake_quant(xd, cfg), jax.jit(lambda v, c=cfg: fake_quant(v, c))(xd)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want, err_msg=f"{i} {cfg}")
