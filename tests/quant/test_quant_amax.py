"""Static per-tensor amax (`tensor_amax` / `lhs_amax` / `rhs_amax`): an amax equal to the data's
gives the default bits, a smaller one saturates at it, a larger one gives the formula's scale;
formats without a per-tensor scale reject it; it reaches the forward of quantized_dot_general
only and gets a zero cotangent."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from lowrl.quant import QDotConfig, QuantConfig, fake_quant, make_dot_general, quantize
from lowrl.quant import quantized_dot_general as qdg
from quant_reference import exact_fake_quant

f32 = np.float32
MM = (((1,), (0,)), ((), ()))
PER_TENSOR = [QuantConfig("fp8_e4m3"), QuantConfig("fp8_e5m2"), QuantConfig("nvfp4"),
              QuantConfig("nvfp4", four_over_six=True)]


def _bits_equal(a, b):
  a, b = np.asarray(a, f32), np.asarray(b, f32)
  same = (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))
  return bool(same.all())


def _x(seed=0, shape=(8, 64)):
  return np.random.default_rng(seed).standard_normal(shape).astype(f32) * 3


@pytest.mark.parametrize("cfg", PER_TENSOR, ids=lambda c: c.fmt + ("_46" if c.four_over_six else ""))
def test_own_amax_is_bit_identical_to_default(cfg):
  x = _x()
  amax = jnp.float32(np.abs(x).max())
  assert _bits_equal(fake_quant(x, cfg, tensor_amax=amax), fake_quant(x, cfg))
  q0, q1 = quantize(x, cfg), quantize(x, cfg, tensor_amax=amax)
  for a, b in zip(jax.tree.leaves(q0), jax.tree.leaves(q1)):
    assert np.array_equal(np.atleast_1d(np.asarray(a)).view(np.uint8),
                          np.atleast_1d(np.asarray(b)).view(np.uint8))


@pytest.mark.parametrize("cfg", PER_TENSOR, ids=lambda c: c.fmt + ("_46" if c.four_over_six else ""))
@pytest.mark.parametrize("factor", [0.25, 4.0])
def test_static_amax_follows_the_exact_formula(cfg, factor):
  """Against the exact-rounding reference with the outer scale taken from the given amax
  (elements above a small amax saturate at the format max times the scale)."""
  x = _x(1)
  amax = f32(np.abs(x).max() * factor)
  got = np.asarray(fake_quant(x, cfg, tensor_amax=jnp.float32(amax)))
  assert _bits_equal(got, exact_fake_quant(x, cfg, tensor_amax=amax))
  if factor < 1:  # saturation at the format's top value: amax, or 1.75 * amax with 4/6 (6 * 448
    # over the 6 * 256 denominator); one rounding of the FP32 outer scale on top (< 2**-23).
    top = amax * (448 / 256 if cfg.four_over_six else 1.0) * (1 + 2.0**-22)
    assert np.abs(got).max() <= top


def test_static_amax_is_traced_not_static():
  """One compiled program serves every amax value (it is a traced scalar)."""
  cfg = QuantConfig("fp8_e4m3")
  x = _x(2)
  f = jax.jit(lambda x, a: fake_quant(x, cfg, tensor_amax=a))
  outs = [f(x, jnp.float32(a)) for a in (1.0, 2.0, 4.0)]
  assert f._cache_size() == 1
  assert _bits_equal(outs[1], fake_quant(x, cfg, tensor_amax=jnp.float32(2.0)))


def test_static_amax_special_values():
  cfg = QuantConfig("fp8_e4m3")
  x = _x(3)
  assert np.isnan(np.asarray(fake_quant(x, cfg, tensor_amax=jnp.float32(np.nan)))).all()
  assert np.isnan(np.asarray(fake_quant(x, cfg, tensor_amax=jnp.float32(-1.0)))).all()
  # Zero amax: scale 0, everything dequantizes to 0.
  assert not np.asarray(fake_quant(x, cfg, tensor_amax=jnp.float32(0.0))).any()
  # With a static scale an Inf element saturates instead of poisoning the tensor.
  x2 = x.copy()
  x2[0, 0] = np.inf
  out = np.asarray(fake_quant(x2, cfg, tensor_amax=jnp.float32(4.0)))
  assert out[0, 0] == 4.0 and np.isfinite(out).all()


def test_static_amax_validation():
  x = _x()
  a = jnp.float32(1.0)
  for cfg in (QuantConfig("mxfp8_e4m3"), QuantConfig("mxfp4"), QuantConfig("nvfp4", per_token=True)):
    with pytest.raises(ValueError, match="tensor_amax"):
      fake_quant(x, cfg, tensor_amax=a)
    with pytest.raises(ValueError, match="tensor_amax"):
      quantize(x, cfg, tensor_amax=a)
  with pytest.raises(ValueError, match="scalar"):
    fake_quant(x, QuantConfig("fp8_e4m3"), tensor_amax=jnp.ones(2))
  with pytest.raises(ValueError, match="rhs_amax"):
    qdg(x, x.T, MM, QDotConfig(lhs=QuantConfig("nvfp4")), rhs_amax=a)
  with pytest.raises(ValueError, match="lhs_amax"):
    qdg(x, x.T, MM, None, lhs_amax=a)
  with pytest.raises(ValueError, match="lhs_amax"):
    qdg(x, x.T, MM, QDotConfig(lhs=QuantConfig("mxfp4")), lhs_amax=a)


@pytest.mark.parametrize("backward", ["high_precision", "dequantized", "quantized"])
def test_qdot_forward_uses_amax_and_cotangent_is_zero(backward):
  a, b = _x(4, (8, 64)), _x(5, (64, 16))
  lq, rq = QuantConfig("fp8_e4m3"), QuantConfig("nvfp4")
  cfg = QDotConfig(lhs=lq, rhs=rq, backward=backward,
                   grad=QuantConfig("fp8_e5m2") if backward == "quantized" else None)
  la, ra = jnp.float32(2.0), jnp.float32(20.0)
  want = lax.dot_general(fake_quant(a, dataclasses_replace(lq, 1), tensor_amax=la),
                         fake_quant(b, dataclasses_replace(rq, 0), tensor_amax=ra), MM,
                         preferred_element_type=jnp.float32)
  f = lambda a, b, la, ra: qdg(a, b, MM, cfg, lhs_amax=la, rhs_amax=ra)  # noqa: E731
  assert _bits_equal(jax.jit(f)(a, b, la, ra), want)
  assert _bits_equal(make_dot_general(cfg, lhs_amax=la, rhs_amax=ra)(a, b, MM, None, jnp.float32),
                     want)
  # The amaxes get zero cotangents.
  grads = jax.grad(lambda la, ra: jnp.sum(f(a, b, la, ra)), argnums=(0, 1))(la, ra)
  assert grads == (0.0, 0.0)


def dataclasses_replace(cfg, axis):
  import dataclasses
  return dataclasses.replace(cfg, axis=axis)
