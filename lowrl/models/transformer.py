"""Llama/Qwen-family decoder: Flax description plus pure functions over a params pytree.

`params` (the tree in ARCHITECTURE.md) is the only state. The Flax modules describe the
computation; callers use the pure functions `init_params`, `forward`, `forward_with_cache`,
`token_logprobs`, `token_logprobs_and_entropy` and `init_cache`, all jittable with `model_cfg` and
`policy` static, and `param_shapes` (the tree's ShapeDtypeStructs, for sharding and restoring).

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
in compute_dtype. A call with T new tokens writes columns [index, index + T) for every row; a
query in column c attends to keys in columns <= c whose mask is set. Rows therefore share
columns, not positions: left-pad prompts so that every row's next token lands in the same column.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping

from flax import traverse_util
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from lowrl.models import layout
from lowrl.models.config import ModelConfig
from lowrl.models.layout import BLOCK_MATMULS, LM_HEAD
from lowrl.precision import PrecisionPolicy, activation_scaling
from lowrl.quant.qdot import quantized_dot_general

Params = Any
Cache = dict[str, Any]
# Static activation amaxes: full matmul path ("layers_0/attn/q_proj", "lm_head") -> FP32 scalar.
ActAmax = Mapping[str, jax.Array]
# Flax collection the calibration forward records per-token activation amaxes in.
_CALIB = "act_amax"

# Masked attention scores: finite so that a fully masked (padding) query row gives a uniform,
# finite softmax instead of NaN.
_NEG_INF = -1e30
# Quant-key streams: fold_in(key, layer) then fold_in(., path id); the LM head uses layer n_layers.
_PATH_IDS = {p: i for i, p in enumerate(BLOCK_MATMULS + (LM_HEAD,))}


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
          act_amax: ActAmax | None, record_name: str) -> jax.Array:
  """x[..., in] . w over x's last axis and w's axis `contract_w`, through the policy's quantizer.

  A matmul whose activation scale spans the whole tensor takes its amax from `act_amax` (static,
  calibrated) when given, else from the data. Under a calibration apply (`_CALIB` mutable) the
  per-token max |x| is recorded in `module`'s scope as `record_name`. Returns FP32.
  """
  full_path = layout.matmul_path(layer, path)
  cfg = policy.qdot_config(full_path)
  if module.is_mutable_collection(_CALIB):
    module.sow(_CALIB, record_name, jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1))
  lhs_amax = None
  if act_amax is not None and activation_scaling(cfg) == "tensor":
    lhs_amax = act_amax[full_path]  # completeness checked in Transformer
  dims = (((x.ndim - 1,), (contract_w,)), ((), ()))
  return quantized_dot_general(x, w, dims, cfg, key=_fold(quant_key, _PATH_IDS[path]),
                               preferred_element_type=jnp.float32, lhs_amax=lhs_amax)


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
               act_amax: ActAmax | None = None) -> jax.Array:
    # Initializers here only give shapes: `init_params` draws the values.
    kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features),
                        self.param_dtype)
    y = _qdot(self, x, kernel, 0, self.policy, self.layer, self.matmul, quant_key, act_amax,
              "amax")
    if self.use_bias:
      bias = self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
      y = y + bias.astype(jnp.float32)
    return y.astype(self.out_dtype or self.policy.dtype)


class Embedder(nn.Module):
  """Token embedding table [V, D]; also the LM head when embeddings are tied."""

  cfg: ModelConfig
  param_dtype: Any = jnp.float32

  def setup(self):
    self.embedding = self.param("embedding", nn.initializers.normal(self.cfg.d_model ** -0.5),
                                (self.cfg.vocab_size, self.cfg.d_model), self.param_dtype)

  def __call__(self, tokens_BT: jax.Array, dtype) -> jax.Array:
    return jnp.take(self.embedding, tokens_BT, axis=0).astype(dtype)


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
    q_BTNH = dense(h * hd, "attn/q_proj", use_bias=cfg.qkv_bias, name="q_proj")(
        x_BTD, quant_key, act_amax).reshape(batch, steps, h, hd)
    k_BTKH = dense(k * hd, "attn/k_proj", use_bias=cfg.qkv_bias, name="k_proj")(
        x_BTD, quant_key, act_amax).reshape(batch, steps, k, hd)
    v_BTKH = dense(k * hd, "attn/v_proj", use_bias=cfg.qkv_bias, name="v_proj")(
        x_BTD, quant_key, act_amax).reshape(batch, steps, k, hd)
    if cfg.qk_norm:
      q_BTNH = RMSNorm(cfg.rms_eps, self.param_dtype, name="q_norm")(q_BTNH)
      k_BTKH = RMSNorm(cfg.rms_eps, self.param_dtype, name="k_norm")(k_BTKH)
    inv_freq = rope_inv_freq(cfg)
    q_BTNH = apply_rope(q_BTNH, positions_BT, inv_freq)
    k_BTKH = apply_rope(k_BTKH, positions_BT, inv_freq)

    if cache_layer is None:
      keys_BSKH, values_BSKH, new_cache = k_BTKH, v_BTKH, None
    else:
      start = (0, cache_index, 0, 0)
      keys_BSKH = jax.lax.dynamic_update_slice(cache_layer["k"], k_BTKH.astype(dtype), start)
      values_BSKH = jax.lax.dynamic_update_slice(cache_layer["v"], v_BTKH.astype(dtype), start)
      new_cache = {"k": keys_BSKH, "v": values_BSKH}
    # Causal over columns: the query in column cache_index + t sees key columns <= it.
    q_col_T = cache_index + jnp.arange(steps)
    k_col_S = jnp.arange(keys_BSKH.shape[1])
    allowed_BTS = (k_col_S[None, None, :] <= q_col_T[None, :, None]) & key_mask_BS[:, None, :]

    g = h // k  # query heads per kv head; HF repeat_kv order: head n = kv * g + j.
    q_BTKGH = q_BTNH.reshape(batch, steps, k, g, hd)
    scores_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, keys_BSKH.astype(dtype),
                              preferred_element_type=jnp.float32) * (hd ** -0.5)
    scores_BKGTS = jnp.where(allowed_BTS[:, None, None], scores_BKGTS, _NEG_INF)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1)
    out_BTKGH = jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS.astype(dtype),
                           values_BSKH.astype(dtype), preferred_element_type=jnp.float32)
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
    gate_BTF = dense(self.cfg.d_ff, "mlp/gate_proj", name="gate_proj")(x_BTD, quant_key, act_amax)
    up_BTF = dense(self.cfg.d_ff, "mlp/up_proj", name="up_proj")(x_BTD, quant_key, act_amax)
    # SiLU in FP32: its output feeds a (possibly quantized) GEMM, round once.
    h_BTF = (jax.nn.silu(gate_BTF.astype(jnp.float32)) * up_BTF.astype(jnp.float32))
    return dense(self.cfg.d_model, "mlp/down_proj", name="down_proj")(
        h_BTF.astype(self.policy.dtype), quant_key, act_amax)


class Block(nn.Module):
  """Pre-norm decoder block."""

  cfg: ModelConfig
  layer: int
  policy: PrecisionPolicy
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BTD, positions_BT, cache_layer, cache_index, key_mask_BS, quant_key,
               act_amax):
    kw = dict(cfg=self.cfg, layer=self.layer, policy=self.policy, param_dtype=self.param_dtype)
    layer_key = _fold(quant_key, self.layer)
    h = RMSNorm(self.cfg.rms_eps, self.param_dtype, name="attn_norm")(x_BTD)
    attn_BTD, new_cache = Attention(**kw, name="attn")(
        h, positions_BT, cache_layer, cache_index, key_mask_BS, layer_key, act_amax)
    x_BTD = x_BTD + attn_BTD
    h = RMSNorm(self.cfg.rms_eps, self.param_dtype, name="mlp_norm")(x_BTD)
    x_BTD = x_BTD + Mlp(**kw, name="mlp")(h, layer_key, act_amax)
    return x_BTD, new_cache


class Transformer(nn.Module):
  """The decoder. __call__ returns (FP32 logits [B, T or 1, V], updated cache or None)."""

  cfg: ModelConfig
  policy: PrecisionPolicy
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, tokens_BT, positions_BT, mask_BT, cache=None, quant_key=None,
               last_only=False, act_amax=None):
    cfg, dtype = self.cfg, self.policy.dtype
    check_act_amax(self.policy, cfg, act_amax)
    embed = Embedder(cfg, self.param_dtype, name="embed")
    x_BTD = embed(tokens_BT, dtype)

    if cache is None:
      cache_index, key_mask_BS = 0, mask_BT
    else:
      cache_index = cache["index"]
      key_mask_BS = jax.lax.dynamic_update_slice(cache["mask"], mask_BT, (0, cache_index))
    new_layers = []
    for i in range(cfg.n_layers):
      cache_layer = None if cache is None else cache["layers"][i]
      x_BTD, new_layer = Block(cfg, i, self.policy, self.param_dtype, name=f"layers_{i}")(
          x_BTD, positions_BT, cache_layer, cache_index, key_mask_BS, quant_key, act_amax)
      new_layers.append(new_layer)

    if last_only:
      x_BTD = x_BTD[:, -1:]
    # The head's input stays FP32 (the norm computes in FP32): an FP32 head, not a BF16 one.
    h_BTD = RMSNorm(cfg.rms_eps, self.param_dtype, name="final_norm")(x_BTD.astype(jnp.float32))
    head_key = _fold(quant_key, cfg.n_layers)
    if cfg.tie_embeddings:
      logits_BTV = _qdot(self, h_BTD, embed.embedding, 1, self.policy, None, LM_HEAD, head_key,
                         act_amax, LM_HEAD)
    else:
      logits_BTV = QDense(cfg.vocab_size, LM_HEAD, None, self.policy, param_dtype=self.param_dtype,
                          out_dtype=jnp.float32, name="lm_head")(h_BTD, head_key, act_amax)
    new_cache = None if cache is None else {
        "index": cache_index + tokens_BT.shape[1], "mask": key_mask_BS,
        "layers": tuple(new_layers)}
    return logits_BTV.astype(jnp.float32), new_cache


# ----------------------------------------------------------------------------------------------
# Pure functions.


def init_params(model_cfg: ModelConfig, rng: jax.Array, param_dtype=jnp.float32) -> Params:
  """A fresh parameter tree (ARCHITECTURE.md layout), deterministic in `rng`.

  Kernels ~ N(0, 1/fan_in), embedding ~ N(0, 1/D) (so tied logits start with unit scale), norm
  scales 1, biases 0.
  """
  return _init_fn(model_cfg, jnp.dtype(param_dtype))(rng)


@functools.lru_cache(maxsize=None)
def param_shapes(model_cfg: ModelConfig, param_dtype=jnp.float32) -> Params:
  """ShapeDtypeStructs of `init_params`'s tree (nothing is allocated): the tree to lay out,
  shard or restore into without building the model's values."""
  return jax.eval_shape(lambda: init_params(model_cfg, jax.random.key(0), param_dtype))


