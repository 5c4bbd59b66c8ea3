"""LoRA adapters in Hugging Face PEFT's layout: adapter_config.json + adapter_model.safetensors.

The layout (PEFT's docs/source/developer_guides/checkpoint.md and `get_peft_model_state_dict`,
which strips the adapter name): one tensor per adapter matrix, named
`base_model.model.<HF module>.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]), e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` for Llama/Qwen; lowrl's A [in, r]
and B [r, out] are their transposes. The config names `peft_type` LORA, `r`, `lora_alpha` (PEFT
scales by lora_alpha / r: `use_rslora` false), `lora_dropout` 0, `bias` none, `fan_in_fan_out`
false, and `target_modules`: the modules' short names (PEFT matches a list entry against a
module name's suffix) when those select exactly the adapted modules, else a regex PEFT
fullmatches against module names. vLLM's LoRA loader reads the same two files.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

import jax
import numpy as np
import safetensors.numpy

from lowrl.models import layout, lora
from lowrl.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."


def _names(m: layout.Matmul) -> tuple[str, str]:
  """PEFT's tensor names of matmul `m`'s A and B."""
  return f"{PREFIX}{m.hf_name}.lora_A.weight", f"{PREFIX}{m.hf_name}.lora_B.weight"


def _peft_matches(target: list[str] | str, name: str) -> bool:
  """PEFT's rule (`check_target_module_exists`): a str is fullmatched, a list entry matches the
  whole name or a dotted suffix of it."""
  if isinstance(target, str):
    return re.fullmatch(target, name) is not None
  return any(name == t or name.endswith("." + t) for t in target)


def target_modules(cfg: lora.LoraConfig, model_cfg: ModelConfig) -> list[str] | str:
  """adapter_config.json's target_modules for `cfg`'s adapters (module docstring)."""
  hit = {m.hf_name for m in lora.targets(cfg, model_cfg)}
  linear = [m.hf_name for m in layout.matmuls(model_cfg) if m.owns_kernel]
  short = sorted({n.rsplit(".", 1)[-1] for n in hit})
  if {n for n in linear if _peft_matches(short, n)} == hit:
    return short
  return "|".join(re.escape(n) for n in sorted(hit))


def save_adapters(path: str | os.PathLike, params: Any, cfg: lora.LoraConfig,
                  model_cfg: ModelConfig, base_model_name_or_path: str | None = None) -> None:
  """Writes the adapters of `params` (a combined tree, or the adapter tree) as a PEFT adapter
  directory (created if needed), tensors in FP32 (exact for BF16 adapters)."""
  adapters = lora.split(params)[1]
  tensors = {}
  for m in lora.targets(cfg, model_cfg):
    leaf = layout.get_param(adapters, m.param_keys[:-1])
    name_a, name_b = _names(m)
    tensors[name_a] = np.ascontiguousarray(np.asarray(leaf[lora.A], np.float32).T)
    tensors[name_b] = np.ascontiguousarray(np.asarray(leaf[lora.B], np.float32).T)
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank,
            "lora_alpha": cfg.alpha, "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "target_modules": target_modules(cfg, model_cfg), "modules_to_save": None,
            "inference_mode": True, "init_lora_weights": True,
            "base_model_name_or_path": base_model_name_or_path, "revision": None,
            "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None,
            "layers_pattern": None}
  os.makedirs(path, exist_ok=True)
  safetensors.numpy.save_file(tensors, os.path.join(path, WEIGHTS_FILE),
                              metadata={"format": "pt"})
  with open(os.path.join(path, CONFIG_FILE), "w") as fh:
    json.dump(config, fh, indent=2)


def load_adapters(path: str | os.PathLike, model_cfg: ModelConfig, dtype=np.float32
                  ) -> tuple[lora.LoraConfig, Any]:
  """(LoraConfig, adapter tree) of a PEFT LoRA directory for `model_cfg`; `merge` it into the
  base's params. The config's targets are the full paths of the adapted matmuls.

  Raises ValueError (naming the file and entry) for what lowrl's adapters cannot represent:
  another peft_type, per-module ranks or alphas, rsLoRA, DoRA, trained biases, fan_in_fan_out,
  modules_to_save, tensors of no matmul of `model_cfg`, or shapes that disagree."""
  cfg_file = os.path.join(path, CONFIG_FILE)
  with open(cfg_file) as fh:
    c = json.load(fh)
  unsupported = {"peft_type": ("LORA",), "use_rslora": (False, None), "use_dora": (False, None),
                 "bias": ("none", None), "fan_in_fan_out": (False, None),
                 "modules_to_save": (None, []), "rank_pattern": ({}, None),
                 "alpha_pattern": ({}, None)}
  for key, ok in unsupported.items():
    if c.get(key, ok[-1]) not in ok:
      raise ValueError(f"{cfg_file}: {key}={c[key]!r} is not supported by lowrl's LoRA "
                       f"(supported: {ok[0]!r}).")
  rank, alpha = int(c["r"]), float(c.get("lora_alpha", 8))
  tensors = safetensors.numpy.load_file(os.path.join(path, WEIGHTS_FILE))
  by_name = {m.hf_name: m for m in layout.matmuls(model_cfg)}
  adapters: dict = {}
  hit = []
  for name in sorted(tensors):
    module, sep, tail = name.removeprefix(PREFIX).rpartition(".lora_")
    m = by_name.get(module)
    if not name.startswith(PREFIX) or not sep or m is None or tail not in ("A.weight",
                                                                            "B.weight"):
      raise ValueError(f"{os.path.join(path, WEIGHTS_FILE)}: tensor {name!r} is not a LoRA "
                       "matrix of a linear layer of this model.")
    want = (rank, m.in_features) if tail == "A.weight" else (m.out_features, rank)
    if tuple(tensors[name].shape) != want:
      raise ValueError(f"{os.path.join(path, WEIGHTS_FILE)}: {name} has shape "
                       f"{tuple(tensors[name].shape)}, expected {want} (r={rank}).")
    node = adapters
    for k in m.param_keys[:-1]:
      node = node.setdefault(k, {})
    node[lora.A if tail == "A.weight" else lora.B] = jax.numpy.asarray(
        tensors[name].T.astype(dtype))
    if tail == "A.weight":
      hit.append(m)
  if not hit:
    raise ValueError(f"{path}: no LoRA tensors in {WEIGHTS_FILE}.")
  for m in {by_name[n.removeprefix(PREFIX).rpartition(".lora_")[0]] for n in tensors}:
    node = layout.get_param(adapters, m.param_keys[:-1])
    if lora.A not in node or lora.B not in node:
      raise ValueError(f"{os.path.join(path, WEIGHTS_FILE)}: {m.hf_name} has only one of "
                       "lora_A / lora_B.")
  order = {m.full_path: i for i, m in enumerate(layout.matmuls(model_cfg))}
  targets = "|".join(re.escape(m.full_path) for m in sorted(hit, key=lambda m: order[m.full_path]))
  cfg = lora.LoraConfig(rank=rank, alpha=alpha, targets=targets)
  lora.check(cfg, model_cfg)
  return cfg, adapters
