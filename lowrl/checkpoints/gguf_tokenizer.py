"""A GGUF file's tokenizer (llama.cpp metadata) as a `tokenizers.Tokenizer`, its special tokens and
chat template, and the Hugging Face tokenizer files that describe the same tokenizer.

A GGUF holds no tokenizer.json: it stores `tokenizer.ggml.model` (the algorithm), `.tokens` (the
vocabulary in id order), `.merges` (BPE), `.token_type` (1 normal, 3 control, 4 user-defined, ...),
`.pre` (the pre-tokenizer by name: llama.cpp's `llama_vocab_pre_type`), the special ids and
`tokenizer.chat_template`. We build the byte-level BPE (`model` "gpt2") the way llama.cpp runs it:

- the vocabulary and merges as stored (byte-level BPE tokens are spelled in GPT-2's
  bytes-to-unicode alphabet already; a token outside it is respelled byte by byte, as transformers
  does);
- the pre-tokenizer named by `.pre`, from llama.cpp's `llm_tokenizer_bpe` regex lists: each regex
  of the list splits the pieces of the previous one (`_PRE_TOKENIZERS`). "smollm" (and
  starcoder, refact, command-r, codeshell, exaone, minerva) first isolates every digit (`\\p{N}`),
  then applies GPT-2's regex; this is also the Digits(individual) + ByteLevel pipeline of the
  original SmolLM2 tokenizer.json. transformers' GGUF reader has no "smollm" entry and falls back
  to GPT-2's regex, which keeps digit runs together: its token ids differ from llama.cpp's (and
  ours) on text with multi-digit numbers, and agree elsewhere (tests/checkpoints/test_gguf.py);
- control tokens (type 3) as special added tokens and user-defined ones (type 4) as plain added
  tokens, so that they are matched whole in text;
- `tokenizer.ggml.add_bos_token` / `add_eos_token` as a post-processor (what
  `encode(add_special_tokens=True)` adds), and the bos id is reported only when the file asks for
  it to be added: lowrl's batching prepends `Tokenizer.bos_id`, and llama.cpp adds no BOS when
  add_bos_token is false (SmolLM2: its `<|im_start|>` bos is written by the chat template).

Other tokenizer models (sentencepiece "llama", "t5", ...) and pre-tokenizers raise a one-line
error naming what is supported.
"""
from __future__ import annotations

import json
import os
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from lowrl.checkpoints import gguf

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's llama_token_type values

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?"
                 r"\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?"
                r"\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp pre-tokenizer name -> (its regexes in order, BPE ignore_merges). llama.cpp's
