"""grouped_quantized_dot against a dense per-expert reference: the sum over experts e of the dense
`quantized_dot_general` on the rows of group e (the other rows zeroed), values and gradients, for
every backward mode.

Tolerance: both sides multiply the same compute-dtype operands (fake quantization is
sign-symmetric, so |fq(x)| = fq(|x|)) and accumulate n products in FP32, possibly in another order:
|difference| <= 2 * n * 2**-24 * sum|products|, and sum|products| is the reference run on |x|,
|w|, |g| (n = K for the product, N for dx, the group's rows <= M for dw).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrl.quant import QDotConfig, QuantConfig, quantized_dot_general
from lowrl.quant.grouped_qdot import fake_quant_experts, group_ids, grouped_quantized_dot

MM = (((1,), (0,)), ((), ()))
SIZES = (16, 0, 17, 15)  # an empty group, groups not multiples of the block
M, K, N, E = sum(SIZES), 32, 32, len(SIZES)


def _reference(x, w, gs, cfg):
  gid = np.repeat(np.arange(E), gs)

  def f(x, w):
    out = jnp.zeros((x.shape[0], w.shape[2]), jnp.float32)
    for e in range(E):
      rows = jnp.asarray(gid == e)[:, None]
      out = out + jnp.where(rows, quantized_dot_general(jnp.where(rows, x, 0), w[e], MM, cfg), 0)
    return out
  return f


def _vjp(f, x, w, g):
  y, vjp = jax.vjp(f, x, w)
  return (y,) + vjp(g)


def _operands(seed=0):
  kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (M, K), jnp.float32)
  # Experts of very different scales: a global scale shared by experts would show.
  w = jax.random.normal(kw, (E, K, N), jnp.float32) * jnp.array([0.02, 1.0, 0.3, 5.0])[:, None,
                                                                                       None]
  g = jax.random.normal(kg, (M, N), jnp.float32)
  return x, w, g


NVFP4_TOK = QuantConfig("nvfp4", per_token=True, four_over_six=True)
CASES = {
    "nvfp4_recipe_dequantized": QDotConfig(lhs=NVFP4_TOK, rhs=QuantConfig("nvfp4"),
                                           backward="dequantized", compute_dtype="bfloat16"),
    "nvfp4_naive_high_precision": QDotConfig(lhs=QuantConfig("nvfp4"), rhs=QuantConfig("nvfp4"),
                                             backward="high_precision",
                                             compute_dtype="float32"),
    "nvfp4_quantized_original": QDotConfig(lhs=NVFP4_TOK, rhs=QuantConfig("nvfp4", block_2d=True),
                                           backward="quantized", grad=QuantConfig("nvfp4"),
                                           compute_dtype="float32"),
    "fp8_quantized_dequantized": QDotConfig(lhs=QuantConfig("fp8_e4m3"),
                                            rhs=QuantConfig("mxfp8_e4m3"),
                                            backward="quantized", grad=QuantConfig("fp8_e5m2"),
                                            requantize_from="dequantized",
                                            compute_dtype="float32"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_grouped_matches_dense_per_expert_reference(name):
  cfg = CASES[name]
  x, w, g = _operands()
  gs = jnp.asarray(SIZES, jnp.int32)
  ref = _reference(x, w, np.asarray(SIZES), cfg)
  got = jax.jit(lambda x, w, g: _vjp(lambda a, b: grouped_quantized_dot(a, b, gs, cfg), x, w,
                                     g))(x, w, g)
  want = jax.jit(lambda x, w, g: _vjp(ref, x, w, g))(x, w, g)
  bound = jax.jit(lambda x, w, g: _vjp(ref, x, w, g))(jnp.abs(x), jnp.abs(w), jnp.abs(g))
  for what, a, b, s, n in zip(("y", "dx", "dw"), got, want, bound, (K, N, max(SIZES))):
    tol = 2 * n * 2.0**-24 * np.asarray(s) + 1e-30
    np.testing.assert_array_less(np.abs(np.asarray(a) - np.asarray(b)), tol * 1.0001 + 1e-12,
                                 err_msg=f"{name}: {what}")
  # The empty group's expert gets exactly zero gradient, and every other expert some.
  assert not np.any(np.asarray(got[2][1]))
  assert all(np.any(np.asarray(got[2][e])) for e in (0, 2, 3))


def test_one_global_scale_per_expert():
  _, w, _ = _operands()
  q = fake_quant_experts(w, QuantConfig("nvfp4"))
  from lowrl.quant import fake_quant
  for e in range(E):  # each expert alone, as a dense weight [K, N] quantized along K
    np.testing.assert_array_equal(np.asarray(q[e]),
                                  np.asarray(fake_quant(w[e], QuantConfig("nvfp4", axis=0))))


def test_group_ids_and_unquantized_is_ragged_dot():
  gs = jnp.asarray(SIZES, jnp.int32)
  np.testing.assert_array_equal(np.asarray(group_ids(gs, M + 2)),
                                np.concatenate([np.repeat(np.arange(E), SIZES), [E, E]]))
  x, w, _ = _operands()
  y = grouped_quantized_dot(x, w, gs, QDotConfig(compute_dtype="float32"))
  gid = np.repeat(np.arange(E), SIZES)
  want = np.einsum("mk,mkn->mn", np.asarray(x, np.float64), np.asarray(w, np.float64)[gid])
  np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_bad_inputs_raise_before_compile():
  x, w, _ = _operands()
  gs = jnp.asarray(SIZES, jnp.int32)
  tile = QDotConfig(lhs=QuantConfig("nvfp4", block_2d=True), compute_dtype="float32")
  with pytest.raises(ValueError, match="2-D activation tiles"):
    grouped_quantized_dot(x, w, gs, tile)
  with pytest.raises(ValueError, match=r"x \[M, K\]"):
    grouped_quantized_dot(x, w[:, :16], gs, CASES["nvfp4_recipe_dequantized"])
  sr = QDotConfig(lhs=QuantConfig("nvfp4", stochastic_rounding=True), compute_dtype="float32")
  with pytest.raises(ValueError, match="key"):
    grouped_quantized_dot(x, w, gs, sr)
