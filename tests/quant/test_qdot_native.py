"""gemm="native": FP8 codes as float8 GEMM operands. Forward equal to the emulated path within a
bound derived below, float8 operands in the lowered program, backward bit for bit the emulated
one in every backward mode, clear errors for formats without an FP8 GEMM."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowrl import precision
from lowrl.models import init, layout, logprobs
from lowrl.quant import QDotConfig, QuantConfig, dequantize, quantize, quantized_dot_general
import tiny

U = 2.0 ** -24  # FP32 unit roundoff
# [B, T, K] x [K, N] (a dense layer) and [B, T, K] x [N, K] (the tied head: rhs contracts axis 1).
DENSE = (((2,), (0,)), ((), ()))
TIED = (((2,), (1,)), ((), ()))


def _operands(dn, k=64, n=32, seed=0, rows=(2, 3)):
  ka, kb = jax.random.split(jax.random.key(seed))
  a = jax.random.normal(ka, (*rows, k), jnp.float32)
  shape = (k, n) if dn == DENSE else (n, k)
  return a, jax.random.normal(kb, shape, jnp.float32) * 0.3


def _abs_products(a, b, dn, cfg):
  """sum_k |a_k b_k| in float64 of the quantized operands' exact values (codes x scales)."""
  (lc, rc), _ = dn
  def exact(x, q, axis):
    if q.kind != "tensor":
      q = dataclasses.replace(q, axis=axis)
    return np.abs(np.asarray(dequantize(quantize(x, q)), np.float64))
  ea, eb = exact(a, cfg.lhs, lc[0]), exact(b, cfg.rhs, rc[0])
  return np.einsum("btk,kn->btn", ea, eb if dn == DENSE else eb.T)


def _pair(cfg, dn, a, b):
  native = dataclasses.replace(cfg, gemm="native")
  run = jax.jit(lambda a, b, c: quantized_dot_general(a, b, dn, c), static_argnums=2)
  return run(a, b, native), run(a, b, cfg)


MX_CASES = [
    (QuantConfig("mxfp8_e4m3"), QuantConfig("mxfp8_e4m3"), "float32"),
    (QuantConfig("mxfp8_e4m3"), QuantConfig("mxfp8_e5m2", scale_rounding="floor"), "bfloat16"),
]


@pytest.mark.parametrize("dn", [DENSE, TIED])
@pytest.mark.parametrize("lhs,rhs,compute", MX_CASES)
def test_mx_native_equals_emulated_up_to_summation_order(lhs, rhs, compute, dn):
  # MX scales are powers of two: every dequantized operand (FP32 or BF16: <= 4 significant bits)
  # and every product (<= 8 bits) is exact in both paths, so they sum the same exact products
  # with FP32 accumulation, possibly in another order: each sum is within (n - 1) u S of the
  # exact one, S = sum |a_k b_k|, so the two are within 2 (n - 1) u S.
  cfg = QDotConfig(lhs, rhs, compute_dtype=compute)
  a, b = _operands(dn)
  native, emulated = _pair(cfg, dn, a, b)
  bound = 2 * (a.shape[-1] - 1) * U * _abs_products(a, b, dn, cfg)
  assert native.dtype == emulated.dtype == jnp.float32
  assert np.all(np.abs(np.asarray(native, np.float64) - np.asarray(emulated)) <= bound)


@pytest.mark.parametrize("dn", [DENSE, TIED])
@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_per_tensor_native_within_the_scale_rounding_bound(compute, dn):
  # Per-tensor FP8 scales s are arbitrary FP32 numbers. Emulated: each operand code * s is
  # rounded to FP32 and then to the compute dtype (relative error e_c = (1 + u)(1 + u_c) - 1,
  # u_c = u for FP32, 2^-8 for BF16), the products rounded to FP32 (exact for BF16), n terms
  # summed in FP32: within ((1 + e_c)^2 (1 + u)^n - 1) S of the exact sum. Native: exact code
  # products (<= 8 bits) summed in FP32, times s_l s_r rounded once, the result rounded once:
  # within ((1 + u)^(n + 1) - 1) S. The two are within the sum of both.
  cfg = QDotConfig(QuantConfig("fp8_e4m3"), QuantConfig("fp8_e5m2"), compute_dtype=compute)
  a, b = _operands(dn)
  n = a.shape[-1]
  native, emulated = _pair(cfg, dn, a, b)
  e_c = (1 + U) * (1 + (U if compute == "float32" else 2.0 ** -8)) - 1
  rel = (1 + e_c) ** 2 * (1 + U) ** n - 1 + (1 + U) ** (n + 1) - 1
  bound = rel * _abs_products(a, b, dn, cfg)
  diff = np.abs(np.asarray(native, np.float64) - np.asarray(emulated))
  assert np.all(diff <= bound)
  assert np.any(diff > 0) or compute == "float32"  # BF16 emulation rounds: the paths differ