# llama-vocab.cpp: LLAMA_VOCAB_PRE_TYPE_GPT2/... use GPT-2's regex, the SMOLLM group prepends
# "\p{N}", LLAMA3 and QWEN2 have their own regex, and LLAMA3 looks whole words up first
# (ignore_merges).
_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    **{name: ((_GPT2_SPLIT,), False)
       for name in ("default", "gpt-2", "gpt2", "mpt", "olmo", "jais")},
    **{name: ((r"\p{N}", _GPT2_SPLIT), False)
       for name in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                    "minerva-7b")},
    **{name: ((_LLAMA3_SPLIT,), True) for name in ("llama-bpe", "llama3", "llama-v3")},
    **{name: ((_QWEN2_SPLIT,), False) for name in ("qwen2", "deepseek-r1-qwen")},
}


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
      list(range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


def _spelled(tokens: list[str]) -> list[str]:
  """Tokens in the byte-level alphabet; a token using any other character respelled from its
  UTF-8 bytes (llama.cpp stores some added tokens as raw text)."""
  table = _bytes_to_unicode()
  alphabet = set(table.values())
  return [t if set(t) <= alphabet else "".join(table[b] for b in t.encode("utf-8"))
          for t in tokens]


def _meta(reader, name: str, default: Any = None) -> Any:
  return gguf.metadata(reader, f"tokenizer.ggml.{name}", default)


def _pre_tokenizer(pre: str):
  if pre not in _PRE_TOKENIZERS:
    raise ValueError(f"GGUF tokenizer.ggml.pre={pre!r} is not supported; lowrl builds "
                     f"{sorted(_PRE_TOKENIZERS)}.")
  regexes, _ = _PRE_TOKENIZERS[pre]
  splits = [pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated") for r in regexes]
  return pre_tokenizers.Sequence(
      splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _check_model(reader) -> tuple[str, str]:
  model = _meta(reader, "model")
  if model != "gpt2":
    raise ValueError(f"GGUF tokenizer.ggml.model={model!r} is not supported; lowrl builds "
                     "byte-level BPE tokenizers ('gpt2') from GGUF metadata.")
  pre = _meta(reader, "pre", "default")
  _pre_tokenizer(pre)
  if not _meta(reader, "tokens") or _meta(reader, "merges") is None:
    raise ValueError("GGUF file has no tokenizer.ggml.tokens / merges; it carries no tokenizer.")
  if _meta(reader, "eos_token_id") is None:
    raise ValueError("GGUF file has no tokenizer.ggml.eos_token_id; lowrl needs an eos token.")
  return model, pre


def build_tokenizer(reader) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
  """(the `tokenizers.Tokenizer`, its special ids {"bos", "eos_ids", "pad"}) of a GGUF reader.

  bos is None unless tokenizer.ggml.add_bos_token is true (see the module docstring); eos_ids
  are the eos id then llama.cpp's end-of-turn id when it differs.
  """
  _, pre = _check_model(reader)
  tokens = _spelled(list(_meta(reader, "tokens")))
  vocab = {t: i for i, t in enumerate(tokens)}
  if len(vocab) != len(tokens):
    raise ValueError("GGUF tokenizer.ggml.tokens has duplicate tokens; the file is corrupt.")
  merges = [tuple(m.split(" ", 1)) for m in _meta(reader, "merges")]
  _, ignore_merges = _PRE_TOKENIZERS[pre]
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
  tok.pre_tokenizer = _pre_tokenizer(pre)
  tok.decoder = decoders.ByteLevel()
  types = list(_meta(reader, "token_type", []))
  tok.add_special_tokens([tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                          for i, kind in enumerate(types) if kind == CONTROL])
  tok.add_tokens([tokenizers.AddedToken(tokens[i], special=False, normalized=False)
                  for i, kind in enumerate(types) if kind == USER_DEFINED])
  bos, eos = _meta(reader, "bos_token_id"), int(_meta(reader, "eos_token_id"))
  add_bos = bool(_meta(reader, "add_bos_token", False)) and bos is not None
  add_eos = bool(_meta(reader, "add_eos_token", False))
  single = ([f"{tokens[bos]}:0"] if add_bos else []) + ["$A:0"] + \
      ([f"{tokens[eos]}:0"] if add_eos else [])
  specials = ([(tokens[bos], int(bos))] if add_bos else []) + \
      ([(tokens[eos], eos)] if add_eos else [])
  tok.post_processor = processors.TemplateProcessing(
      single=single, pair=single + ["$B:1"], special_tokens=specials)
  eot = _meta(reader, "eot_token_id")
  eos_ids = [eos] + ([int(eot)] if eot is not None and int(eot) != eos else [])
  pad = _meta(reader, "padding_token_id")
  return tok, {"bos": int(bos) if add_bos else None, "eos_ids": eos_ids,
               "pad": None if pad is None else int(pad)}


def tokenizer_config(reader) -> dict[str, Any]:
  """The tokenizer_config.json dict of a GGUF file: special tokens by text, add_bos/eos flags and
  the chat template (what transformers' GGUF reader writes for it)."""
  tokens = list(_meta(reader, "tokens"))
  out: dict[str, Any] = {"add_bos_token": bool(_meta(reader, "add_bos_token", False)),
                         "add_eos_token": bool(_meta(reader, "add_eos_token", False))}
  for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                    ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
    token_id = _meta(reader, key)
    out[name] = None if token_id is None else tokens[int(token_id)]
  template = gguf.metadata(reader, "tokenizer.chat_template")
  if template is not None:
    out["chat_template"] = template
  return out


def read_tokenizer_config(path: str | os.PathLike) -> dict[str, Any]:
  """tokenizer_config of the GGUF file at `path` (its chat template under "chat_template")."""
  return tokenizer_config(gguf.open_gguf(path))


def check_tokenizer(path: str | os.PathLike) -> None:
  """One-line ValueError unless the file's tokenizer is one lowrl builds (reads metadata only)."""
  _check_model(gguf.open_gguf(path))


def write_hf_tokenizer_files(path: str | os.PathLike, out: str | os.PathLike) -> list[str]:
  """Writes tokenizer.json, tokenizer_config.json and generation_config.json for the GGUF file's
  tokenizer into directory `out` (the export's tokenizer files); returns their names."""
  reader = gguf.open_gguf(path)
  tok, ids = build_tokenizer(reader)
  tok.save(os.path.join(out, "tokenizer.json"))
  with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
    json.dump({**tokenizer_config(reader), "tokenizer_class": "PreTrainedTokenizerFast"}, fh,
              indent=2, ensure_ascii=False)
    fh.write("\n")
  generation = {"eos_token_id": ids["eos_ids"] if len(ids["eos_ids"]) > 1 else ids["eos_ids"][0]}
  if _meta(reader, "bos_token_id") is not None:
    generation["bos_token_id"] = int(_meta(reader, "bos_token_id"))
  if ids["pad"] is not None:
    generation["pad_token_id"] = ids["pad"]
  with open(os.path.join(out, "generation_config.json"), "w", encoding="utf-8") as fh:
    json.dump(generation, fh, indent=2)
    fh.write("\n")
  return ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
