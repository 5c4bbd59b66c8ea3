"""Hugging Face checkpoint loading/saving against tiny checkpoints written by tests/hf_builders.py.

The reference is independent of lowrl.checkpoints: tensor names and shapes are spelled out in
hf_builders.py, and `hf_reference_logits` redoes the transformers modeling code (Llama / Qwen2 /
Qwen3) in NumPy FP64 straight from the raw Hugging Face tensors.
"""
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from hf_builders import (BF16, FAMILIES, HF_CONFIGS, STORAGE, TOKENIZER_FILES, write_checkpoint,
                         write_tokenizer)
from lowrl.models import layout
from lowrl.checkpoints import (hf_config_from_model, load_hf_checkpoint, load_tokenizer,
                               model_config_from_hf, read_hf_config, save_hf_checkpoint)
from lowrl.models import transformer
from lowrl.models.config import ModelConfig
from lowrl.precision import policy_for
from lowrl.tasks.tokenizer import Tokenizer as TaskTokenizer

# ------------------------------------------------------------------------------------------------
# Independent NumPy forward (transformers' math: modeling_llama / modeling_qwen2 / modeling_qwen3)


def _rms_norm(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rotate_half(x):
  half = x.shape[-1] // 2
  return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _inv_freq(c: dict, apply_scaling: bool = True) -> np.ndarray:
  hd = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
  inv_freq = 1.0 / c["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
  rs = c.get("rope_scaling")
  if rs is None or not apply_scaling:
    return inv_freq
  assert rs["rope_type"] == "llama3"
  factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
  old_ctx = rs["original_max_position_embeddings"]
  low_freq_wavelen, high_freq_wavelen = old_ctx / low, old_ctx / high
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
  smooth = (old_ctx / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
  return np.where(medium, smoothed, scaled)


def swiglu(x, linear, name, t=None, c=None):
  """transformers' LlamaMLP / Qwen2MLP: down(silu(gate(x)) * up(x))."""
  gate = linear(x, name + ".gate_proj")
  return linear(gate / (1 + np.exp(-gate)) * linear(x, name + ".up_proj"), name + ".down_proj")


def hf_reference_logits(t: dict[str, np.ndarray], c: dict, ids: np.ndarray,
                        apply_rope_scaling: bool = True, mlp=None) -> np.ndarray:
  """Logits [B, T, V] of the HF model `c` with raw HF tensors `t`, in FP64; `mlp(x, linear,
  "model.layers.N.mlp", t, c)` replaces the SwiGLU MLP (the MoE tests' sparse blocks)."""
  t = {k: v.astype(np.float64) for k, v in t.items()}
  eps = c["rms_norm_eps"]
  h_, k_ = c["num_attention_heads"], c["num_key_value_heads"]
  hd = c.get("head_dim", c["hidden_size"] // h_)
  b, s = ids.shape
  angles = np.arange(s)[:, None] * _inv_freq(c, apply_rope_scaling)[None, :]
  emb = np.concatenate([angles, angles], axis=-1)
  cos, sin = np.cos(emb), np.sin(emb)
  causal = np.tril(np.ones((s, s), bool))

  def linear(x, name):
    y = x @ t[name + ".weight"].T
    return y + t[name + ".bias"] if name + ".bias" in t else y

  h = t["model.embed_tokens.weight"][ids]
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}."
    x = _rms_norm(h, t[p + "input_layernorm.weight"], eps)
    q = linear(x, p + "self_attn.q_proj").reshape(b, s, h_, hd).transpose(0, 2, 1, 3)
    k = linear(x, p + "self_attn.k_proj").reshape(b, s, k_, hd).transpose(0, 2, 1, 3)
    v = linear(x, p + "self_attn.v_proj").reshape(b, s, k_, hd).transpose(0, 2, 1, 3)
    if p + "self_attn.q_norm.weight" in t:
      q = _rms_norm(q, t[p + "self_attn.q_norm.weight"], eps)
      k = _rms_norm(k, t[p + "self_attn.k_norm.weight"], eps)
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    k, v = np.repeat(k, h_ // k_, axis=1), np.repeat(v, h_ // k_, axis=1)  # repeat_kv
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd)
    scores = np.where(causal, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    attn = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, h_ * hd)
    h = h + linear(attn, p + "self_attn.o_proj")
    x = _rms_norm(h, t[p + "post_attention_layernorm.weight"], eps)
    h = h + (mlp or swiglu)(x, linear, p + "mlp", t, c)
  h = _rms_norm(h, t["model.norm.weight"], eps)
  head = t["model.embed_tokens.weight"] if c["tie_word_embeddings"] else t["lm_head.weight"]
  return h @ head.T


def _ids(c: dict, b: int = 2, s: int = 12, seed: int = 1) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, c["vocab_size"], (b, s)).astype(np.int32)


def _read_dir(path: str) -> dict[str, np.ndarray]:
  """All tensors of a checkpoint directory, whatever its file layout."""
  out = {}
  for name in sorted(os.listdir(path)):
    if name.endswith(".safetensors"):
      out.update(safetensors.numpy.load_file(os.path.join(path, name)))
  return out


# ------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def test_model_config_from_hf_fields():
  cfgs = {f: model_config_from_hf(c) for f, c in HF_CONFIGS.items()}
  assert cfgs["qwen2"] == ModelConfig(
      vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=72,
      rope_theta=1e6, rms_eps=1e-6, qk_norm=False, qkv_bias=True, tie_embeddings=True,
      max_seq_len=128, rope_llama3_scaling=None)
  assert cfgs["qwen3"] == ModelConfig(
      vocab_size=100, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=16, d_ff=48,
      rope_theta=1e4, rms_eps=1e-6, qk_norm=True, qkv_bias=False, tie_embeddings=False,
      max_seq_len=256, rope_llama3_scaling=None)
  assert cfgs["llama"] == ModelConfig(
      vocab_size=90, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=8, d_ff=64,
      rope_theta=100.0, rms_eps=1e-5, qk_norm=False, qkv_bias=False, tie_embeddings=False,
      max_seq_len=512, rope_llama3_scaling=(8.0, 1.0, 4.0, 32))
  # transformers >= 5 layout: rope settings inside rope_parameters.
  v5 = {k: v for k, v in HF_CONFIGS["llama"].items() if k not in ("rope_theta", "rope_scaling")}
  v5["rope_parameters"] = {**HF_CONFIGS["llama"]["rope_scaling"], "rope_theta": 100.0}
  assert model_config_from_hf(v5) == cfgs["llama"]
  # ... and that layout is kept when the v5 config is passed as `extra`.
  again = hf_config_from_model(cfgs["llama"], "llama", extra=v5)
  assert "rope_scaling" not in again and {k: again[k] for k in v5} == v5
  # Older Llama 2 style: no head_dim, no num_key_value_heads, no rope_scaling.
  old = {k: v for k, v in HF_CONFIGS["llama"].items()
         if k not in ("head_dim", "num_key_value_heads", "rope_scaling")}
  cfg = model_config_from_hf(old)
  assert (cfg.head_dim, cfg.n_kv_heads, cfg.rope_llama3_scaling) == (8, 6, None)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_config_from_model_inverts(family):
  cfg = model_config_from_hf(HF_CONFIGS[family])
  out = hf_config_from_model(cfg, family, dtype=jnp.bfloat16)
  assert model_config_from_hf(out) == cfg
  assert out["model_type"] == family and out["torch_dtype"] == "bfloat16"
  assert hf_config_from_model(cfg) == hf_config_from_model(cfg, family)  # family inferred
  # With the original as `extra`, every original field comes back unchanged.
  kept = hf_config_from_model(cfg, family, dtype=HF_CONFIGS[family]["torch_dtype"],
                              extra=HF_CONFIGS[family])
  assert {k: kept[k] for k in HF_CONFIGS[family]} == HF_CONFIGS[family]


@pytest.mark.parametrize("change, match", [
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "'linear' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 rope_scaling lacks"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True}, "o_proj bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantized checkpoints"),
    ({"hidden_size": None}, "hidden_size"),
])
def test_model_config_from_hf_rejects(change, match):
  hf = {**HF_CONFIGS["llama"], **change}
  hf = {k: v for k, v in hf.items() if v is not None}
  with pytest.raises(ValueError, match=match):
    model_config_from_hf(hf)


