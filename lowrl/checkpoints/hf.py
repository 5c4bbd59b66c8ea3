"""Hugging Face safetensors checkpoints <-> (ModelConfig, params).

Supported families: Llama (2/3, incl. `rope_scaling` type "llama3"), Qwen2/Qwen2.5 (qkv bias) and
Qwen3 (q/k RMSNorm, explicit head_dim). A checkpoint directory holds `config.json` plus either
`model.safetensors` or `model.safetensors.index.json` with its shards.

One table (`_tensor_specs`) lists every Hugging Face tensor with its place in the lowrl param tree,
so loading and saving are exact inverses: the linear layers (names, places, widths, biases) come
from the model's layout (`lowrl.models.layout`), the embedding and norms are listed here. Hugging
Face `nn.Linear` weights are `[out, in]`, lowrl kernels `[in, out]`; everything else is copied as
is.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from lowrl.checkpoints import hf_moe
from lowrl.models import layout
from lowrl.models.config import ModelConfig

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3") + hf_moe.MOE_MODEL_TYPES
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    **hf_moe.ARCHITECTURES,
}
_LOAD_DTYPES = ("float32", "bfloat16")
_DTYPES_BY_NAME = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
# Float dtypes a checkpoint tensor may be stored in; FP8/int tensors belong to quantized
# checkpoints, whose scales have no place in the param tree.
_FLOAT_SOURCE_DTYPES = ("float64", "float32", "float16", "bfloat16")
# transformers' defaults for the optional config.json fields (LlamaConfig, Qwen2Config,
# Qwen3Config), so that a sparse config.json means what it means to transformers.
_HF_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "num_key_value_heads": None},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32},
    **hf_moe.HF_DEFAULTS,
}
# Buffers some old exports carry that hold no learned state (recomputed from the config).
_IGNORED_TENSOR_RE = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


@dataclasses.dataclass(frozen=True)
class _TensorSpec:
  """One Hugging Face tensor and where it lives in the lowrl param tree."""
  hf_name: str
  path: tuple[str, ...]
  hf_shape: tuple[int, ...]
  transpose: bool  # HF Linear weight [out, in] <-> lowrl kernel [in, out]
  expert: int | None = None  # the slice [expert] of a stacked expert kernel [E, in, out]


def _linear_specs(m: layout.Matmul) -> list[_TensorSpec]:
  """The weight (and bias) of a matmul that owns its kernel; HF Linear stores it [out, in]."""
  if m.n_experts:  # one HF tensor per expert
    return [_TensorSpec(name, m.param_keys, (m.out_features, m.in_features), True, e)
            for e, name in enumerate(hf_moe.expert_tensor_names(m))]
  transpose = m.contract_axis == 0  # lowrl [in, out] -> HF [out, in]
  hf_shape = m.weight_shape[::-1] if transpose else m.weight_shape
  specs = [_TensorSpec(f"{m.hf_name}.weight", m.param_keys, hf_shape, transpose)]
  if m.has_bias:
    specs.append(_TensorSpec(f"{m.hf_name}.bias", m.param_keys[:-1] + ("bias",),
                             (m.out_features,), False))
  return specs


def _norm_specs(cfg: ModelConfig, m: layout.Matmul) -> list[_TensorSpec]:
  """The norms (not matmuls) listed just before matmul `m` in the table's order."""
  def norm(hf_name, path, dim):
    return [_TensorSpec(hf_name, path + ("scale",), (dim,), False)]

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


def _tensor_specs(cfg: ModelConfig) -> list[_TensorSpec]:
  """Every tensor of a checkpoint for `cfg`, layer by layer.

  The linear layers come from the model's layout (`layout.matmuls`); the embedding and the norms,
  which are no matmuls, are listed here. A tied LM head reads the embedding, stored once.
  """
  specs = [_TensorSpec("model.embed_tokens.weight", ("embed", "embedding"),
                       (cfg.vocab_size, cfg.d_model), False)]
  for m in layout.matmuls(cfg):
    specs += _norm_specs(cfg, m)
    if m.owns_kernel:
      specs += _linear_specs(m)
  return specs


# ------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


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
  moe_fields = hf_moe.hf_moe_fields(cfg, model_type)
  if cfg.qkv_bias != want_bias or cfg.qk_norm != want_norm:
    raise ValueError(
        f"model_type {model_type!r} has qkv_bias={want_bias}, qk_norm={want_norm}, but the "
        f"ModelConfig has qkv_bias={cfg.qkv_bias}, qk_norm={cfg.qk_norm}; pass "
        f"model_type={infer_model_type(cfg)!r} (or None to infer it).")
  out = dict(extra or {})
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


# ------------------------------------------------------------------------------------------------
# safetensors files