@functools.lru_cache(maxsize=16)
def _init_fn(model_cfg: ModelConfig, param_dtype):
  module = Transformer(model_cfg, PrecisionPolicy.unquantized(layout.matmuls(model_cfg)),
                       param_dtype)
  tokens = jnp.zeros((1, 1), jnp.int32)
  shapes = jax.eval_shape(
      lambda: module.init(jax.random.key(0), tokens, tokens, jnp.ones((1, 1), bool))["params"])
  leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
  names = [jax.tree_util.keystr(path, simple=True, separator="/") for path, _ in leaves]
  random = [i for i, n in enumerate(names) if n.endswith(("kernel", "embedding"))]
  sizes = [leaves[i][1].size for i in random]

  @jax.jit
  def init(rng):
    # One normal draw sliced into every random leaf: a draw per leaf compiles ~10x slower.
    flat = jax.random.normal(rng, (sum(sizes),), jnp.float32)
    out = [None] * len(leaves)
    offset = 0
    for i, size in zip(random, sizes):
      shape = leaves[i][1].shape
      fan_in = shape[1] if names[i].endswith("embedding") else shape[0]
      out[i] = flat[offset:offset + size].reshape(shape) * fan_in ** -0.5
      offset += size
    for i, name in enumerate(names):
      if out[i] is None:
        fill = 1.0 if name.endswith("scale") else 0.0
        out[i] = jnp.full(leaves[i][1].shape, fill, jnp.float32)
      out[i] = out[i].astype(param_dtype)
    return jax.tree_util.tree_unflatten(treedef, out)

  return init


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
  """Raises ValueError unless `act_amax` is None or holds every tensor-scaled activation path."""
  if act_amax is None:
    return
  missing = [p for p in policy.act_paths(layout.matmuls(model_cfg), "tensor")
             if p not in act_amax]
  if missing:
    raise ValueError(f"act_amax lacks the static activation amax of {missing} (policy "
                     f"{policy.name!r} scales them per tensor); calibrate them with "
                     "transformer.calibrate_act_amax(..., paths=policy.act_paths("
                     "layout.matmuls(model_cfg), 'tensor')).")


