"""Mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE): dropless top-k routing and grouped experts.

Routing as transformers computes it (modeling_qwen3_moe.py `Qwen3MoeSparseMoeBlock` at
huggingface/transformers 16b6c53c8ec3a720bd45c1c377bf94e1d01249c5, modeling_qwen2_moe.py
`Qwen2MoeSparseMoeBlock` at 00a3f9386614dde0dc41cf4e9b8d0abd3af0671d): router logits = x . W_gate
(the `mlp/router` matmul, FP32 out), p = softmax(logits) in FP32, the k largest p (ties: the
lower expert index, `lax.top_k`), renormalised to sum 1 when `norm_topk_prob`; each token's
output is sum_j p_j * expert_{i_j}(x) with expert = SwiGLU of width moe_d_ff. Qwen2-MoE adds
sigmoid(x . w_shared_gate) * shared_expert(x). Dropless: every token reaches its k experts (no
capacity). The N*k (token, expert) pairs are sorted by expert and multiplied by
`grouped_quantized_dot` (lax.ragged_dot): each pair meets one expert's weights, not all E.

Routing replay ("R3"): `Transformer.apply` given a `replay` collection
{layers_i: {mlp: {expert_ids: [B, T, k]}}} routes every token to those experts instead of its own
top-k, while the combine weights are gathered from the trainer's full softmax (renormalised as
usual), so the router still gets its gradient through them (never from zeroed probabilities).
Under a mutable `routing` collection the block records its choices there (`expert_ids`) and,
when replaying, the top-k its own router would have picked (`own_ids`; lowrl/models/routing.py).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowrl.models import layout
from lowrl.models.config import ModelConfig
from lowrl.precision import PrecisionPolicy
from lowrl.quant.grouped_qdot import grouped_quantized_dot

ROUTING = "routing"  # Flax collection the blocks record their expert choices in
REPLAY = "replay"  # Flax collection of expert choices to reuse
EXPERT_IDS = "expert_ids"
OWN_IDS = "own_ids"  # recorded under replay: the experts the block's own router would pick


def route(logits_NE: jax.Array, k: int, norm_topk_prob: bool,
          replay_ids_Nk: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(combine weights [.., k] FP32, expert ids [.., k] int32) from router logits [.., E].

  With `replay_ids_Nk` the ids are those, and the weights their softmax probabilities.
  """
  probs = jax.nn.softmax(logits_NE.astype(jnp.float32), axis=-1)
  if replay_ids_Nk is None:
    weights, ids = jax.lax.top_k(probs, k)
  else:
    ids = replay_ids_Nk.astype(jnp.int32)
    weights = jnp.take_along_axis(probs, ids, axis=-1)
  if norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, ids.astype(jnp.int32)


def routing_flip_fraction(ids_a: jax.Array, ids_b: jax.Array,
                          mask: jax.Array | None = None) -> jax.Array:
  """Fraction of tokens (mask 1) whose top-k expert *set* differs between two routings [.., k]."""
  differ = jnp.any(jnp.sort(ids_a, axis=-1) != jnp.sort(ids_b, axis=-1), axis=-1)
  if mask is None:
    return jnp.mean(differ.astype(jnp.float32))
  mask = mask.astype(jnp.float32)
  return jnp.sum(differ * mask) / jnp.maximum(jnp.sum(mask), 1.0)


class _Kernel(nn.Module):
  """One stacked expert kernel [E, in, out] (the param `kernel` of its own scope)."""

  shape: tuple[int, ...]
  param_dtype: Any

  @nn.compact
  def __call__(self):
    return self.param("kernel", nn.initializers.lecun_normal(), self.shape, self.param_dtype)


class _Experts(nn.Module):
  """The routed experts on rows sorted by expert: SwiGLU through three grouped matmuls."""

  cfg: ModelConfig
  layer: int
  policy: PrecisionPolicy
  param_dtype: Any

  @nn.compact
  def __call__(self, x_MD, group_sizes_E, quant_key):
    cfg, dtype = self.cfg, self.policy.dtype
    e, d, f = cfg.n_experts, cfg.d_model, cfg.moe_d_ff

    def gdot(x, path, shape):
      w = _Kernel(shape, self.param_dtype, name=path.rsplit("/", 1)[1])()
      qcfg = self.policy.qdot_config(layout.matmul_path(self.layer, path))
      key = None if quant_key is None else jax.random.fold_in(quant_key, layout.PATH_IDS[path])
      return grouped_quantized_dot(x, w, group_sizes_E, qcfg, key)

    gate_proj, up_proj, down_proj = layout.EXPERT_MATMULS
    gate_MF = gdot(x_MD, gate_proj, (e, d, f))
    up_MF = gdot(x_MD, up_proj, (e, d, f))
    h_MF = jax.nn.silu(gate_MF.astype(jnp.float32)) * up_MF.astype(jnp.float32)
    return gdot(h_MF.astype(dtype), down_proj, (e, f, d))  # FP32


