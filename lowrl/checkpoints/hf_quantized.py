"""Rollout weights as a quantized Hugging Face checkpoint in NVIDIA ModelOpt's layout.

vLLM (`quantization="modelopt_fp4"` / `"modelopt_mxfp8"`, detected from the config), SGLang and
TensorRT-LLM load this "unified HF checkpoint" layout. Every decoder-block linear
(`model.layers.{i}.self_attn.{q,k,v,o}_proj`, `model.layers.{i}.mlp.{gate,up,down}_proj`) stores,
next to its unchanged bias, in Hugging Face's [out, in] orientation (blocks run along `in`):

  NVFP4 (group_size 16):
    weight          uint8          [out, in/2]   E2M1 codes, two per byte: element 2j of a row in
                                                 the low nibble, 2j+1 in the high nibble
    weight_scale    float8_e4m3fn  [out, in/16]  block scales
    weight_scale_2  float32        []            the per-tensor (outer) scale
    input_scale     float32        []            static activation scale = amax(input) / (6*448)
    dequantized weight = e2m1(code) * weight_scale * weight_scale_2 (the first product exact)
  MXFP8 (blocks of 32):
    weight          float8_e4m3fn  [out, in]
    weight_scale    uint8          [out, in/32]  E8M0 block scales (biased exponent, 2**(s-127))

Embeddings, norms and `lm_head` stay unquantized (listed in `ignore` / `exclude_modules`). The
config gets `quantization_config = {"quant_method": "modelopt", "quant_algo": "NVFP4" | "MXFP8",
"group_size", "kv_cache_quant_algo": None, "ignore": [...]}` and `hf_quant_config.json` the same
in ModelOpt's own form. The codes and scales are lowrl's (`lowrl.quant.quantize`, spec-exact,
default roundings: the weight quantizer of the `nvfp4_naive` and `mxfp8` recipes), so the
dequantized weights equal lowrl's `fake_quant` of the kernels bit for bit, i.e. the weights such
a sampler used. A recipe with 4/6 selection or high-precision layers (`nvfp4_recipe`) sampled
with other weights than this layout holds.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from lowrl.checkpoints import hf
from lowrl.models import layout
from lowrl.models.config import ModelConfig
from lowrl.quant.config import QuantConfig
from lowrl.quant.packing import pack_e2m1, unpack_e2m1
from lowrl.quant.quantize import quantize

ROLLOUT_FORMATS = ("nvfp4", "mxfp8")
QUANT_CONFIG_FILE = "hf_quant_config.json"
_ALGO = {"nvfp4": "NVFP4", "mxfp8": "MXFP8"}
_ELEMENT_FMT = {"nvfp4": "nvfp4", "mxfp8": "mxfp8_e4m3"}
_GROUP = {"nvfp4": 16, "mxfp8": 32}
_NVFP4_MAX = 6.0 * 448.0  # E2M1 max x E4M3 max: ModelOpt's scale = amax / this
# safetensors dtype names -> NumPy dtypes (safetensors' NumPy reader lacks the FP8 types).
_ST_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
              "BF16": np.dtype(ml_dtypes.bfloat16), "U8": np.dtype(np.uint8),
              "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
              "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64),
              "I32": np.dtype(np.int32), "F64": np.dtype(np.float64)}


def _check_format(fmt: str) -> None:
  if fmt not in ROLLOUT_FORMATS:
    raise ValueError(f"rollout format {fmt!r} is not supported; use one of {ROLLOUT_FORMATS}.")


def weight_quant_config(fmt: str) -> QuantConfig:
  """lowrl's quantizer of an [out, in] weight for `fmt` (blocks along `in`, the default roundings:
  the weight quantizer of the `nvfp4_naive` / `mxfp8` recipes)."""
  _check_format(fmt)
  return QuantConfig(_ELEMENT_FMT[fmt], axis=-1)


def quantize_linear(weight_OI: Any, fmt: str, input_amax: float | None = None
                    ) -> dict[str, np.ndarray]:
  """The ModelOpt tensors (`weight`, `weight_scale`, ...) of one [out, in] weight.

  input_amax: max |input| of the linear (NVFP4's static `input_scale`); required for nvfp4.
  """
  cfg = weight_quant_config(fmt)
  w = jnp.asarray(weight_OI, jnp.float32)
  if w.ndim != 2 or w.shape[1] % _GROUP[fmt]:
    raise ValueError(f"{fmt} weights must be 2-D [out, in] with in divisible by {_GROUP[fmt]}, "
                     f"got shape {tuple(w.shape)}.")
  q = quantize(w, cfg)
  if fmt == "mxfp8":
    return {"weight": np.asarray(q.codes),
            "weight_scale": np.asarray(q.scale).view(np.uint8)}  # E8M0 bits = biased exponent
  if input_amax is None:
    raise ValueError("NVFP4 export needs the linear's input amax (input_scale); calibrate it "
                     "with lowrl.models.transformer.calibrate_act_amax.")
  return {"weight": np.asarray(pack_e2m1(q.codes, axis=-1)),
          "weight_scale": np.asarray(q.scale),
          "weight_scale_2": np.asarray(q.outer, np.float32).reshape(()),
          "input_scale": np.asarray(np.float32(input_amax) / np.float32(_NVFP4_MAX))}


def dequantize_linear(tensors: Mapping[str, np.ndarray], fmt: str) -> np.ndarray:
  """FP32 [out, in] weight of a linear's ModelOpt tensors (the engine's dequantization)."""
  _check_format(fmt)
  scale = np.asarray(tensors["weight_scale"])
  if fmt == "mxfp8":
    codes = np.asarray(tensors["weight"]).astype(np.float32)
    block = np.exp2(scale.astype(np.float32) - 127.0)  # E8M0: 2**(bits - 127), exact
  else:
    codes = np.asarray(unpack_e2m1(jnp.asarray(tensors["weight"]), axis=-1)).astype(np.float32)
    block = scale.astype(np.float32)
  out, width = codes.shape
  g = _GROUP[fmt]
  deq = (codes.reshape(out, width // g, g) * block[:, :, None]).reshape(out, width)
  if fmt == "nvfp4":
    deq = deq * np.float32(tensors["weight_scale_2"])
  return deq.astype(np.float32)


def _quantized_linears(model_cfg: ModelConfig) -> list[layout.Matmul]:
  return [m for m in layout.matmuls(model_cfg) if m.layer is not None]


def quant_config_dict(model_cfg: ModelConfig, fmt: str) -> dict[str, Any]:
  """The `quantization_config` entry of config.json."""
  _check_format(fmt)
  ignore = ["lm_head"]
  return {"quant_method": "modelopt", "quant_algo": _ALGO[fmt], "group_size": _GROUP[fmt],
          "kv_cache_quant_algo": None, "ignore": ignore}


def save_quantized_checkpoint(path: str | os.PathLike, model_cfg: ModelConfig, params: Mapping,
                              fmt: str, *, act_amax: Mapping[str, Any] | None = None,
                              model_type: str | None = None, dtype: Any = None,
                              extra_config: Mapping[str, Any] | None = None) -> None:
  """Writes (model_cfg, params) with every block linear quantized to `fmt` (module docstring).

  Args:
    path: output directory (config.json, model.safetensors, hf_quant_config.json).
    model_cfg, params: the model (lowrl param tree).
    fmt: "nvfp4" or "mxfp8".
    act_amax: {"layers_0/attn/q_proj": amax, ...} for every block linear (nvfp4's input_scale),
      e.g. from `transformer.calibrate_act_amax`; unused for mxfp8.
    model_type, dtype, extra_config: as for `save_hf_checkpoint` (dtype applies to the tensors
      left unquantized).
  """
  _check_format(fmt)
  linears = _quantized_linears(model_cfg)
  if fmt == "nvfp4":
    missing = [m.full_path for m in linears if act_amax is None or m.full_path not in act_amax]
    if missing:
      raise ValueError(f"NVFP4 export needs act_amax for every block linear; missing "
                       f"{missing[:4]}{' ...' if len(missing) > 4 else ''}.")
  for m in linears:
    if m.in_features % _GROUP[fmt]:
      raise ValueError(f"{m.hf_name} has {m.in_features} inputs, not a multiple of the {fmt} "
                       f"block size {_GROUP[fmt]}; it cannot be stored in this layout.")
  path = os.fspath(path)
  # The plain checkpoint first (its tensor table and config), then the linears replaced.
  hf.save_hf_checkpoint(path, model_cfg, params, model_type=model_type, dtype=dtype,
                        extra_config=extra_config)
  weights_file = os.path.join(path, hf.SINGLE_FILE)
  with safetensors.safe_open(weights_file, framework="np") as fh:
    tensors = {name: fh.get_tensor(name) for name in fh.keys()}
  for m in linears:
    kernel = jax.device_get(layout.get_param(params, m.param_keys))
    amax = None if fmt == "mxfp8" else act_amax[m.full_path]
    del tensors[f"{m.hf_name}.weight"]
    for name, array in quantize_linear(np.asarray(kernel).T, fmt, amax).items():
      # (ascontiguousarray would turn the 0-d scales into shape [1])
      tensors[f"{m.hf_name}.{name}"] = np.ascontiguousarray(array) if array.ndim else array
  safetensors.numpy.save_file(tensors, weights_file, metadata={"format": "pt"})

  config_file = os.path.join(path, hf.CONFIG_FILE)
  with open(config_file) as fh:
    config = json.load(fh)
  qcfg = quant_config_dict(model_cfg, fmt)
  config["quantization_config"] = qcfg
  with open(config_file, "w") as fh:
    json.dump(config, fh, indent=2, sort_keys=True)
    fh.write("\n")
  modelopt = {"producer": {"name": "lowrl", "version": "0.1.0"},
              "quantization": {"quant_algo": qcfg["quant_algo"], "group_size": qcfg["group_size"],
                               "kv_cache_quant_algo": None, "exclude_modules": qcfg["ignore"]}}
  with open(os.path.join(path, QUANT_CONFIG_FILE), "w") as fh:
    json.dump(modelopt, fh, indent=2)
    fh.write("\n")


def read_safetensors(file: str | os.PathLike) -> dict[str, np.ndarray]:
  """Every tensor of a safetensors file, FP8 included (safetensors' NumPy reader has no FP8).

  The format: an 8-byte little-endian header length, a JSON header {name: {"dtype", "shape",
  "data_offsets"}} (plus "__metadata__"), then the data the offsets index.
  """
  with open(file, "rb") as fh:
    raw = fh.read()
  (n,) = struct.unpack("<Q", raw[:8])
  header = json.loads(raw[8:8 + n])
  data = memoryview(raw)[8 + n:]
  out = {}
  for name, info in header.items():
    if name == "__metadata__":
      continue
    if info["dtype"] not in _ST_DTYPES:
      raise ValueError(f"{file}: tensor {name!r} has dtype {info['dtype']}, which this reader "
                       f"does not know ({sorted(_ST_DTYPES)}).")
    start, end = info["data_offsets"]
    out[name] = np.frombuffer(data[start:end], _ST_DTYPES[info["dtype"]]).reshape(info["shape"])
  return out
