"""Rollout weights as a quantized Hugging Face checkpoint in NVIDIA ModelOpt's layout.

vLLM (`quantization="modelopt_fp4"` / `"modelopt_mxfp8"`, detected from the config), SGLang and
TensorRT-LLM load this "unified HF checkpoint" layout. Every decoder-block linear
(`model.layers.{i}.self_attn.{q,k,v,o}_proj`, `model.layers.{i}.mlp.{gate,up,down}_proj`) stores,
next to its unchanged bias, in Hugging Face's [out, in] orientation (blocks run along `in`):

  NVFP4 (group_size 16; quant_algo "NVFP4", or "W4A16_NVFP4" for weight-only):
    weight          uint8          [out, in/2]   E2M1 codes, two per byte: element 2j of a row in
                                                 the low nibble, 2j+1 in the high nibble
    weight_scale    float8_e4m3fn  [out, in/16]  block scales
    weight_scale_2  float32        [1]           the per-tensor (outer) scale
    input_scale     float32        [1]           static activation scale = amax(input) / (6*448)
                                                 (NVFP4 only; W4A16 keeps activations unquantized)
    dequantized weight = e2m1(code) * weight_scale * weight_scale_2 (the first product exact)
  MXFP8 (blocks of 32):
    weight          float8_e4m3fn  [out, in]
    weight_scale    uint8          [out, in/32]  E8M0 block scales (biased exponent, 2**(s-127))

Embeddings, norms and `lm_head` stay unquantized (listed in `ignore` / `exclude_modules`). The
config gets `quantization_config = {"quant_method": "modelopt", "quant_algo": "NVFP4" |
"W4A16_NVFP4" | "MXFP8", "group_size", "kv_cache_quant_algo": None, "ignore": [...]}` and
`hf_quant_config.json` the same in ModelOpt's own form.

The codes and scales are lowrl's (`lowrl.quant.quantize`): with a sampler `policy` whose weights
are in the layout's format, each linear's own weight quantizer (4/6 and 16x16 blocks included:
both are plain NVFP4 codes and scales), the linears it leaves unquantized written unquantized and
listed in `ignore`; without one, the format's default quantizer (the `nvfp4_naive` / `mxfp8`
recipes'). Either way the dequantized weights are the sampler's weights bit for bit. The per-tensor
scales are written with shape [1], as ModelOpt does: compressed-tensors' ModelOpt converter
computes `weight_global_scale = 1 / weight_scale_2` and dequantizes `code * (weight_scale /
weight_global_scale)`, which PyTorch's type promotion rounds to BF16 when the global scale is a
0-d tensor (a dimensioned BF16 operand wins over a 0-d FP32 one) and keeps in FP32 with shape [1].

Fused linears (docs/export.md): vLLM reads q/k/v and gate/up as one linear with one global scale,
`weight_scale_2.max()` over the partitions, without requantizing their block scales. Under
`weight_scales="fused"` (the policy's default, `lowrl.models.fused_scales`) the partitions are
quantized with their joint amax, so each stores that one global scale and the fused reading is the
sampler's weights bit for bit; their `input_scale`s are unified likewise (vLLM takes the max).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors

from lowrl.checkpoints import hf, hf_config
from lowrl.models import fused_scales, layout
from lowrl.models.config import ModelConfig
from lowrl.precision import PrecisionPolicy
from lowrl.quant.config import QDotConfig, QuantConfig
from lowrl.quant.packing import pack_e2m1, unpack_e2m1
from lowrl.quant.quantize import quantize

ROLLOUT_FORMATS = ("nvfp4", "nvfp4_w4a16", "mxfp8")
QUANT_CONFIG_FILE = "hf_quant_config.json"
# vLLM's ModelOpt quant_algo names (vllm/model_executor/layers/quantization/modelopt.py,
# QUANT_ALGOS: "NVFP4" = W4A4, "W4A16_NVFP4" = weight-only, loaded by
# ModelOptNvFp4W4A16LinearMethod from the same weight tensors without input_scale).
_ALGO = {"nvfp4": "NVFP4", "nvfp4_w4a16": "W4A16_NVFP4", "mxfp8": "MXFP8"}
_ELEMENT_FMT = {"nvfp4": "nvfp4", "nvfp4_w4a16": "nvfp4", "mxfp8": "mxfp8_e4m3"}
_GROUP = {"nvfp4": 16, "nvfp4_w4a16": 16, "mxfp8": 32}
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


def _check_quantizer(fmt: str, cfg: QuantConfig, what: str) -> None:
  """Raises ValueError unless the layout of `fmt` holds `cfg`'s codes and scales exactly."""
  ok = cfg.fmt == _ELEMENT_FMT[fmt] and cfg.block == _GROUP[fmt] and not cfg.stochastic_rounding
  ok = ok and not cfg.per_token and cfg.scale_convention == "exact"
  if not ok:
    raise ValueError(f"{what}: its weight quantizer ({cfg.fmt}, block {cfg.block}"
                     f"{', per_token' if cfg.per_token else ''}"
                     f"{', stochastic rounding' if cfg.stochastic_rounding else ''}, "
                     f"scale_convention={cfg.scale_convention}) is not one the {fmt} layout "
                     f"holds bit for bit; export with the run's own format or a round-to-nearest "
                     f"{_ELEMENT_FMT[fmt]} recipe (scale_convention='exact').")


