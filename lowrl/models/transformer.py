"""Llama/Qwen-family decoder: Flax description plus pure functions over a params pytree.

`params` (the tree in ARCHITECTURE.md) is the only state. The Flax modules describe the
computation; callers use the pure functions `init_params`, `forward`, `forward_with_cache`,
`token_logprobs`, `token_logprobs_and_entropy` and `init_cache`, all jittable with `model_cfg` and
`policy` static, and `param_shapes` (the tree's ShapeDtypeStructs, for sharding and restoring).

Execution knobs (ModelConfig: scan_layers, remat, attention, logprob_chunk) change how the
forward runs, not the param tree; see ModelConfig.

Precision: every linear layer goes through `quantized_dot_general` with the QDotConfig the policy
gives for its (layer, path). Everything else runs in `policy.compute_dtype`, except RMSNorm,
RoPE and softmax (FP32), and the logits and log-softmax (always FP32).

Per-tensor activation scales: a matmul whose activation quantizer takes one scale over the whole
tensor (`precision.activation_scaling(cfg) == "tensor"`) uses the amax of its [B, T, D] input by
default (the trainer's current scaling: non-causal, batch-dependent) or, given `act_amax`, a
static calibrated amax per matmul (`calibrate_act_amax`), which makes it causal and row-local.

Masks and positions: `mask_BT` marks real tokens (1) and padding (0). Padding never serves as a
key; padded query rows produce finite garbage that callers mask out. Positions default to
`cumsum(mask) - 1`, so left-padded rows start at position 0 like unpadded ones.

KV cache: `{'index': int32 scalar, 'mask': [B, S] bool, 'layers': ({'k', 'v'}: [B, S, K, hd], ...)}`
in compute_dtype; with `model_cfg.scan_layers`, `'layers': {'k', 'v'}: [L, B, S, K, hd]` (one
stacked pair the layer scans index into and update in place). A call with T new tokens writes columns [index, index + T) for every row; a
query in column c attends to keys in columns <= c whose mask is set. Rows therefore share
columns, not positions: left-pad prompts so that every row's next token lands in the same column.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

from flax import traverse_util
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lowrl.models import fused_scales, init, kv_cache, layout, moe
from lowrl.models.config import ModelConfig
from lowrl.models.layout import BLOCK_MATMULS, LM_HEAD
from lowrl.models.row_sharding import constrain_rows, constrain_unsplit
from lowrl.precision import PrecisionPolicy, activation_scaling
from lowrl.quant.config import QDotConfig
from lowrl.quant.qdot import quantized_dot_general

Params = Any
Cache = dict[str, Any]
# Static activation amaxes: full matmul path ("layers_0/attn/q_proj", "lm_head") -> FP32 scalar;
# a quantized KV cache's "layers_0/attn/k_cache" / "v_cache" -> FP32 [n_kv_heads] (kv_cache.py).
ActAmax = Mapping[str, jax.Array]
# Flax collection the calibration forward records per-token activation amaxes in.
_CALIB = "act_amax"

# Masked attention scores: finite so that a fully masked (padding) query row gives a uniform,
# finite softmax instead of NaN.
_NEG_INF = -1e30
# Quant-key streams: fold_in(key, layer) then fold_in(., path id); the LM head uses layer n_layers.
_PATH_IDS = layout.PATH_IDS


def _fold(key: jax.Array | None, data: int) -> jax.Array | None:
  return None if key is None else jax.random.fold_in(key, data)


# ----------------------------------------------------------------------------------------------
# Building blocks.


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


def _qdot(module: nn.Module, x: jax.Array, w: jax.Array, contract_w: int,
          policy: PrecisionPolicy, layer: int | None, path: str, quant_key: jax.Array | None,
          act_amax: ActAmax | None, record_name: str, rhs_amax: jax.Array | None = None
          ) -> jax.Array:
  """x[..., in] . w over x's last axis and w's axis `contract_w`, through the policy's quantizer.

  A matmul whose activation scale spans the whole tensor takes its amax from `act_amax` (static,
  calibrated; keyed by `path`, the layer's own paths) when given, else from the data. Under a
  calibration apply (`_CALIB` mutable) the per-token max |x| is recorded in `module`'s scope as
  `record_name`. `rhs_amax`: the weight's static per-tensor amax (its fused group's,
  `fused_scales`), or None. Returns FP32.
  """
  cfg = policy.qdot_config(layout.matmul_path(layer, path))
  if module.is_mutable_collection(_CALIB):
    module.sow(_CALIB, record_name, jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1))
  lhs_amax = None
  if act_amax is not None and activation_scaling(cfg) == "tensor":
    lhs_amax = act_amax[path]  # completeness checked in Transformer
  dims = (((x.ndim - 1,), (contract_w,)), ((), ()))
  return quantized_dot_general(x, w, dims, cfg, key=_fold(quant_key, _PATH_IDS[path]),
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
    # Initializers here only give shapes: `init_params` draws the values.
    kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features),
                        self.param_dtype)
    y = _qdot(self, x, kernel, 0, self.policy, self.layer, self.matmul, quant_key, act_amax,
              "amax", rhs_amax)
    if self.use_bias:
      bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
      y = y + bias.astype(jnp.float32)
    return y.astype(self.out_dtype or self.policy.dtype)


def _fused_amax(module: nn.Module, policy: PrecisionPolicy, layer: int, scope: str
                ) -> dict[str, jax.Array]:
  """The shared weight amaxes (`fused_scales.weight_amax`) of `module`'s fused kernels, read from
  its bound params (`scope`: "attn" or "mlp"); {} while initializing (no values yet)."""
  groups = [g for g in fused_scales.shared_groups(policy, layer) if g[0].startswith(scope + "/")]
  if module.is_initializing() or not groups:
    return {}
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
  columns). Scores and softmax in FP32 (one [B, K, G, T, S] tensor), the products in `dtype`.
  """
  hd = q_BTKGH.shape[-1]
  k_col_S = jnp.arange(keys_BSKH.shape[1])
  allowed_BTS = (k_col_S[None, None, :] <= q_col_T[None, :, None]) & key_mask_BS[:, None, :]
  scores_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, keys_BSKH.astype(dtype),
                            preferred_element_type=jnp.float32) * (hd ** -0.5)
  scores_BKGTS = jnp.where(allowed_BTS[:, None, None], scores_BKGTS, _NEG_INF)
  probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1)
  return jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS.astype(dtype),
                    values_BSKH.astype(dtype), preferred_element_type=jnp.float32)


