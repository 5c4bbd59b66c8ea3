"""The decoder as a Flax module (`Transformer`): embedding, the blocks (unrolled or one
`lax.scan` per run of identically quantized layers), final norm and LM head.

Callers use the pure functions of `transformer.py` (forward, KV cache), `logprobs.py`,
`calibration.py` and `init.py`; this module is the description they apply. The logits and
log-softmax are always FP32.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from lowrl.models import kv_cache, layout, moe
from lowrl.models.blocks import CALIB, ActAmax, Block, Embedder, QDense, RMSNorm, fold, qdot
from lowrl.models.config import ModelConfig
from lowrl.models.layout import BLOCK_MATMULS, LM_HEAD
from lowrl.models.row_sharding import constrain_rows
from lowrl.precision import PrecisionPolicy, activation_scaling


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
            x_BTD, positions_BT, cache_layer, cache_index, key_mask_BS, fold(quant_key, i),
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
    head_key = fold(quant_key, cfg.n_layers)
    if cfg.tie_embeddings:
      logits_BTV = qdot(self, h_BTD, embed.embedding, 1, self.policy, None, LM_HEAD, head_key,
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
    calibrating = self.is_mutable_collection(CALIB)
    # Routing record/replay of MoE blocks (lowrl.models.routing): replayed ids enter the scan as
    # per-layer inputs, recorded ones leave it stacked, both per layer like the amaxes.
    replay = self.variables.get(moe.REPLAY)
    mutable = [c for c, on in ((CALIB, calibrating),
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
                          fold(quant_key, index), amax_layer, mutable=mutable or False)
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
                     "calibrate them with calibration.calibrate_act_amax(..., paths="
                     "act_scales.calibration_paths(policy, model_cfg)).")