def quantize_linear(weight_OI: Any, fmt: str, input_amax: float | None = None, *,
                    cfg: QuantConfig | None = None, weight_amax: Any = None
                    ) -> dict[str, np.ndarray]:
  """The ModelOpt tensors (`weight`, `weight_scale`, ...) of one [out, in] weight.

  input_amax: max |input| of the linear (NVFP4's static `input_scale`); required for nvfp4 (not
    for nvfp4_w4a16). cfg: the weight quantizer (default `weight_quant_config(fmt)`; its blocks
    run along `in`). weight_amax: a static per-tensor amax (the fused group's) for NVFP4's
    `weight_scale_2`; None = the weight's own.
  """
  cfg = weight_quant_config(fmt) if cfg is None else dataclasses.replace(cfg, axis=-1)
  _check_quantizer(fmt, cfg, "quantize_linear")
  w = jnp.asarray(weight_OI, jnp.float32)
  if w.ndim != 2 or w.shape[1] % _GROUP[fmt]:
    raise ValueError(f"{fmt} weights must be 2-D [out, in] with in divisible by {_GROUP[fmt]}, "
                     f"got shape {tuple(w.shape)}.")
  q = quantize(w, cfg, tensor_amax=None if fmt == "mxfp8" else weight_amax)
  # 16x16 tiles: each row of a tile carries the tile's scale (the layout's per-row blocks).
  scale = np.asarray(q.scale)
  if cfg.block_2d:
    scale = np.repeat(scale, cfg.block, axis=0)
  if fmt == "mxfp8":
    return {"weight": np.asarray(q.codes),
            "weight_scale": scale.view(np.uint8)}  # E8M0 bits = biased exponent
  out = {"weight": np.asarray(pack_e2m1(q.codes, axis=-1)), "weight_scale": scale,
         "weight_scale_2": np.asarray(q.outer, np.float32).reshape(1)}
  if fmt == "nvfp4":
    if input_amax is None:
      raise ValueError("NVFP4 export needs the linear's input amax (input_scale); calibrate it "
                       "with lowrl.models.calibration.calibrate_act_amax.")
    out["input_scale"] = (np.asarray(input_amax, np.float32)
                          / np.float32(_NVFP4_MAX)).reshape(1)
  return out


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
  if fmt != "mxfp8":
    deq = deq * np.asarray(tensors["weight_scale_2"], np.float32).reshape(())
  return deq.astype(np.float32)


def _quantized_linears(model_cfg: ModelConfig) -> list[layout.Matmul]:
  return [m for m in layout.matmuls(model_cfg) if m.layer is not None]


def quant_config_dict(model_cfg: ModelConfig, fmt: str,
                      unquantized: tuple[str, ...] = ()) -> dict[str, Any]:
  """The `quantization_config` entry of config.json (`unquantized`: HF names of block linears
  written unquantized, listed in `ignore` after lm_head)."""
  _check_format(fmt)
  ignore = ["lm_head", *unquantized]
  return {"quant_method": "modelopt", "quant_algo": _ALGO[fmt], "group_size": _GROUP[fmt],
          "kv_cache_quant_algo": None, "ignore": ignore}


def _default_policy(model_cfg: ModelConfig, fmt: str, weight_scales: str) -> PrecisionPolicy:
  """Every block linear's weight quantized by `weight_quant_config(fmt)` (the head unquantized)."""
  head = layout.matmul(model_cfg, None, layout.LM_HEAD).full_path
  return PrecisionPolicy(rules=((re.escape(head), QDotConfig()),
                                (".*", QDotConfig(rhs=weight_quant_config(fmt)))),
                         name=f"export_{fmt}", weight_scales=weight_scales)