def calibrate_act_amax(params: Params, tokens_BT: jax.Array, model_cfg: ModelConfig,
                       policy: PrecisionPolicy, paths: tuple[str, ...], *,
                       mask_BT: jax.Array | None = None, positions_BT: jax.Array | None = None,
                       quant_key: jax.Array | None = None) -> dict[str, jax.Array]:
  """Static activation amaxes: {path: max |input| of that matmul over the real tokens} (FP32).

  One full forward of a calibration batch under `policy` (the trainer's precision: an inference
  engine's calibration pass on the rollout weights); padding positions (mask 0) are excluded, as
  their activations are garbage. `paths` are full matmul paths, e.g. a sampler policy's
  `act_paths(layout.matmuls(model_cfg), "tensor")`. Jittable; no gradient.
  """
  _check_key(policy, quant_key)
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
  return {p: jnp.max(jnp.where(mask_BT, recorded[p], 0.0)) for p in paths}


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
  """An empty KV cache of `max_len` columns (use the policy's compute dtype)."""
  if max_len > model_cfg.max_seq_len:
    raise ValueError(f"KV cache of {max_len} columns exceeds model_cfg.max_seq_len="
                     f"{model_cfg.max_seq_len}; shorten prompts/max_new_tokens or raise "
                     "max_seq_len.")
  shape = (batch, max_len, model_cfg.n_kv_heads, model_cfg.head_dim)
  layer = lambda: {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}  # noqa: E731
  return {"index": jnp.zeros((), jnp.int32), "mask": jnp.zeros((batch, max_len), bool),
          "layers": tuple(layer() for _ in range(model_cfg.n_layers))}


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


