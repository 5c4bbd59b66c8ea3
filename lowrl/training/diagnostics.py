"""Diagnostics of the parameters under a precision policy."""
from __future__ import annotations

import dataclasses
from typing import Iterator

import jax
import jax.numpy as jnp

from lowrl import precision
from lowrl.models import layout
from lowrl.models.fused_scales import weight_amaxes
from lowrl.models.config import ModelConfig
from lowrl.quant import QuantConfig, fake_quant
from lowrl.quant.grouped_qdot import fake_quant_experts


def quantized_weights(params, model_cfg: ModelConfig, policy: precision.PrecisionPolicy
                      ) -> Iterator[tuple[layout.Matmul, jax.Array, QuantConfig, jax.Array | None]]:
  """(matmul, its FP32 weight, the weight's quantizer, its static per-tensor amax or None) of
  every weight the policy quantizes: along the contracting axis, as the forward does, with round
  to nearest for stochastically rounded quantizers (the deterministic grid), the amax its fused
  group shares (`weight_amaxes`). Traceable."""
  amaxes = weight_amaxes(params, model_cfg, policy)
  for m, w in layout.iter_weights(params, model_cfg):
    q = policy.qdot_config(m.full_path).rhs
    if q is None:
      continue
    q = dataclasses.replace(q, axis=m.contract_axis, stochastic_rounding=False)
    yield m, w.astype(jnp.float32), q, amaxes.get(m.full_path)


def weight_quant_errors(params, model_cfg: ModelConfig,
                        policy: precision.PrecisionPolicy) -> dict[str, jax.Array]:
  """Relative RMS error ||fq(W) - W|| / ||W|| of every weight the policy quantizes.

  Weights are quantized along their contracting axis, as the forward does (a tied LM head's
  embedding table is measured as the head reads it). Stochastic-rounding quantizers are measured with round-to-nearest (the error of the
  deterministic grid; SR adds zero-mean noise on top).
  """
  out = {}
  for m, w32, q, amax in quantized_weights(params, model_cfg, policy):
    err = (fake_quant_experts(w32, q) if m.n_experts else
           fake_quant(w32, q, tensor_amax=amax)) - w32
    out[m.full_path] = jnp.sqrt(jnp.sum(err**2) / jnp.maximum(
        jnp.sum(w32**2), 1e-30))
  return out