def _weight_files(path: str) -> dict[str, str]:
  """Tensor name -> file holding it, from the single file or the shard index."""
  single, index = os.path.join(path, SINGLE_FILE), os.path.join(path, INDEX_FILE)
  # Same preference as transformers: the single file wins over an index.
  if os.path.isfile(single):
    with _open(single) as fh:
      return {name: single for name in fh.keys()}
  if os.path.isfile(index):
    try:
      with open(index) as fh:
        weight_map = json.load(fh)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise ValueError(f"{index} is not a valid shard index (needs a 'weight_map' object): {e}. "
                       "Re-download it.") from e
    shards = {}
    for shard in sorted(set(weight_map.values())):
      shards[shard] = os.path.join(path, shard)
      if not os.path.isfile(shards[shard]):
        raise FileNotFoundError(f"{shards[shard]} is listed in {INDEX_FILE} but missing; "
                                "download all shards.")
    return {name: shards[shard] for name, shard in weight_map.items()}
  raise FileNotFoundError(f"No {SINGLE_FILE} or {INDEX_FILE} in {path!r}; lowrl loads safetensors "
                          "checkpoints only (convert *.bin/*.pth weights to safetensors first).")


def _open(file: str):
  """safe_open with corrupt/truncated files reported by name."""
  try:
    return safetensors.safe_open(file, framework="np")
  except safetensors.SafetensorError as e:
    raise ValueError(f"{file} is not a readable safetensors file ({e}); it is probably truncated "
                     "or corrupt (an interrupted download?). Re-download it.") from e


