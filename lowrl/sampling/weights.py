"""Rollout weights: the policy's deterministic weight quantizers applied ahead of time, and
kernels held packed (E2M1 codes two per byte + scales) between sampler calls.

Both are exact: `quantize_weights` and `unpack_params` give `fake_quant(W)` bit for bit, the value
the forward's own weight quantizer computes (with the fused groups' shared per-tensor amax,
`lowrl.models.fused_scales`, as the forward takes it), and `prequantized_policy` then skips that
quantizer.
This module knows the model's layout (which kernels, which contracting axis) and the precision
policy (which quantizer); the format-level packing (`PackedWeight`, `pack_qtensor`) lives with the
quantizers in `lowrl.quant.packing`, which sits below both.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp

from lowrl.models import layout
from lowrl.models.fused_scales import weight_amaxes
from lowrl.models.config import ModelConfig
from lowrl.precision import PrecisionPolicy
from lowrl.quant.config import QuantConfig
from lowrl.quant.packing import PackedWeight, pack_qtensor
from lowrl.quant.grouped_qdot import fake_quant_experts
from lowrl.quant.quantize import fake_quant, quantize

Params = Any


def _weight_quantizer(policy: PrecisionPolicy, m: layout.Matmul) -> QuantConfig | None:
  """The deterministic rhs QuantConfig the forward applies to matmul `m`'s weight, or None.

  Stochastically rounded weight quantizers draw a new key per forward and cannot be applied
  ahead of time: None for those too.
  """
  q = policy.qdot_config(m.full_path).rhs
  if q is None or q.stochastic_rounding:
    return None
  # As quantized_dot_general does: 1-D blocks run along the contracting axis.
  return q if q.kind == "tensor" or q.block_2d else dataclasses.replace(q, axis=m.contract_axis)


def _kernels(model_cfg: ModelConfig) -> list[layout.Matmul]:
  """The matmuls with an [in, out] kernel of their own (a tied head reads the embedding)."""
  return [m for m in layout.matmuls(model_cfg) if m.owns_kernel]


def prequantizable(policy: PrecisionPolicy, model_cfg: ModelConfig) -> list[layout.Matmul]:
  """The kernels whose weight quantizer `quantize_weights` / `pack_params` apply ahead of time."""
  return [m for m in _kernels(model_cfg) if _weight_quantizer(policy, m) is not None]


def prequantized_policy(policy: PrecisionPolicy, model_cfg: ModelConfig) -> PrecisionPolicy:
  """`policy` without the weight quantizers that `quantize_weights` / `pack_params` apply ahead
  of time (deterministic ones on [in, out] kernels; a tied head quantizes the embedding itself).
  Idempotent: a policy with nothing to drop comes back unchanged."""
  if not prequantizable(policy, model_cfg):
    return policy

  def drop(c):
    droppable = c.rhs is not None and not c.rhs.stochastic_rounding
    return dataclasses.replace(c, rhs=None) if droppable else c

  rules = [(p, drop(c)) for p, c in policy.rules]
  if model_cfg.tie_embeddings:  # the head quantizes the embedding table itself: keep its rule
    head = layout.matmul(model_cfg, None, layout.LM_HEAD).full_path
    rules.insert(0, (re.escape(head), policy.qdot_config(head)))
  return dataclasses.replace(policy, rules=tuple(rules), name=policy.name + "+prequantized")


def quantize_weights(params: Params, model_cfg: ModelConfig, policy: PrecisionPolicy
                     ) -> tuple[Params, PrecisionPolicy]:
  """(params with kernels fake-quantized once, the policy that then skips weight quantizers).

  Exact: the pair computes bit for bit what (params, policy) computes, since the forward's own
  weight quantization is the same `fake_quant` call; the decode program applies it once so that
  its loop does not re-quantize every weight at every step. Traceable.
  """
  out = params
  amaxes = weight_amaxes(params, model_cfg, policy)
  for m in _kernels(model_cfg):
    q = _weight_quantizer(policy, m)
    if q is not None:
      # Stacked experts: each expert alone (its own global scale), as the grouped GEMM does.
      if m.n_experts:
        w_q = fake_quant_experts(layout.get_param(params, m.param_keys), q)
      else:
        w_q = fake_quant(layout.get_param(params, m.param_keys), q,
                         tensor_amax=amaxes.get(m.full_path))
      out = layout.set_param(out, m.param_keys, w_q)
  return out, prequantized_policy(policy, model_cfg)


def cast_kernels(params: Params, model_cfg: ModelConfig, policy: PrecisionPolicy) -> Params:
  """`params` with every kernel that the forward under `policy` only casts (no weight quantizer:
  an unquantized matmul, or one whose weight `quantize_weights` already quantized) cast to its
  matmul's compute dtype ahead of time.

  Exact: such a kernel's first operation in the forward is that cast (`quantized_dot_general`),
  which is then a no-op; the decode program casts once per call, not at every step. Stacked
  experts (the grouped GEMM) are left as they are. Traceable.
  """
  out = params
  for m in _kernels(model_cfg):
    cfg = policy.qdot_config(m.full_path)
    if cfg.rhs is None and not m.n_experts:
      out = layout.set_param(out, m.param_keys,
                             layout.get_param(params, m.param_keys).astype(cfg.compute_dtype))
  return out


# ----------------------------------------------------------------------------------------------
# Packed kernels.


def _is_packed(x) -> bool:
  return isinstance(x, PackedWeight)


def check_packable(model_cfg: ModelConfig, policy: PrecisionPolicy) -> None:
  """ValueError unless every weight quantizer of `policy` can be applied ahead of time."""
  for m in _kernels(model_cfg):
    rhs = policy.qdot_config(m.full_path).rhs
    if rhs is not None and m.n_experts:
      raise ValueError(f"{m.full_path}: packed rollout weights of stacked experts (one global "
                       "scale per expert) are not implemented; run the sampler on the master "
                       "weights (unpacked).")
    if rhs is not None and rhs.stochastic_rounding:
      raise ValueError(f"{m.full_path}: stochastically rounded weights are re-drawn every "
                       "forward and cannot be packed; use precision.stochastic_rounding=grad or "
                       "none for a packed sampler.")


def pack_params(params: Params, model_cfg: ModelConfig, policy: PrecisionPolicy,
                other_dtype=None) -> Params:
  """Replaces every kernel the policy quantizes by a PackedWeight (E2M1 two codes per byte).

  Kernels the policy keeps unquantized, norms, biases and the embedding stay as they are, or are
  cast to `other_dtype` (e.g. bfloat16: exact for the embedding and unquantized kernels, which the
  forward casts to the compute dtype anyway, but it rounds norm scales and biases). With
  other_dtype None, `unpack_params` + `prequantized_policy` compute exactly what the master
  weights do (fake_quant(W) == dequantize(quantize(W)) bit for bit).

  A tree whose kernels are already packed (a LoRA run's packed base, quantized once at load:
  lowrl.training.lora_update.pack_base) comes back as it is.

  Raises:
    ValueError: a stochastically rounded weight quantizer (re-drawn every forward).
  """
  check_packable(model_cfg, policy)
  if is_packed(params):
    return params
  return _pack(params, model_cfg=model_cfg, policy=policy,
               other_dtype=None if other_dtype is None else jnp.dtype(other_dtype))


@functools.partial(jax.jit, static_argnames=("model_cfg", "policy", "other_dtype"))
def _pack(params, *, model_cfg, policy, other_dtype):
  # One program for all kernels (eager quantize calls would compile once per kernel shape).
  out = params if other_dtype is None else jax.tree.map(lambda x: x.astype(other_dtype), params)
  amaxes = weight_amaxes(params, model_cfg, policy)
  for m in _kernels(model_cfg):
    q = _weight_quantizer(policy, m)
    if q is not None:
      w = layout.get_param(params, m.param_keys)
      out = layout.set_param(out, m.param_keys,
                 pack_qtensor(quantize(w, q, tensor_amax=amaxes.get(m.full_path))))
  return out


@jax.jit
def unpack_params(packed: Params) -> Params:
  """PackedWeight leaves -> FP32 dequantized kernels (inside the sampler call, the emulation)."""
  return jax.tree.map(lambda x: x.dequantize() if _is_packed(x) else x, packed,
                      is_leaf=_is_packed)


def is_packed(params: Params) -> bool:
  """Whether the tree holds PackedWeight leaves (a `pack_params` tree)."""
  return any(_is_packed(x) for x in jax.tree.leaves(params, is_leaf=_is_packed))


def dequantize_packed(params: Params, model_cfg: ModelConfig, policy: PrecisionPolicy
                      ) -> tuple[Params, PrecisionPolicy]:
  """A packed tree as (FP32 kernels, the policy that skips the quantizers they already went
  through); master weights come back as they are. Traceable."""
  if not is_packed(params):
    return params, policy
  return unpack_params(params), prequantized_policy(policy, model_cfg)


def packed_bytes(packed: Params) -> dict[str, float]:
  """Storage of a packed tree: quantized kernels (codes + scales) vs everything else."""
  leaves = jax.tree.leaves(packed, is_leaf=_is_packed)
  q = [x for x in leaves if _is_packed(x)]
  rest = [x for x in leaves if not _is_packed(x)]
  q_params = sum(x.num_elements for x in q)
  q_bytes = sum(x.nbytes for x in q)
  rest_params = sum(int(x.size) for x in rest)
  rest_bytes = sum(int(x.nbytes) for x in rest)
  total = q_params + rest_params
  return {"quantized_params": q_params, "quantized_bytes": q_bytes,
          "bytes_per_quantized_param": q_bytes / max(q_params, 1),
          "other_params": rest_params, "other_bytes": rest_bytes,
          "bytes_per_param": (q_bytes + rest_bytes) / max(total, 1)}