def attend_chunked(q_BTKGH: jax.Array, keys_BSKH: jax.Array, values_BSKH: jax.Array,
                   q_col_T: jax.Array, key_mask_BS: jax.Array, dtype, chunk: int) -> jax.Array:
  """`attend` over query chunks of `chunk` rows: at most one FP32 [B, K, G, chunk, S] score
  tensor is live, forward and backward (each chunk is rematerialised in the backward).

  Every query row still takes its softmax over all of its keys in one piece, so each output row
  is computed by the same operations as in `attend`: equal up to how XLA blocks the score and
  value contractions for the chunk's shapes (tests/models/test_model_chunked.py states the bound).
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
    if self.is_mutable_collection(_CALIB):  # static K/V scales (lowrl.models.kv_cache)
      self.sow(_CALIB, "k_cache", kv_cache.record_amax(k_BTKH))
      self.sow(_CALIB, "v_cache", kv_cache.record_amax(v_BTKH))
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


def _remat_policy(model_cfg: ModelConfig):
  """The jax.checkpoint policy of `model_cfg.remat` ("full": save nothing but the layer input)."""
  return {"full": None,
          "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}[model_cfg.remat]


def _block_signature(policy: PrecisionPolicy, layer: int, paths: tuple[str, ...]) -> tuple:
  return tuple(policy.qdot_config(layout.matmul_path(layer, p)) for p in paths)


def layer_groups(model_cfg: ModelConfig, policy: PrecisionPolicy) -> tuple[tuple[int, int], ...]:
  """[start, stop) runs of consecutive layers whose matmuls all get identical QDotConfigs: the
  layers one scan can cover (e.g. the quantized prefix and the BF16 suffix of nvfp4_recipe)."""
  groups, start = [], 0
  for i in range(1, model_cfg.n_layers + 1):
    paths = layout.block_paths(model_cfg)
    if (i == model_cfg.n_layers
        or _block_signature(policy, i, paths) != _block_signature(policy, start, paths)):
      groups.append((start, i))
      start = i
  return tuple(groups)


def _tensor_scaled_paths(policy: PrecisionPolicy, layer: int) -> tuple[str, ...]:
  """Block paths of layer `layer`'s static amaxes: tensor-scaled matmuls, quantized K/V cache."""
  return tuple(p for p in BLOCK_MATMULS
               if activation_scaling(policy.qdot_config(layout.matmul_path(layer, p))) == "tensor"
               ) + kv_cache.block_kv_paths(policy.kv_cache)