def test_hf_config_from_model_rejects_wrong_family():
  cfg = model_config_from_hf(HF_CONFIGS["qwen2"])  # qkv bias
  with pytest.raises(ValueError, match="model_type='qwen2'"):
    hf_config_from_model(cfg, "llama")


# ------------------------------------------------------------------------------------------------
# Loading and saving


@pytest.mark.parametrize("family", FAMILIES)
def test_load_maps_and_transposes(tmp_path, family):
  path, raw = write_checkpoint(tmp_path, family)
  cfg, params = load_hf_checkpoint(path)
  assert cfg == model_config_from_hf(HF_CONFIGS[family])
  f32 = {k: v.astype(np.float32) for k, v in raw.items()}
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
  np.testing.assert_array_equal(params["embed"]["embedding"], f32["model.embed_tokens.weight"])
  layer, hf = params["layers_1"], "model.layers.1."
  np.testing.assert_array_equal(layer["attn"]["q_proj"]["kernel"],
                                f32[hf + "self_attn.q_proj.weight"].T)
  np.testing.assert_array_equal(layer["attn"]["o_proj"]["kernel"],
                                f32[hf + "self_attn.o_proj.weight"].T)
  np.testing.assert_array_equal(layer["mlp"]["down_proj"]["kernel"],
                                f32[hf + "mlp.down_proj.weight"].T)
  np.testing.assert_array_equal(layer["mlp_norm"]["scale"],
                                f32[hf + "post_attention_layernorm.weight"])
  assert ("bias" in layer["attn"]["k_proj"]) == (family == "qwen2")
  assert ("q_norm" in layer["attn"]) == (family == "qwen3")
  assert ("lm_head" in params) == (not HF_CONFIGS[family]["tie_word_embeddings"])
  if family == "qwen2":
    np.testing.assert_array_equal(layer["attn"]["v_proj"]["bias"],
                                  f32[hf + "self_attn.v_proj.bias"])
  if family == "qwen3":
    np.testing.assert_array_equal(layer["attn"]["k_norm"]["scale"],
                                  f32[hf + "self_attn.k_norm.weight"])
  # Every parameter comes from exactly one tensor: same count of numbers.
  assert sum(x.size for x in jax.tree.leaves(params)) == sum(v.size for v in raw.values())
  assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params()


