"""Diagnostics of the parameters under a precision policy."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lowrl import precision
from lowrl.models.config import ModelConfig
from lowrl.quant import fake_quant


def _kernel(params, layer: int | None, path: str):
  node = params if layer is None else params[f"layers_{layer}"]
  for part in path.split("/"):
    if part not in node:
      return None
    node = node[part]
  return node["kernel"]


def weight_quant_errors(params, model_cfg: ModelConfig,
                        policy: precision.PrecisionPolicy) -> dict[str, jax.Array]:
  """Relative RMS error ||fq(W) - W|| / ||W|| of every weight the policy quantizes.

  Weights are quantized along their contracting axis (axis 0 of an [in, out] kernel), as the
  forward does. Stochastic-rounding quantizers are measured with round-to-nearest (the error of the
  deterministic grid; SR adds zero-mean noise on top).
  """
  out = {}
  for layer, path in precision.matmul_paths(model_cfg.n_layers):
    q = policy.qdot_config(layer, path).rhs
    w = _kernel(params, layer, path)
    if q is None or w is None:
      continue
    q = dataclasses.replace(q, axis=0, stochastic_rounding=False)
    w32 = w.astype(jnp.float32)
    err = fake_quant(w32, q) - w32
    out[precision.matmul_path(layer, path)] = jnp.sqrt(jnp.sum(err**2) / jnp.maximum(
        jnp.sum(w32**2), 1e-30))
  return out
