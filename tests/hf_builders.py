"""Tiny Hugging Face checkpoints and tokenizers the tests write (config.json shaped like the public
Qwen2.5 / Qwen3 / Llama 3 ones, random safetensors weights, a BPE tokenizer.json trained with
`tokenizers`), shared by tests/checkpoints and tests/training."""
import json
import math
import os
import pathlib

import ml_dtypes
import numpy as np
import safetensors.numpy
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

BF16 = np.dtype(ml_dtypes.bfloat16)

# config.json files shaped like the public ones (Qwen2.5-0.5B, Qwen3-0.6B, Llama-3.2-1B), shrunk.
HF_CONFIGS = {
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
        "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02,
        "intermediate_size": 72, "max_position_embeddings": 128, "max_window_layers": 2,
        "model_type": "qwen2", "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000.0, "sliding_window": 128, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 96,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "head_dim": 16, "hidden_act": "silu",
        "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 48,
        "max_position_embeddings": 256, "max_window_layers": 2, "model_type": "qwen3",
        "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 1,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.51.0",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 100,
    },
    "llama": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": [2, 3], "head_dim": 8, "hidden_act": "silu",
        "hidden_size": 48, "initializer_range": 0.02, "intermediate_size": 64,
        "max_position_embeddings": 512, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 6, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        # Small original context and base so that the 4 RoPE frequencies fall in all three
        # llama3 bands (kept, smoothed, divided by factor) at short sequence lengths.
        "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 32, "rope_type": "llama3"},
        "rope_theta": 100.0, "tie_word_embeddings": False, "torch_dtype": "float32",
        "transformers_version": "4.45.0", "use_cache": True, "vocab_size": 90,
    },
}
# How each family is stored: dtype and number of shards (None = single model.safetensors).
STORAGE = {"qwen2": ("bfloat16", None), "qwen3": ("float32", 3), "llama": ("float32", None)}
FAMILIES = tuple(HF_CONFIGS)

# Mixture-of-experts families, shaped like Qwen3-30B-A3B / Qwen1.5-MoE-A2.7B's config.json
# (transformers' Qwen3MoeConfig / Qwen2MoeConfig fields), shrunk: 4 experts, top-2, d = 32.
MOE_CONFIGS = {
    "qwen3_moe": {
        **HF_CONFIGS["qwen3"], "architectures": ["Qwen3MoeForCausalLM"], "model_type":
        "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "output_router_logits": False, "router_aux_loss_coef": 0.001,
        "vocab_size": 64, "tie_word_embeddings": False,
    },
    "qwen2_moe": {
        **HF_CONFIGS["qwen2"], "architectures": ["Qwen2MoeForCausalLM"], "model_type":
        "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "norm_topk_prob": False,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False,
        "router_aux_loss_coef": 0.001, "vocab_size": 64,
    },
}
MOE_STORAGE = {"qwen3_moe": ("float32", 2), "qwen2_moe": ("float32", None)}
MOE_FAMILIES = tuple(MOE_CONFIGS)


def hf_tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
  """Every tensor name -> shape of a checkpoint for config `c`, as transformers saves it."""
  d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
  h, k = c["num_attention_heads"], c["num_key_value_heads"]
  hd = c.get("head_dim", d // h)
  shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}."
    shapes.update({
        p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
        p + "self_attn.q_proj.weight": (h * hd, d), p + "self_attn.k_proj.weight": (k * hd, d),
        p + "self_attn.v_proj.weight": (k * hd, d), p + "self_attn.o_proj.weight": (d, h * hd),
    })
    if "num_experts" not in c:
      shapes.update({p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                     p + "mlp.down_proj.weight": (d, f)})
    else:  # transformers' Qwen3MoeSparseMoeBlock / Qwen2MoeSparseMoeBlock
      fe = c["moe_intermediate_size"]
      shapes[p + "mlp.gate.weight"] = (c["num_experts"], d)
      for e in range(c["num_experts"]):
        q = f"{p}mlp.experts.{e}."
        shapes.update({q + "gate_proj.weight": (fe, d), q + "up_proj.weight": (fe, d),
                       q + "down_proj.weight": (d, fe)})
      if c.get("shared_expert_intermediate_size"):
        fs = c["shared_expert_intermediate_size"]
        shapes.update({p + "mlp.shared_expert.gate_proj.weight": (fs, d),
                       p + "mlp.shared_expert.up_proj.weight": (fs, d),
                       p + "mlp.shared_expert.down_proj.weight": (d, fs),
                       p + "mlp.shared_expert_gate.weight": (1, d)})
    if c["model_type"] in ("qwen2", "qwen2_moe"):
      shapes.update({p + "self_attn.q_proj.bias": (h * hd,), p + "self_attn.k_proj.bias": (k * hd,),
                     p + "self_attn.v_proj.bias": (k * hd,)})
    if c["model_type"] in ("qwen3", "qwen3_moe"):
      shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
  if not c["tie_word_embeddings"]:
    shapes["lm_head.weight"] = (v, d)
  return shapes


