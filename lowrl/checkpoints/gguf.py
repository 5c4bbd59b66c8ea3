"""GGUF checkpoints (llama.cpp's single-file format) -> (config.json dict, params).

A GGUF file holds the model's hyperparameters as metadata (`llama.block_count`, ...), its
tokenizer (`gguf_tokenizer.py`) and its tensors under llama.cpp's names, each stored as F32/F16/
BF16 or in a block quantization (Q4_0, Q4_1, Q8_0, the K-quants, ...). We read the file with the
`gguf` package (llama.cpp's own reader) and dequantize every tensor to FP32 with its
`gguf.quants.dequantize`, so the params are exactly the values llama.cpp computes with.

Three things differ from a Hugging Face checkpoint, each undone here:
- the names (`blk.3.attn_q.weight` for `model.layers.3.self_attn.q_proj.weight`): `_GGUF_NAMES`;
- llama.cpp's converter permutes the rows of a Llama q/k projection within each head from
  transformers' RoPE layout (the two halves of a head) to its own (interleaved pairs):
  `unpermute_qk` is the inverse of its `LlamaModel.permute` (convert_hf_to_gguf.py);
- the hyperparameters: `hf_config_from_gguf` writes the config.json dict transformers would have
  for them, so that `hf_config.model_config_from_hf` builds the ModelConfig (one place decides
  what lowrl supports) and the export keeps the token ids.

Every check (architecture, hyperparameters, tensor names, shapes, quantization types) reads only
the header: `check_gguf_weights` runs before anything is compiled.
"""
from __future__ import annotations

import functools
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lowrl.checkpoints.hf_names import TensorSpec, tensor_specs
from lowrl.models.config import ModelConfig

GGUF_SUFFIX = ".gguf"
# Families whose GGUF tensors map onto the lowrl decoder (the dense ones hf_config supports).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Only llama.cpp's Llama converter permutes q/k; its Qwen2/Qwen3 converters keep HF's layout.
_PERMUTED_QK = ("llama",)
# Storage types we dequantize (through gguf.quants): what the common small checkpoints use.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K",
                   "Q4_K", "Q5_K", "Q6_K")

# HF tensor name (hf_names' table) -> GGUF name: llama.cpp's tensor_mapping for these families.
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                 "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
_LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def is_gguf(path: str | os.PathLike) -> bool:
  """Whether `path` names a GGUF file (by its suffix: a directory is a HF checkpoint)."""
  return os.fspath(path).lower().endswith(GGUF_SUFFIX)


class MissingGGUFPackage(ImportError, ValueError):
  """The optional `gguf` package is not installed (a ValueError too, so that the config checks
  report it as their one-line errors)."""


def _gguf_package():
  try:
    import gguf  # noqa: PLC0415  (optional dependency: only GGUF checkpoints need it)
  except ImportError:
    raise MissingGGUFPackage("Reading a .gguf checkpoint needs the `gguf` package: "
                             "pip install -e '.[gguf]' (or pip install gguf).") from None
  return gguf


@functools.lru_cache(maxsize=4)
def _reader(path: str, mtime: float):
  """The file's GGUFReader (memory-mapped; cached per path and modification time)."""
  del mtime  # part of the cache key only
  gguf = _gguf_package()
  try:
    return gguf.GGUFReader(path)
  except (ValueError, OSError, KeyError, IndexError) as e:
    raise ValueError(f"{path} is not a readable GGUF file ({e}); it is truncated or corrupt. "
                     "Re-download it.") from None


