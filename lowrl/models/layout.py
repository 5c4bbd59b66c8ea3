"""The decoder's layout: which matmuls exist, where their weights live, and their widths.

The model owns this description; everything that walks the model's matmuls (the precision
policy's assignment table, the quantization-block check, weight packing, weight diagnostics,
the Hugging Face loader) iterates `matmuls(cfg)` instead of re-deriving it.

A matmul is `x[..., in] . W` contracting x's last axis with W's `contract_axis`. Kernels are
stored `[in, out]` (contract axis 0); a tied LM head reads the embedding table `[V, D]` (contract
axis 1). Paths: `attn/q_proj`, ..., `mlp/down_proj` inside `layers_{i}`, and `lm_head`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

from lowrl.models.config import ModelConfig

# Linear layers of one decoder block, in execution order.
BLOCK_MATMULS = ("attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/o_proj",
                 "mlp/gate_proj", "mlp/up_proj", "mlp/down_proj")
LM_HEAD = "lm_head"
# The block matmuls an inference engine runs as one fused linear on one input (vLLM's `qkv_proj`
# and `gate_up_proj`: their weights concatenated along `out`, one per-tensor scale for the whole;
# ModelOpt's exporter unifies their amax, `preprocess_linear_fusion`).
FUSED_GROUPS = (("attn/q_proj", "attn/k_proj", "attn/v_proj"), ("mlp/gate_proj", "mlp/up_proj"))
# Hugging Face module names of the block matmuls (under `model.layers.{i}.`).
_HF_BLOCK_NAMES = {"attn/q_proj": "self_attn.q_proj", "attn/k_proj": "self_attn.k_proj",
                   "attn/v_proj": "self_attn.v_proj", "attn/o_proj": "self_attn.o_proj",
                   "mlp/gate_proj": "mlp.gate_proj", "mlp/up_proj": "mlp.up_proj",
                   "mlp/down_proj": "mlp.down_proj"}


def layer_key(layer: int) -> str:
  """The param-tree key of decoder layer `layer`."""
  return f"layers_{layer}"


def matmul_path(layer: int | None, path: str) -> str:
  """The full path of a matmul: `layers_3/mlp/up_proj`, or `lm_head` (layer None)."""
  return path if layer is None else f"{layer_key(layer)}/{path}"


def matmul_sites(n_layers: int) -> tuple[tuple[int | None, str], ...]:
  """Every (layer, path) of an `n_layers` decoder in execution order; the LM head last."""
  return tuple((i, p) for i in range(n_layers) for p in BLOCK_MATMULS) + ((None, LM_HEAD),)


@dataclasses.dataclass(frozen=True)
class Matmul:
  """One matmul of the decoder.

  Attributes:
    layer: decoder layer index; None for the LM head.
    path: "attn/q_proj", ..., "mlp/down_proj" or "lm_head" (what precision rules name).
    param_keys: keys of the weight it reads in the param tree (e.g. ("layers_0", "attn",
      "q_proj", "kernel"); ("embed", "embedding") for a tied head).
    contract_axis: the weight's contracting axis (0 for [in, out] kernels, 1 for a tied head).
    in_features: contracting width.
    out_features: output width.
    hf_name: the Hugging Face module whose `.weight` it is ("model.layers.0.self_attn.q_proj",
      "lm_head", or "model.embed_tokens" for a tied head).
    has_bias: whether a `bias` [out] sits next to the kernel (Qwen2's q/k/v).
  """

  layer: int | None
  path: str
  param_keys: tuple[str, ...]
  contract_axis: int
  in_features: int
  out_features: int
  hf_name: str
  has_bias: bool = False

  @property
  def full_path(self) -> str:
    return matmul_path(self.layer, self.path)

  @property
  def owns_kernel(self) -> bool:
    """True for an [in, out] kernel of its own (False for a tied head reading the embedding)."""
    return self.param_keys[-1] == "kernel"

  @property
  def weight_shape(self) -> tuple[int, int]:
    """The stored weight's shape."""
    if self.contract_axis == 0:
      return (self.in_features, self.out_features)
    return (self.out_features, self.in_features)


def _widths(cfg: ModelConfig, path: str) -> tuple[int, int]:
  d, f = cfg.d_model, cfg.d_ff
  return {"attn/q_proj": (d, cfg.q_dim), "attn/k_proj": (d, cfg.kv_dim),
          "attn/v_proj": (d, cfg.kv_dim), "attn/o_proj": (cfg.q_dim, d),
          "mlp/gate_proj": (d, f), "mlp/up_proj": (d, f), "mlp/down_proj": (f, d),
          LM_HEAD: (d, cfg.vocab_size)}[path]


def matmul(cfg: ModelConfig, layer: int | None, path: str) -> Matmul:
  """The Matmul at (layer, path) of `cfg`."""
  width_in, width_out = _widths(cfg, path)
  if layer is None:
    if cfg.tie_embeddings:
      return Matmul(None, path, ("embed", "embedding"), 1, width_in, width_out,
                    "model.embed_tokens")
    return Matmul(None, path, ("lm_head", "kernel"), 0, width_in, width_out, "lm_head")
  bias = cfg.qkv_bias and path in ("attn/q_proj", "attn/k_proj", "attn/v_proj")
  return Matmul(layer, path, (layer_key(layer), *path.split("/"), "kernel"), 0, width_in,
                width_out, f"model.layers.{layer}.{_HF_BLOCK_NAMES[path]}", bias)


def matmuls(cfg: ModelConfig) -> tuple[Matmul, ...]:
  """Every matmul of `cfg` in execution order (the LM head last)."""
  return tuple(matmul(cfg, layer, path) for layer, path in matmul_sites(cfg.n_layers))


def get_param(params: Any, keys: tuple[str, ...]) -> Any:
  """The leaf (or subtree) of `params` at `keys`."""
  for k in keys:
    params = params[k]
  return params


def iter_weights(params: Any, cfg: ModelConfig) -> Iterator[tuple[Matmul, Any]]:
  """(Matmul, weight) for every matmul of `cfg`, the weight read from `params`."""
  for m in matmuls(cfg):
    yield m, get_param(params, m.param_keys)