def _layer_amax(policy: PrecisionPolicy, layer: int,
                act_amax: ActAmax | None) -> dict[str, jax.Array] | None:
  """Layer `layer`'s static amaxes keyed by block path (what `Block` reads)."""
  if act_amax is None:
    return None
  return {p: act_amax[layout.matmul_path(layer, p)] for p in _tensor_scaled_paths(policy, layer)}


class Transformer(nn.Module):
  """The decoder. __call__ returns (FP32 logits [B, T or 1, V], updated cache or None); with
  head=False the FP32 final-norm output [B, T or 1, D] instead of the logits."""

  cfg: ModelConfig
  policy: PrecisionPolicy
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, tokens_BT, positions_BT, mask_BT, cache=None, quant_key=None,
               last_only=False, act_amax=None, head=True):
    cfg, dtype = self.cfg, self.policy.dtype
    check_act_amax(self.policy, cfg, act_amax)
    embed = Embedder(cfg, self.param_dtype, name="embed")
    x_BTD = constrain_rows(embed(tokens_BT, dtype))

    if cache is None:
      cache_index, key_mask_BS = 0, mask_BT
    else:
      cache_index = cache["index"]
      key_mask_BS = jax.lax.dynamic_update_slice(cache["mask"], mask_BT, (0, cache_index))
    layer_args = (positions_BT, cache_index, key_mask_BS)
    if cfg.scan_layers and not self.is_initializing():
      x_BTD, new_layers = self._scanned_layers(x_BTD, layer_args, cache, quant_key, act_amax)
    else:
      block = Block if cfg.remat == "none" else nn.remat(Block, policy=_remat_policy(cfg))
      new_layers = []
      for i in range(cfg.n_layers):
        cache_layer = None if cache is None else cache["layers"][i]
        x_BTD, new_layer = block(cfg, i, self.policy, self.param_dtype, name=f"layers_{i}")(
            x_BTD, positions_BT, cache_layer, cache_index, key_mask_BS, _fold(quant_key, i),
            _layer_amax(self.policy, i, act_amax))
        x_BTD = constrain_rows(x_BTD)
        new_layers.append(new_layer)
      new_layers = tuple(new_layers)

    if last_only:
      x_BTD = x_BTD[:, -1:]
    # The head's input stays FP32 (the norm computes in FP32): an FP32 head, not a BF16 one.
    h_BTD = RMSNorm(cfg.rms_eps, self.param_dtype, name="final_norm")(x_BTD.astype(jnp.float32))
    new_cache = None if cache is None else {
        "index": cache_index + tokens_BT.shape[1], "mask": key_mask_BS, "layers": new_layers}
    if not head and not self.is_initializing():
      return h_BTD, new_cache
    head_key = _fold(quant_key, cfg.n_layers)
    if cfg.tie_embeddings:
      logits_BTV = _qdot(self, h_BTD, embed.embedding, 1, self.policy, None, LM_HEAD, head_key,
                         act_amax, LM_HEAD)
    else:
      logits_BTV = QDense(cfg.vocab_size, LM_HEAD, None, self.policy, param_dtype=self.param_dtype,
                          out_dtype=jnp.float32, name="lm_head")(h_BTD, head_key, act_amax)
    return logits_BTV.astype(jnp.float32), new_cache

  def _scanned_layers(self, x_BTD, layer_args, cache, quant_key, act_amax):
    """The blocks as one `lax.scan` per `layer_groups` run, over the run's params stacked here.

    Each step folds the quant key with its (scanned) layer index, as the unrolled loop does, and
    reads/writes its slice of the stacked [L, B, S, K, hd] cache. Under a calibration apply the
    recorded amaxes come out of the scans stacked and are put back per layer.
    """
    cfg, policy = self.cfg, self.policy
    params = self.variables["params"]
    calibrating = self.is_mutable_collection(_CALIB)
    # Routing record/replay of MoE blocks (lowrl.models.routing): replayed ids enter the scan as
    # per-layer inputs, recorded ones leave it stacked, both per layer like the amaxes.
    replay = self.variables.get(moe.REPLAY)
    mutable = [c for c, on in ((_CALIB, calibrating),
                               (moe.ROUTING, self.is_mutable_collection(moe.ROUTING))) if on]
    cache_kv = None if cache is None else dict(cache["layers"])
    for start, stop in layer_groups(cfg, policy):
      stack = lambda trees: jax.tree.map(lambda *a: jnp.stack(a), *trees)  # noqa: E731
      layer_params = stack([params[layout.layer_key(i)] for i in range(start, stop)])
      amax = None if act_amax is None else stack(
          [_layer_amax(policy, i, act_amax) for i in range(start, stop)])
      replay_ids = None if replay is None else stack(
          [replay[layout.layer_key(i)] for i in range(start, stop)])
      block = Block(cfg, start, policy, self.param_dtype, parent=None)

      def body(carry, xs, block=block):
        x_BTD, kv = carry
        p, index, amax_layer, replay_layer = xs
        cache_layer = None if kv is None else {**kv, "layer": index}
        variables = {"params": p} if replay_layer is None else {"params": p,
                                                                moe.REPLAY: replay_layer}
        out = block.apply(variables, x_BTD, *layer_args[:1], cache_layer, *layer_args[1:],
                          _fold(quant_key, index), amax_layer, mutable=mutable or False)
        (x_BTD, new_cache), recorded = out if mutable else (out, {})
        x_BTD = constrain_rows(x_BTD)
        kv = None if new_cache is None else {"k": new_cache["k"], "v": new_cache["v"]}
        return (x_BTD, kv), {c: recorded.get(c, {}) for c in mutable}

      if cfg.remat != "none":
        body = jax.checkpoint(body, policy=_remat_policy(cfg), prevent_cse=False)
      xs = (layer_params, jnp.arange(start, stop, dtype=jnp.int32), amax, replay_ids)
      (x_BTD, cache_kv), recorded = jax.lax.scan(body, (x_BTD, cache_kv), xs)
      for c in mutable:
        for j, i in enumerate(range(start, stop)):
          self.put_variable(c, layout.layer_key(i), jax.tree.map(lambda a: a[j], recorded[c]))
    return x_BTD, cache_kv