@pytest.mark.parametrize("family, load_dtype", [
    ("qwen2", jnp.bfloat16), ("qwen2", jnp.float32), ("qwen3", jnp.float32),
    ("llama", jnp.float32), ("llama", jnp.bfloat16)])
def test_load_save_round_trip_is_exact(tmp_path, family, load_dtype):
  path, raw = write_checkpoint(tmp_path, family)
  cfg, params = load_hf_checkpoint(path, dtype=load_dtype)
  assert all(x.dtype == load_dtype for x in jax.tree.leaves(params))
  out = str(tmp_path / "saved")
  stored = STORAGE[family][0]
  # The original dtype is restored on save; from a bf16 load of an fp32 checkpoint the
  # values are the bf16-rounded ones.
  save_hf_checkpoint(out, cfg, params, model_type=family, dtype=stored,
                     extra_config=read_hf_config(path))
  saved = _read_dir(out)
  assert sorted(saved) == sorted(raw)
  for name, x in raw.items():
    expect = x
    if stored == "float32" and load_dtype == jnp.bfloat16:
      expect = x.astype(BF16).astype(np.float32)
    assert saved[name].dtype == x.dtype and saved[name].shape == x.shape, name
    assert saved[name].tobytes() == expect.tobytes(), name
  assert read_hf_config(out) == HF_CONFIGS[family]
  cfg2, params2 = load_hf_checkpoint(out, dtype=load_dtype)
  assert cfg2 == cfg
  assert jax.tree.structure(params2) == jax.tree.structure(params)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def test_save_sharded_and_resave_single(tmp_path):
  path, raw = write_checkpoint(tmp_path, "llama")
  cfg, params = load_hf_checkpoint(path)
  out = str(tmp_path / "saved")
  save_hf_checkpoint(out, cfg, params, max_shard_bytes=20_000)
  files = sorted(os.listdir(out))
  shards = [f for f in files if f.endswith(".safetensors")]
  assert len(shards) > 2 and "model.safetensors.index.json" in files
  with open(os.path.join(out, "model.safetensors.index.json")) as fh:
    index = json.load(fh)
  assert sorted(index["weight_map"]) == sorted(raw)
  assert set(index["weight_map"].values()) == set(shards)
  assert index["metadata"]["total_size"] == sum(v.nbytes for v in raw.values())
  saved = _read_dir(out)
  assert all(saved[n].tobytes() == raw[n].tobytes() for n in raw)
  # Saving single-file into the same directory removes the old shards and index.
  save_hf_checkpoint(out, cfg, params)
  assert sorted(f for f in os.listdir(out)) == ["config.json", "model.safetensors"]
  _, params2 = load_hf_checkpoint(out)
  assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params),
                                                  jax.tree.leaves(params2)))