class _SharedExpert(nn.Module):
  """Qwen2-MoE's shared expert: a SwiGLU MLP of width shared_expert_d_ff."""

  cfg: ModelConfig
  layer: int
  policy: PrecisionPolicy
  param_dtype: Any
  dense: Any

  @nn.compact
  def __call__(self, x_BTD, quant_key):
    dense = lambda n, p: self.dense(n, p, self.layer, self.policy,  # noqa: E731
                                    param_dtype=self.param_dtype, name=p.rsplit("/", 1)[1])
    gate_proj, up_proj, down_proj, _ = layout.SHARED_EXPERT_MATMULS
    f = self.cfg.shared_expert_d_ff
    gate_BTF = dense(f, gate_proj)(x_BTD, quant_key)
    up_BTF = dense(f, up_proj)(x_BTD, quant_key)
    h_BTF = jax.nn.silu(gate_BTF.astype(jnp.float32)) * up_BTF.astype(jnp.float32)
    return dense(self.cfg.d_model, down_proj)(h_BTF.astype(self.policy.dtype), quant_key)


class MoeMlp(nn.Module):
  """The block's MLP when `cfg.n_experts` > 0 (module docstring). `dense` is the model's QDense
  (passed in: this module sits below transformer.py)."""

  cfg: ModelConfig
  layer: int
  policy: PrecisionPolicy
  param_dtype: Any = jnp.float32
  dense: Any = None

  @nn.compact
  def __call__(self, x_BTD, quant_key, act_amax):
    if act_amax:
      raise ValueError("Static activation amaxes (act_amax) are not implemented for "
                       "mixture-of-experts blocks; use row-local activation scales "
                       "(precision.act_per_token=True or an MX format).")
    cfg, dtype = self.cfg, self.policy.dtype
    batch, steps, d = x_BTD.shape
    k = cfg.n_experts_per_tok
    logits_BTE = self.dense(cfg.n_experts, layout.ROUTER, self.layer, self.policy,
                            param_dtype=self.param_dtype, out_dtype=jnp.float32,
                            name="router")(x_BTD, quant_key)
    replay = None
    if self.has_variable(REPLAY, EXPERT_IDS):
      replay = self.get_variable(REPLAY, EXPERT_IDS)
    weights_BTk, ids_BTk = route(logits_BTE, k, cfg.norm_topk_prob, replay)
    if self.is_mutable_collection(ROUTING):
      self.sow(ROUTING, EXPERT_IDS, ids_BTk)
      if replay is not None:  # what this forward's router would have chosen (the flip metric)
        self.sow(ROUTING, OWN_IDS, route(logits_BTE, k, cfg.norm_topk_prob)[1])

    # Sort the N*k (token, expert) pairs by expert (stable: token order within an expert).
    x_ND = x_BTD.reshape(batch * steps, d)
    ids_P = ids_BTk.reshape(-1)
    order_P = jnp.argsort(ids_P, stable=True)
    group_sizes_E = jnp.bincount(ids_P, length=cfg.n_experts).astype(jnp.int32)
    y_PD = _Experts(cfg, self.layer, self.policy, self.param_dtype, name="experts")(
        x_ND[order_P // k], group_sizes_E, quant_key)
    y_NkD = jnp.zeros_like(y_PD).at[order_P].set(y_PD).reshape(batch, steps, k, d)
    out_BTD = jnp.einsum("btk,btkd->btd", weights_BTk, y_NkD.astype(jnp.float32))
    if cfg.shared_expert_d_ff:
      shared_BTD = _SharedExpert(cfg, self.layer, self.policy, self.param_dtype, self.dense,
                                 name="shared_expert")(x_BTD, quant_key)
      gate_BT1 = self.dense(1, layout.SHARED_EXPERT_MATMULS[3], self.layer, self.policy,
                            param_dtype=self.param_dtype, out_dtype=jnp.float32,
                            name="shared_expert_gate")(x_BTD, quant_key)
      out_BTD = out_BTD + jax.nn.sigmoid(gate_BT1) * shared_BTD.astype(jnp.float32)
    return out_BTD.astype(dtype)
