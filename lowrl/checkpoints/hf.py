"""Hugging Face safetensors checkpoints <-> (ModelConfig, params): the safetensors I/O.

A checkpoint directory holds `config.json` (read and written by `hf_config.py`) plus either
`model.safetensors` or `model.safetensors.index.json` with its shards. Which tensor goes where is
one table (`hf_names.tensor_specs`), so loading and saving are exact inverses; `load_hf_params`
places the tensors on a mesh, each process reading only its devices' slices. A path ending in
`.gguf` is a llama.cpp GGUF file instead (`gguf.py`): `read_checkpoint_config`, `check_hf_weights`,
`load_hf_params` and `load_hf_checkpoint` read it through the same calls.
"""
from __future__ import annotations

import contextlib
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

from lowrl.checkpoints import gguf
from lowrl.checkpoints.hf_config import (CONFIG_FILE, hf_config_from_model, model_config_from_hf,
                                         read_hf_config)
from lowrl.checkpoints.hf_names import IGNORED_TENSOR_RE, TensorSpec, tensor_specs
from lowrl.models.config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_LOAD_DTYPES = ("float32", "bfloat16")
_DTYPES_BY_NAME = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
# Float dtypes a checkpoint tensor may be stored in; FP8/int tensors belong to quantized
# checkpoints, whose scales have no place in the param tree.
_FLOAT_SOURCE_DTYPES = ("float64", "float32", "float16", "bfloat16")


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


def _checked_files(path: str, cfg: ModelConfig) -> tuple[dict[str, str], dict[str, TensorSpec]]:
  """(tensor name -> file, tensor name -> spec) of a checkpoint for `cfg`, every tensor's presence,
  dtype and shape checked from the file headers (no tensor data is read)."""
  files = _weight_files(path)
  specs = {s.hf_name: s for s in tensor_specs(cfg)}
  missing = [name for name in specs if name not in files]
  if missing:
    hint = ""
    if "lm_head.weight" in missing:
      hint = (" config.json says tie_word_embeddings=false; if the model shares the embedding "
              "with the LM head, set it to true.")
    raise ValueError(f"Checkpoint {path!r} is missing {len(missing)} tensor(s) required by its "
                     f"config.json: {missing[:8]}{' ...' if len(missing) > 8 else ''}.{hint}")
  unexpected = [n for n in files if n not in specs and not IGNORED_TENSOR_RE.match(n)
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


def read_checkpoint_config(path: str | os.PathLike) -> dict:
  """The config.json dict of checkpoint `path`: a directory's file, or what a `.gguf` file's
  metadata says (gguf.read_gguf_config)."""
  if gguf.is_gguf(path):
    return gguf.read_gguf_config(path)
  return read_hf_config(path)


def check_hf_weights(path: str | os.PathLike, model_cfg: ModelConfig) -> None:
  """Raises (FileNotFoundError / ValueError naming the file or tensor) unless the weight files of
  checkpoint `path` hold every tensor of `model_cfg` with its shape, in a float dtype (a `.gguf`
  file: in a storage type lowrl dequantizes). Reads only the headers: a check to run before
  anything is compiled."""
  if gguf.is_gguf(path):
    gguf.check_gguf_weights(path, model_cfg)
    return
  _checked_files(os.fspath(path), model_cfg)


def _slice_reader(fh, spec: TensorSpec, target: np.dtype):
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
    path: checkpoint directory (config.json + model.safetensors or an index and shards), or a
      `.gguf` file (every tensor dequantized to FP32 first).
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
  if gguf.is_gguf(path):
    return gguf.load_gguf_params(path, model_cfg, dtype=target, shardings=shardings)
  files, specs = _checked_files(path, model_cfg)
  params: dict = {}
  with contextlib.ExitStack() as stack:
    handles = {f: stack.enter_context(_open(f)) for f in sorted(set(files[n] for n in specs))}
    groups: dict[tuple[str, ...], list[TensorSpec]] = {}
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
      plus shards), or a llama.cpp `.gguf` file.
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
  cfg = model_config_from_hf(read_checkpoint_config(path))
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
  specs = tensor_specs(model_cfg)
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
    save_safetensors(tensors, os.path.join(path, SINGLE_FILE), metadata)
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_safetensors({n: tensors[n] for n in shard}, os.path.join(path, file), metadata)
      weight_map.update({n: file for n in shard})
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(path, INDEX_FILE), "w") as fh:
      json.dump(index, fh, indent=2)
      fh.write("\n")
  with open(os.path.join(path, CONFIG_FILE), "w") as fh:
    json.dump(hf_cfg, fh, indent=2, sort_keys=True)
    fh.write("\n")


def save_safetensors(tensors: Mapping[str, np.ndarray], file: str,
                     metadata: Mapping[str, str] | None = None) -> None:
  """`safetensors.numpy.save_file`, leaving the file with a normal file's mode.

  safetensors writes through a private temporary file and renames it, so the file keeps that
  file's 0600; other users (a serving container's) could not read the weights. The mode is set to
  what `open()` would give, 0666 less the process umask (0644 under the usual 022)."""
  safetensors.numpy.save_file(dict(tensors), file, metadata=dict(metadata or {}))
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(file, 0o666 & ~umask)


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
