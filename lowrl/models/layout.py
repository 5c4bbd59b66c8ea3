"""The decoder's layout: which matmuls exist, where their weights live, and their widths.

The model owns this description; everything that walks the model's matmuls (the precision
policy's assignment table, the quantization-block check, weight packing, weight diagnostics,
the Hugging Face loader) iterates `matmuls(cfg)` instead of re-deriving it.

A matmul is `x[..., in] . W` contracting x's last axis with W's `contract_axis`. Kernels are
stored `[in, out]` (contract axis 0); a tied LM head reads the embedding table `[V, D]` (contract
axis 1). Paths: `attn/q_proj`, ..., `mlp/down_proj` inside `layers_{i}`, and `lm_head`.

Mixture-of-experts blocks (`cfg.n_experts` > 0, lowrl/models/moe.py) have `MOE_MATMULS` in
place of the three MLP matmuls: the router `mlp/router` (kernel [D, E]), the routed experts
`mlp/experts/{gate,up,down}_proj` (one stacked kernel [E, in, out] each: contract axis 1, the
expert axis 0) and, with a shared expert, `mlp/shared_expert/{gate,up,down}_proj` plus its gate
`mlp/shared_expert_gate` ([D, 1]).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

from lowrl.models.config import ModelConfig

# Linear layers of one decoder block, in execution order.
BLOCK_MATMULS = ("attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/o_proj",
                 "mlp/gate_proj", "mlp/up_proj", "mlp/down_proj")
LM_HEAD = "lm_head"
ROUTER = "mlp/router"
EXPERT_MATMULS = ("mlp/experts/gate_proj", "mlp/experts/up_proj", "mlp/experts/down_proj")
SHARED_EXPERT_MATMULS = ("mlp/shared_expert/gate_proj", "mlp/shared_expert/up_proj",
                         "mlp/shared_expert/down_proj", "mlp/shared_expert_gate")
MOE_MATMULS = (ROUTER,) + EXPERT_MATMULS + SHARED_EXPERT_MATMULS
# Quant-key stream of each path: the dense ids first (unchanged), the MoE ones after the head.
PATH_IDS = {p: i for i, p in enumerate(BLOCK_MATMULS + (LM_HEAD,) + MOE_MATMULS)}
# The block matmuls an inference engine runs as one fused linear on one input (vLLM's `qkv_proj`
# and `gate_up_proj`: their weights concatenated along `out`, one per-tensor scale for the whole;
# ModelOpt's exporter unifies their amax, `preprocess_linear_fusion`).
FUSED_GROUPS = (("attn/q_proj", "attn/k_proj", "attn/v_proj"), ("mlp/gate_proj", "mlp/up_proj"))
# Hugging Face module names of the block matmuls (under `model.layers.{i}.`).
_HF_BLOCK_NAMES = {"attn/q_proj": "self_attn.q_proj", "attn/k_proj": "self_attn.k_proj",
                   "attn/v_proj": "self_attn.v_proj", "attn/o_proj": "self_attn.o_proj",
                   "mlp/gate_proj": "mlp.gate_proj", "mlp/up_proj": "mlp.up_proj",
                   "mlp/down_proj": "mlp.down_proj", ROUTER: "mlp.gate",
                   # A stacked expert kernel holds E HF tensors `mlp.experts.{e}.gate_proj`.
                   "mlp/experts/gate_proj": "mlp.experts.gate_proj",
                   "mlp/experts/up_proj": "mlp.experts.up_proj",
                   "mlp/experts/down_proj": "mlp.experts.down_proj",
                   "mlp/shared_expert/gate_proj": "mlp.shared_expert.gate_proj",
                   "mlp/shared_expert/up_proj": "mlp.shared_expert.up_proj",
                   "mlp/shared_expert/down_proj": "mlp.shared_expert.down_proj",
                   "mlp/shared_expert_gate": "mlp.shared_expert_gate"}


def block_paths(cfg: ModelConfig) -> tuple[str, ...]:
  """The matmul paths of one decoder block of `cfg`, in execution order."""
  if not cfg.is_moe:
    return BLOCK_MATMULS
  moe = (ROUTER,) + EXPERT_MATMULS + (SHARED_EXPERT_MATMULS if cfg.shared_expert_d_ff else ())
  return BLOCK_MATMULS[:4] + moe


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
    n_experts: routed experts of a stacked expert kernel [E, in, out] (contract axis 1), else 0.
  """

  layer: int | None
  path: str
  param_keys: tuple[str, ...]
  contract_axis: int
  in_features: int
  out_features: int
  hf_name: str
  has_bias: bool = False
  n_experts: int = 0

  @property
  def out_axis(self) -> int:
    """The weight's output axis."""
    return 2 if self.n_experts else 1 - self.contract_axis

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
    if self.n_experts:
      return (self.n_experts, self.in_features, self.out_features)
    if self.contract_axis == 0:
      return (self.in_features, self.out_features)
    return (self.out_features, self.in_features)