def _lowered(cfg, dn, a, b):
  return jax.jit(lambda a, b: quantized_dot_general(a, b, dn, cfg)).lower(a, b).as_text()


def test_lowered_program_has_float8_gemm_operands():
  a, b = _operands(DENSE)
  tensor = QDotConfig(QuantConfig("fp8_e4m3"), QuantConfig("fp8_e4m3"), gemm="native")
  text = _lowered(tensor, DENSE, a, b)
  dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
  assert len(dots) == 1 and "(tensor<2x3x64xf8E4M3FN>, tensor<64x32xf8E4M3FN>) -> " \
      "tensor<2x3x32xf32>" in dots[0]
  mx = QDotConfig(QuantConfig("mxfp8_e4m3"), QuantConfig("mxfp8_e5m2"), gemm="native")
  text = _lowered(mx, DENSE, a, b)
  composite = [line for line in text.splitlines() if 'composite "xla.scaled_dot"' in line]
  assert len(composite) == 1
  # As [batch, free, K]: rows = B * T, K = 64 in blocks of 32.
  assert ("tensor<1x6x64xf8E4M3FN>, tensor<1x32x64xf8E5M2>, tensor<1x6x2xf8E8M0FNU>, "
          "tensor<1x32x2xf8E8M0FNU>") in composite[0]
  # The emulated path has no float8 GEMM operand.
  emulated = _lowered(dataclasses.replace(tensor, gemm="emulated"), DENSE, a, b)
  assert not any("f8E" in line for line in emulated.splitlines() if "dot_general" in line)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "mxfp8_e4m3"])
@pytest.mark.parametrize("backward", ["high_precision", "dequantized", "quantized"])
def test_backward_is_the_emulated_one_bit_for_bit(fmt, backward):
  q = QuantConfig(fmt)
  grad = QuantConfig("mxfp8_e5m2") if backward == "quantized" else None
  cfg = QDotConfig(q, q, backward=backward, grad=grad, compute_dtype="bfloat16")
  # B x T = 32 rows: the quantized wgrad GEMM blocks along them.
  a, b = _operands(DENSE, rows=(4, 8))
  g = jax.random.normal(jax.random.key(3), (4, 8, 32), jnp.float32)

  @jax.jit
  def grads(a, b):
    out = {}
    for gemm in ("emulated", "native"):
      c = dataclasses.replace(cfg, gemm=gemm)
      _, vjp = jax.vjp(lambda a, b: quantized_dot_general(a, b, DENSE, c), a, b)
      out[gemm] = vjp(g)
    return out

  out = grads(a, b)
  for x, y in zip(out["native"], out["emulated"]):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_model_logprobs_under_native_mxfp8():
  # The tiny model under the mxfp8 recipe: native vs emulated logprobs, and the emulated default.
  cfg = tiny.TINY
  params = init.init_params(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)
  pol = {g: precision.policy_for("mxfp8", layout.matmuls(cfg), gemm=g)
         for g in ("emulated", "native")}
  assert precision.recipe("mxfp8").gemm == "emulated"
  lp = {g: jax.jit(lambda p, t, g=g: logprobs.token_logprobs(p, t, cfg, pol[g]))(params,
                                                                                     tokens)
        for g in pol}
  # Every matmul differs by FP32 summation order only (above); through the BF16 network that
  # moves a BF16 rounding at most, so the log-probs agree to a few BF16 ulps of their size.
  np.testing.assert_allclose(np.asarray(lp["native"]), np.asarray(lp["emulated"]),
                             rtol=0, atol=0.05)
  rows = precision.assignment_table(pol["native"], layout.matmuls(cfg))
  assert "native_gemm" in rows[0].options


@pytest.mark.parametrize("make, match", [
    (lambda: QDotConfig(QuantConfig("nvfp4"), QuantConfig("nvfp4"), gemm="native"),
     "gemm='native' multiplies FP8 codes.*got lhs=nvfp4"),
    (lambda: QDotConfig(None, QuantConfig("fp8_e4m3"), gemm="native"), "got lhs=None"),
    (lambda: QDotConfig(QuantConfig("fp8_e4m3"), QuantConfig("mxfp8_e4m3"), gemm="native"),
     "both per-tensor or both MX"),
    (lambda: QDotConfig(gemm="fast"), r"gemm='fast'; use one of \('emulated', 'native'\)"),
    (lambda: precision.policy_for("bf16", layout.matmuls(tiny.TINY), gemm="native"),
     "precision.gemm=native needs an FP8 precision.format"),
    (lambda: precision.policy_for("nvfp4_recipe", layout.matmuls(tiny.TINY), gemm="native"),
     "precision.gemm=native needs an FP8 precision.format"),
    (lambda: precision.policy_for("mxfp8", layout.matmuls(tiny.TINY), gemm="cublas"),
     "precision.gemm='cublas'; use one of"),
])
def test_errors_name_the_fix(make, match):
  with pytest.raises(ValueError, match=match):
    make()
