"""Hugging Face `config.json` <-> ModelConfig: Llama (2/3, incl. `rope_scaling` type "llama3"),
Qwen2/Qwen2.5 (qkv bias), Qwen3 (q/k RMSNorm, explicit head_dim) and the MoE families of
`hf_moe.py`, read with transformers' defaults for the optional fields.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from lowrl.checkpoints import hf_moe
from lowrl.models.config import ModelConfig

CONFIG_FILE = "config.json"

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3") + hf_moe.MOE_MODEL_TYPES
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    **hf_moe.ARCHITECTURES,
}
# transformers' defaults for the optional config.json fields (LlamaConfig, Qwen2Config,
# Qwen3Config), so that a sparse config.json means what it means to transformers.
_HF_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "num_key_value_heads": None},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
    **hf_moe.HF_DEFAULTS,
}


def _rope_fields(hf: Mapping[str, Any]) -> tuple[float, Mapping[str, Any] | None]:
  """(rope_theta, rope scaling dict or None) from either config layout.

  transformers < 5 writes `rope_theta` + `rope_scaling`; transformers >= 5 writes one
  `rope_parameters` dict holding both.
  """
  params = hf.get("rope_parameters")
  if isinstance(params, Mapping):
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    return float(theta), params
  return float(hf.get("rope_theta", 10000.0)), hf.get("rope_scaling")


def _llama3_scaling(scaling: Mapping[str, Any] | None) -> tuple[float, float, float, int] | None:
  if scaling is None:
    return None
  rope_type = scaling.get("rope_type", scaling.get("type", "default"))
  if rope_type == "default":
    return None
  if rope_type != "llama3":
    raise ValueError(
        f"config.json: rope scaling type {rope_type!r} is not supported; lowrl implements "
        "unscaled RoPE and rope_type 'llama3' only. Use a checkpoint without (or with llama3) "
        "rope_scaling.")
  keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
  missing = [k for k in keys if k not in scaling]
  if missing:
    raise ValueError(f"config.json: llama3 rope_scaling lacks {missing}; it needs all of {keys}.")
  return (float(scaling["factor"]), float(scaling["low_freq_factor"]),
          float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))


def model_config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
  """Builds a ModelConfig from a Hugging Face `config.json` dict.

  Raises ValueError for a model type, activation, bias or rope variant the lowrl decoder does
  not implement, naming the field.
  """
  model_type = hf.get("model_type")
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(f"config.json: model_type {model_type!r} is not supported; lowrl loads "
                     f"{SUPPORTED_MODEL_TYPES} (Qwen2.5 checkpoints use 'qwen2').")
  if hf.get("quantization_config") is not None:
    raise ValueError("config.json has a quantization_config: quantized checkpoints are not "
                     "supported. Load the unquantized (BF16/FP32) checkpoint instead.")
  hf_moe.moe_fields_from_hf(hf, model_type)  # MoE fields checked before the others
  required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "vocab_size")
  missing = [k for k in required if k not in hf]
  if missing:
    raise ValueError(f"config.json lacks {missing}; these fields are required.")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"config.json: hidden_act {act!r} is not supported; lowrl's MLP is SwiGLU "
                     "(hidden_act 'silu').")
  if hf.get("mlp_bias", False):
    raise ValueError("config.json: mlp_bias=true is not supported (the lowrl MLP has no biases).")
  if hf.get("use_sliding_window", False):
    raise ValueError("config.json: use_sliding_window=true is not supported; lowrl attention is "
                     "full causal attention. Set use_sliding_window to false if the checkpoint "
                     "was trained without it.")
  layer_types = hf.get("layer_types")
  if layer_types is not None and any(t != "full_attention" for t in layer_types):
    raise ValueError("config.json: layer_types contains non-'full_attention' layers; lowrl "
                     "implements full causal attention only.")

  # Qwen2 always has q/k/v biases (and never an o_proj bias); Llama and Qwen3 put
  # `attention_bias` on all four projections, and lowrl has no o_proj bias.
  family = hf_moe.base_family(model_type)
  if family == "qwen2":
    qkv_bias = True
  else:
    if hf.get("attention_bias", False):
      raise ValueError(f"config.json: attention_bias=true for model_type {model_type!r} adds an "
                       "o_proj bias, which the lowrl param tree does not have.")
    qkv_bias = False

  defaults = _HF_DEFAULTS[model_type]
  d_model, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
  n_kv_heads = int(hf.get("num_key_value_heads", defaults["num_key_value_heads"]) or n_heads)
  head_dim = hf.get("head_dim")
  if head_dim is None:
    if d_model % n_heads:
      raise ValueError(f"config.json: hidden_size {d_model} is not divisible by "
                       f"num_attention_heads {n_heads}; set head_dim explicitly.")
    head_dim = d_model // n_heads
  if n_heads % n_kv_heads:
    raise ValueError(f"config.json: num_attention_heads {n_heads} is not a multiple of "
                     f"num_key_value_heads {n_kv_heads}.")
  rope_theta, scaling = _rope_fields(hf)
  return ModelConfig(
      vocab_size=int(hf["vocab_size"]),
      d_model=d_model,
      n_layers=int(hf["num_hidden_layers"]),
      n_heads=n_heads,
      n_kv_heads=n_kv_heads,
      head_dim=int(head_dim),
      d_ff=int(hf["intermediate_size"]),
      rope_theta=rope_theta,
      rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
      qk_norm=family == "qwen3",
      qkv_bias=qkv_bias,
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      max_seq_len=int(hf.get("max_position_embeddings", defaults["max_position_embeddings"])),
      rope_llama3_scaling=_llama3_scaling(scaling),
      **hf_moe.moe_fields_from_hf(hf, model_type),
  )


def infer_model_type(cfg: ModelConfig) -> str:
  """The Hugging Face family a ModelConfig corresponds to: q/k norm -> qwen3, qkv bias -> qwen2."""
  if cfg.qk_norm and cfg.qkv_bias:
    raise ValueError("ModelConfig has both qk_norm and qkv_bias; no supported Hugging Face "
                     "family (llama, qwen2, qwen3) has both.")
  if cfg.is_moe:
    return hf_moe.infer_moe_model_type(cfg)
  return "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"


def hf_config_from_model(cfg: ModelConfig, model_type: str | None = None,
                         dtype: Any = None, extra: Mapping[str, Any] | None = None) -> dict:
  """The Hugging Face `config.json` dict for `cfg`.

  Args:
    cfg: the model config.
    model_type: "llama", "qwen2" or "qwen3"; None infers it from cfg (see infer_model_type).
    dtype: recorded as `torch_dtype` (e.g. jnp.bfloat16); None leaves it out (or as in `extra`).
    extra: fields of an original config.json to keep (token ids, initializer_range, ...);
      the fields that describe the architecture are overwritten from cfg.

  Raises ValueError when cfg has a feature the family lacks (e.g. qkv_bias for llama).
  """
  model_type = model_type or infer_model_type(cfg)
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ValueError(f"model_type {model_type!r} is not supported; use one of "
                     f"{SUPPORTED_MODEL_TYPES}.")
  family = hf_moe.base_family(model_type)
  want_bias, want_norm = family == "qwen2", family == "qwen3"
  moe_fields = hf_moe.hf_moe_fields(cfg, model_type, original=extra)
  if cfg.qkv_bias != want_bias or cfg.qk_norm != want_norm:
    raise ValueError(
        f"model_type {model_type!r} has qkv_bias={want_bias}, qk_norm={want_norm}, but the "
        f"ModelConfig has qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm}; pass "
        f"model_type={infer_model_type(cfg)!r} (or None to infer it).")
  out = {k: v for k, v in (extra or {}).items() if k not in hf_moe.EXPERT_COUNT_KEYS}
  if out.get("model_type", model_type) != model_type:
    # Family-specific leftovers of another family would confuse transformers.
    raise ValueError(f"extra config is for model_type {out['model_type']!r}, not {model_type!r}.")
  out.update(
      architectures=[_ARCHITECTURES[model_type]],
      model_type=model_type,
      vocab_size=cfg.vocab_size,
      hidden_size=cfg.d_model,
      intermediate_size=cfg.d_ff,
      num_hidden_layers=cfg.n_layers,
      num_attention_heads=cfg.n_heads,
      num_key_value_heads=cfg.n_kv_heads,
      hidden_act="silu",
      max_position_embeddings=cfg.max_seq_len,
      rms_norm_eps=cfg.rms_eps,
      tie_word_embeddings=cfg.tie_embeddings,
      **moe_fields,
  )
  # Qwen2 configs usually carry no head_dim (older transformers ignore it there); write it only
  # when it differs from the hidden_size // num_attention_heads default or the original has it.
  if (family != "qwen2" or "head_dim" in out
      or cfg.head_dim * cfg.n_heads != cfg.d_model):
    out["head_dim"] = cfg.head_dim
  if family != "qwen2":
    out["attention_bias"] = False
  if model_type == "llama":
    out["mlp_bias"] = False
  if dtype is not None:
    name = jnp.dtype(dtype).name
    out["torch_dtype"] = name
    if "dtype" in out:  # transformers >= 5 spelling
      out["dtype"] = name

  scaling = None
  if cfg.rope_llama3_scaling is not None:
    factor, low, high, orig = cfg.rope_llama3_scaling
    scaling = {"factor": float(factor), "low_freq_factor": float(low),
               "high_freq_factor": float(high), "original_max_position_embeddings": int(orig),
               "rope_type": "llama3"}
  if isinstance(out.get("rope_parameters"), Mapping):
    # Keep the transformers >= 5 layout the original used.
    out["rope_parameters"] = {"rope_type": "default", **(scaling or {}),
                              "rope_theta": cfg.rope_theta}
  else:
    out["rope_theta"] = cfg.rope_theta
    out["rope_scaling"] = scaling
  return out


def read_hf_config(path: str | os.PathLike) -> dict:
  """The `config.json` dict of a checkpoint directory (clear error when it is missing)."""
  file = os.path.join(path, CONFIG_FILE)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"Checkpoint directory {str(path)!r} does not exist.")
  if not os.path.isfile(file):
    raise FileNotFoundError(
        f"{file} not found: a Hugging Face checkpoint directory needs config.json next to the "
        "*.safetensors files. Copy it from the original model repository.")
  try:
    with open(file) as fh:
      return json.load(fh)
  except json.JSONDecodeError as e:
    raise ValueError(f"{file} is not valid JSON ({e}); re-download or fix it.") from e