def test_tied_checkpoint_with_stored_lm_head_loads(tmp_path):
  """Some exports keep lm_head.weight although it is tied, or RoPE buffers; both are ignored."""
  path, raw = write_checkpoint(tmp_path, "qwen2")
  raw["lm_head.weight"] = raw["model.embed_tokens.weight"].copy()
  raw["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
  safetensors.numpy.save_file(raw, os.path.join(path, "model.safetensors"))
  cfg, params = load_hf_checkpoint(path)
  assert cfg.tie_embeddings and "lm_head" not in params


# ------------------------------------------------------------------------------------------------
# The loaded model computes what transformers computes


_forward = jax.jit(transformer.forward, static_argnums=(2, 3))


def _assert_logits_close(ours, ref, what=""):
  # FP32 tolerance relative to the logit scale (logits near 0 make elementwise rtol meaningless).
  scale = np.abs(ref).max()
  np.testing.assert_allclose(np.asarray(ours), ref, rtol=0, atol=1e-4 * scale, err_msg=what)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_numpy_reference(tmp_path, family):
  path, raw = write_checkpoint(tmp_path, family)
  c = HF_CONFIGS[family]
  cfg, params = load_hf_checkpoint(path)
  ids = _ids(c)
  ours = _forward(params, jnp.asarray(ids), cfg, policy_for("fp32", layout.matmuls(cfg)))
  ref = hf_reference_logits(raw, c, ids)
  assert ours.shape == ref.shape == (2, 12, c["vocab_size"])
  assert ref.std() > 1.0  # weights large enough for every tensor to matter
  _assert_logits_close(ours, ref, family)
  if family == "llama":
    # The llama3 rope scaling changes these logits far beyond the tolerance, so the match
    # above checks that it is applied.
    unscaled = hf_reference_logits(raw, c, ids, apply_rope_scaling=False)
    assert np.abs(unscaled - ref).max() > 100 * 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_cache_decode_matches_full_forward(tmp_path, family):
  path, _ = write_checkpoint(tmp_path, family)
  cfg, params = load_hf_checkpoint(path)
  policy = policy_for("fp32", layout.matmuls(cfg))
  ids = jnp.asarray(_ids(HF_CONFIGS[family], s=10, seed=2))
  full = _forward(params, ids, cfg, policy)
  step = jax.jit(transformer.forward_with_cache, static_argnums=(3, 4))
  prompt = 4
  cache = transformer.init_cache(cfg, ids.shape[0], ids.shape[1], dtype=jnp.float32)
  logits, cache = step(params, ids[:, :prompt], cache, cfg, policy)
  _assert_logits_close(logits, np.asarray(full[:, :prompt]), "prefill")
  for t in range(prompt, ids.shape[1]):
    positions = jnp.full((ids.shape[0], 1), t, jnp.int32)
    logits, cache = step(params, ids[:, t:t + 1], cache, cfg, policy, positions_BT=positions)
    _assert_logits_close(logits[:, 0], np.asarray(full[:, t]), f"decode step {t}")


def test_bf16_load_runs_close_to_reference(tmp_path):
  """A BF16 load under the BF16 policy stays near the FP64 reference (coarse: BF16 math)."""
  path, raw = write_checkpoint(tmp_path, "qwen2")
  cfg, params = load_hf_checkpoint(path, dtype=jnp.bfloat16)
  ids = _ids(HF_CONFIGS["qwen2"])
  ours = np.asarray(_forward(params, jnp.asarray(ids), cfg, policy_for("bf16", layout.matmuls(cfg))))
  ref = hf_reference_logits(raw, HF_CONFIGS["qwen2"], ids)
  assert np.abs(ours - ref).max() < 0.05 * np.abs(ref).max()


# ------------------------------------------------------------------------------------------------
# Bad input


def test_truncated_file_is_reported(tmp_path):
  path, _ = write_checkpoint(tmp_path, "llama")
  file = os.path.join(path, "model.safetensors")
  with open(file, "rb") as fh:
    data = fh.read()
  with open(file, "wb") as fh:
    fh.write(data[: len(data) - 100])
  with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file.*"
                                       r"truncated or corrupt.*Re-download"):
    load_hf_checkpoint(path)


