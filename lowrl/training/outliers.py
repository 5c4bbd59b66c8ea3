"""Outlier channels in a base (`sft.outlier_channels`, `sft.outlier_gain`) and the probe that
shows them.

Trained LLMs carry a few hidden channels whose activations are tens of times larger than the
rest (LLM.int8(), arXiv 2208.07339; massive activations, arXiv 2402.17762), largely through the
RMSNorm gains of those channels: every matmul that reads a normed input (q/k/v, gate/up) then
sees them. A block of 16 that holds one such channel has its NVFP4 scale set by it, and its
other 15 elements fall onto the bottom of the E2M1 grid: the effect per-token scales and 4/6 are
for. The tiny mid-trained base has none, so `plant` gives it some without changing the function
it computes: for `n` evenly spaced channels c (each in a block of 16 of its own when d_model /
n >= 16), every layer's attn_norm and mlp_norm gain of c is multiplied by `gain` and the rows c
of the kernels that read those norms (q/k/v_proj, gate/up_proj) are divided by it, so x_c * g *
W[c] / g = x_c * W[c] exactly in real arithmetic (the SmoothQuant migration, run backwards). The
BF16 policy is the same function up to rounding; the quantized ones see the outliers; RL trains
the planted parametrisation from there (every setting and the twin alike).

`channel_stats` measures them: per layer and norm, the largest per-channel max |activation| over
the real tokens divided by the median channel's, and the kurtosis of the activations (Gaussian:
3), from one unquantized FP32 forward.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from lowrl import precision
from lowrl.models import layout
from lowrl.models.blocks import RMSNorm
from lowrl.models.config import ModelConfig
from lowrl.models.decoder import Transformer
from lowrl.models.transformer import model_inputs

# norm -> the matmuls that read its output.
READERS = {"attn_norm": ("attn/q_proj", "attn/k_proj", "attn/v_proj"),
           "mlp_norm": ("mlp/gate_proj", "mlp/up_proj")}


def channels(d_model: int, n: int) -> tuple[int, ...]:
  """The `n` planted channels: evenly spaced, each in the middle of its 1/n of the width."""
  if not 0 <= n <= d_model:
    raise ValueError(f"--config.sft.outlier_channels={n}: must be in [0, d_model={d_model}].")
  step = d_model // n if n else 1
  return tuple(range(step // 2, step * n, step)) if n else ()


def plant(params: Any, model_cfg: ModelConfig, n: int, gain: float) -> Any:
  """`params` with `n` outlier channels of gain `gain` (module docstring); n = 0: unchanged.
  Dense decoders only (an MoE router would read the planted channels too)."""
  if n == 0 or gain == 1.0:
    return params
  if model_cfg.is_moe:
    raise ValueError("--config.sft.outlier_channels: dense models only (set it to 0 for MoE).")
  idx = jnp.asarray(channels(model_cfg.d_model, n))
  out = jax.tree.map(lambda x: x, params)  # a fresh tree: the caller's is left as it is
  for i in range(model_cfg.n_layers):
    layer = dict(out[layout.layer_key(i)])
    for norm, readers in READERS.items():
      s = layer[norm]["scale"]
      layer[norm] = {**layer[norm], "scale": s.at[idx].multiply(jnp.asarray(gain, s.dtype))}
      for path in readers:
        block, name = path.split("/")
        k = layer[block][name]["kernel"]  # [D, out]: rows are the input channels
        layer[block] = {**layer[block], name: {
            **layer[block][name], "kernel": k.at[idx, :].divide(jnp.asarray(gain, k.dtype))}}
    out = {**out, layout.layer_key(i): layer}
  return out


def channel_stats(params: Any, tokens_BT: jax.Array, mask_BT: jax.Array | None,
                  model_cfg: ModelConfig) -> dict[str, dict[str, float]]:
  """{"layers_{i}/{attn_norm,mlp_norm}": {"max_over_median": largest per-channel max |y| /
  the median channel's, "kurtosis": E[y^4] / E[y^2]^2 over the real tokens' values, "top":
  the channel of the largest max}} of the normed inputs y of the matmuls, from one FP32
  forward without quantization (unrolled layers)."""
  cfg = dataclasses.replace(model_cfg, scan_layers=False)
  fp32 = precision.PrecisionPolicy.unquantized(layout.matmuls(cfg), "float32", name="fp32")
  mask_BT, positions_BT = model_inputs(tokens_BT, mask_BT, None)
  _, state = Transformer(cfg, fp32).apply(
      {"params": params}, tokens_BT, positions_BT, mask_BT,
      capture_intermediates=lambda mdl, _: isinstance(mdl, RMSNorm), mutable=["intermediates"])
  flat = traverse_util.flatten_dict(state["intermediates"], sep="/")
  real = np.asarray(mask_BT, bool)
  out = {}
  for i in range(cfg.n_layers):
    for norm in READERS:
      y = np.asarray(flat[f"layers_{i}/{norm}/__call__"][0], np.float64)[real]  # [N, D]
      ch_max = np.abs(y).max(0)
      out[f"layers_{i}/{norm}"] = {
          "max_over_median": float(ch_max.max() / max(np.median(ch_max), 1e-30)),
          "kurtosis": float(np.mean(y**4) / max(np.mean(y**2) ** 2, 1e-300)),
          "top": int(ch_max.argmax())}
  return out