# ----------------------------------------------------------------------------------------------
# Pure functions.


def init_params(model_cfg: ModelConfig, rng: jax.Array, param_dtype=jnp.float32, *,
                method: str = "auto") -> Params:
  """A fresh parameter tree (ARCHITECTURE.md layout), deterministic in `rng`.

  Kernels ~ N(0, 1/fan_in), embedding ~ N(0, 1/D) (so tied logits start with unit scale), norm
  scales 1, biases 0. `method`: how the draw is compiled (lowrl/models/init.py): "auto" (the
  fused program up to init.FUSED_MAX_PARAMS parameters, the split one above), "fused", "split".
  """
  return init.init_from_shapes(_module_shapes(model_cfg, jnp.dtype(param_dtype)), rng,
                               param_dtype, method=method)


@functools.lru_cache(maxsize=None)
def param_shapes(model_cfg: ModelConfig, param_dtype=jnp.float32) -> Params:
  """ShapeDtypeStructs of `init_params`'s tree (nothing is allocated): the tree to lay out,
  shard or restore into without building the model's values."""
  return jax.eval_shape(lambda: init_params(model_cfg, jax.random.key(0), param_dtype))


@functools.lru_cache(maxsize=16)
def _module_shapes(model_cfg: ModelConfig, param_dtype) -> Params:
  module = Transformer(model_cfg, PrecisionPolicy.unquantized(layout.matmuls(model_cfg)),
                       param_dtype)
  tokens = jnp.zeros((1, 1), jnp.int32)
  return jax.eval_shape(
      lambda: module.init(jax.random.key(0), tokens, tokens, jnp.ones((1, 1), bool))["params"])


def positions_from_mask(mask_BT: jax.Array) -> jax.Array:
  """0, 1, 2, ... over the real tokens of each row (padding gets its neighbour's position)."""
  return jnp.maximum(jnp.cumsum(mask_BT.astype(jnp.int32), axis=-1) - 1, 0)


