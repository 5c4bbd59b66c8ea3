"""Grouped (ragged) quantized matmul for mixture-of-experts layers (jax.custom_vjp).

`grouped_quantized_dot(x_MK, w_EKN, group_sizes_E, cfg)` multiplies the rows of x, sorted by
expert (group e is the next group_sizes[e] rows), by their expert's weight w[e], with
`lax.ragged_dot`: each row meets one expert, not all E. It is E independent quantized GEMMs,
`quantized_dot_general(x_e, w[e])` on the rows x_e of group e, as `lowrl.quant.qdot` computes
them, with every scale taken per group:

  weights      w[e] quantized alone (vmapped `fake_quant` along K): one NVFP4 / per-tensor FP8
               global scale per expert, blocks along K (16x16 tiles with block_2d).
  activations  per-token NVFP4 and MX scales are row-local, so grouping changes nothing; a
               per-tensor scale (FP8, NVFP4 without per_token) is the amax of the row's group,
               as the dense GEMM on x_e would take it. 2-D activation tiles are refused.

The backward modes are qdot's (`QDotConfig.backward`), with its saved operands:
  high_precision / dequantized: dgrad = ragged_dot(g, w_opᵀ), wgrad[e] = x_op,eᵀ g_e (a ragged
    contraction over the group's rows), compute-dtype operands, FP32 accumulation.
  quantized: qdot's own `_backward` per expert on the group's rows (the other rows zeroed, which
    quantize to 0 and leave every scale of the group unchanged; 1-D blocks along the token axis
    then start at multiples of the block in the sorted row order). That is E dense GEMMs, an
    emulation of the research mode, not a grouped kernel; the forward and the other modes scale.

Keys: (k_lhs, k_rhs, k_dgrad, k_wgrad) = split(key, 4) as in qdot; expert e's weight quantizer
and its quantized backward take fold_in of their key with e. No gradient reaches group_sizes.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from lowrl.quant import qdot
from lowrl.quant.config import QDotConfig, QuantConfig
from lowrl.quant.quantize import fake_quant

_DN = (((1,), (0,)), ((), ()))  # one expert's GEMM: x_e [m, K] . w_e [K, N]


def group_ids(group_sizes_E: jax.Array, rows: int) -> jax.Array:
  """[rows] int32: the group of each sorted row (rows past the last group get E)."""
  ends = jnp.cumsum(group_sizes_E.astype(jnp.int32))
  return jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right").astype(jnp.int32)


def _fold(key, data):
  return None if key is None else jax.random.fold_in(key, data)


def expert_weight_config(cfg: QuantConfig) -> QuantConfig:
  """`cfg` as applied to one expert's [K, N] weight: 1-D blocks along K (axis 0)."""
  if cfg.kind != "tensor" and not cfg.block_2d:
    return dataclasses.replace(cfg, axis=0)
  return cfg


def fake_quant_experts(w_EKN: jax.Array, cfg: QuantConfig | None,
                       key: jax.Array | None = None) -> jax.Array:
  """Each expert's weight [K, N] fake-quantized alone (blocks along K; key folded with e)."""
  if cfg is None:
    return w_EKN
  cfg = expert_weight_config(cfg)
  n = w_EKN.shape[0]
  if key is None:
    return jax.vmap(lambda w: fake_quant(w, cfg))(w_EKN)
  keys = jax.vmap(lambda e: jax.random.fold_in(key, e))(jnp.arange(n))
  return jax.vmap(lambda w, k: fake_quant(w, cfg, k))(w_EKN, keys)


def _tensor_scaled(cfg: QuantConfig) -> bool:
  return cfg.kind == "tensor" or (cfg.kind == "nvfp4" and not cfg.per_token)


def _fq_rows(x_MK: jax.Array, cfg: QuantConfig | None, key, gid_M: jax.Array,
             n_groups: int) -> jax.Array:
  """x fake-quantized along K as the dense GEMM of each row's group would quantize it."""
  if cfg is None:
    return x_MK
  if cfg.kind != "tensor":
    cfg = dataclasses.replace(cfg, axis=1)
  if not _tensor_scaled(cfg):
    return fake_quant(x_MK, cfg, key)  # row-local scales
  # One scale per group: its amax, given to each row as a static tensor amax.
  row_amax = jnp.max(jnp.abs(x_MK.astype(jnp.float32)), axis=1)
  amax_M = jax.ops.segment_max(row_amax, gid_M, num_segments=n_groups + 1)[gid_M]
  if key is None:
    return jax.vmap(lambda r, a: fake_quant(r[None], cfg, tensor_amax=a)[0])(x_MK, amax_M)
  keys = jax.random.split(key, x_MK.shape[0])
  return jax.vmap(lambda r, a, k: fake_quant(r[None], cfg, k, tensor_amax=a)[0])(
      x_MK, amax_M, keys)


def _forward(x, w, gs, key, cfg: QDotConfig, precision, pet):
  compute = jnp.dtype(cfg.compute_dtype)
  k_lhs, k_rhs, _, _ = qdot._split_key(key)
  gid = group_ids(gs, x.shape[0])
  x_q = _fq_rows(x, cfg.lhs, k_lhs, gid, w.shape[0]).astype(compute)
  w_q = fake_quant_experts(w, cfg.rhs, k_rhs).astype(compute)
  x_q, w_q = lax.optimization_barrier((x_q, w_q))
  out = lax.ragged_dot(x_q, w_q, gs, precision=precision, preferred_element_type=pet)
  return out, x_q, w_q