def test_truncated_shard_is_reported(tmp_path):
  path, _ = write_checkpoint(tmp_path, "qwen3")
  file = os.path.join(path, "model-00002-of-00003.safetensors")
  with open(file, "rb") as fh:
    data = fh.read()
  with open(file, "wb") as fh:
    fh.write(data[:6])
  with pytest.raises(ValueError, match=r"model-00002-of-00003\.safetensors is not a readable"):
    load_hf_checkpoint(path)


def test_missing_tensor_is_reported(tmp_path):
  path, raw = write_checkpoint(tmp_path, "llama")
  del raw["model.layers.1.mlp.up_proj.weight"]
  safetensors.numpy.save_file(raw, os.path.join(path, "model.safetensors"))
  with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
    load_hf_checkpoint(path)


def test_missing_lm_head_suggests_tying(tmp_path):
  path, raw = write_checkpoint(tmp_path, "llama")
  del raw["lm_head.weight"]
  safetensors.numpy.save_file(raw, os.path.join(path, "model.safetensors"))
  with pytest.raises(ValueError, match="lm_head.weight.*tie_word_embeddings"):
    load_hf_checkpoint(path)


def test_missing_shard_entry_is_reported(tmp_path):
  path, _ = write_checkpoint(tmp_path, "qwen3")
  index_file = os.path.join(path, "model.safetensors.index.json")
  with open(index_file) as fh:
    index = json.load(fh)
  del index["weight_map"]["model.layers.0.self_attn.q_norm.weight"]
  with open(index_file, "w") as fh:
    json.dump(index, fh)
  with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_norm\.weight"):
    load_hf_checkpoint(path)
  os.remove(os.path.join(path, "model-00001-of-00003.safetensors"))
  with pytest.raises(FileNotFoundError, match="model-00001-of-00003.safetensors.*missing"):
    load_hf_checkpoint(path)


def test_wrong_shape_is_reported(tmp_path):
  path, raw = write_checkpoint(tmp_path, "llama")
  raw["model.layers.0.self_attn.k_proj.weight"] = np.zeros((48, 48), np.float32)
  safetensors.numpy.save_file(raw, os.path.join(path, "model.safetensors"))
  with pytest.raises(ValueError, match=r"k_proj\.weight' has shape \(48, 48\).*\(16, 48\)"):
    load_hf_checkpoint(path)


def test_unexpected_tensor_is_reported(tmp_path):
  path, raw = write_checkpoint(tmp_path, "llama")
  raw["model.layers.0.self_attn.o_proj.bias"] = np.zeros((48,), np.float32)
  safetensors.numpy.save_file(raw, os.path.join(path, "model.safetensors"))
  with pytest.raises(ValueError, match=r"o_proj\.bias"):
    load_hf_checkpoint(path)


def test_missing_files_are_reported(tmp_path):
  path, _ = write_checkpoint(tmp_path, "llama")
  with pytest.raises(ValueError, match="dtype 'float16' is not supported"):
    load_hf_checkpoint(path, dtype=jnp.float16)
  os.remove(os.path.join(path, "model.safetensors"))
  with pytest.raises(FileNotFoundError, match="No model.safetensors or model.safetensors.index"):
    load_hf_checkpoint(path)
  os.remove(os.path.join(path, "config.json"))
  with pytest.raises(FileNotFoundError, match="config.json not found"):
    load_hf_checkpoint(path)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_hf_checkpoint(tmp_path / "nowhere")