def logprobs_from_logits(logits_BTV: jax.Array, tokens_BT: jax.Array,
                         mask_BT: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(logp_BT, entropy_BT) of next-token predictions, aligned with the predicted token.

  logp[:, t] = log p(tokens[:, t] | tokens[:, :t]) from logits[:, t - 1]; entropy[:, t] is the
  entropy of that same distribution. Both are 0 at t = 0 and wherever mask[:, t] or
  mask[:, t - 1] is 0 (no real context to predict from, or not a real token). FP32.
  """
  logits = logits_BTV[:, :-1].astype(jnp.float32)
  logz_BT = jax.nn.logsumexp(logits, axis=-1)
  picked_BT = jnp.take_along_axis(logits, tokens_BT[:, 1:, None], axis=-1)[..., 0]
  logp_BT = picked_BT - logz_BT
  logp_all = logits - logz_BT[..., None]
  entropy_BT = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  valid = jnp.ones(tokens_BT.shape, bool) if mask_BT is None else mask_BT.astype(bool)
  valid_BT = valid[:, 1:] & valid[:, :-1]
  pad = lambda x: jnp.pad(jnp.where(valid_BT, x, 0.0), ((0, 0), (1, 0)))  # noqa: E731
  return pad(logp_BT), pad(entropy_BT)


def token_logprobs_and_entropy(params: Params, tokens_BT: jax.Array, model_cfg: ModelConfig,
                               policy: PrecisionPolicy, *, mask_BT: jax.Array | None = None,
                               positions_BT: jax.Array | None = None,
                               quant_key: jax.Array | None = None,
                               act_amax: ActAmax | None = None
                               ) -> tuple[jax.Array, jax.Array]:
  """(logp_BT, entropy_BT): see `logprobs_from_logits` for the alignment."""
  logits_BTV = forward(params, tokens_BT, model_cfg, policy, mask_BT=mask_BT,
                       positions_BT=positions_BT, quant_key=quant_key, act_amax=act_amax)
  return logprobs_from_logits(logits_BTV, tokens_BT, mask_BT)


def token_logprobs(params: Params, tokens_BT: jax.Array, model_cfg: ModelConfig,
                   policy: PrecisionPolicy, *, mask_BT: jax.Array | None = None,
                   positions_BT: jax.Array | None = None,
                   quant_key: jax.Array | None = None,
                   act_amax: ActAmax | None = None) -> jax.Array:
  """logp_BT[:, t] = log p(tokens[:, t] | tokens[:, :t]) in FP32; 0 at t = 0 and on padding."""
  return token_logprobs_and_entropy(params, tokens_BT, model_cfg, policy, mask_BT=mask_BT,
                                    positions_BT=positions_BT, quant_key=quant_key,
                                    act_amax=act_amax)[0]