def _inputs(tokens_BT, mask_BT, positions_BT):
  if mask_BT is None:
    mask_BT = jnp.ones(tokens_BT.shape, bool)
  mask_BT = mask_BT.astype(bool)
  if positions_BT is None:
    positions_BT = positions_from_mask(mask_BT)
  return mask_BT, positions_BT


def _check_key(policy: PrecisionPolicy, quant_key) -> None:
  if policy.needs_key and quant_key is None:
    raise ValueError(f"Precision policy {policy.name!r} rounds stochastically: pass "
                     "quant_key=jax.random.key(...) (the same key in sampler and trainer for "
                     "identical quantization), or set precision.stochastic_rounding=none.")


def check_act_amax(policy: PrecisionPolicy, model_cfg: ModelConfig,
                   act_amax: ActAmax | None) -> None:
  """Raises ValueError unless `act_amax` is None or holds every tensor-scaled activation path
  (and the static K/V amaxes of a quantized KV cache)."""
  if act_amax is None:
    return
  missing = [p for p in policy.act_paths(layout.matmuls(model_cfg), "tensor")
             + kv_cache.kv_paths(policy.kv_cache, model_cfg.n_layers) if p not in act_amax]
  if missing:
    raise ValueError(f"act_amax lacks the static activation amax of {missing} (policy "
                     f"{policy.name!r} scales them per tensor or quantizes its KV cache); "
                     "calibrate them with transformer.calibrate_act_amax(..., paths="
                     "act_scales.calibration_paths(policy, model_cfg)).")


def calibrate_act_amax(params: Params, tokens_BT: jax.Array, model_cfg: ModelConfig,
                       policy: PrecisionPolicy, paths: tuple[str, ...], *,
                       mask_BT: jax.Array | None = None, positions_BT: jax.Array | None = None,
                       quant_key: jax.Array | None = None) -> dict[str, jax.Array]:
  """Static activation amaxes: {path: max |input| of that matmul over the real tokens} (FP32).

  One full forward of a calibration batch under `policy` (the trainer's precision: an inference
  engine's calibration pass on the rollout weights); padding positions (mask 0) are excluded, as
  their activations are garbage. `paths` are full matmul paths, e.g. a sampler policy's
  `act_paths(layout.matmuls(model_cfg), "tensor")`, and "layers_{i}/attn/k_cache" / "v_cache":
  max |K| (after RoPE) and |V| per kv head ([n_kv_heads]), read with an unquantized cache
  (lowrl.models.kv_cache). Jittable; no gradient.
  """
  _check_key(policy, quant_key)
  policy = dataclasses.replace(policy, kv_cache="none")  # K/V amaxes of the unquantized cache
  mask_BT, positions_BT = _inputs(tokens_BT, mask_BT, positions_BT)
  _, state = Transformer(model_cfg, policy).apply(
      {"params": jax.lax.stop_gradient(params)}, tokens_BT, positions_BT, mask_BT,
      quant_key=quant_key, mutable=[_CALIB])
  # Flattened names: ".../q_proj/amax" for a QDense, "lm_head" for a tied head.
  recorded = {k.removesuffix("/amax"): v[0] for k, v in
              traverse_util.flatten_dict(state[_CALIB], sep="/").items()}
  unknown = [p for p in paths if p not in recorded]
  if unknown:
    raise ValueError(f"calibrate_act_amax: no matmul {unknown}; paths are "
                     f"{sorted(recorded)}.")
  # Max over the real tokens ([B, T] of each record; K/V records keep their heads).
  real = lambda r: mask_BT.reshape(mask_BT.shape + (1,) * (r.ndim - 2))  # noqa: E731
  return {p: jnp.max(jnp.where(real(recorded[p]), recorded[p], 0.0), axis=(0, 1))
          for p in paths}