def test_unsupported_config_in_directory(tmp_path):
  path, _ = write_checkpoint(tmp_path, "llama")
  with open(os.path.join(path, "config.json"), "w") as fh:
    json.dump({**HF_CONFIGS["llama"], "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, fh)
  with pytest.raises(ValueError, match="'dynamic' is not supported"):
    load_hf_checkpoint(path)


# ------------------------------------------------------------------------------------------------
# Tokenizer


@pytest.mark.parametrize("style", TOKENIZER_FILES)
def test_tokenizer_round_trip_and_special_ids(tmp_path, style):
  write_tokenizer(tmp_path, style)
  tok = load_tokenizer(tmp_path)
  assert isinstance(tok, TaskTokenizer)
  text = "the cat ate 42 apples and what is 7 + 3"
  ids = tok.encode(text)
  assert len(ids) < len(text) // 2  # merges were learned: not one id per character
  assert tok.decode(ids) == text
  assert [tok.decode(x) for x in tok.encode_batch([text, "a dog"])] == [text, "a dog"]
  assert tok.vocab_size == 64
  if style == "qwen":
    # tokenizer_config's bos null wins over generation_config's bos_token_id (as in Qwen2.5);
    # eos from tokenizer_config first, then generation_config's other eos.
    assert (tok.bos_id, tok.eos_id, tok.eos_ids, tok.pad_id) == (None, 3, (3, 1), 1)
    assert tok.id_to_token(tok.eos_id) == "<|im_end|>"
  else:
    # No pad token anywhere: pad falls back to eos.
    assert (tok.bos_id, tok.eos_id, tok.eos_ids, tok.pad_id) == (1, 2, (2, 3), 2)
    assert tok.id_to_token(tok.eos_id) == "</s>"
  # The checkpoint's post-processor (BOS template) runs only on request.
  bos_token = TOKENIZER_FILES[style][0][1]
  assert tok.encode(text, add_special_tokens=True) == [tok.token_to_id(bos_token)] + ids
  # decode: up to the first eos (any of eos_ids), bos and pad dropped; raw keeps everything.
  second_eos = tok.eos_ids[1]
  bos = [] if tok.bos_id is None else [tok.bos_id]
  sampled = bos + ids + [second_eos] + tok.encode("a dog") + [tok.pad_id]
  assert tok.decode(sampled) == text
  assert tok.decode(np.asarray(sampled)) == text
  assert tok.decode(sampled, raw=True).endswith(tok.id_to_token(tok.pad_id))
  with pytest.raises(ValueError, match="1-D sequence"):
    tok.decode(np.asarray([ids, ids]))


def test_tokenizer_overrides_and_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="tokenizer.json not found.*saved without its "
                                              "tokenizer. Copy tokenizer.json"):
    load_tokenizer(tmp_path)
  (tmp_path / "tokenizer.json").write_text("{not json")
  with pytest.raises(ValueError, match="cannot be parsed"):
    load_tokenizer(tmp_path)
  write_tokenizer(tmp_path, "llama")
  tok = load_tokenizer(tmp_path / "tokenizer.json", eos_token="<|eot_id|>", pad_token="<unk>")
  assert (tok.eos_ids, tok.pad_id, tok.bos_id) == ((3,), 0, 1)
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 500}))
  with pytest.raises(ValueError, match=r"ids \[500\].*outside"):
    load_tokenizer(tmp_path)
  (tmp_path / "generation_config.json").unlink()
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot|>"}))
  with pytest.raises(ValueError, match="'<\\|eot\\|>' is not in the tokenizer.json vocabulary"):
    load_tokenizer(tmp_path)
  # Without tokenizer_config.json the ids come from generation_config.json, then config.json.
  (tmp_path / "tokenizer_config.json").unlink()
  (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": 3,
                                                    "pad_token_id": 0}))
  (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
  tok = load_tokenizer(tmp_path)
  assert (tok.bos_id, tok.eos_ids, tok.pad_id) == (1, (3,), 0)
  (tmp_path / "config.json").unlink()
  with pytest.raises(ValueError, match="No eos token.*eos_token="):
    load_tokenizer(tmp_path)