def _widths(cfg: ModelConfig, path: str) -> tuple[int, int]:
  d, f = cfg.d_model, cfg.d_ff
  return {"attn/q_proj": (d, cfg.q_dim), "attn/k_proj": (d, cfg.kv_dim),
          "attn/v_proj": (d, cfg.kv_dim), "attn/o_proj": (cfg.q_dim, d),
          "mlp/gate_proj": (d, f), "mlp/up_proj": (d, f), "mlp/down_proj": (f, d),
          LM_HEAD: (d, cfg.vocab_size), ROUTER: (d, cfg.n_experts),
          "mlp/experts/gate_proj": (d, cfg.moe_d_ff), "mlp/experts/up_proj": (d, cfg.moe_d_ff),
          "mlp/experts/down_proj": (cfg.moe_d_ff, d),
          "mlp/shared_expert/gate_proj": (d, cfg.shared_expert_d_ff),
          "mlp/shared_expert/up_proj": (d, cfg.shared_expert_d_ff),
          "mlp/shared_expert/down_proj": (cfg.shared_expert_d_ff, d),
          "mlp/shared_expert_gate": (d, 1)}[path]


def matmul(cfg: ModelConfig, layer: int | None, path: str) -> Matmul:
  """The Matmul at (layer, path) of `cfg`."""
  width_in, width_out = _widths(cfg, path)
  if layer is None:
    if cfg.tie_embeddings:
      return Matmul(None, path, ("embed", "embedding"), 1, width_in, width_out,
                    "model.embed_tokens")
    return Matmul(None, path, ("lm_head", "kernel"), 0, width_in, width_out, "lm_head")
  bias = cfg.qkv_bias and path in ("attn/q_proj", "attn/k_proj", "attn/v_proj")
  experts = cfg.n_experts if path in EXPERT_MATMULS else 0
  return Matmul(layer, path, (layer_key(layer), *path.split("/"), "kernel"), 1 if experts else 0,
                width_in, width_out, f"model.layers.{layer}.{_HF_BLOCK_NAMES[path]}", bias,
                experts)


def matmuls(cfg: ModelConfig) -> tuple[Matmul, ...]:
  """Every matmul of `cfg` in execution order (the LM head last)."""
  if not cfg.is_moe:
    return tuple(matmul(cfg, layer, path) for layer, path in matmul_sites(cfg.n_layers))
  return tuple(matmul(cfg, layer, path) for layer in range(cfg.n_layers)
               for path in block_paths(cfg)) + (matmul(cfg, None, LM_HEAD),)


def get_param(params: Any, keys: tuple[str, ...]) -> Any:
  """The leaf (or subtree) of `params` at `keys`."""
  for k in keys:
    params = params[k]
  return params


def set_param(params: Any, keys: tuple[str, ...], value: Any) -> Any:
  """`params` (nested dicts) with the leaf at `keys` replaced (a new tree; the rest shared)."""
  if len(keys) == 1:
    return {**params, keys[0]: value}
  return {**params, keys[0]: set_param(params[keys[0]], keys[1:], value)}


def iter_weights(params: Any, cfg: ModelConfig) -> Iterator[tuple[Matmul, Any]]:
  """(Matmul, weight) for every matmul of `cfg`, the weight read from `params`."""
  for m in matmuls(cfg):
    yield m, get_param(params, m.param_keys)
