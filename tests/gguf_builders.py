"""Tiny GGUF files written on the spot with the `gguf` package's GGUFWriter (no download): a Llama
decoder with a real byte-level BPE tokenizer (trained here), tensors stored as llama.cpp stores
them (q/k rows permuted by llama.cpp's converter, quantized with gguf.quants, K-quant blocks
assembled byte by byte since gguf-py has no K-quant quantizer).
"""
from __future__ import annotations

import json

import numpy as np

# Small, but every in-width a multiple of 256 so the K-quants' super-blocks fit.
TINY = {"n_layers": 2, "d_model": 256, "d_ff": 512, "n_heads": 4, "n_kv_heads": 2,
        "rope_theta": 10000.0, "rms_eps": 1e-5, "context": 256}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = ["What is 12 + 345? The answer is 357.", "hello world, the sea is blue",
          "Write one sentence about the sea.", "Compute 8 * 7 - 6 = 50", "colours: red, green"]

# Storage of each tensor kind per layer (layer index % 2): every type the loader promises.
LAYER_TYPES = (
    {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_K",
     "ffn_gate": "Q6_K", "ffn_up": "F16", "ffn_down": "Q4_K"},
    {"attn_q": "Q8_0", "attn_k": "Q6_K", "attn_v": "Q4_K", "attn_output": "Q4_1",
     "ffn_gate": "Q4_0", "ffn_up": "Q8_0", "ffn_down": "Q6_K"},
)


def train_bpe(digits_split: bool = True, vocab_size: int = 330):
  """(tokens in id order, merges "a b") of a byte-level BPE trained on CORPUS; with digits_split
  the digits are isolated first (SmolLM's Digits + ByteLevel), so no merge joins digits."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                byte_level]) if digits_split else byte_level)
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(CORPUS * 20 + ["1234567890 99 100 2024"] * 20, trainer)
  model = json.loads(tok.to_str())["model"]
  tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  return tokens, merges


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
  """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`: HF q/k rows -> GGUF rows."""
  if n_head_kv is not None and n_head != n_head_kv:
    n_head = n_head_kv
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))


def _k_quant_bytes(rng, rows: int, cols: int, kind: str) -> np.ndarray:
  """Random but valid Q4_K / Q6_K blocks: random codes and sub-scales, fp16 super-block scales
  set to sizes that give weights of order 0.1 (random fp16 bytes could be inf/nan)."""
  import gguf
  qtype = gguf.GGMLQuantizationType[kind]
  block, size = gguf.GGML_QUANT_SIZES[qtype]
  raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
  if kind == "Q4_K":  # d, dmin (fp16) lead the block
    raw[..., 0:2] = np.frombuffer(np.float16(4e-4).tobytes(), np.uint8)
    raw[..., 2:4] = np.frombuffer(np.float16(4e-4).tobytes(), np.uint8)
  else:  # Q6_K: ql, qh, int8 scales, then d (fp16) last
    raw[..., -2:] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
  return raw.reshape(rows, -1)


def _store(rng, w: np.ndarray, kind: str):
  """(array to write, raw_dtype) of HF-layout weight `w` stored as `kind`."""
  import gguf
  qtype = gguf.GGMLQuantizationType[kind]
  if kind == "F32":
    return w.astype(np.float32), None
  if kind == "F16":
    return w.astype(np.float16), None
  if kind in ("Q4_K", "Q6_K"):
    return _k_quant_bytes(rng, w.shape[0], w.shape[1], kind), qtype
  return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


def write_gguf(path, *, tied: bool = True, pre: str = "smollm", digits_split: bool = True,
               arch: str = "llama", tokenizer_model: str = "gpt2", add_bos: bool = False,
               skip: tuple[str, ...] = (), extra: dict | None = None, seed: int = 0) -> str:
  """Writes a tiny Llama GGUF to `path` and returns it. `skip`: tensor names left out;
  `extra`: {tensor name: (array, raw qtype name)} written besides the normal ones."""
  import gguf
  rng = np.random.default_rng(seed)
  c = TINY
  tokens, merges = train_bpe(digits_split)
  vocab, d, f = len(tokens), c["d_model"], c["d_ff"]
  hd = d // c["n_heads"]
  w = gguf.GGUFWriter(str(path), arch)
  w.add_name("tiny")
  w.add_block_count(c["n_layers"])
  w.add_context_length(c["context"])
  w.add_embedding_length(d)
  w.add_feed_forward_length(f)
  w.add_head_count(c["n_heads"])
  w.add_head_count_kv(c["n_kv_heads"])
  w.add_rope_freq_base(c["rope_theta"])
  w.add_layer_norm_rms_eps(c["rms_eps"])
  w.add_rope_dimension_count(hd)
  w.add_vocab_size(vocab)
  w.add_tokenizer_model(tokenizer_model)
  w.add_tokenizer_pre(pre)
  w.add_token_list(tokens)
  w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
  w.add_token_merges(merges)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_pad_token_id(2)
  w.add_add_bos_token(add_bos)
  w.add_chat_template(CHATML)

  def add(name, array, kind):
    if name in skip:
      return
    data, raw = _store(rng, array, kind)
    w.add_tensor(name, data, raw_dtype=raw)

  def linear(n_out, n_in):
    return (rng.standard_normal((n_out, n_in)) * 1.5 / np.sqrt(n_in)).astype(np.float32)

  add("token_embd.weight", rng.standard_normal((vocab, d)).astype(np.float32), "Q8_0")
  for i in range(c["n_layers"]):
    types = LAYER_TYPES[i % 2]
    add(f"blk.{i}.attn_norm.weight", (1 + 0.2 * rng.standard_normal(d)).astype(np.float32), "F32")
    add(f"blk.{i}.ffn_norm.weight", (1 + 0.2 * rng.standard_normal(d)).astype(np.float32), "F32")
    add(f"blk.{i}.attn_q.weight", permute(linear(d, d), c["n_heads"], c["n_heads"]),
        types["attn_q"])
    add(f"blk.{i}.attn_k.weight",
        permute(linear(c["n_kv_heads"] * hd, d), c["n_heads"], c["n_kv_heads"]), types["attn_k"])
    add(f"blk.{i}.attn_v.weight", linear(c["n_kv_heads"] * hd, d), types["attn_v"])
    add(f"blk.{i}.attn_output.weight", linear(d, d), types["attn_output"])
    add(f"blk.{i}.ffn_gate.weight", linear(f, d), types["ffn_gate"])
    add(f"blk.{i}.ffn_up.weight", linear(f, d), types["ffn_up"])
    add(f"blk.{i}.ffn_down.weight", linear(d, f), types["ffn_down"])
  add("output_norm.weight", (1 + 0.2 * rng.standard_normal(d)).astype(np.float32), "F32")
  if not tied:
    add("output.weight", linear(vocab, d), "Q6_K")
  for name, (array, kind) in (extra or {}).items():
    w.add_tensor(name, array, raw_dtype=None if kind is None else
                 gguf.GGMLQuantizationType[kind])
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)