def export_policy(model_cfg: ModelConfig, fmt: str, policy: PrecisionPolicy | None,
                  weight_scales: str = "fused") -> PrecisionPolicy:
  """The policy whose weight quantizers the export applies: `policy` (a sampler's) when it
  quantizes some block linear's weight in `fmt`'s element format, else the format's default
  quantizer on every block linear with `weight_scales`. Raises ValueError for a policy whose
  weights the layout cannot hold exactly, or that quantizes part of a fused group (vLLM fuses
  q/k/v and gate/up: all of a group quantized, or none)."""
  _check_format(fmt)
  linears = _quantized_linears(model_cfg)
  if policy is None or not any(
      (q := policy.qdot_config(m.full_path).rhs) is not None and q.fmt == _ELEMENT_FMT[fmt]
      for m in linears):
    return _default_policy(model_cfg, fmt, weight_scales if policy is None
                           else policy.weight_scales)
  for m in linears:
    q = policy.qdot_config(m.full_path).rhs
    if q is not None:
      _check_quantizer(fmt, q, m.hf_name)
  if fmt == "nvfp4" and all(policy.qdot_config(m.full_path).lhs is None for m in linears):
    raise ValueError("The sampler's recipe keeps activations unquantized (weight-only): export "
                     "it as --rollout_format=nvfp4_w4a16 (NVFP4 would quantize them).")
  for i in range(model_cfg.n_layers):
    for group in layout.FUSED_GROUPS:
      quantized = {policy.qdot_config(layout.matmul_path(i, p)).rhs is not None for p in group}
      if len(quantized) > 1:
        raise ValueError(f"layer {i}: {group} are partly quantized, but engines fuse them into "
                         "one linear; quantize all of them or none (precision."
                         "high_precision_paths).")
  return policy


def save_quantized_checkpoint(path: str | os.PathLike, model_cfg: ModelConfig, params: Mapping,
                              fmt: str, *, act_amax: Mapping[str, Any] | None = None,
                              policy: PrecisionPolicy | None = None,
                              weight_scales: str = "fused",
                              model_type: str | None = None, dtype: Any = None,
                              extra_config: Mapping[str, Any] | None = None) -> None:
  """Writes (model_cfg, params) with the block linears quantized to `fmt` (module docstring).

  Args:
    path: output directory (config.json, model.safetensors, hf_quant_config.json).
    model_cfg, params: the model (lowrl param tree).
    fmt: "nvfp4", "nvfp4_w4a16" or "mxfp8".
    act_amax: {"layers_0/attn/q_proj": amax, ...} for every block linear (nvfp4's input_scale),
      e.g. from `calibration.calibrate_act_amax`; unused for nvfp4_w4a16 and mxfp8.
    policy: the sampler's precision policy (`export_policy`: its weight quantizers, unquantized
      linears and weight_scales); None = the format's default quantizer on every block linear.
    weight_scales: "fused" | "per_linear", without a policy (a policy brings its own).
    model_type, dtype, extra_config: as for `save_hf_checkpoint` (dtype applies to the tensors
      left unquantized).
  """
  _check_format(fmt)
  policy = export_policy(model_cfg, fmt, policy, weight_scales)
  linears = [m for m in _quantized_linears(model_cfg)
             if policy.qdot_config(m.full_path).rhs is not None]
  unquantized = tuple(m.hf_name for m in _quantized_linears(model_cfg) if m not in linears)
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
  w_amax = fused_scales.weight_amaxes(params, model_cfg, policy)
  in_amax = _input_amaxes(model_cfg, policy, act_amax) if fmt == "nvfp4" else {}
  for m in linears:
    kernel = jax.device_get(layout.get_param(params, m.param_keys))
    del tensors[f"{m.hf_name}.weight"]
    arrays = quantize_linear(np.asarray(kernel).T, fmt, in_amax.get(m.full_path),
                             cfg=policy.qdot_config(m.full_path).rhs,
                             weight_amax=w_amax.get(m.full_path))
    for name, array in arrays.items():
      tensors[f"{m.hf_name}.{name}"] = np.ascontiguousarray(array)
  hf.save_safetensors(tensors, weights_file, {"format": "pt"})

  config_file = os.path.join(path, hf_config.CONFIG_FILE)
  with open(config_file) as fh:
    config = json.load(fh)
  qcfg = quant_config_dict(model_cfg, fmt, unquantized)
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


def _input_amaxes(model_cfg: ModelConfig, policy: PrecisionPolicy,
                  act_amax: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """Each block linear's input amax for `input_scale`; under fused weight scales the max over its
  fused group (vLLM's fused linear takes `input_scale.max()`; ModelOpt unifies them too). The
  partitions of a group read one input, so their calibrated amaxes agree anyway."""
  out = {m.full_path: np.asarray(act_amax[m.full_path], np.float32)
         for m in _quantized_linears(model_cfg) if m.full_path in act_amax}
  for i in range(model_cfg.n_layers):
    for group in fused_scales.shared_groups(policy, i):
      paths = [layout.matmul_path(i, p) for p in group]
      joint = np.max(np.stack([out[p] for p in paths]))
      out.update({p: joint for p in paths})
  return out


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
