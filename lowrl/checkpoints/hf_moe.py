"""Mixture-of-experts families in Hugging Face checkpoints: Qwen3-MoE and Qwen2-MoE.

The config.json fields and tensor names of transformers' Qwen3MoeConfig / Qwen2MoeConfig and
their sparse MoE blocks (modeling_qwen3_moe.py at huggingface/transformers
16b6c53c8ec3a720bd45c1c377bf94e1d01249c5, modeling_qwen2_moe.py at
00a3f9386614dde0dc41cf4e9b8d0abd3af0671d):

  model.layers.N.mlp.gate.weight                       [E, D]   router (lowrl mlp/router [D, E])
  model.layers.N.mlp.experts.e.{gate,up}_proj.weight   [F, D]   expert e (lowrl stacked [E, D, F])
  model.layers.N.mlp.experts.e.down_proj.weight        [D, F]   (lowrl [E, F, D])
  model.layers.N.mlp.shared_expert.{gate,up,down}_proj.weight   Qwen2-MoE shared expert
  model.layers.N.mlp.shared_expert_gate.weight         [1, D]   its sigmoid gate

num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob (and
shared_expert_intermediate_size for Qwen2-MoE) map to ModelConfig's MoE fields. The expert count
has two spellings: transformers up to 5.0 and every Qwen2MoeConfig write `num_experts`;
Qwen3MoeConfig from transformers 5.1 on maps num_experts to `num_local_experts` (its
attribute_map), so its save_pretrained writes that name (seen in the wheels of 5.0.0, 5.1.0 and
5.25.0). Both spellings are read; a save keeps the one the original config.json used.
Qwen2MoeConfig's `qkv_bias` (default true) must be true: lowrl's Qwen2 attention always has
q/k/v biases. lowrl has MoE blocks in every layer: decoder_sparse_step other than 1 or a
non-empty mlp_only_layers (dense layers between sparse ones) are refused. The router's auxiliary
load-balancing loss (output_router_logits, router_aux_loss_coef) is a training-time extra lowrl
does not compute.
hf.py builds the tensor table from these names; this module imports nothing from it.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lowrl.models import layout
from lowrl.models.config import ModelConfig

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")
ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
# No defaults are assumed for these families: max_position_embeddings and num_key_value_heads
# are required (moe_fields_from_hf).
HF_DEFAULTS = {t: {"max_position_embeddings": None, "num_key_value_heads": None}
               for t in MOE_MODEL_TYPES}
# The expert count's spellings in config.json (module docstring): transformers < 5.1 / >= 5.1.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")


def _expert_count(hf: Mapping[str, Any]) -> int | None:
  """The expert count under either spelling (None when neither is there)."""
  given = {k: hf[k] for k in EXPERT_COUNT_KEYS if hf.get(k) is not None}
  if len({int(v) for v in given.values()}) > 1:
    raise ValueError(f"config.json: {' and '.join(f'{k}={v}' for k, v in given.items())} "
                     "disagree; they are two spellings of the expert count (transformers < 5.1 / "
                     ">= 5.1): keep the right one and drop the other.")
  return next((int(v) for v in given.values()), None)


def base_family(model_type: str) -> str:
  """The dense family whose attention a MoE family shares: qwen3_moe -> qwen3, ..."""
  return model_type.removesuffix("_moe")


def moe_fields_from_hf(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
  """ModelConfig keyword arguments of a MoE config.json (empty for dense families)."""
  if model_type not in MOE_MODEL_TYPES:
    return {}
  required = ["num_experts_per_tok", "moe_intermediate_size", "max_position_embeddings",
              "num_key_value_heads"]
  if model_type == "qwen2_moe":
    required.append("shared_expert_intermediate_size")
  missing = [k for k in required if k not in hf]
  n_experts = _expert_count(hf)
  if n_experts is None:
    missing.insert(0, " or ".join(EXPERT_COUNT_KEYS))
  if missing:
    raise ValueError(f"config.json ({model_type}) lacks {missing}; these fields are required.")
  if int(hf.get("decoder_sparse_step", 1)) != 1 or list(hf.get("mlp_only_layers", []) or []):
    raise ValueError(f"config.json: decoder_sparse_step={hf.get('decoder_sparse_step')} / "
                     f"mlp_only_layers={hf.get('mlp_only_layers')} put dense MLPs between the "
                     "sparse layers; lowrl has a mixture-of-experts MLP in every layer "
                     "(decoder_sparse_step 1, mlp_only_layers []).")
  if model_type == "qwen2_moe" and not hf.get("qkv_bias", True):
    raise ValueError("config.json: qkv_bias=false is not supported for qwen2_moe; lowrl's Qwen2 "
                     "attention has q/k/v biases (transformers' default, qkv_bias true).")
  return dict(n_experts=n_experts, n_experts_per_tok=int(hf["num_experts_per_tok"]),
              moe_d_ff=int(hf["moe_intermediate_size"]),
              norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
              shared_expert_d_ff=int(hf.get("shared_expert_intermediate_size", 0)))


def hf_moe_fields(cfg: ModelConfig, model_type: str,
                  original: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """The config.json MoE fields of `cfg` (ValueError when cfg and model_type disagree).

  The expert count is written as `num_local_experts` when `original` (the config.json the
  weights came from) spells it so, else as `num_experts`, which every transformers version
  reads (>= 5.1 through Qwen3MoeConfig's attribute_map)."""
  if (model_type in MOE_MODEL_TYPES) != cfg.is_moe:
    raise ValueError(f"model_type {model_type!r} and ModelConfig.n_experts={cfg.n_experts} "
                     "disagree; MoE configs save as qwen3_moe / qwen2_moe, dense ones as dense "
                     "families.")
  if not cfg.is_moe:
    return {}
  if (model_type == "qwen2_moe") != bool(cfg.shared_expert_d_ff):
    raise ValueError(f"model_type {model_type!r}: Qwen2-MoE has a shared expert and Qwen3-MoE none, "
                     f"but ModelConfig.shared_expert_d_ff={cfg.shared_expert_d_ff}.")
  count_key = next((k for k in reversed(EXPERT_COUNT_KEYS) if k in (original or {})),
                   EXPERT_COUNT_KEYS[0])
  out = {count_key: cfg.n_experts}
  out.update(num_experts_per_tok=cfg.n_experts_per_tok,
             moe_intermediate_size=cfg.moe_d_ff, norm_topk_prob=cfg.norm_topk_prob,
             decoder_sparse_step=1, mlp_only_layers=[])
  if cfg.shared_expert_d_ff:
    out["shared_expert_intermediate_size"] = cfg.shared_expert_d_ff
  return out


def infer_moe_model_type(cfg: ModelConfig) -> str:
  """qwen3_moe (q/k norm, no shared expert) or qwen2_moe (qkv bias, shared expert)."""
  return "qwen3_moe" if cfg.qk_norm else "qwen2_moe"


def expert_tensor_names(m: layout.Matmul) -> list[str]:
  """The E Hugging Face weight names a stacked expert kernel holds, expert by expert."""
  parent, proj = m.hf_name.rsplit(".", 1)  # "model.layers.N.mlp.experts", "gate_proj"
  return [f"{parent}.{e}.{proj}.weight" for e in range(m.n_experts)]
