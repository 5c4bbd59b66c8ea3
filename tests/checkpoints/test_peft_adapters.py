"""LoRA adapters in PEFT's layout (lowrl/checkpoints/peft_adapters.py): names and shapes as PEFT
writes them, the round trip, the merged model's logits against an FP64 NumPy forward of the HF
tensors plus the file's B A alpha / r, and (when torch + peft are installed) PEFT itself loading
the directory onto a transformers model."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from hf_builders import HF_CONFIGS, write_checkpoint
from lowrl.checkpoints import load_hf_checkpoint
from lowrl.checkpoints import peft_adapters
from lowrl.models import layout, lora, transformer
from lowrl.precision import policy_for
from test_hf import _ids, hf_reference_logits

FAMILIES = ("llama", "qwen3")


def _adapted(path, targets=lora.ALL_LINEAR, rank=4, alpha=8.0):
  """(model cfg, base params, lora cfg, combined params with B drawn) of checkpoint `path`."""
  mc, params = load_hf_checkpoint(path)
  cfg = lora.LoraConfig(rank=rank, alpha=alpha, targets=targets)
  adapters = lora.init_adapters(cfg, mc, jax.random.key(1))
  leaves, treedef = jax.tree.flatten(adapters)  # B drawn too (leaf i from key i): live adapters
  paths = [kp for kp, _ in jax.tree_util.tree_leaves_with_path(adapters)]
  adapters = jax.tree.unflatten(treedef, [
      0.3 * jax.random.normal(jax.random.key(i), x.shape) if kp[-1].key == lora.B else x
      for i, (kp, x) in enumerate(zip(paths, leaves))])
  return mc, params, cfg, lora.merge(params, adapters)


@pytest.mark.parametrize("family", FAMILIES)
def test_names_shapes_config_and_round_trip(tmp_path, family):
  path, _ = write_checkpoint(tmp_path, family)
  mc, _, cfg, params = _adapted(path)
  out = os.path.join(tmp_path, "adapter")
  peft_adapters.save_adapters(out, params, cfg, mc, base_model_name_or_path=path)
  tensors = safetensors.numpy.load_file(os.path.join(out, "adapter_model.safetensors"))
  c = HF_CONFIGS[family]
  d, f = c["hidden_size"], c["intermediate_size"]
  a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
  b = tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
  assert a.shape == (4, d) and b.shape == (d, 4)
  assert tensors["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"].shape == (f, 4)
  assert len(tensors) == 2 * 7 * c["num_hidden_layers"]
  config = json.load(open(os.path.join(out, "adapter_config.json")))
  assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
  assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                      "up_proj", "v_proj"]
  assert config["lora_dropout"] == 0.0 and config["use_rslora"] is False
  cfg2, adapters2 = peft_adapters.load_adapters(out, mc)
  assert (cfg2.rank, cfg2.alpha) == (cfg.rank, cfg.alpha)
  assert lora.targets(cfg2, mc) == lora.targets(cfg, mc)
  want = lora.split(params)[1]
  assert jax.tree.structure(adapters2) == jax.tree.structure(want)
  for x, y in zip(jax.tree.leaves(adapters2), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_layer_subset_targets_are_a_regex_over_module_names(tmp_path):
  path, _ = write_checkpoint(tmp_path, "llama")
  mc, _, cfg, params = _adapted(path, targets=r"layers_1/attn/(q|v)_proj")
  out = os.path.join(tmp_path, "adapter")
  peft_adapters.save_adapters(out, params, cfg, mc)
  target = json.load(open(os.path.join(out, "adapter_config.json")))["target_modules"]
  assert isinstance(target, str)
  import re
  assert re.fullmatch(target, "model.layers.1.self_attn.q_proj")
  assert not re.fullmatch(target, "model.layers.0.self_attn.q_proj")
  cfg2, _ = peft_adapters.load_adapters(out, mc)
  assert [m.full_path for m in lora.targets(cfg2, mc)] == ["layers_1/attn/q_proj",
                                                           "layers_1/attn/v_proj"]


@pytest.mark.parametrize("family", FAMILIES)
def test_adapted_logits_match_fp64_reference_of_the_peft_files(tmp_path, family):
  """The file read by PEFT's rule, W + (lora_B.weight @ lora_A.weight) * lora_alpha / r, in an
  FP64 NumPy forward of the HF model, vs lowrl's FP32 forward with the adapters (the bound of
  tests/checkpoints/test_hf.py: 1e-4 of the largest logit)."""
  path, raw = write_checkpoint(tmp_path, family)
  mc, _, cfg, params = _adapted(path)
  out = os.path.join(tmp_path, "adapter")
  peft_adapters.save_adapters(out, params, cfg, mc)
  files = safetensors.numpy.load_file(os.path.join(out, "adapter_model.safetensors"))
  conf = json.load(open(os.path.join(out, "adapter_config.json")))
  merged = {k: v.astype(np.float64) for k, v in raw.items()}
  for name in files:
    if name.endswith("lora_A.weight"):
      module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
      delta = files[name.replace("lora_A", "lora_B")].astype(np.float64) @ files[name]
      merged[module + ".weight"] += delta * conf["lora_alpha"] / conf["r"]
  c = HF_CONFIGS[family]
  ids = _ids(c)
  ref = hf_reference_logits(merged, c, ids)
  policy = lora.adapter_policy(policy_for("fp32", layout.matmuls(mc)), cfg)
  ours = np.asarray(transformer.forward(params, jnp.asarray(ids), mc, policy))
  base = hf_reference_logits(raw, c, ids)
  tol = 1e-4 * np.abs(ref).max()
  assert np.abs(base - ref).max() > 100 * tol  # the adapters matter at this tolerance
  np.testing.assert_allclose(ours, ref, rtol=0, atol=tol)


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_loads_the_directory_onto_transformers(tmp_path, family):
  """PEFT's own loader (PeftModel.from_pretrained) on the transformers model of the checkpoint:
  its state-dict names and shapes are the file's, and its logits lowrl's (FP32 both sides)."""
  import peft  # noqa: PLC0415 - the reference (the `test` extra installs it)
  import torch  # noqa: PLC0415
  import transformers  # noqa: PLC0415
  path, _ = write_checkpoint(tmp_path, family)
  mc, _, cfg, params = _adapted(path)
  out = os.path.join(tmp_path, "adapter")
  peft_adapters.save_adapters(out, params, cfg, mc, base_model_name_or_path=path)
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  model = peft.PeftModel.from_pretrained(model, out).eval()
  theirs = peft.get_peft_model_state_dict(model)
  files = safetensors.numpy.load_file(os.path.join(out, "adapter_model.safetensors"))
  assert sorted(theirs) == sorted(files)
  for k, v in theirs.items():
    np.testing.assert_array_equal(v.numpy(), files[k])
  ids = _ids(HF_CONFIGS[family])
  with torch.no_grad():
    ref = model(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
  policy = lora.adapter_policy(policy_for("fp32", layout.matmuls(mc)), cfg)
  ours = np.asarray(transformer.forward(params, jnp.asarray(ids), mc, policy))
  np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4 * np.abs(ref).max())


def test_unsupported_peft_configs_are_refused(tmp_path):
  path, _ = write_checkpoint(tmp_path, "llama")
  mc, _, cfg, params = _adapted(path)
  out = os.path.join(tmp_path, "adapter")
  peft_adapters.save_adapters(out, params, cfg, mc)
  conf_file = os.path.join(out, "adapter_config.json")
  conf = json.load(open(conf_file))
  json.dump({**conf, "use_dora": True}, open(conf_file, "w"))
  with pytest.raises(ValueError, match="use_dora=True is not supported"):
    peft_adapters.load_adapters(out, mc)
  json.dump({**conf, "r": 8}, open(conf_file, "w"))
  with pytest.raises(ValueError, match=r"has shape \(4, (\d+)\), expected \(8, \1\)"):
    peft_adapters.load_adapters(out, mc)
