"""quantized_dot_general: forward equals dot of fake-quantized operands; gradients equal each
backward mode's closed form, with and without jit."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from lowrl.quant import (QDotConfig, QuantConfig, fake_quant, make_dot_general,
                         quantized_dot_general, rht)

MM = (((1,), (0,)), ((), ()))  # [M, K] x [K, N]
NVFP4 = QuantConfig("nvfp4")


def _operands(m=32, k=64, n=32, seed=0):
  ka, kb, kg = jax.random.split(jax.random.key(seed), 3)
  a = jax.random.normal(ka, (m, k), jnp.float32)
  b = jax.random.normal(kb, (k, n), jnp.float32) * 0.3
  g = jax.random.normal(kg, (m, n), jnp.float32)
  return a, b, g


def _vjp_fn(cfg, use_jit=False, dn=MM):
  """(a, b, g, key) -> (y, da, db), optionally jitted (one compile per config, any key)."""
  def run(a, b, g, key):
    y, vjp = jax.vjp(lambda a, b: quantized_dot_general(a, b, dn, cfg, key), a, b)
    return (y,) + vjp(g)
  return jax.jit(run) if use_jit else run


def _vjp(cfg, a, b, g, key=None, use_jit=False, dn=MM):
  return _vjp_fn(cfg, use_jit, dn)(a, b, g, key)


def _mm(x, y, compute):
  return jnp.matmul(x.astype(compute), y.astype(compute), preferred_element_type=jnp.float32)


def _close(x, y):
  # Same products, possibly a different FP32 summation order in XLA's GEMMs.
  scale = float(jnp.max(jnp.abs(y)))
  np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-6, atol=2e-6 * scale)


FWD_CASES = [
    (QuantConfig("nvfp4", per_token=True, four_over_six=True), QuantConfig("nvfp4"), "float32"),
    (QuantConfig("mxfp4"), QuantConfig("mxfp8_e4m3", scale_rounding="floor"), "bfloat16"),
    (QuantConfig("fp8_e4m3"), QuantConfig("fp8_e5m2"), "float32"),
    (None, QuantConfig("nvfp4", block_2d=True), "bfloat16"),
]


@pytest.mark.parametrize("lhs_cfg,rhs_cfg,compute,use_jit",
                         [c + (True,) for c in FWD_CASES] + [FWD_CASES[0] + (False,)])
def test_forward_equals_dot_of_fake_quant(lhs_cfg, rhs_cfg, compute, use_jit):
  a, b, _ = _operands()
  # The configs' axes are deliberately wrong (-1 for lhs is right, -1 for rhs is not): qdot must
  # override them with the contracting axes (lhs 1, rhs 0).
  cfg = QDotConfig(lhs_cfg, rhs_cfg, compute_dtype=compute)
  f = lambda a, b: quantized_dot_general(a, b, MM, cfg)  # noqa: E731
  y = (jax.jit(f) if use_jit else f)(a, b)
  a_q = a if lhs_cfg is None else fake_quant(a, dataclasses.replace(lhs_cfg, axis=1))
  b_q = b if rhs_cfg is None else fake_quant(b, dataclasses.replace(rhs_cfg, axis=0))
  want = lax.dot_general(a_q.astype(compute), b_q.astype(compute), MM,
                         preferred_element_type=jnp.float32)
  assert y.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
  # And quantization did something (guards against a silently unquantized forward).
  assert not np.array_equal(np.asarray(y), np.asarray(a @ b))


@pytest.mark.parametrize("compute,use_jit", [("float32", True), ("bfloat16", False)])
def test_high_precision_backward_is_straight_through(compute, use_jit):
  a, b, g = _operands()
  cfg = QDotConfig(NVFP4, NVFP4, backward="high_precision", compute_dtype=compute)
  _, da, db = _vjp(cfg, a, b, g, use_jit=use_jit)
  _close(da, _mm(g, b.T, compute))
  _close(db, _mm(a.T, g, compute))


@pytest.mark.parametrize("compute,use_jit", [("bfloat16", True), ("float32", False)])
def test_dequantized_backward_uses_forward_values(compute, use_jit):
  a, b, g = _operands()
  lcfg, rcfg = QuantConfig("nvfp4", per_token=True, four_over_six=True), NVFP4
  cfg = QDotConfig(lcfg, rcfg, backward="dequantized", compute_dtype=compute)
  _, da, db = _vjp(cfg, a, b, g, use_jit=use_jit)
  a_dq = fake_quant(a, dataclasses.replace(lcfg, axis=1))
  b_dq = fake_quant(b, dataclasses.replace(rcfg, axis=0))
  _close(da, _mm(g, b_dq.T, compute))
  _close(db, _mm(a_dq.T, g, compute))
  # Distinct from straight-through by the quantization error.
  assert float(jnp.max(jnp.abs(db - _mm(a.T, g, compute)))) > 1e-2


def _quantized_closed_form(a, b, g, lcfg, rcfg, gcfg, key, rht_wgrad, compute="float32",
                           source="original"):
  """da = Q_g(g, axis 1) @ Q_b(src(b), axis 1)^T;  db = Q_a(H src(a), axis 0)^T @ Q_g(H g, axis 0).

  src(.) is the original operand (source "original"), or the forward operand as the forward GEMM
  saw it: fake-quantized, cast to compute (source "dequantized").
  """
  _, _, k_dgrad, k_wgrad = jax.random.split(key, 4)
  a_dq, b_dq = a, b
  if source == "dequantized":
    a_dq = fake_quant(a, dataclasses.replace(lcfg, axis=1)).astype(compute).astype(jnp.float32)
    b_dq = fake_quant(b, dataclasses.replace(rcfg, axis=0)).astype(compute).astype(jnp.float32)
  no_sr = lambda c, ax: dataclasses.replace(c, axis=ax, stochastic_rounding=False)  # noqa: E731
  g_d = fake_quant(g, dataclasses.replace(gcfg, axis=1), k_dgrad)
  da = _mm(g_d, fake_quant(b_dq, no_sr(rcfg, 1)).T, compute)
  g_w, a_w = g, a_dq
  if rht_wgrad:
    g_w, a_w = rht(g_w, axis=0), rht(a_w, axis=0)
  g_w = fake_quant(g_w, dataclasses.replace(gcfg, axis=0), k_wgrad)
  db = _mm(fake_quant(a_w, no_sr(lcfg, 0)).T, g_w, compute)
  return da, db


@pytest.mark.parametrize("gcfg,rht_wgrad,use_jit,source", [
    (QuantConfig("fp8_e5m2"), False, True, "original"),
    (QuantConfig("fp8_e5m2"), False, True, "dequantized"),
    (QuantConfig("nvfp4", stochastic_rounding=True), False, True, "original"),
    (QuantConfig("nvfp4", stochastic_rounding=True), True, True, "original"),
    (QuantConfig("nvfp4", stochastic_rounding=True), True, False, "dequantized"),
])
def test_quantized_backward_closed_form(gcfg, rht_wgrad, use_jit, source):
  a, b, g = _operands()
  lcfg, rcfg = QuantConfig("mxfp8_e4m3"), NVFP4
  cfg = QDotConfig(lcfg, rcfg, backward="quantized", grad=gcfg, rht_wgrad=rht_wgrad,
                   requantize_from=source)
  key = jax.random.key(7)
  _, da, db = _vjp(cfg, a, b, g, key=key, use_jit=use_jit)
  want_da, want_db = jax.jit(_quantized_closed_form, static_argnums=(3, 4, 5, 7, 8, 9))(
      a, b, g, lcfg, rcfg, gcfg, key, rht_wgrad, "float32", source)
  _close(da, want_da)
  _close(db, want_db)


def test_quantized_backward_from_original_has_one_quantization_error():
  """The default requantizes the original operands (one quantization error, as TransformerEngine
  does); the 'dequantized' source compounds the forward's error with a second one. Against
  db_exact = a^T @ Q_g(g) (same quantized gradient), the original source's error is the smaller
  (by ~1.4x here: two independent errors of similar size add in quadrature; the margin far exceeds
  any GEMM summation-order difference)."""
  a, b, g = _operands(m=64, k=64, n=64, seed=3)
  gcfg = QuantConfig("fp8_e4m3")
  key = jax.random.key(0)
  assert QDotConfig(NVFP4, NVFP4, backward="quantized", grad=gcfg).requantize_from == "original"
  errs = {}
  for source in ("original", "dequantized"):
    cfg = QDotConfig(NVFP4, NVFP4, backward="quantized", grad=gcfg, requantize_from=source)
    _, _, db = _vjp(cfg, a, b, g, key=key, use_jit=True)
    g_w = fake_quant(g, dataclasses.replace(gcfg, axis=0))
    errs[source] = float(jnp.linalg.norm(db - _mm(a.T, g_w, "float32")))
  assert errs["original"] < 0.9 * errs["dequantized"], errs


def test_quantized_backward_gradient_depends_on_key_only_through_sr():
  a, b, g = _operands()
  gcfg = QuantConfig("nvfp4", stochastic_rounding=True)
  f = _vjp_fn(QDotConfig(NVFP4, NVFP4, backward="quantized", grad=gcfg), use_jit=True)
  r1, r2 = f(a, b, g, jax.random.key(1)), f(a, b, g, jax.random.key(2))
  np.testing.assert_array_equal(np.asarray(r1[0]), np.asarray(r2[0]))  # forward has no SR
  assert not np.allclose(np.asarray(r1[1]), np.asarray(r2[1]))
  assert not np.allclose(np.asarray(r1[2]), np.asarray(r2[2]))


def test_three_d_activations_and_flattened_wgrad():
  """[B, T, D] x [D, F]: the weight gradient contracts B and T, blocked along B*T flattened."""
  kx, kw, kg = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(kx, (2, 16, 32))
  w = jax.random.normal(kw, (32, 48)) * 0.2
  g = jax.random.normal(kg, (2, 16, 48))
  dn = (((2,), (0,)), ((), ()))
  lcfg, gcfg = QuantConfig("nvfp4", per_token=True), QuantConfig("fp8_e4m3")
  cfg = QDotConfig(lcfg, NVFP4, backward="quantized", grad=gcfg, compute_dtype="bfloat16")
  key = jax.random.key(0)
  y, dx, dw = _vjp(cfg, x, w, g, key=key, use_jit=True, dn=dn)
  assert y.shape == (2, 16, 48) and dx.shape == x.shape and dw.shape == w.shape
  want_dx, want_dw = jax.jit(_quantized_closed_form, static_argnums=(3, 4, 5, 7, 8, 9))(
      x.reshape(32, 32), w, g.reshape(32, 48), lcfg, NVFP4, gcfg, key, False, "bfloat16",
      "original")
  _close(dx, want_dx.reshape(x.shape))
  _close(dw, want_dw)


@pytest.mark.parametrize("backward", ["high_precision", "dequantized"])
def test_batch_dims(backward):
  """[B, M, K] x [B, N, K] contracting K (rhs transposed layout), batch dim 0 on both."""
  ka, kb, kg = jax.random.split(jax.random.key(4), 3)
  a = jax.random.normal(ka, (2, 8, 32))
  b = jax.random.normal(kb, (2, 16, 32))
  g = jax.random.normal(kg, (2, 8, 16))
  dn = (((2,), (2,)), ((0,), (0,)))
  q = QuantConfig("mxfp4")
  cfg = QDotConfig(q, q, backward=backward)
  y, da, db = _vjp(cfg, a, b, g, use_jit=True, dn=dn)
  a_q, b_q = fake_quant(a, q), fake_quant(b, q)  # axis -1 is the contracting axis here
  np.testing.assert_array_equal(np.asarray(y), np.asarray(jnp.einsum("bmk,bnk->bmn", a_q, b_q)))
  a_op, b_op = (a, b) if backward == "high_precision" else (a_q, b_q)
  _close(da, jnp.einsum("bmn,bnk->bmk", g, b_op))
  _close(db, jnp.einsum("bmk,bmn->bnk", a_op, g))


def test_gradient_dtypes_follow_primals():
  a, b, g = _operands()
  cfg = QDotConfig(NVFP4, NVFP4, backward="dequantized", compute_dtype="bfloat16")
  _, da, db = _vjp(cfg, a.astype(jnp.bfloat16), b, g, use_jit=True)
  assert da.dtype == jnp.bfloat16 and db.dtype == jnp.float32


def test_unquantized_configs_are_plain_dot():
  a, b, _ = _operands()
  np.testing.assert_array_equal(np.asarray(quantized_dot_general(a, b, MM, None)),
                                np.asarray(lax.dot_general(a, b, MM)))
  cfg = QDotConfig(compute_dtype="bfloat16")
  y = quantized_dot_general(a, b, MM, cfg)
  want = lax.dot_general(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), MM,
                         preferred_element_type=jnp.float32)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


def test_make_dot_general_in_flax_dense():
  a, _, _ = _operands()
  cfg = QDotConfig(QuantConfig("nvfp4", per_token=True), NVFP4, backward="dequantized")
  dense = nn.Dense(32, use_bias=False, dot_general=make_dot_general(cfg))
  params = dense.init(jax.random.key(0), a)
  y = dense.apply(params, a)
  w = params["params"]["kernel"]
  want = (fake_quant(a, QuantConfig("nvfp4", per_token=True))
          @ fake_quant(w, QuantConfig("nvfp4", axis=0)))
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
  grads = jax.grad(lambda p: jnp.sum(dense.apply(p, a) ** 2))(params)
  assert grads["params"]["kernel"].shape == w.shape


def test_errors_are_raised_at_trace_time():
  a, b, _ = _operands()
  two_axes = (((0, 1), (0, 1)), ((), ()))
  with pytest.raises(ValueError, match="contracts 2 axes"):
    jax.jit(lambda a: quantized_dot_general(a, a, two_axes, QDotConfig(NVFP4, None))).lower(a)
  # Per-tensor formats don't care how many axes are contracted.
  quantized_dot_general(a, a, two_axes, QDotConfig(QuantConfig("fp8_e4m3"), None))
  sr = QDotConfig(QuantConfig("nvfp4", stochastic_rounding=True), None)
  with pytest.raises(ValueError, match="pass key"):
    quantized_dot_general(a, b, MM, sr)
  with pytest.raises(ValueError, match="not a multiple of the block size"):
    quantized_dot_general(a[:, :40], b[:40], MM, QDotConfig(NVFP4, None))
  # Quantized backward: the wgrad contracts M=8 tokens, not a multiple of 16 -> caught in forward.
  bwd = QDotConfig(NVFP4, NVFP4, backward="quantized", grad=QuantConfig("fp8_e4m3"))
  with pytest.raises(ValueError, match="wgrad lhs"):
    quantized_dot_general(a[:8], b, MM, bwd)
