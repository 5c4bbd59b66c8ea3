"""Llama/Qwen-family decoder: the pure forward functions over a params pytree.

`params` (the tree in ARCHITECTURE.md) is the only state. The model is split by concern:
`blocks.py` and `decoder.py` hold the Flax description (layers, the `Transformer` module), this
module the functions that apply it (`forward`, `forward_with_cache`, `init_cache`), `logprobs.py`
the per-token log-probs and entropies (`token_logprobs`, chunked over V), `calibration.py` the
static activation amaxes (`calibrate_act_amax`), `init.py` the parameter tree (`init_params`,
`param_shapes`). All are jittable with `model_cfg` and `policy` static.

Execution knobs (ModelConfig: scan_layers, remat, attention, logprob_chunk) change how the
forward runs, not the param tree; see ModelConfig.

Precision: every linear layer goes through `quantized_dot_general` with the QDotConfig the policy
gives for its (layer, path). Everything else runs in `policy.compute_dtype`, except RMSNorm,
RoPE and softmax (FP32), and the logits and log-softmax (always FP32).

Per-tensor activation scales: a matmul whose activation quantizer takes one scale over the whole
tensor (`precision.activation_scaling(cfg) == "tensor"`) uses the amax of its [B, T, D] input by
default (the trainer's current scaling: non-causal, batch-dependent) or, given `act_amax`, a
static calibrated amax per matmul (`calibration.calibrate_act_amax`), which makes it causal and
row-local.

Masks and positions: `mask_BT` marks real tokens (1) and padding (0). Padding never serves as a
key; padded query rows produce finite garbage that callers mask out. Positions default to
`cumsum(mask) - 1`, so left-padded rows start at position 0 like unpadded ones.

KV cache: `{'index': int32 scalar, 'mask': [B, S] bool, 'layers': ({'k', 'v'}: [B, S, K, hd], ...)}`
in compute_dtype; with `model_cfg.scan_layers`, `'layers': {'k', 'v'}: [L, B, S, K, hd]` (one
stacked pair the layer scans index into and update in place). A call with T new tokens writes
columns [index, index + T) for every row; a query in column c attends to keys in columns <= c
whose mask is set. Rows therefore share columns, not positions: left-pad prompts so that every
row's next token lands in the same column.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from lowrl.models.blocks import ActAmax
from lowrl.models.config import ModelConfig
from lowrl.models.decoder import Transformer
from lowrl.precision import PrecisionPolicy

Params = Any
Cache = dict[str, Any]


def positions_from_mask(mask_BT: jax.Array) -> jax.Array:
  """0, 1, 2, ... over the real tokens of each row (padding gets its neighbour's position)."""
  return jnp.maximum(jnp.cumsum(mask_BT.astype(jnp.int32), axis=-1) - 1, 0)


def positions_from_segments(segment_ids_BT: jax.Array) -> jax.Array:
  """0, 1, 2, ... restarting at each segment of a packed row (padding, id 0, counts on)."""
  t_T = jnp.arange(segment_ids_BT.shape[1])
  starts_BT = jnp.concatenate([jnp.ones_like(segment_ids_BT[:, :1], bool),
                               segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
  return t_T[None, :] - jax.lax.cummax(jnp.where(starts_BT, t_T[None, :], 0), axis=1)


def model_inputs(tokens_BT: jax.Array, mask_BT: jax.Array | None,
                 positions_BT: jax.Array | None,
                 segment_ids_BT: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """(key mask, positions) with their defaults: all tokens real, `positions_from_mask`.

  With `segment_ids_BT` (packed rows: int, 0 = padding, one id per sequence) the key mask is the
  int32 segment ids themselves (attention then stays within a segment: `blocks.attend`) and the
  positions default to `positions_from_segments`; `mask_BT` is then ignored."""
  if segment_ids_BT is not None:
    segment_ids_BT = segment_ids_BT.astype(jnp.int32)
    if positions_BT is None:
      positions_BT = positions_from_segments(segment_ids_BT)
    return segment_ids_BT, positions_BT
  if mask_BT is None:
    mask_BT = jnp.ones(tokens_BT.shape, bool)
  mask_BT = mask_BT.astype(bool)
  if positions_BT is None:
    positions_BT = positions_from_mask(mask_BT)
  return mask_BT, positions_BT


def check_key(policy: PrecisionPolicy, quant_key: jax.Array | None) -> None:
  """Raises ValueError when the policy rounds stochastically and no quant key is given."""
  if policy.needs_key and quant_key is None:
    raise ValueError(f"Precision policy {policy.name!r} rounds stochastically: pass "
                     "quant_key=jax.random.key(...) (the same key in sampler and trainer for "
                     "identical quantization), or set precision.stochastic_rounding=none.")


def forward(params: Params, tokens_BT: jax.Array, model_cfg: ModelConfig,
            policy: PrecisionPolicy, *, mask_BT: jax.Array | None = None,
            positions_BT: jax.Array | None = None,
            quant_key: jax.Array | None = None,
            act_amax: ActAmax | None = None,
            segment_ids_BT: jax.Array | None = None) -> jax.Array:
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
    segment_ids_BT: packed rows (`model_inputs`): int ids, 0 = padding; replaces mask_BT.
  """
  check_key(policy, quant_key)
  mask_BT, positions_BT = model_inputs(tokens_BT, mask_BT, positions_BT, segment_ids_BT)
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
  check_key(policy, quant_key)
  mask_BT, positions_BT = model_inputs(tokens_BT, mask_BT, positions_BT)
  return Transformer(model_cfg, policy).apply(
      {"params": params}, tokens_BT, positions_BT, mask_BT, cache=cache,
      quant_key=quant_key, last_only=last_only, act_amax=act_amax)