def open_gguf(path: str | os.PathLike):
  """A `gguf.GGUFReader` of `path` (FileNotFoundError / one-line ValueError when unreadable)."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"GGUF file {path!r} does not exist.")
  return _reader(os.path.abspath(path), os.path.getmtime(path))


def metadata(reader, key: str, default: Any = None) -> Any:
  """The value of metadata `key` (a str, number, bool or list), `default` when absent."""
  field = reader.get_field(key)
  if field is None:
    return default
  return field.contents()


def _scalar(reader, key: str, default: Any = None) -> Any:
  value = metadata(reader, key, default)
  if isinstance(value, list):
    # Per-layer values (e.g. head counts varying by layer) have no ModelConfig equivalent.
    if len(set(value)) != 1:
      raise ValueError(f"GGUF metadata {key} varies by layer ({value[:6]}...); lowrl's decoder "
                       "has one value for all layers.")
    value = value[0]
  return value


def architecture(reader) -> str:
  """general.architecture, checked against SUPPORTED_ARCHITECTURES."""
  arch = metadata(reader, "general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(f"GGUF architecture {arch!r} is not supported; lowrl loads "
                     f"{SUPPORTED_ARCHITECTURES} GGUF files.")
  return arch


def hf_config_from_gguf(reader) -> dict:
  """The Hugging Face config.json dict of a GGUF file's metadata (what transformers' GGUF loader
  builds), with the special token ids of its tokenizer. Raises ValueError for a feature the lowrl
  decoder lacks (MoE, partial or scaled RoPE, sliding windows), naming the key."""
  arch = architecture(reader)

  def key(name, default=None):
    return _scalar(reader, f"{arch}.{name}", default)

  required = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size",
              "feed_forward_length": "intermediate_size", "attention.head_count":
              "num_attention_heads"}
  missing = [f"{arch}.{k}" for k in required if key(k) is None]
  if missing:
    raise ValueError(f"GGUF metadata lacks {missing}; the file is incomplete.")
  if key("expert_count", 0):
    raise ValueError(f"GGUF {arch}.expert_count={key('expert_count')}: mixture-of-experts GGUF "
                     "files are not supported (load the HF safetensors checkpoint instead).")
  scaling = key("rope.scaling.type", "none")
  if scaling not in ("none", None) or reader_has_tensor(reader, "rope_freqs.weight"):
    raise ValueError(f"GGUF RoPE scaling ({arch}.rope.scaling.type={scaling!r} or a "
                     "rope_freqs.weight tensor) is not supported; lowrl's GGUF loader implements "
                     "unscaled RoPE (load the HF checkpoint for Llama 3.1 scaling).")
  if key("attention.sliding_window") is not None:
    raise ValueError(f"GGUF {arch}.attention.sliding_window is set; lowrl implements full causal "
                     "attention only.")
  d_model, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
  head_dim = int(key("attention.key_length", d_model // n_heads))
  if int(key("attention.value_length", head_dim)) != head_dim:
    raise ValueError(f"GGUF {arch}.attention.value_length differs from key_length; lowrl's "
                     "attention has one head_dim.")
  rope_dims = key("rope.dimension_count")
  if rope_dims is not None and int(rope_dims) != head_dim:
    raise ValueError(f"GGUF {arch}.rope.dimension_count={rope_dims} rotates part of a head of "
                     f"{head_dim}; lowrl implements full-head RoPE only.")
  tokens = metadata(reader, "tokenizer.ggml.tokens") or []
  embed = reader_tensor(reader, "token_embd.weight")
  vocab = key("vocab_size") or (int(embed.shape[-1]) if embed is not None else len(tokens))
  hf: dict[str, Any] = {
      "model_type": arch,
      "num_hidden_layers": int(key("block_count")),
      "hidden_size": d_model,
      "intermediate_size": int(key("feed_forward_length")),
      "num_attention_heads": n_heads,
      "num_key_value_heads": int(key("attention.head_count_kv", n_heads)),
      "head_dim": head_dim,
      "rope_theta": float(key("rope.freq_base", 10000.0)),
      "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
      "max_position_embeddings": int(key("context_length", 2048)),
      "vocab_size": int(vocab),
      "hidden_act": "silu",
      # llama.cpp writes no output.weight when the LM head is the embedding.
      "tie_word_embeddings": not reader_has_tensor(reader, "output.weight"),
  }
  for name, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                         ("pad_token_id", "padding_token_id")):
    token_id = metadata(reader, f"tokenizer.ggml.{gguf_key}")
    if token_id is not None:
      hf[name] = int(token_id)
  return hf


def read_gguf_config(path: str | os.PathLike) -> dict:
  """hf_config_from_gguf of the file at `path`."""
  return hf_config_from_gguf(open_gguf(path))


def reader_tensor(reader, name: str):
  """The ReaderTensor called `name`, None if the file has none."""
  return _tensors(reader).get(name)


def reader_has_tensor(reader, name: str) -> bool:
  return reader_tensor(reader, name) is not None


def _tensors(reader) -> dict:
  return {t.name: t for t in reader.tensors}


def gguf_name(hf_name: str) -> str:
  """The GGUF tensor name of a Hugging Face tensor name of a dense Llama/Qwen decoder."""
  if hf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[hf_name]
  m = _LAYER_RE.match(hf_name)
  if m is None or m.group(2) not in _LAYER_NAMES:
    raise ValueError(f"{hf_name} has no GGUF name in lowrl's table (llama/qwen2/qwen3 dense "
                     "decoders only).")
  return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
  """llama.cpp's q/k row order -> transformers': the inverse of convert_hf_to_gguf's
  `permute(w, n_head, n_head_kv)`, which reshapes the rows [out] to (heads, 2, head_dim/2) and
  swaps the last two axes (`n_heads` = the tensor's own heads: query heads for q, KV heads for k).
  Works on a weight [out, in] and on a bias [out]."""
  rows = w.shape[0]
  return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))


def _gguf_specs(reader, cfg: ModelConfig) -> dict[str, TensorSpec]:
  """GGUF name -> the HF spec it fills, every tensor's presence, shape and type checked."""
  gguf = _gguf_package()
  tensors = _tensors(reader)
  specs = {gguf_name(s.hf_name): s for s in tensor_specs(cfg)}
  missing = [n for n in specs if n not in tensors]
  if missing:
    raise ValueError(f"GGUF file lacks {len(missing)} tensor(s) its metadata implies: "
                     f"{missing[:8]}{' ...' if len(missing) > 8 else ''}.")
  unexpected = [n for n in tensors if n not in specs]
  if unexpected:
    raise ValueError(f"GGUF file has tensor(s) the lowrl decoder does not use: "
                     f"{sorted(unexpected)[:8]}; the file is a variant lowrl does not implement "
                     "(biases, MoE, scaled RoPE, ...).")
  for name, spec in specs.items():
    t = tensors[name]
    kind = gguf.GGMLQuantizationType(t.tensor_type).name
    if kind not in SUPPORTED_TYPES:
      raise ValueError(f"GGUF tensor {name} is stored as {kind}; lowrl dequantizes "
                       f"{SUPPORTED_TYPES} (requantize the file, e.g. llama-quantize ... Q8_0).")
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
    if shape != spec.hf_shape:
      raise ValueError(f"GGUF tensor {name} has shape {shape} (as [out, in]) but the metadata "
                       f"implies {spec.hf_shape}; the file is inconsistent.")
  return specs


def check_gguf_weights(path: str | os.PathLike, cfg: ModelConfig) -> None:
  """Raises (FileNotFoundError / one-line ValueError) unless the GGUF file holds every tensor of
  `cfg` with its shape in a supported storage type. Reads only the header."""
  _gguf_specs(open_gguf(path), cfg)


def _hf_array(reader, t, spec: TensorSpec, arch: str, cfg: ModelConfig) -> np.ndarray:
  """One tensor dequantized to FP32 in Hugging Face layout ([out, in] for a linear)."""
  gguf = _gguf_package()
  qtype = gguf.GGMLQuantizationType(t.tensor_type)
  if qtype.name in ("F32", "F16"):
    array = np.asarray(t.data, dtype=np.float32)
  else:
    array = gguf.quants.dequantize(np.asarray(t.data), qtype)
  array = np.asarray(array, dtype=np.float32).reshape(spec.hf_shape)
  if arch in _PERMUTED_QK:
    if t.name.endswith(("attn_q.weight", "attn_q.bias")):
      array = unpermute_qk(array, cfg.n_heads)
    elif t.name.endswith(("attn_k.weight", "attn_k.bias")):
      array = unpermute_qk(array, cfg.n_kv_heads)
  return array


def load_gguf_params(path: str | os.PathLike, cfg: ModelConfig, *, dtype: Any = jnp.float32,
                     shardings: Any = None) -> dict:
  """The lowrl param tree of GGUF file `path` for `cfg` (from `read_gguf_config`), every tensor
  dequantized to FP32 by gguf.quants, then cast to `dtype`; placed like
  `hf.load_hf_params` (`shardings`: None = the default device, else a tree of Shardings)."""
  reader = open_gguf(path)
  arch = architecture(reader)
  specs = _gguf_specs(reader, cfg)
  tensors = _tensors(reader)
  target = jnp.dtype(dtype)
  params: dict = {}
  for name, spec in specs.items():
    array = _hf_array(reader, tensors[name], spec, arch, cfg)
    if spec.transpose:
      array = array.T
    array = np.ascontiguousarray(array).astype(target)
    if shardings is None:
      value = jnp.asarray(array)
    else:
      sharding = shardings
      for key in spec.path:
        sharding = sharding[key]
      value = jax.make_array_from_callback(array.shape, sharding, lambda i, a=array: a[i])
    node = params
    for key in spec.path[:-1]:
      node = node.setdefault(key, {})
    node[spec.path[-1]] = value
  return params


def storage_types(path: str | os.PathLike) -> dict[str, int]:
  """{storage type name: number of tensors} of a GGUF file (what its weights were rounded to)."""
  gguf = _gguf_package()
  out: dict[str, int] = {}
  for t in open_gguf(path).tensors:
    kind = gguf.GGMLQuantizationType(t.tensor_type).name
    out[kind] = out.get(kind, 0) + 1
  return out

