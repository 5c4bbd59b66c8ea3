"""Per-update churn of the quantized weights: the fraction of NVFP4 (or MX / FP8) weight codes, block
scales and dequantized values that an update changes.

QuRL (arXiv 2602.13953) observes that RL updates are mostly smaller than the 4-bit quantization
step, so the quantized policy barely "sees" training: an element's E2M1 code changes only when
the update carries it across a rounding boundary of its block's grid (or moves its block's amax
enough to change the block scale). `weight_qtensors` quantizes every weight a policy quantizes
with the quantizer the forward uses (`lowrl.quant.quantize`: contracting axis, the fused groups'
shared per-tensor amax, stacked experts one by one), `churn` compares two such trees, and
`CodeChurn` is the loop's diagnostic (`diagnostics.code_churn`, off by default): the codes of
the weights before and after each RL step (all its optimizer updates; one with rl.mu = 1 and one
minibatch), under the sampler's precision policy (the rollout weights whose unchanged codes the
observation is about; the trainer's when the two recipes are the same).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from lowrl import precision
from lowrl.models.config import ModelConfig
from lowrl.quant import QTensor, dequantize, quantize
from lowrl.quant.grouped_qdot import expert_weight_config
from lowrl.training.diagnostics import quantized_weights

PREFIX = "code_churn"


def weight_qtensors(params: Any, model_cfg: ModelConfig, policy: precision.PrecisionPolicy
                    ) -> dict[str, QTensor]:
  """{full matmul path: QTensor} of every weight `policy` quantizes, quantized as the forward
  does (along the contracting axis, with the fused group's shared amax; a stacked expert kernel
  expert by expert, as `fake_quant_experts`). Stochastically rounded weight quantizers are taken
  with round-to-nearest (the deterministic grid the draws scatter around). Traceable."""
  out = {}
  for m, w32, q, amax in quantized_weights(params, model_cfg, policy):
    if m.n_experts:
      q = expert_weight_config(q)
      out[m.full_path] = jax.vmap(lambda x, q=q: quantize(x, q))(w32)
    else:
      out[m.full_path] = quantize(w32, q, tensor_amax=amax)
  return out


def _differs(a: jax.Array, b: jax.Array) -> jax.Array:
  """Element-wise: the two codes differ bit for bit (-0 vs +0 included; FP32 holds every code of
  E2M1 / E4M3 / E5M2 / E8M0 exactly)."""
  a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
  return (a32 != b32) | (jnp.signbit(a32) != jnp.signbit(b32))


def _fraction(changed: list[jax.Array]) -> jax.Array:
  n = sum(x.size for x in changed)
  return sum(jnp.sum(x.astype(jnp.float32)) for x in changed) / max(n, 1)


def churn(old: dict[str, QTensor], new: dict[str, QTensor]) -> dict[str, jax.Array]:
  """Fractions (FP32 scalars) over all the weights of two `weight_qtensors` trees of the same
  params' shapes: `code_churn/codes` of the elements whose code changed, `code_churn/values` of
  those whose dequantized value changed (a changed block scale moves every nonzero element of
  its block), `code_churn/scales` of the block scales (per-tensor formats: their one scale) that
  changed, and `code_churn/outer` of NVFP4's FP32 outer scales (when a weight has them). {} when
  the trees are empty (the policy quantizes no weight). Pure, jittable."""
  if not old:
    return {}
  if set(old) != set(new):
    raise ValueError(f"churn: the trees quantize different weights ({sorted(set(old) ^ set(new))}).")
  paths = sorted(old)
  out = {
      f"{PREFIX}/codes": _fraction([_differs(old[p].codes, new[p].codes) for p in paths]),
      f"{PREFIX}/values": _fraction([dequantize(old[p]) != dequantize(new[p]) for p in paths]),
      f"{PREFIX}/scales": _fraction([_differs(old[p].scale, new[p].scale) for p in paths]),
  }
  outer = [_differs(old[p].outer, new[p].outer) for p in paths if old[p].outer is not None]
  if outer:
    out[f"{PREFIX}/outer"] = _fraction(outer)
  return out


class CodeChurn:
  """The loop's `diagnostics.code_churn`: `start(params)` before the first step, then
  `after_step(params)` -> the churn of the step's update (floats), the new codes kept for the
  next step (one quantization per step). The step's own program and numbers are untouched."""

  def __init__(self, model_cfg: ModelConfig, policy: precision.PrecisionPolicy):
    self._codes = jax.jit(functools.partial(weight_qtensors, model_cfg=model_cfg, policy=policy))
    self._churn = jax.jit(churn)
    self._prev: dict[str, QTensor] | None = None

  def start(self, params: Any) -> None:
    self._prev = self._codes(params)

  def after_step(self, params: Any) -> dict[str, float]:
    new = self._codes(params)
    out = {k: float(v) for k, v in self._churn(self._prev, new).items()}
    self._prev = new
    return out