def _set(tree: dict, path: tuple[str, ...], value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get(tree: Mapping, path: tuple[str, ...]):
  for key in path:
    tree = tree[key]
  return tree


def _check_dtype(dtype: Any, allowed: tuple[str, ...]) -> np.dtype:
  name = jnp.dtype(dtype).name
  if name not in allowed:
    raise ValueError(f"dtype {name!r} is not supported here; use one of {allowed}.")
  return _DTYPES_BY_NAME[name]


# safetensors header dtype names -> numpy dtype names (the float ones a checkpoint may hold).
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _checked_files(path: str, cfg: ModelConfig) -> tuple[dict[str, str], dict[str, _TensorSpec]]:
  """(tensor name -> file, tensor name -> spec) of a checkpoint for `cfg`, every tensor's presence,
  dtype and shape checked from the file headers (no tensor data is read)."""
  files = _weight_files(path)
  specs = {s.hf_name: s for s in _tensor_specs(cfg)}
  missing = [name for name in specs if name not in files]
  if missing:
    hint = ""
    if "lm_head.weight" in missing:
      hint = (" config.json says tie_word_embeddings=false; if the model shares the embedding "
              "with the LM head, set it to true.")
    raise ValueError(f"Checkpoint {path!r} is missing {len(missing)} tensor(s) required by its "
                     f"config.json: {missing[:8]}{' ...' if len(missing) > 8 else ''}.{hint}")
  unexpected = [n for n in files if n not in specs and not _IGNORED_TENSOR_RE.match(n)
                # A tied checkpoint may still store the (identical) LM head.
                and not (cfg.tie_embeddings and n == "lm_head.weight")]
  if unexpected:
    raise ValueError(f"Checkpoint {path!r} has tensor(s) the lowrl {cfg.__class__.__name__} does "
                     f"not use: {sorted(unexpected)[:8]}{' ...' if len(unexpected) > 8 else ''}. "
                     "The checkpoint does not match config.json or uses a variant lowrl does not "
                     "implement (e.g. biases, MoE, quantization scales).")
  by_file: dict[str, list[str]] = {}
  for name in specs:
    by_file.setdefault(files[name], []).append(name)
  for file, names in by_file.items():
    with _open(file) as fh:
      present = set(fh.keys())
      for name in names:
        if name not in present:
          raise ValueError(f"{INDEX_FILE} maps {name!r} to {file}, which does not contain it; "
                           "the index and shards are inconsistent. Re-download them.")
        header = fh.get_slice(name)
        dtype = header.get_dtype()
        if _SAFETENSORS_DTYPES.get(dtype) not in _FLOAT_SOURCE_DTYPES:
          raise ValueError(f"Tensor {name!r} has dtype {dtype}; only float tensors "
                           f"{_FLOAT_SOURCE_DTYPES} load (quantized checkpoints are not "
                           "supported).")
        shape = tuple(header.get_shape())
        if shape != specs[name].hf_shape:
          raise ValueError(f"Tensor {name!r} has shape {shape}, but config.json implies "
                           f"{specs[name].hf_shape}; the weights do not match the config.")
  return files, specs


def check_hf_weights(path: str | os.PathLike, model_cfg: ModelConfig) -> None:
  """Raises (FileNotFoundError / ValueError naming the file or tensor) unless the weight files of
  checkpoint `path` hold every tensor of `model_cfg` with its shape, in a float dtype. Reads only
  the safetensors headers: a check to run before anything is compiled."""
  _checked_files(os.fspath(path), model_cfg)


def _slice_reader(fh, spec: _TensorSpec, target: np.dtype):
  """index (a tuple of slices in lowrl coordinates) -> that slice of the tensor, read alone from
  the file, in lowrl layout and `target` dtype."""
  def read(index: tuple[slice, ...]) -> np.ndarray:
    index = tuple(index) + (slice(None),) * (len(spec.hf_shape) - len(index))
    try:
      array = fh.get_slice(spec.hf_name)[index[::-1] if spec.transpose else index]
    except safetensors.SafetensorError as e:
      raise ValueError(f"tensor {spec.hf_name!r} cannot be read ({e}); the file is probably "
                       "corrupt. Re-download it.") from e
    if spec.transpose:
      array = array.T
    return np.ascontiguousarray(array.astype(target))
  return read


def _stacked_reader(readers):
  """index -> the slice of a stacked [E, ...] kernel, each expert's part read from its tensor."""
  def read(index: tuple[slice, ...]) -> np.ndarray:
    index = tuple(index) or (slice(None),)
    return np.stack([readers[e](index[1:]) for e in range(len(readers))[index[0]]])
  return read


def load_hf_params(path: str | os.PathLike, model_cfg: ModelConfig, *, dtype: Any = jnp.float32,
                   shardings: Any = None) -> dict:
  """The params of checkpoint `path` for `model_cfg` (its architecture must be the checkpoint's).

  Args:
    path: checkpoint directory (config.json + model.safetensors or an index and shards).
    model_cfg: the model config (`model_config_from_hf` of the checkpoint's config.json, execution
      knobs such as scan_layers free).
    dtype: jnp.float32 or jnp.bfloat16; every parameter is cast to it (BF16 -> FP32 is exact).
    shardings: None = each parameter whole on the default device; else a tree of
      jax.sharding.Sharding matching the param tree (e.g. ShardingPlan.param_shardings): each
      parameter becomes a global array built with `jax.make_array_from_callback`, so a process
      reads from the files only the slices its addressable devices hold (each distinct slice
      once, however many of its devices hold it).

  Raises:
    FileNotFoundError / ValueError as `check_hf_weights`, before any tensor data is read.
  """
  path = os.fspath(path)
  target = _check_dtype(dtype, _LOAD_DTYPES)
  files, specs = _checked_files(path, model_cfg)
  params: dict = {}
  with contextlib.ExitStack() as stack:
    handles = {f: stack.enter_context(_open(f)) for f in sorted(set(files[n] for n in specs))}
    groups: dict[tuple[str, ...], list[_TensorSpec]] = {}
    for spec in specs.values():  # a stacked expert kernel: its E tensors in expert order
      groups.setdefault(spec.path, []).append(spec)
    for group in groups.values():
      spec = group[0]
      readers = [_slice_reader(handles[files[s.hf_name]], s, target) for s in group]
      shape = spec.hf_shape[::-1] if spec.transpose else spec.hf_shape
      read = readers[0]
      if spec.expert is not None:
        shape, read = (len(readers),) + shape, _stacked_reader(readers)
      if shardings is None:
        value = jnp.asarray(read(()))
      else:
        cache: dict[tuple, np.ndarray] = {}  # replicas of one slice on several devices: one read

        def cached(index, read=read, cache=cache):
          key = tuple((s.start, s.stop, s.step) for s in index)
          if key not in cache:
            cache[key] = read(index)
          return cache[key]
        value = jax.make_array_from_callback(shape, _get(shardings, spec.path), cached)
      _set(params, spec.path, value)
  return params


def load_hf_checkpoint(path: str | os.PathLike,
                       dtype: Any = jnp.float32) -> tuple[ModelConfig, dict]:
  """Loads a Hugging Face Llama/Qwen2/Qwen3 safetensors checkpoint directory.

  Args:
    path: directory with config.json and model.safetensors (or model.safetensors.index.json
      plus shards).
    dtype: jnp.float32 or jnp.bfloat16; every parameter is cast to it (BF16 -> FP32 is exact).

  Returns:
    (ModelConfig, params) with params in the lowrl tree of ARCHITECTURE.md (kernels [in, out]),
    on the default device (`load_hf_params` places them on a mesh instead).

  Raises:
    FileNotFoundError: missing directory, config.json, weights or shard.
    ValueError: unsupported config, corrupt/truncated file, missing/unexpected tensor, wrong
      shape or non-float (quantized) tensor; the message names the file or tensor.
  """
  _check_dtype(dtype, _LOAD_DTYPES)
  cfg = model_config_from_hf(read_hf_config(path))
  return cfg, load_hf_params(path, cfg, dtype=dtype)


def save_hf_checkpoint(path: str | os.PathLike, model_cfg: ModelConfig, params: Mapping,
                       model_type: str | None = None, dtype: Any = None,
                       extra_config: Mapping[str, Any] | None = None,
                       max_shard_bytes: int | None = None) -> None:
  """Writes (model_cfg, params) as a Hugging Face checkpoint directory.

  The inverse of load_hf_checkpoint: loading the result gives back the same config and params,
  and saving a loaded checkpoint with its original dtype gives the original tensors bitwise.

  Args:
    path: output directory (created if needed). Weight files of an earlier save there
      (model.safetensors, the index, model-*-of-*.safetensors) are replaced.
    model_cfg: the model config.
    params: the lowrl param tree.
    model_type: "llama", "qwen2" or "qwen3"; None infers it from model_cfg.
    dtype: dtype the tensors are written in (jnp.float32 / jnp.bfloat16); None keeps each
      parameter's own dtype.
    extra_config: fields of the original config.json to keep (see hf_config_from_model), e.g.
      read_hf_config(source_dir).
    max_shard_bytes: split into model-0000i-of-0000n.safetensors shards of at most this many
      bytes of tensor data (a tensor larger than that gets a shard of its own), plus an index;
      None writes a single model.safetensors.
  """
  path = os.fspath(path)
  target = None if dtype is None else _check_dtype(dtype, _LOAD_DTYPES)
  specs = _tensor_specs(model_cfg)
  tensors: dict[str, np.ndarray] = {}
  for spec in specs:
    try:
      value = _get(params, spec.path)
    except (KeyError, TypeError) as e:
      raise ValueError(f"params lacks {'/'.join(spec.path)} (for {spec.hf_name}), which the "
                       "ModelConfig requires.") from e
    if spec.expert is not None:
      if np.ndim(value) != 3 or np.shape(value)[0] <= spec.expert:
        raise ValueError(f"params {'/'.join(spec.path)} has shape {np.shape(value)}; the "
                         f"ModelConfig needs stacked experts [E, in, out] for {spec.hf_name}.")
      value = value[spec.expert]
    array = np.asarray(jax.device_get(value))
    if target is not None:
      array = array.astype(target)
    if spec.transpose:
      array = array.T
    if tuple(array.shape) != spec.hf_shape:
      ours = array.shape[::-1] if spec.transpose else array.shape
      raise ValueError(f"params {'/'.join(spec.path)} has shape {tuple(ours)}, which does not "
                       f"match the ModelConfig ({spec.hf_name} must be {spec.hf_shape}).")
    tensors[spec.hf_name] = np.ascontiguousarray(array)
  dtypes = {a.dtype.name for a in tensors.values()}
  hf_cfg = hf_config_from_model(model_cfg, model_type,
                                dtype=dtypes.pop() if len(dtypes) == 1 else None,
                                extra=extra_config)

  os.makedirs(path, exist_ok=True)
  # Stale shards of an earlier save would be mixed into (or even preferred over) the new
  # weights by the loader; transformers' save_pretrained removes them the same way.
  for name in os.listdir(path):
    if name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.match(name):
      os.remove(os.path.join(path, name))

  metadata = {"format": "pt"}  # transformers refuses safetensors files without it
  shards = _split_shards(tensors, max_shard_bytes)
  if len(shards) == 1 and max_shard_bytes is None:
    safetensors.numpy.save_file(tensors, os.path.join(path, SINGLE_FILE), metadata=metadata)
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      safetensors.numpy.save_file({n: tensors[n] for n in shard}, os.path.join(path, file),
                                  metadata=metadata)
      weight_map.update({n: file for n in shard})
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(path, INDEX_FILE), "w") as fh:
      json.dump(index, fh, indent=2)
      fh.write("\n")
  with open(os.path.join(path, CONFIG_FILE), "w") as fh:
    json.dump(hf_cfg, fh, indent=2, sort_keys=True)
    fh.write("\n")


def _split_shards(tensors: Mapping[str, np.ndarray], max_bytes: int | None) -> list[list[str]]:
  """Greedy split in tensor order into groups of at most max_bytes (None: one group)."""
  if max_bytes is None:
    return [list(tensors)]
  if max_bytes <= 0:
    raise ValueError(f"max_shard_bytes must be positive, got {max_bytes}.")
  shards: list[list[str]] = [[]]
  size = 0
  for name, array in tensors.items():
    if shards[-1] and size + array.nbytes > max_bytes:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += array.nbytes
  return shards