def _ragged_wgrad(x_op, g, gs, precision):
  """[E, K, N] FP32: per group e, x_eᵀ g_e (the ragged contraction over the sorted rows)."""
  dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                       lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  return lax.ragged_dot_general(x_op, g, gs, dims, precision=precision,
                                preferred_element_type=jnp.float32)


def _backward(cfg: QDotConfig, precision, x_op, w_op, gs, key, g):
  compute = jnp.dtype(cfg.compute_dtype)
  if cfg.backward != "quantized":
    g_c = g.astype(compute)
    dx = lax.ragged_dot(g_c, jnp.swapaxes(w_op, 1, 2), gs, precision=precision,
                        preferred_element_type=jnp.float32)
    return dx, _ragged_wgrad(x_op, g_c, gs, precision)
  gid = group_ids(gs, x_op.shape[0])

  def one_expert(dx, e):
    rows = (gid == e)[:, None]
    dx_e, dw_e = qdot._backward(_DN, cfg, precision, jnp.where(rows, x_op, 0), w_op[e],
                                _fold(key, e), jnp.where(rows, g, 0))
    return dx + dx_e, dw_e  # other groups' rows of dx_e are exactly 0

  dx0 = jnp.zeros(x_op.shape, jnp.float32)
  return lax.scan(one_expert, dx0, jnp.arange(w_op.shape[0]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _gqdot(x, w, gs, key, cfg, precision, pet):
  return _forward(x, w, gs, key, cfg, precision, pet)[0]


def _gqdot_fwd(x, w, gs, key, cfg, precision, pet):
  out, x_q, w_q = _forward(x, w, gs, key, cfg, precision, pet)
  if cfg.backward == "high_precision":
    compute = jnp.dtype(cfg.compute_dtype)
    x_q, w_q = x.astype(compute), w.astype(compute)
  elif cfg.backward == "quantized" and cfg.requantize_from == "original":
    x_q, w_q = x, w
  dtypes = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))
  return out, (x_q, w_q, gs, key, dtypes)


def _gqdot_bwd(cfg, precision, pet, res, g):
  del pet
  x_op, w_op, gs, key, (x_dt, w_dt) = res
  dx, dw = _backward(cfg, precision, x_op, w_op, gs, key, g)
  gs_ct = jnp.zeros(gs.shape, jax.dtypes.float0)
  return dx.astype(x_dt.dtype), dw.astype(w_dt.dtype), gs_ct, None


_gqdot.defvjp(_gqdot_fwd, _gqdot_bwd)


def _check(x, w, gs, cfg: QDotConfig, key) -> None:
  if x.ndim != 2 or w.ndim != 3 or gs.shape != (w.shape[0],) or x.shape[1] != w.shape[1]:
    raise ValueError(f"grouped_quantized_dot takes x [M, K], w [E, K, N], group_sizes [E]; got "
                     f"{x.shape}, {w.shape}, {gs.shape}.")
  if cfg.lhs is not None and cfg.lhs.block_2d:
    raise ValueError("grouped_quantized_dot: 2-D activation tiles span rows of different "
                     "experts; quantize the activations with 1-D blocks (block_2d is for weights).")
  if cfg.gemm != "emulated":
    raise ValueError("grouped_quantized_dot has no native GEMM; set precision.gemm=emulated.")
  # The dense checks on one expert's GEMM (keys, formats, backward quantizers), abstractly.
  qdot._check(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(w.shape[1:], w.dtype),
              _DN, cfg, key, (None, None))


def grouped_quantized_dot(x_MK: jax.Array, w_EKN: jax.Array, group_sizes_E: jax.Array,
                          cfg: QDotConfig | None, key: jax.Array | None = None,
                          preferred_element_type: Any = jnp.float32,
                          precision: Any = None) -> jax.Array:
  """`lax.ragged_dot(x, w, group_sizes)` with per-group quantized operands (module docstring).

  Args:
    x_MK: rows sorted by group; rows past sum(group_sizes) give 0.
    w_EKN: one [K, N] weight per group.
    group_sizes_E: int32 rows per group.
    cfg: the QDotConfig (None: a plain ragged_dot on the operands as given; unquantized: in
      cfg.compute_dtype).
    key: PRNG key for stochastic rounding (required when a quantizer uses it).
    preferred_element_type: output / accumulation dtype.
  Returns:
    [M, N] in preferred_element_type.
  """
  pet = None if preferred_element_type is None else jnp.dtype(preferred_element_type)
  gs = group_sizes_E.astype(jnp.int32)
  if cfg is None:
    return lax.ragged_dot(x_MK, w_EKN, gs, precision=precision, preferred_element_type=pet)
  if not cfg.quantized:
    compute = jnp.dtype(cfg.compute_dtype)
    return lax.ragged_dot(x_MK.astype(compute), w_EKN.astype(compute), gs, precision=precision,
                          preferred_element_type=pet)
  _check(x_MK, w_EKN, gs, cfg, key)
  return _gqdot(x_MK, w_EKN, gs, key, cfg, precision, pet)