def forward(params: Params, tokens_BT: jax.Array, model_cfg: ModelConfig,
            policy: PrecisionPolicy, *, mask_BT: jax.Array | None = None,
            positions_BT: jax.Array | None = None,
            quant_key: jax.Array | None = None,
            act_amax: ActAmax | None = None) -> jax.Array:
  """FP32 logits [B, T, V]; logits[:, t] predicts token t + 1.

  Args:
    params: parameter tree.
    tokens_BT: int token ids.
    model_cfg, policy: static.
    mask_BT: 1 for real tokens, 0 for padding (default all ones).
    positions_BT: RoPE positions (default cumsum(mask) - 1).
    quant_key: PRNG key for stochastic-rounding quantizers (required iff policy.needs_key).
    act_amax: static amaxes of the tensor-scaled activations (`calibrate_act_amax`): the
      scales an inference engine uses, causal and independent of the other rows. None: each
      such scale is the amax of the whole [B, T, D] input (the trainer's current scaling).
  """
  _check_key(policy, quant_key)
  mask_BT, positions_BT = _inputs(tokens_BT, mask_BT, positions_BT)
  logits_BTV, _ = Transformer(model_cfg, policy).apply(
      {"params": params}, tokens_BT, positions_BT, mask_BT,
      quant_key=quant_key, act_amax=act_amax)
  return logits_BTV


