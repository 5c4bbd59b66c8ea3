"""The decoder's Flax building blocks: RMSNorm, RoPE, the quantized linear layer, attention,
the SwiGLU MLP and the pre-norm block (descriptions only; `decoder.Transformer` stacks them).

Precision: every linear layer goes through `quantized_dot_general` with the QDotConfig the policy
gives for its (layer, path). Everything else runs in `policy.compute_dtype`, except RMSNorm,
RoPE and softmax (FP32).

Per-tensor activation scales: a matmul whose activation quantizer takes one scale over the whole
tensor (`precision.activation_scaling(cfg) == "tensor"`) uses the amax of its [B, T, D] input by
default or, given `act_amax`, a static calibrated amax per matmul (`calibration.py`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lowrl.models import fused_scales, kv_cache, layout, lora, moe
from lowrl.models.config import ModelConfig
from lowrl.models.row_sharding import constrain_unsplit
from lowrl.precision import PrecisionPolicy, activation_scaling
from lowrl.quant.packing import PackedWeight
from lowrl.quant.qdot import quantized_dot_general

# Static activation amaxes: full matmul path ("layers_0/attn/q_proj", "lm_head") -> FP32 scalar;
# a quantized KV cache's "layers_0/attn/k_cache" / "v_cache" -> FP32 [n_kv_heads] (kv_cache.py).
ActAmax = Mapping[str, jax.Array]
# Flax collection the calibration forward records per-token activation amaxes in.
CALIB = "act_amax"

# Masked attention scores: finite so that a fully masked (padding) query row gives a uniform,
# finite softmax instead of NaN.
NEG_INF = -1e30
# Quant-key streams: fold_in(key, layer) then fold_in(., path id); the LM head uses layer n_layers.
_PATH_IDS = layout.PATH_IDS


def fold(key: jax.Array | None, data: int) -> jax.Array | None:
  """`jax.random.fold_in(key, data)`, None for no key (deterministic quantizers)."""
  return None if key is None else jax.random.fold_in(key, data)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """Inverse RoPE frequencies [hd/2] (FP32), with Llama 3 scaling when configured.

  Follows Hugging Face `_compute_default_rope_parameters` / `_compute_llama3_parameters`.
  """
  hd = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
  if cfg.rope_llama3_scaling is not None:
    factor, low_ff, high_ff, orig_len = cfg.rope_llama3_scaling
    low_freq_wavelen = orig_len / low_ff
    high_freq_wavelen = orig_len / high_ff
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (orig_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    inv_freq = np.where(medium, smoothed, scaled)
  return inv_freq.astype(np.float32)


def apply_rope(x_BTNH: jax.Array, positions_BT: jax.Array, inv_freq: np.ndarray) -> jax.Array:
  """Rotary embedding, Hugging Face `rotate_half` convention (halves, not interleaved pairs)."""
  freqs_BTh = positions_BT[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
  angles_BTH = jnp.concatenate([freqs_BTh, freqs_BTh], axis=-1)[:, :, None, :]
  x = x_BTNH.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  out = x * jnp.cos(angles_BTH) + rotated * jnp.sin(angles_BTH)
  return out.astype(x_BTNH.dtype)


class RMSNorm(nn.Module):
  """Llama/Qwen RMSNorm, computed in FP32, returned in the input dtype."""

  eps: float
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def qdot(module: nn.Module, x: jax.Array, w: jax.Array, contract_w: int,
          policy: PrecisionPolicy, layer: int | None, path: str, quant_key: jax.Array | None,
          act_amax: ActAmax | None, record_name: str, rhs_amax: jax.Array | None = None,
          prequantized: bool = False) -> jax.Array:
  """x[..., in] . w over x's last axis and w's axis `contract_w`, through the policy's quantizer.

  A matmul whose activation scale spans the whole tensor takes its amax from `act_amax` (static,
  calibrated; keyed by `path`, the layer's own paths) when given, else from the data. Under a
  calibration apply (`CALIB` mutable) the per-token max |x| is recorded in `module`'s scope as
  `record_name`. `rhs_amax`: the weight's static per-tensor amax (its fused group's,
  `fused_scales`), or None. `prequantized`: `w` already went through its (deterministic) weight
  quantizer, which is skipped (as `sampling.weights.prequantized_policy` drops it). Returns FP32.
  """
  cfg = policy.qdot_config(layout.matmul_path(layer, path))
  if prequantized and cfg.rhs is not None:
    cfg = dataclasses.replace(cfg, rhs=None)
  if module.is_mutable_collection(CALIB):
    module.sow(CALIB, record_name, jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1))
  lhs_amax = None
  if act_amax is not None and activation_scaling(cfg) == "tensor":
    lhs_amax = act_amax[path]  # completeness checked in Transformer
  dims = (((x.ndim - 1,), (contract_w,)), ((), ()))
  return quantized_dot_general(x, w, dims, cfg, key=fold(quant_key, _PATH_IDS[path]),
                               preferred_element_type=jnp.float32, lhs_amax=lhs_amax,
                               rhs_amax=rhs_amax)


class QDense(nn.Module):
  """Linear layer `x @ kernel (+ bias)`, kernel [in, out], quantized as the policy says.

  Returns `out_dtype` (default: the policy's compute dtype).
  """

  features: int
  matmul: str  # the policy's path: "attn/q_proj", ..., "lm_head"
  layer: int | None
  policy: PrecisionPolicy
  use_bias: bool = False
  param_dtype: Any = jnp.float32
  out_dtype: Any = None

  @nn.compact
  def __call__(self, x: jax.Array, quant_key: jax.Array | None,
               act_amax: ActAmax | None = None, rhs_amax: jax.Array | None = None) -> jax.Array:
    packed = self._packed_kernel()
    if packed is not None:
      kernel = packed.dequantize()
    else:  # Initializers here only give shapes: `init_params` draws the values.
      kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features),
                          self.param_dtype)
    y = qdot(self, x, kernel, 0, self.policy, self.layer, self.matmul, quant_key, act_amax,
              "amax", rhs_amax, prequantized=packed is not None)
    if self.use_bias:
      bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
      y = y + bias.astype(jnp.float32)
    if self.has_variable("params", lora.A):  # a LoRA adapter next to the kernel (models/lora.py)
      if self.policy.adapter is None:
        raise ValueError(f"{layout.matmul_path(self.layer, self.matmul)} has LoRA adapters but "
                         "the policy has no adapter precision; use lora.adapter_policy(policy, "
                         "lora_cfg).")
      y = y + lora.adapter_delta(x, self.get_variable("params", lora.A),
                                 self.get_variable("params", lora.B), self.policy.adapter)
    return y.astype(self.out_dtype or self.policy.dtype)

  def _packed_kernel(self) -> PackedWeight | None:
    """The kernel when it is held packed (a LoRA run's packed base, lowrl.training.lora_update),
    else None. It is dequantized here, inside the layer, so a program holds one layer's FP32
    kernels at a time (a dequantized tree would be an FP32 copy of the base); its weight
    quantizer already ran (fake_quant(W) == dequantize(quantize(W)) bit for bit) and is skipped,
    which is what `sampling.weights.prequantized_policy` does for the sampler's dequantized tree:
    one forward on both sides."""
    if not self.has_variable("params", "kernel"):
      return None
    kernel = self.get_variable("params", "kernel")
    return kernel if isinstance(kernel, PackedWeight) else None


def _fused_amax(module: nn.Module, policy: PrecisionPolicy, layer: int, scope: str
                ) -> dict[str, jax.Array]:
  """The shared weight amaxes (`fused_scales.weight_amax`) of `module`'s fused kernels, read from
  its bound params (`scope`: "attn" or "mlp"); {} while initializing (no values yet)."""
  groups = [g for g in fused_scales.shared_groups(policy, layer) if g[0].startswith(scope + "/")]
  if module.is_initializing() or not groups:
    return {}
  if any(isinstance(x, PackedWeight) for x in jax.tree.leaves(
      module.variables["params"], is_leaf=lambda x: isinstance(x, PackedWeight))):
    return {}  # packed kernels went through their quantizer (and its shared amax) at packing
  out = {}
  for g in groups:
    amax = fused_scales.joint_amax(
        fused_scales.layer_kernels({scope: module.variables["params"]}, g), g)
    out.update({p: amax for p in g})
  return out


class Embedder(nn.Module):
  """Token embedding table [V, D]; also the LM head when embeddings are tied."""

  cfg: ModelConfig
  param_dtype: Any = jnp.float32

  def setup(self):
    self.embedding = self.param("embedding", nn.initializers.normal(self.cfg.d_model ** -0.5),
                                (self.cfg.vocab_size, self.cfg.d_model), self.param_dtype)

  def __call__(self, tokens_BT: jax.Array, dtype) -> jax.Array:
    # Under a row context the table's D is gathered (as FSDP gathers every weight), so each
    # device looks up only its own rows' tokens.
    table_VD = constrain_unsplit(self.embedding, axis=1)
    return jnp.take(table_VD, tokens_BT, axis=0).astype(dtype)


def attend(q_BTKGH: jax.Array, keys_BSKH: jax.Array, values_BSKH: jax.Array,
           q_col_T: jax.Array, key_mask_BS: jax.Array, dtype) -> jax.Array:
  """Grouped-query softmax attention of T query rows over S key columns; FP32 [B, T, K, G, hd].

  The query in column q_col_T[t] sees key columns <= it whose key_mask is set (causal over
  columns). An integer key_mask holds segment ids (packed rows: 0 = padding, sequences 1, 2,
  ...): a query then sees only keys of its own column's segment. Scores and softmax in FP32 (one
  [B, K, G, T, S] tensor), the products in `dtype`.
  """
  hd = q_BTKGH.shape[-1]
  k_col_S = jnp.arange(keys_BSKH.shape[1])
  allowed_BTS = k_col_S[None, None, :] <= q_col_T[None, :, None]
  if jnp.issubdtype(key_mask_BS.dtype, jnp.integer):
    q_seg_BT = jnp.take(key_mask_BS, jnp.clip(q_col_T, 0, key_mask_BS.shape[1] - 1), axis=1)
    allowed_BTS = allowed_BTS & ((key_mask_BS[:, None, :] == q_seg_BT[:, :, None])
                                 & (key_mask_BS > 0)[:, None, :])
  else:
    allowed_BTS = allowed_BTS & key_mask_BS[:, None, :]
  scores_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, keys_BSKH.astype(dtype),
                            preferred_element_type=jnp.float32) * (hd ** -0.5)
  scores_BKGTS = jnp.where(allowed_BTS[:, None, None], scores_BKGTS, NEG_INF)
  probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1)
  return jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS.astype(dtype),
                    values_BSKH.astype(dtype), preferred_element_type=jnp.float32)


def attend_chunked(q_BTKGH: jax.Array, keys_BSKH: jax.Array, values_BSKH: jax.Array,
                   q_col_T: jax.Array, key_mask_BS: jax.Array, dtype, chunk: int) -> jax.Array:
  """`attend` over query chunks of `chunk` rows: at most one FP32 [B, K, G, chunk, S] score
  tensor is live, forward and backward (each chunk is rematerialised in the backward).

  Every query row still takes its softmax over all of its keys in one piece, so each output row
  is computed by the same operations as in `attend`: equal up to how XLA blocks the score and
  value contractions for the chunk's shapes (tests/models/test_logprobs.py states the bound).
  """
  batch, steps = q_BTKGH.shape[:2]
  chunk = min(chunk, steps)
  n = -(-steps // chunk)
  pad = n * chunk - steps
  # Padded query rows (column -1: they see no key) produce finite garbage, sliced off below.
  q_BTKGH = jnp.pad(q_BTKGH, ((0, 0), (0, pad)) + ((0, 0),) * 3)
  q_col_T = jnp.pad(q_col_T, (0, pad), constant_values=-1)
  q_NBCKGH = jnp.moveaxis(q_BTKGH.reshape(batch, n, chunk, *q_BTKGH.shape[2:]), 1, 0)

  @functools.partial(jax.checkpoint, prevent_cse=False)
  def one_chunk(_, xs):
    q_BCKGH, col_C = xs
    return None, attend(q_BCKGH, keys_BSKH, values_BSKH, col_C, key_mask_BS, dtype)

  _, out_NBCKGH = jax.lax.scan(one_chunk, None, (q_NBCKGH, q_col_T.reshape(n, chunk)))
  out_BTKGH = jnp.moveaxis(out_NBCKGH, 0, 1).reshape(batch, n * chunk, *out_NBCKGH.shape[3:])
  return out_BTKGH[:, :steps]


class Attention(nn.Module):
  """Grouped-query causal self-attention with optional QK-norm, qkv bias and KV cache."""

  cfg: ModelConfig
  layer: int
  policy: PrecisionPolicy
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BTD, positions_BT, cache_layer, cache_index, key_mask_BS, quant_key,
               act_amax):
    cfg, dtype = self.cfg, self.policy.dtype
    batch, steps = x_BTD.shape[:2]
    h, k, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    dense = functools.partial(QDense, layer=self.layer, policy=self.policy,
                              param_dtype=self.param_dtype)
    w_amax = _fused_amax(self, self.policy, self.layer, "attn")
    q_BTNH = dense(h * hd, "attn/q_proj", use_bias=cfg.qkv_bias, name="q_proj")(
        x_BTD, quant_key, act_amax, w_amax.get("attn/q_proj")).reshape(batch, steps, h, hd)
    k_BTKH = dense(k * hd, "attn/k_proj", use_bias=cfg.qkv_bias, name="k_proj")(
        x_BTD, quant_key, act_amax, w_amax.get("attn/k_proj")).reshape(batch, steps, k, hd)
    v_BTKH = dense(k * hd, "attn/v_proj", use_bias=cfg.qkv_bias, name="v_proj")(
        x_BTD, quant_key, act_amax, w_amax.get("attn/v_proj")).reshape(batch, steps, k, hd)
    if cfg.qk_norm:
      q_BTNH = RMSNorm(cfg.rms_eps, self.param_dtype, name="q_norm")(q_BTNH)
      k_BTKH = RMSNorm(cfg.rms_eps, self.param_dtype, name="k_norm")(k_BTKH)
    inv_freq = rope_inv_freq(cfg)
    q_BTNH = apply_rope(q_BTNH, positions_BT, inv_freq)
    k_BTKH = apply_rope(k_BTKH, positions_BT, inv_freq)
    if self.is_mutable_collection(CALIB):  # static K/V scales (lowrl.models.kv_cache)
      self.sow(CALIB, "k_cache", kv_cache.record_amax(k_BTKH))
      self.sow(CALIB, "v_cache", kv_cache.record_amax(v_BTKH))
    k_BTKH, v_BTKH = kv_cache.quantize_kv(k_BTKH, v_BTKH, self.policy.kv_cache, act_amax)

    if cache_layer is None:
      keys_BSKH, values_BSKH, new_cache = k_BTKH, v_BTKH, None
    elif "layer" in cache_layer:  # stacked [L, B, S, K, hd] cache of a scanned forward
      li = cache_layer["layer"]
      start = (li, 0, cache_index, 0, 0)
      k_LBSKH = jax.lax.dynamic_update_slice(cache_layer["k"], k_BTKH.astype(dtype)[None], start)
      v_LBSKH = jax.lax.dynamic_update_slice(cache_layer["v"], v_BTKH.astype(dtype)[None], start)
      keys_BSKH, values_BSKH = k_LBSKH[li], v_LBSKH[li]
      new_cache = {"k": k_LBSKH, "v": v_LBSKH, "layer": li}
    else:
      start = (0, cache_index, 0, 0)
      keys_BSKH = jax.lax.dynamic_update_slice(cache_layer["k"], k_BTKH.astype(dtype), start)
      values_BSKH = jax.lax.dynamic_update_slice(cache_layer["v"], v_BTKH.astype(dtype), start)
      new_cache = {"k": keys_BSKH, "v": values_BSKH}

    g = h // k  # query heads per kv head; HF repeat_kv order: head n = kv * g + j.
    q_BTKGH = q_BTNH.reshape(batch, steps, k, g, hd)
    q_col_T = cache_index + jnp.arange(steps)
    if cfg.attention == "chunked":
      out_BTKGH = attend_chunked(q_BTKGH, keys_BSKH, values_BSKH, q_col_T, key_mask_BS, dtype,
                                 cfg.attention_chunk)
    else:
      out_BTKGH = attend(q_BTKGH, keys_BSKH, values_BSKH, q_col_T, key_mask_BS, dtype)
    out_BTF = out_BTKGH.astype(dtype).reshape(batch, steps, h * hd)
    y_BTD = dense(cfg.d_model, "attn/o_proj", name="o_proj")(out_BTF, quant_key, act_amax)
    return y_BTD, new_cache


class Mlp(nn.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  cfg: ModelConfig
  layer: int
  policy: PrecisionPolicy
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BTD, quant_key, act_amax):
    dense = functools.partial(QDense, layer=self.layer, policy=self.policy,
                              param_dtype=self.param_dtype)
    w_amax = _fused_amax(self, self.policy, self.layer, "mlp")
    gate_BTF = dense(self.cfg.d_ff, "mlp/gate_proj", name="gate_proj")(
        x_BTD, quant_key, act_amax, w_amax.get("mlp/gate_proj"))
    up_BTF = dense(self.cfg.d_ff, "mlp/up_proj", name="up_proj")(
        x_BTD, quant_key, act_amax, w_amax.get("mlp/up_proj"))
    # SiLU in FP32: its output feeds a (possibly quantized) GEMM, round once.
    h_BTF = (jax.nn.silu(gate_BTF.astype(jnp.float32)) * up_BTF.astype(jnp.float32))
    return dense(self.cfg.d_model, "mlp/down_proj", name="down_proj")(
        h_BTF.astype(self.policy.dtype), quant_key, act_amax)


class Block(nn.Module):
  """Pre-norm decoder block.

  `layer` (static) selects the precision policy's configs; `layer_key` is the quant key already
  folded with the layer index (a traced index under scan); `act_amax` holds this layer's static
  amaxes keyed by block path ("attn/q_proj", ...), or None.
  """

  cfg: ModelConfig
  layer: int
  policy: PrecisionPolicy
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BTD, positions_BT, cache_layer, cache_index, key_mask_BS, layer_key,
               act_amax):
    kw = dict(cfg=self.cfg, layer=self.layer, policy=self.policy, param_dtype=self.param_dtype)
    h = RMSNorm(self.cfg.rms_eps, self.param_dtype, name="attn_norm")(x_BTD)
    attn_BTD, new_cache = Attention(**kw, name="attn")(
        h, positions_BT, cache_layer, cache_index, key_mask_BS, layer_key, act_amax)
    x_BTD = x_BTD + attn_BTD
    h = RMSNorm(self.cfg.rms_eps, self.param_dtype, name="mlp_norm")(x_BTD)
    mlp = functools.partial(moe.MoeMlp, dense=QDense) if self.cfg.is_moe else Mlp
    x_BTD = x_BTD + mlp(**kw, name="mlp")(h, layer_key, act_amax)
    return x_BTD, new_cache