def random_tensors(c: dict, dtype: str, seed: int) -> dict[str, np.ndarray]:
  """Random weights big enough that every tensor moves the logits visibly."""
  rng = np.random.default_rng(seed)
  out = {}
  for name, shape in hf_tensor_shapes(c).items():
    if name.endswith("norm.weight"):
      x = 1.0 + 0.3 * rng.standard_normal(shape)  # not all-ones: a dropped norm must show
    elif name.endswith(".bias"):
      x = 0.5 * rng.standard_normal(shape)
    elif name == "model.embed_tokens.weight":
      x = rng.standard_normal(shape)
    else:
      x = rng.standard_normal(shape) * 1.5 / math.sqrt(shape[1])
    out[name] = x.astype(BF16 if dtype == "bfloat16" else np.float32)
  return out


def build_tokenizer(specials: list[str]) -> tokenizers.Tokenizer:
  """A small sentencepiece-style BPE (Metaspace) trained here, with a BOS post-processor."""
  tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Metaspace()
  tok.decoder = decoders.Metaspace()
  corpus = ["the cat sat on the mat", "a dog ate 12 apples and 7 pears",
            "what is 3 + 4 = 7", "the answer is 42"] * 20
  tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=64, special_tokens=specials))
  bos = specials[1]
  tok.post_processor = processors.TemplateProcessing(
      single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
  return tok


def write_checkpoint(root, family: str, seed: int = 0) -> tuple[str, dict[str, np.ndarray]]:
  """Writes a tiny HF checkpoint directory; returns (dir, raw tensors)."""
  c = {**HF_CONFIGS, **MOE_CONFIGS}[family]
  dtype, shards = {**STORAGE, **MOE_STORAGE}[family]
  tensors = random_tensors(c, dtype, seed)
  path = os.path.join(root, family)
  os.makedirs(path)
  with open(os.path.join(path, "config.json"), "w") as fh:
    json.dump(c, fh, indent=2)
  if shards is None:
    safetensors.numpy.save_file(tensors, os.path.join(path, "model.safetensors"),
                                metadata={"format": "pt"})
  else:
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
      file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
      part = {n: tensors[n] for n in names[i::shards]}
      safetensors.numpy.save_file(part, os.path.join(path, file), metadata={"format": "pt"})
      weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
      json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                 "weight_map": weight_map}, fh)
  return path, tensors


TOKENIZER_FILES = {
    # Qwen style: no BOS token, pad and eos named in tokenizer_config.json, a second eos in
    # generation_config.json.
    "qwen": (["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
             {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
             {"bos_token_id": 1, "eos_token_id": [3, 1], "pad_token_id": 1}),
    # Llama style: AddedToken dicts, no pad token, several eos ids in generation_config.json.
    "llama": (["<unk>", "<s>", "</s>", "<|eot_id|>"],
              {"bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False},
               "eos_token": {"__type": "AddedToken", "content": "</s>"}},
              {"bos_token_id": 1, "eos_token_id": [2, 3]}),
}


def write_tokenizer(path, style: str, **tokenizer_config) -> None:
  """tokenizer.json, tokenizer_config.json (plus the `tokenizer_config` entries, e.g.
  chat_template=...) and generation_config.json of `style` in directory `path`."""
  specials, tok_cfg, gen_cfg = TOKENIZER_FILES[style]
  path = pathlib.Path(path)
  tok_cfg = {**tok_cfg, **tokenizer_config}
  build_tokenizer(specials).save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
  (path / "generation_config.json").write_text(json.dumps(gen_cfg))
