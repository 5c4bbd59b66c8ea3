"""The Hugging Face tensor table: every tensor of a checkpoint with its place in the lowrl param
tree, so that loading and saving (`hf.py`) are exact inverses.

The linear layers (names, places, widths, biases) come from the model's layout
(`lowrl.models.layout`), the embedding and norms are listed here. Hugging Face `nn.Linear`
weights are `[out, in]`, lowrl kernels `[in, out]`; everything else is copied as is.
"""
from __future__ import annotations

import dataclasses
import re

from lowrl.checkpoints import hf_moe
from lowrl.models import layout
from lowrl.models.config import ModelConfig

# Buffers some old exports carry that hold no learned state (recomputed from the config).
IGNORED_TENSOR_RE = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """One Hugging Face tensor and where it lives in the lowrl param tree."""
  hf_name: str
  path: tuple[str, ...]
  hf_shape: tuple[int, ...]
  transpose: bool  # HF Linear weight [out, in] <-> lowrl kernel [in, out]
  expert: int | None = None  # the slice [expert] of a stacked expert kernel [E, in, out]


def _linear_specs(m: layout.Matmul) -> list[TensorSpec]:
  """The weight (and bias) of a matmul that owns its kernel; HF Linear stores it [out, in]."""
  if m.n_experts:  # one HF tensor per expert
    return [TensorSpec(name, m.param_keys, (m.out_features, m.in_features), True, e)
            for e, name in enumerate(hf_moe.expert_tensor_names(m))]
  transpose = m.contract_axis == 0  # lowrl [in, out] -> HF [out, in]
  hf_shape = m.weight_shape[::-1] if transpose else m.weight_shape
  specs = [TensorSpec(f"{m.hf_name}.weight", m.param_keys, hf_shape, transpose)]
  if m.has_bias:
    specs.append(TensorSpec(f"{m.hf_name}.bias", m.param_keys[:-1] + ("bias",),
                             (m.out_features,), False))
  return specs


def _norm_specs(cfg: ModelConfig, m: layout.Matmul) -> list[TensorSpec]:
  """The norms (not matmuls) listed just before matmul `m` in the table's order."""
  def norm(hf_name, path, dim):
    return [TensorSpec(hf_name, path + ("scale",), (dim,), False)]

  if m.layer is None:
    return norm("model.norm.weight", ("final_norm",), cfg.d_model)
  hf, ours = f"model.layers.{m.layer}", layout.layer_key(m.layer)
  if m.path == layout.BLOCK_MATMULS[0]:  # q_proj
    return norm(f"{hf}.input_layernorm.weight", (ours, "attn_norm"), cfg.d_model)
  if m.path == layout.block_paths(cfg)[4]:  # the MLP's first matmul
    specs = []
    if cfg.qk_norm:
      specs += norm(f"{hf}.self_attn.q_norm.weight", (ours, "attn", "q_norm"), cfg.head_dim)
      specs += norm(f"{hf}.self_attn.k_norm.weight", (ours, "attn", "k_norm"), cfg.head_dim)
    return specs + norm(f"{hf}.post_attention_layernorm.weight", (ours, "mlp_norm"), cfg.d_model)
  return []


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
  """Every tensor of a checkpoint for `cfg`, layer by layer.

  The linear layers come from the model's layout (`layout.matmuls`); the embedding and the norms,
  which are no matmuls, are listed here. A tied LM head reads the embedding, stored once.
  """
  specs = [TensorSpec("model.embed_tokens.weight", ("embed", "embedding"),
                       (cfg.vocab_size, cfg.d_model), False)]
  for m in layout.matmuls(cfg):
    specs += _norm_specs(cfg, m)
    if m.owns_kernel:
      specs += _linear_specs(m)
  return specs

