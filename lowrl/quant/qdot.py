"""Quantized dot_general with a selectable backward pass (jax.custom_vjp).

Forward: each operand is fake-quantized along its contracting axis and cast to cfg.compute_dtype,
then multiplied by `lax.dot_general`, so the forward equals
`lax.dot_general(fake_quant(lhs).astype(c), fake_quant(rhs).astype(c), ...)` exactly.

Native forward (cfg.gemm="native", FP8 operands only): the same quantizers give FP8 codes and
scales, and the GEMM takes the codes as float8 operands, as XLA lowers to cuBLASLt FP8 GEMMs on
GPUs with FP8 tensor cores: per-tensor scales as `dot_general(codes_l, codes_r,
preferred_element_type=float32) * (s_l * s_r)`; MX block scales through `lax.scaled_dot` (XLA's
scaled-dot composite, taking our E8M0 scales; where the backend has no block-scaled GEMM, XLA
runs its decomposition: BF16 dequantization, which is exact for MXFP8, and a BF16 GEMM with FP32
accumulation). `jax.nn.scaled_dot_general` is not used: it quantizes with its own quantizer, so
it would not multiply the codes the emulated path dequantizes; `jax.nn.scaled_matmul` has no CPU
lowering in jax 0.10. Native vs emulated: MX products are the same exact values (power-of-two
scales), so they differ only by FP32 summation order; per-tensor FP8 scales are arbitrary FP32
numbers, so the emulated operands code * s are rounded (to FP32, then to compute_dtype) while the
native GEMM sums exact code products and scales once (tests/quant/test_qdot_native.py derives the
bound). The backward and its saved operands are the emulated path's, bit for bit.

Backward (all GEMMs take cfg.compute_dtype operands and accumulate in FP32; the results are cast
to the primal dtypes):
  high_precision  straight-through: dlhs = g·rhsᵀ, drhs = lhsᵀ·g with the original operands.
  dequantized     dlhs = g·dq(rhs)ᵀ, drhs = dq(lhs)ᵀ·g with the dequantized forward operands
                  (the values the forward used) — the 4-bitter recipe.
  quantized       g is quantized with cfg.grad along the contracting axes of each backward GEMM
                  (separately for dgrad and wgrad, with stochastic rounding keys split from `key`).
                  The other operand is quantized with its own forward config (round-to-nearest, no
                  SR) along the new contracting axes, from cfg.requantize_from: "original" (the
                  default) the original operand, as TransformerEngine quantizes its input
                  column-wise, one quantization error; "dequantized" its dequantized forward
                  value, re-blocked for the transposed GEMM (two compounded errors, but the
                  backward sees values the forward saw). An operand that is not quantized in the
                  forward stays unquantized. Optional RHT (cfg.rht_wgrad) transforms both wgrad
                  operands along their contracting axes before quantizing; it cancels in the
                  product.

In the backward GEMMs a contraction can run over several axes (e.g. the batch and time axes of
activations in the weight gradient); block formats then block along those axes flattened in order
(row-major), like the 2-D GEMM a kernel runs. In the forward, block formats need a single
contracting axis per quantized operand.

Key use: `key` is split as (k_lhs, k_rhs, k_dgrad, k_wgrad) = jax.random.split(key, 4): forward SR
of lhs / rhs, and SR of the gradient for the dgrad / wgrad GEMMs. The key gets no gradient.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lowrl.quant.config import QDotConfig, QuantConfig
from lowrl.quant.hadamard import rht
from lowrl.quant.quantize import QTensor, check_tensor_amax, dequantize, fake_quant, quantize

_Axes = tuple[int, ...]
DimensionNumbers = tuple[tuple[_Axes, _Axes], tuple[_Axes, _Axes]]


def _normalize_dn(dn, lhs_ndim: int, rhs_ndim: int) -> DimensionNumbers:
  """Dimension numbers as hashable tuples of non-negative ints."""
  (lc, rc), (lb, rb) = dn
  norm = lambda axes, nd: tuple(int(a) % nd for a in axes)  # noqa: E731
  return ((norm(lc, lhs_ndim), norm(rc, rhs_ndim)), (norm(lb, lhs_ndim), norm(rb, rhs_ndim)))


def _free(ndim: int, contract, batch) -> tuple[int, ...]:
  return tuple(d for d in range(ndim) if d not in contract and d not in batch)


def _along(x: jax.Array, axes: tuple[int, ...], fn: Callable[[jax.Array, int], jax.Array]):
  """fn(x', -1) where x' is x with `axes` moved last and flattened (row-major); then undone."""
  if len(axes) == 1:
    return fn(x, axes[0])
  rest = tuple(d for d in range(x.ndim) if d not in axes)
  perm = rest + tuple(axes)
  xt = jnp.transpose(x, perm)
  merged = xt.reshape(xt.shape[:len(rest)] + (math.prod(xt.shape[len(rest):]),))
  out = fn(merged, -1).reshape(xt.shape)
  return jnp.transpose(out, np.argsort(perm))


def _fq_axes(x, axes, cfg: QuantConfig | None, key, what: str, amax=None) -> jax.Array:
  """Fake-quantizes x for a GEMM contracting `axes` (cfg.axis overridden); cfg None = identity.
  amax: optional static per-tensor amax (fake_quant's tensor_amax)."""
  if cfg is None:
    return x
  if cfg.kind == "tensor" or cfg.block_2d:
    # blocking does not depend on the contracting axis
    return fake_quant(x, cfg, key, tensor_amax=amax)
  if not axes:
    raise ValueError(f"{what}: {cfg.fmt} blocks along the contracting axis, but this GEMM "
                     "contracts no axis; use a per-tensor format (fp8_e4m3 / fp8_e5m2).")
  try:
    return _along(x, axes, lambda xm, a: fake_quant(xm, dataclasses.replace(cfg, axis=a), key,
                                                    tensor_amax=amax))
  except ValueError as e:
    where = f"contracting axes {tuple(axes)} of shape {tuple(x.shape)}"
    raise ValueError(f"{what} ({where}): {e}") from None


def _q_axis(x, axes, cfg: QuantConfig, key, amax) -> QTensor:
  """x quantized for a forward GEMM contracting `axes` (one axis for MX, as _check enforces):
  the codes and scales that _fq_axes dequantizes."""
  if cfg.kind != "tensor":
    cfg = dataclasses.replace(cfg, axis=axes[0])
  return quantize(x, cfg, key, tensor_amax=amax)


def _bmk(x: jax.Array, batch: _Axes, free: _Axes, contract: _Axes) -> jax.Array:
  """x as [batch, free, contract], each group of axes flattened (row-major)."""
  perm = batch + free + contract
  size = lambda axes: math.prod(x.shape[a] for a in axes)  # noqa: E731
  return jnp.transpose(x, perm).reshape(size(batch), size(free), size(contract))


def _scaled_dot(q_l: QTensor, q_r: QTensor, dn: DimensionNumbers) -> jax.Array:
  """FP32 product of two MX tensors by `lax.scaled_dot`, which takes operands and block scales of
  one rank: both as [batch, free, K] (scales [batch, free, K / block]), the output reshaped to
  dot_general's (batch..., lhs free..., rhs free...)."""
  dims = _Dims(dn, q_l.codes.ndim, q_r.codes.ndim)
  lhs = [_bmk(x, dims.lb, dims.lf, dims.lc) for x in (q_l.codes, q_l.scale)]
  rhs = [_bmk(x, dims.rb, dims.rf, dims.rc) for x in (q_r.codes, q_r.scale)]
  out = lax.scaled_dot(lhs[0], rhs[0], lhs_scale=lhs[1], rhs_scale=rhs[1],
                       dimension_numbers=(((2,), (2,)), ((0,), (0,))),
                       preferred_element_type=jnp.float32)
  shape = lambda x, axes: tuple(x.shape[a] for a in axes)  # noqa: E731
  return out.reshape(shape(q_l.codes, dims.lb) + shape(q_l.codes, dims.lf)
                     + shape(q_r.codes, dims.rf))


def _native_forward(lhs, rhs, key, amaxes, dn, cfg: QDotConfig, precision,
                    preferred_element_type):
  """(product, dequantized lhs, dequantized rhs): the product of the FP8 codes as float8 GEMM
  operands; the dequantized operands (compute dtype) are `_forward_operands`' values, bit for
  bit, for the backward."""
  compute = jnp.dtype(cfg.compute_dtype)
  (lc, rc), _ = dn
  k_lhs, k_rhs, _, _ = _split_key(key)
  q_l = _q_axis(lhs, lc, cfg.lhs, k_lhs, amaxes[0])
  q_r = _q_axis(rhs, rc, cfg.rhs, k_rhs, amaxes[1])
  if cfg.lhs.kind == "tensor":
    # One FP32 output scale (cuBLASLt's a_scale * b_scale): the rewriter's FP8 GEMM epilogue.
    out = lax.dot_general(q_l.codes, q_r.codes, dn, precision=precision,
                          preferred_element_type=jnp.float32) * (q_l.scale * q_r.scale)
  else:
    out = _scaled_dot(q_l, q_r, dn)
  out = out.astype(compute if preferred_element_type is None else preferred_element_type)
  # dequantize == fake_quant's values (same stored scales, same decode), cast as the emulated
  # path casts them.
  return (out, dequantize(q_l, lhs.dtype).astype(compute),
          dequantize(q_r, rhs.dtype).astype(compute))


def _no_sr(cfg: QuantConfig | None) -> QuantConfig | None:
  if cfg is None or not cfg.stochastic_rounding:
    return cfg
  return dataclasses.replace(cfg, stochastic_rounding=False)


def _split_key(key):
  if key is None:
    return (None,) * 4
  return tuple(jax.random.split(key, 4))


class _Dims:
  """Axis bookkeeping of one dot_general and its two transposed (backward) GEMMs."""

  def __init__(self, dn: DimensionNumbers, lhs_ndim: int, rhs_ndim: int):
    (self.lc, self.rc), (self.lb, self.rb) = dn
    self.lf = _free(lhs_ndim, self.lc, self.lb)
    self.rf = _free(rhs_ndim, self.rc, self.rb)
    nb, nlf = len(self.lb), len(self.lf)
    # Output layout of dot_general: (batch..., lhs free..., rhs free...).
    self.g_b = tuple(range(nb))
    self.g_lf = tuple(range(nb, nb + nlf))
    self.g_rf = tuple(range(nb + nlf, nb + nlf + len(self.rf)))

  def dgrad(self, g, rhs_op, precision):
    """d lhs = g contracted with rhs over rhs's free axes, laid out like lhs (FP32)."""
    out = lax.dot_general(g, rhs_op, ((self.g_rf, self.rf), (self.g_b, self.rb)),
                          precision=precision, preferred_element_type=jnp.float32)
    src = self.lb + self.lf + tuple(self.lc[self.rc.index(r)] for r in sorted(self.rc))
    return jnp.transpose(out, np.argsort(src))

  def wgrad(self, lhs_op, g, precision):
    """d rhs = lhs contracted with g over lhs's free axes, laid out like rhs (FP32)."""
    out = lax.dot_general(lhs_op, g, ((self.lf, self.g_lf), (self.lb, self.g_b)),
                          precision=precision, preferred_element_type=jnp.float32)
    src = self.rb + tuple(self.rc[self.lc.index(l)] for l in sorted(self.lc)) + self.rf
    return jnp.transpose(out, np.argsort(src))


def _forward_operands(lhs, rhs, key, amaxes, dn, cfg: QDotConfig):
  compute = jnp.dtype(cfg.compute_dtype)
  (lc, rc), _ = dn
  k_lhs, k_rhs, _, _ = _split_key(key)
  lhs_amax, rhs_amax = amaxes
  lhs_q = _fq_axes(lhs, lc, cfg.lhs, k_lhs, "lhs", lhs_amax).astype(compute)
  rhs_q = _fq_axes(rhs, rc, cfg.rhs, k_rhs, "rhs", rhs_amax).astype(compute)
  # Defensive: a simplifier may move a per-tensor scale across the dot (dot(c * s, w) ->
  # s * dot(c, w)), which would round differently from the fake-quant operands. (On XLA CPU
  # the barrier does not constrain fusion and no such rewrite happens; the forward-equality test
  # checks.)
  return lax.optimization_barrier((lhs_q, rhs_q))


def _backward(dn, cfg: QDotConfig, precision, lhs_op, rhs_op, key, g):
  """(dlhs, drhs) in FP32 from the saved operands: original (compute dtype; backward="quantized"
  with requantize_from="original": primal dtype) or dequantized (compute dtype)."""
  compute = jnp.dtype(cfg.compute_dtype)
  dims = _Dims(dn, lhs_op.ndim, rhs_op.ndim)
  if cfg.backward != "quantized":
    g_c = g.astype(compute)
    return dims.dgrad(g_c, rhs_op, precision), dims.wgrad(lhs_op, g_c, precision)
  _, _, k_dgrad, k_wgrad = _split_key(key)
  # dgrad GEMM contracts the rhs free axes.
  g_d = _fq_axes(g, dims.g_rf, cfg.grad, k_dgrad, "dgrad gradient").astype(compute)
  rhs_d = _fq_axes(rhs_op, dims.rf, _no_sr(cfg.rhs), None, "dgrad rhs").astype(compute)
  # wgrad GEMM contracts the lhs free axes (e.g. batch x time).
  g_w, lhs_w = g, lhs_op
  if cfg.rht_wgrad:
    g_w = _along(g_w.astype(jnp.float32), dims.g_lf, rht)
    lhs_w = _along(lhs_w.astype(jnp.float32), dims.lf, rht)
  g_w = _fq_axes(g_w, dims.g_lf, cfg.grad, k_wgrad, "wgrad gradient").astype(compute)
  lhs_w = _fq_axes(lhs_w, dims.lf, _no_sr(cfg.lhs), None, "wgrad lhs").astype(compute)
  return dims.dgrad(g_d, rhs_d, precision), dims.wgrad(lhs_w, g_w, precision)


def _forward(lhs, rhs, key, amaxes, dn, cfg: QDotConfig, precision, preferred_element_type):
  """(product, the dequantized operands in the compute dtype), by cfg.gemm."""
  if cfg.gemm == "native":
    return _native_forward(lhs, rhs, key, amaxes, dn, cfg, precision, preferred_element_type)
  lhs_q, rhs_q = _forward_operands(lhs, rhs, key, amaxes, dn, cfg)
  out = lax.dot_general(lhs_q, rhs_q, dn, precision=precision,
                        preferred_element_type=preferred_element_type)
  return out, lhs_q, rhs_q


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _qdot(lhs, rhs, key, amaxes, dn, cfg, precision, preferred_element_type):
  return _forward(lhs, rhs, key, amaxes, dn, cfg, precision, preferred_element_type)[0]


def _qdot_fwd(lhs, rhs, key, amaxes, dn, cfg, precision, preferred_element_type):
  out, lhs_q, rhs_q = _forward(lhs, rhs, key, amaxes, dn, cfg, precision,
                               preferred_element_type)
  if cfg.backward == "high_precision":
    compute = jnp.dtype(cfg.compute_dtype)
    lhs_q, rhs_q = lhs.astype(compute), rhs.astype(compute)
  elif cfg.backward == "quantized" and cfg.requantize_from == "original":
    lhs_q, rhs_q = lhs, rhs  # quantized along the backward GEMMs' axes in _backward
  # Zero-size arrays carry the primal dtypes to the backward (cotangents must match them).
  dtypes = (jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))
  return out, (lhs_q, rhs_q, key, dtypes)


def _qdot_bwd(dn, cfg, precision, preferred_element_type, res, g):
  del preferred_element_type
  lhs_op, rhs_op, key, (lhs_dt, rhs_dt) = res
  dlhs, drhs = _backward(dn, cfg, precision, lhs_op, rhs_op, key, g)
  # The key and the static amaxes get zero cotangents (None).
  return dlhs.astype(lhs_dt.dtype), drhs.astype(rhs_dt.dtype), None, None


_qdot.defvjp(_qdot_fwd, _qdot_bwd)


def _check_amaxes(cfg: QDotConfig | None, lhs_amax, rhs_amax):
  """Validates the static amaxes (trace time); returns them as FP32 scalars (or None)."""
  out = []
  for name, qc, amax in (("lhs", cfg and cfg.lhs, lhs_amax), ("rhs", cfg and cfg.rhs, rhs_amax)):
    if amax is not None and qc is None:
      raise ValueError(f"{name}_amax is given but the {name} operand is not quantized: pass "
                       f"{name}_amax=None or quantize {name} with a per-tensor-scaled format.")
    try:
      out.append(check_tensor_amax(qc, amax) if qc is not None else None)
    except ValueError as e:
      raise ValueError(f"{name}_amax: {e}") from None
  return tuple(out)


def _check(lhs, rhs, dn: DimensionNumbers, cfg: QDotConfig, key, amaxes) -> None:
  """Trace-time validation of everything the forward and backward will need."""
  (lc, rc), _ = dn
  for name, qc, axes in (("lhs", cfg.lhs, lc), ("rhs", cfg.rhs, rc)):
    if qc is None:
      continue
    if qc.kind != "tensor" and not qc.block_2d and len(axes) != 1:
      raise ValueError(f"{name}: {qc.fmt} blocks along one contracting axis, but this dot_general "
                       f"contracts {len(axes)} axes {axes}; reshape so one axis is contracted, or "
                       "use a per-tensor format.")
  needs_key = any(q is not None and q.stochastic_rounding for q in (cfg.lhs, cfg.rhs))
  needs_key |= cfg.backward == "quantized" and cfg.grad.stochastic_rounding
  if needs_key and key is None:
    raise ValueError("This QDotConfig uses stochastic rounding: pass key=jax.random.key(seed) to "
                     "quantized_dot_general / make_dot_general.")
  if cfg.backward == "quantized" and cfg.grad.block_2d:
    raise ValueError("cfg.grad: block_2d is for weights; quantize gradients with 1-D blocks.")
  # Shape checks of forward and backward quantizers, abstractly (raises before any compile).
  lhs_s = jax.ShapeDtypeStruct(lhs.shape, lhs.dtype)
  rhs_s = jax.ShapeDtypeStruct(rhs.shape, rhs.dtype)
  _, *out_s = jax.eval_shape(lambda a, b, k, m: _forward(a, b, k, m, dn, cfg, None, None),
                             lhs_s, rhs_s, key, amaxes)
  if cfg.backward == "quantized":
    y_s = jax.eval_shape(lambda a, b: lax.dot_general(a, b, dn), *out_s)
    g_s = jax.ShapeDtypeStruct(y_s.shape, jnp.float32)
    jax.eval_shape(lambda a, b, k, g: _backward(dn, cfg, None, a, b, k, g), *out_s, key, g_s)


def quantized_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers,
                          cfg: QDotConfig | None, key: jax.Array | None = None,
                          preferred_element_type: Any = jnp.float32,
                          precision: Any = None, *, lhs_amax: jax.Array | None = None,
                          rhs_amax: jax.Array | None = None) -> jax.Array:
  """`lax.dot_general` with quantized operands and the backward selected by cfg.backward.

  Args:
    lhs, rhs: operands (any float dtype); each is quantized along its contracting axis
      (cfg.lhs.axis / cfg.rhs.axis are overridden).
    dimension_numbers: as for lax.dot_general (batch dims allowed).
    cfg: the QDotConfig; None means a plain `lax.dot_general(lhs, rhs)` on the operands as given.
      A config quantizing neither operand is a plain dot_general in cfg.compute_dtype.
    key: PRNG key, required when any quantizer uses stochastic rounding; not differentiated.
    preferred_element_type: output/accumulation dtype; None = lax's default (the compute dtype).
    precision: passed to every GEMM, forward and backward.
    lhs_amax, rhs_amax: optional static per-tensor amax of an operand (fake_quant's tensor_amax:
      per-tensor FP8 or NVFP4 without per_token), e.g. an inference engine's calibrated
      activation scale. Used by the forward quantizer only (backward requantizations compute their
      own scales); zero cotangent. None = the data's amax.
  Returns:
    The product, in preferred_element_type.
  """
  dn = _normalize_dn(dimension_numbers, lhs.ndim, rhs.ndim)
  pet = None if preferred_element_type is None else jnp.dtype(preferred_element_type)
  if cfg is not None and not isinstance(cfg, QDotConfig):
    raise ValueError(f"cfg must be a QDotConfig or None, got {type(cfg).__name__}.")
  amaxes = _check_amaxes(cfg, lhs_amax, rhs_amax)
  if cfg is None:
    return lax.dot_general(lhs, rhs, dn, precision=precision, preferred_element_type=pet)
  if not cfg.quantized:
    compute = jnp.dtype(cfg.compute_dtype)
    return lax.dot_general(lhs.astype(compute), rhs.astype(compute), dn, precision=precision,
                           preferred_element_type=pet)
  _check(lhs, rhs, dn, cfg, key, amaxes)
  return _qdot(lhs, rhs, key, amaxes, dn, cfg, precision, pet)


def make_dot_general(cfg: QDotConfig | None, key: jax.Array | None = None, *,
                     lhs_amax: jax.Array | None = None,
                     rhs_amax: jax.Array | None = None) -> Callable:
  """A drop-in `dot_general` (lax signature) for Flax layers, e.g. nn.Dense(dot_general=...).

  The returned callable is
  `(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None) -> jax.Array`;
  preferred_element_type None gives the compute dtype, like lax.dot_general on cast operands.
  lhs_amax / rhs_amax: static per-tensor amaxes, as in quantized_dot_general.
  """

  def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    return quantized_dot_general(lhs, rhs, dimension_numbers, cfg, key,
                                 preferred_element_type=preferred_element_type,
                                 precision=precision, lhs_amax=lhs_amax, rhs_amax=rhs_amax)

  return dot_general