def init_cache(model_cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> Cache:
  """An empty KV cache of `max_len` columns (use the policy's compute dtype); its 'layers' are
  stacked [L, B, S, K, hd] arrays when `model_cfg.scan_layers` (module docstring)."""
  if max_len > model_cfg.max_seq_len:
    raise ValueError(f"KV cache of {max_len} columns exceeds model_cfg.max_seq_len="
                     f"{model_cfg.max_seq_len}; shorten prompts/max_new_tokens or raise "
                     "max_seq_len.")
  shape = (batch, max_len, model_cfg.n_kv_heads, model_cfg.head_dim)
  if model_cfg.scan_layers:  # one stacked [L, B, S, K, hd] pair the layer scans index into
    shape = (model_cfg.n_layers,) + shape
    layers = {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
  else:
    layers = tuple({"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
                   for _ in range(model_cfg.n_layers))
  return {"index": jnp.zeros((), jnp.int32), "mask": jnp.zeros((batch, max_len), bool),
          "layers": layers}


def forward_with_cache(params: Params, tokens_BT: jax.Array, cache: Cache,
                       model_cfg: ModelConfig, policy: PrecisionPolicy, *,
                       mask_BT: jax.Array | None = None, positions_BT: jax.Array | None = None,
                       quant_key: jax.Array | None = None, last_only: bool = False,
                       act_amax: ActAmax | None = None) -> tuple[jax.Array, Cache]:
  """Appends T tokens to the cache (columns [index, index + T)) and returns their logits.

  `positions_BT` should be given for decode steps (each row's absolute position); the default
  `cumsum(mask) - 1` is only right for a prefill into an empty cache. `last_only` computes the LM
  head for the last column only ([B, 1, V]), which is all a prefill needs. `act_amax`: as in
  `forward`.
  """
  _check_key(policy, quant_key)
  mask_BT, positions_BT = _inputs(tokens_BT, mask_BT, positions_BT)
  return Transformer(model_cfg, policy).apply(
      {"params": params}, tokens_BT, positions_BT, mask_BT, cache=cache,
      quant_key=quant_key, last_only=last_only, act_amax=act_amax)


def _align(logp_BT: jax.Array, entropy_BT: jax.Array, tokens_BT: jax.Array,
           mask_BT: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """Predictions made at t - 1 ([B, T - 1]) moved to the predicted token t, 0 where invalid."""
  valid = jnp.ones(tokens_BT.shape, bool) if mask_BT is None else mask_BT.astype(bool)
  valid_BT = valid[:, 1:] & valid[:, :-1]
  pad = lambda x: jnp.pad(jnp.where(valid_BT, x, 0.0), ((0, 0), (1, 0)))  # noqa: E731
  return pad(logp_BT), pad(entropy_BT)


def _logz_and_entropy(logits_BTV: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(logsumexp, entropy) over the last axis, FP32."""
  logz_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
  logp_all = logits_BTV - logz_BT[..., None]
  return logz_BT, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)


def logprobs_from_logits(logits_BTV: jax.Array, tokens_BT: jax.Array,
                         mask_BT: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(logp_BT, entropy_BT) of next-token predictions, aligned with the predicted token.

  logp[:, t] = log p(tokens[:, t] | tokens[:, :t]) from logits[:, t - 1]; entropy[:, t] is the
  entropy of that same distribution. Both are 0 at t = 0 and wherever mask[:, t] or
  mask[:, t - 1] is 0 (no real context to predict from, or not a real token). FP32.
  """
  logits = logits_BTV[:, :-1].astype(jnp.float32)
  logz_BT, entropy_BT = _logz_and_entropy(logits)
  picked_BT = jnp.take_along_axis(logits, tokens_BT[:, 1:, None], axis=-1)[..., 0]
  return _align(picked_BT - logz_BT, entropy_BT, tokens_BT, mask_BT)


def _check_chunked_head(model_cfg: ModelConfig, policy: PrecisionPolicy) -> QDotConfig:
  """The LM head's QDotConfig, refused where V-chunks would not quantize like the whole head."""
  qcfg = policy.qdot_config(LM_HEAD)
  fix = "set model.logprob_chunk=0 or keep the LM head unquantized (precision.quantize_lm_head)"
  if any(q is not None and q.stochastic_rounding for q in (qcfg.lhs, qcfg.rhs, qcfg.grad)):
    raise ValueError("logprob_chunk: the LM head rounds stochastically, and a V-chunk draws "
                     f"other random bits than the whole head; {fix}.")
  if qcfg.backward == "quantized":
    raise ValueError("logprob_chunk: the LM head quantizes its gradient along V (the dgrad "
                     f"GEMM's contracting axis), which V-chunks would split; {fix}.")
  if qcfg.rhs is not None and qcfg.rhs.block_2d and model_cfg.logprob_chunk % qcfg.rhs.block:
    raise ValueError(f"logprob_chunk={model_cfg.logprob_chunk} must be a multiple of the LM "
                     f"head's {qcfg.rhs.block}x{qcfg.rhs.block} weight tiles; {fix}.")
  return qcfg


def _chunked_logz_entropy_picked(h_BTD: jax.Array, w: jax.Array, head: layout.Matmul,
                                 qcfg: QDotConfig, head_key: jax.Array | None,
                                 lhs_amax: jax.Array | None, target_BT: jax.Array,
                                 chunk: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(logsumexp, entropy, logit of target_BT) of the LM head's logits, V-chunk by V-chunk.

  Each chunk's logits are the head's own quantized dot on a slice of the weight (blocks run along
  D, so a V-slice quantizes as in the whole head; a per-tensor weight scale takes the whole
  weight's amax); chunk 0 starts the running (logz, entropy), and each further chunk c merges in
  with w = exp(logz - logz'): H' = sum_c w_c (H_c - log w_c). One chunk covering V runs exactly
  `_logz_and_entropy`'s operations. Chunks are rematerialised in the backward, so at most one
  FP32 [B, T, chunk] logits array is live.
  """
  vocab = head.out_features
  chunk = min(chunk, vocab)
  n = -(-vocab // chunk)
  pad = n * chunk - vocab
  rhs_amax = None
  if qcfg.rhs is not None and qcfg.rhs.kind != "mx" and not qcfg.rhs.per_token:
    rhs_amax = jax.lax.stop_gradient(jnp.max(jnp.abs(w)).astype(jnp.float32))
  if head.contract_axis == 0:  # [D, V] kernel -> [n, D, chunk]
    w_N = jnp.pad(w, ((0, 0), (0, pad))).reshape(w.shape[0], n, chunk).transpose(1, 0, 2)
  else:  # tied [V, D] embedding -> [n, chunk, D]
    w_N = jnp.pad(w, ((0, pad), (0, 0))).reshape(n, chunk, w.shape[1])
  dims = (((h_BTD.ndim - 1,), (head.contract_axis,)), ((), ()))
  key = _fold(head_key, _PATH_IDS[LM_HEAD])

  @functools.partial(jax.checkpoint, prevent_cse=False)
  def one_chunk(w_c, c):
    logits_BTC = quantized_dot_general(h_BTD, w_c, dims, qcfg, key=key,
                                       preferred_element_type=jnp.float32, lhs_amax=lhs_amax,
                                       rhs_amax=rhs_amax)
    logits_BTC = logits_BTC.astype(jnp.float32)
    if pad:  # columns past V: exp(-1e30 - logz) = 0, and no NaN in the entropy's gradient
      logits_BTC = jnp.where(c * chunk + jnp.arange(chunk) < vocab, logits_BTC, _NEG_INF)
    logz_BT, entropy_BT = _logz_and_entropy(logits_BTC)
    idx_BT = target_BT - c * chunk
    inside_BT = (idx_BT >= 0) & (idx_BT < chunk)
    picked_BT = jnp.take_along_axis(logits_BTC, jnp.clip(idx_BT, 0, chunk - 1)[..., None],
                                    axis=-1)[..., 0]
    return logz_BT, entropy_BT, jnp.where(inside_BT, picked_BT, 0.0)

  def merge(carry, xs):
    logz, entropy, picked = carry
    logz_c, entropy_c, picked_c = one_chunk(*xs)
    new_logz = jnp.logaddexp(logz, logz_c)
    log_w, log_wc = logz - new_logz, logz_c - new_logz
    entropy = jnp.exp(log_w) * (entropy - log_w) + jnp.exp(log_wc) * (entropy_c - log_wc)
    return (new_logz, entropy, picked + picked_c), None

  carry = one_chunk(w_N[0], 0)
  if n > 1:
    carry, _ = jax.lax.scan(merge, carry, (w_N[1:], jnp.arange(1, n)))
  return carry


def token_logprobs_and_entropy(params: Params, tokens_BT: jax.Array, model_cfg: ModelConfig,
                               policy: PrecisionPolicy, *, mask_BT: jax.Array | None = None,
                               positions_BT: jax.Array | None = None,
                               quant_key: jax.Array | None = None,
                               act_amax: ActAmax | None = None
                               ) -> tuple[jax.Array, jax.Array]:
  """(logp_BT, entropy_BT): see `logprobs_from_logits` for the alignment.

  With `model_cfg.logprob_chunk` > 0 the LM head and log-softmax run over V in chunks of that
  many columns (`_chunked_logz_entropy_picked`): no [B, T, V] FP32 array; the same numbers up to
  the online logsumexp's reassociation (tests/models/test_model_chunked.py states the bound).
  """
  if not model_cfg.logprob_chunk:
    logits_BTV = forward(params, tokens_BT, model_cfg, policy, mask_BT=mask_BT,
                         positions_BT=positions_BT, quant_key=quant_key, act_amax=act_amax)
    return logprobs_from_logits(logits_BTV, tokens_BT, mask_BT)
  qcfg = _check_chunked_head(model_cfg, policy)
  _check_key(policy, quant_key)
  mask_in, positions_in = _inputs(tokens_BT, mask_BT, positions_BT)
  h_BTD, _ = Transformer(model_cfg, policy).apply(
      {"params": params}, tokens_BT, positions_in, mask_in, quant_key=quant_key,
      act_amax=act_amax, head=False)
  head = layout.matmul(model_cfg, None, LM_HEAD)
  lhs_amax = None
  if act_amax is not None and activation_scaling(qcfg) == "tensor":
    lhs_amax = act_amax[LM_HEAD]
  # The head runs on every position (as `forward`'s does, so a per-tensor activation scale sees
  # the same tensor); the last position predicts nothing and is dropped.
  target_BT = jnp.pad(tokens_BT[:, 1:], ((0, 0), (0, 1)))
  logz_BT, entropy_BT, picked_BT = _chunked_logz_entropy_picked(
      h_BTD, layout.get_param(params, head.param_keys), head, qcfg,
      _fold(quant_key, model_cfg.n_layers), lhs_amax, target_BT, model_cfg.logprob_chunk)
  return _align((picked_BT - logz_BT)[:, :-1], entropy_BT[:, :-1], tokens_BT, mask_BT)


def token_logprobs(params: Params, tokens_BT: jax.Array, model_cfg: ModelConfig,
                   policy: PrecisionPolicy, *, mask_BT: jax.Array | None = None,
                   positions_BT: jax.Array | None = None,
                   quant_key: jax.Array | None = None,
                   act_amax: ActAmax | None = None) -> jax.Array:
  """logp_BT[:, t] = log p(tokens[:, t] | tokens[:, :t]) in FP32; 0 at t = 0 and on padding."""
  return token_logprobs_and_entropy(params, tokens_BT, model_cfg, policy, mask_BT=mask_BT,
                                    positions_BT=positions_BT, quant_key=quant_key,
                                    act_amax=act_amax)[0]
