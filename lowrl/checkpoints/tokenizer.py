"""A checkpoint's Hugging Face `tokenizer.json` behind lowrl's tokenizer interface.

The fast-tokenizer file holds the whole pipeline (normalizer, pre-tokenizer, model, post-processor,
decoder), so the `tokenizers` library reproduces transformers' encode/decode without transformers.
The special-token ids are spread over three files; `load_tokenizer` reads them in transformers'
order of authority: tokenizer_config.json (what the tokenizer itself uses), then
generation_config.json (what `generate` stops on), then config.json. A bare tokenizer.json
(none of those files beside it) gets its special tokens from common names instead (`<s>`, `</s>`,
`<|endoftext|>`, ...; see `_CANDIDATES`).

`Tokenizer` satisfies the `lowrl.tasks.tokenizer.Tokenizer` protocol with the same meaning:
`encode` adds no special tokens (batching prepends bos itself), `decode` stops at the first eos
and drops pad/bos, and `pad_id` falls back to the eos id when the checkpoint has no pad token.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import tokenizers

from lowrl.checkpoints import gguf, gguf_tokenizer

TOKENIZER_FILE = "tokenizer.json"
_TOKENIZER_CONFIG = "tokenizer_config.json"
_ID_FILES = ("generation_config.json", "config.json")
# The slow (python) tokenizers' files transformers can convert into a tokenizer.json.
_SLOW_FILES = ("tokenizer.model", "vocab.json", "spiece.model")


class MissingEosError(ValueError):
  """No file of the checkpoint names an eos token. `where`: what was searched; `specials`: the
  tokenizer's special tokens (the likely candidates), in id order; `config_file`: the
  tokenizer_config.json an "eos_token" entry would go in."""

  def __init__(self, where: str, specials: Sequence[str], config_file: str):
    self.where, self.specials, self.config_file = where, tuple(specials), config_file
    super().__init__(
        f"No eos token in {where}. Name the token that ends a completion: pass eos_token=... "
        f"explicitly (its special tokens: {list(self.specials) or 'none'}), or add "
        f"\"eos_token\" to {config_file}.")

# Token names tried, in order, for a special token of a bare tokenizer.json (no config files).
_CANDIDATES = {
    "bos": ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "[BOS]"),
    "eos": ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>",
            "[EOS]"),
    "pad": ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>"),
}


class Tokenizer:
  """A `tokenizers.Tokenizer` plus the special-token ids of its checkpoint.

  Attributes:
    bos_id: begin-of-sequence id, None when the checkpoint has none (Qwen).
    eos_ids: every id that ends a sequence (Qwen and Llama 3 instruct have several); the first
      is `eos_id`.
    pad_id: padding id; the eos id when the checkpoint defines no pad token (Llama 3).
  """

  def __init__(self, tok: tokenizers.Tokenizer, eos_ids: Sequence[int],
               bos_id: int | None = None, pad_id: int | None = None):
    if not eos_ids:
      raise ValueError("A Tokenizer needs at least one eos id.")
    self._tok = tok
    self.eos_ids = tuple(int(i) for i in eos_ids)
    self.bos_id = bos_id
    self.pad_id = self.eos_ids[0] if pad_id is None else pad_id

  @property
  def eos_id(self) -> int:
    """The primary end-of-sequence id."""
    return self.eos_ids[0]

  @property
  def vocab_size(self) -> int:
    """Number of token ids including added/special tokens.

    Can be smaller than ModelConfig.vocab_size: checkpoints pad the embedding (Qwen2.5: 151,665
    tokens, 151,936 rows).
    """
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def backend(self) -> tokenizers.Tokenizer:
    """The wrapped `tokenizers.Tokenizer` (chat templates, offsets, ...)."""
    return self._tok

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of `text`.

    add_special_tokens runs the checkpoint's post-processor (e.g. Llama's BOS), as transformers'
    default does; off by default because lowrl's batching prepends bos itself.
    """
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
    """encode() for many texts (parallel inside `tokenizers`)."""
    encodings = self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)
    return [e.ids for e in encodings]

  def decode(self, ids: Iterable[int], raw: bool = False) -> str:
    """Text of one sequence of ids.

    By default the text before the first eos id, with pad and bos ids dropped (the tasks'
    meaning of decode: a sampled completion up to its end). raw=True decodes every id as is,
    special tokens included.
    """
    seq = np.asarray(list(ids) if not hasattr(ids, "__len__") else ids)
    if seq.size == 0:
      return ""
    if seq.ndim != 1 or not np.issubdtype(seq.dtype, np.integer):
      raise ValueError(f"decode takes one 1-D sequence of integer ids, got shape {seq.shape} "
                       f"dtype {seq.dtype}; decode the rows of a batch one at a time.")
    out = seq.tolist()
    if not raw:
      stop = [i for i, t in enumerate(out) if t in self.eos_ids]
      drop = {self.pad_id, self.bos_id}
      out = [t for t in out[:stop[0] if stop else len(out)] if t not in drop]
    return self._tok.decode(out, skip_special_tokens=False)

  def token_to_id(self, token: str) -> int | None:
    """Id of a token string, None if not in the vocabulary."""
    return self._tok.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    """Token string of an id, None if out of range."""
    return self._tok.id_to_token(int(token_id))


def _read_json(file: str) -> dict:
  if not os.path.isfile(file):
    return {}
  try:
    with open(file) as fh:
      return json.load(fh)
  except json.JSONDecodeError as e:
    raise ValueError(f"{file} is not valid JSON ({e}); re-download or fix it.") from e


def _token_id(tok: tokenizers.Tokenizer, token: Any, where: str) -> int | None:
  """Id of a special token given as a string or a serialized AddedToken dict (from `where`)."""
  if token is None:
    return None
  content = token.get("content") if isinstance(token, Mapping) else token
  token_id = tok.token_to_id(content)
  if token_id is None:
    raise ValueError(f"{where}: {content!r} is not in the {TOKENIZER_FILE} vocabulary; the "
                     "files do not belong together (or name a token the tokenizer has).")
  return token_id


def _given_id(tok: tokenizers.Tokenizer, name: str, token: str) -> int:
  """Id of a special token the caller named."""
  token_id = tok.token_to_id(token)
  if token_id is None:
    raise ValueError(f"{name}_token={token!r} is not in the tokenizer vocabulary "
                     f"({TOKENIZER_FILE}); pass a token it has.")
  return token_id


def _guess_id(tok: tokenizers.Tokenizer, name: str) -> int | None:
  """Id of the first common name for special token `name` that the vocabulary has."""
  return next((i for i in map(tok.token_to_id, _CANDIDATES[name]) if i is not None), None)


def _ids(value: Any) -> list[int]:
  if value is None:
    return []
  return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def special_tokens(tok: tokenizers.Tokenizer, limit: int = 8) -> tuple[str, ...]:
  """The first `limit` special added tokens of `tok`, in id order (eos candidates to name)."""
  added = tok.get_added_tokens_decoder()
  return tuple(added[i].content for i in sorted(added) if added[i].special)[:limit]


def _no_tokenizer_json(path: str, file: str) -> str:
  """Why a checkpoint has no tokenizer.json, and the fix that applies to what it has instead."""
  slow = [f for f in _SLOW_FILES if os.path.isfile(os.path.join(path, f))]
  if slow:
    return (f"{file} not found; {path} has {slow}, a slow tokenizer lowrl does not read. Convert "
            "it once with transformers: python -c \"from transformers import AutoTokenizer; "
            f"AutoTokenizer.from_pretrained('{path}').save_pretrained('{path}')\" (writes "
            "tokenizer.json).")
  return (f"{file} not found, and {path} has no other tokenizer files either ({list(_SLOW_FILES)}): "
          "the checkpoint was saved without its tokenizer. Copy tokenizer.json and "
          "tokenizer_config.json from the model it was trained from (the base model's "
          "repository) into the directory.")


def load_tokenizer(path: str | os.PathLike, *, bos_token: str | None = None,
                   eos_token: str | None = None, pad_token: str | None = None) -> Tokenizer:
  """Loads `tokenizer.json` and the special-token ids from a checkpoint directory.

  Args:
    path: the directory (or the tokenizer.json file itself), or a llama.cpp `.gguf` file (its
      tokenizer built from the file's metadata: `gguf_tokenizer.build_tokenizer`).
    bos_token, eos_token, pad_token: token strings overriding what the checkpoint's files say.

  A token that is neither given nor defined by the files stays undefined (no bos; pad = eos),
  except for a bare tokenizer.json: with no tokenizer_config.json, generation_config.json or
  config.json beside it, each token not given is the first of its `_CANDIDATES` names in the
  vocabulary.

  Raises:
    FileNotFoundError: `path` does not exist, or has no tokenizer.json (e.g. only a
      sentencepiece tokenizer.model).
    ValueError: tokenizer.json cannot be parsed or a special token is not in its vocabulary;
      MissingEosError (a ValueError) when no file defines an eos token and none is given.
  """
  path = os.fspath(path)
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: expected a checkpoint directory or its "
                            f"{TOKENIZER_FILE}.")
  if gguf.is_gguf(path):
    if bos_token or eos_token or pad_token:
      raise ValueError("bos_token/eos_token/pad_token overrides apply to tokenizer.json "
                       "checkpoints; a .gguf file's special tokens come from its metadata.")
    tok, ids = gguf_tokenizer.build_tokenizer(gguf.open_gguf(path))
    return Tokenizer(tok, ids["eos_ids"], bos_id=ids["bos"], pad_id=ids["pad"])
  if os.path.isfile(path):
    path, file = os.path.dirname(path), path
  else:
    file = os.path.join(path, TOKENIZER_FILE)
  if not os.path.isfile(file):
    raise FileNotFoundError(_no_tokenizer_json(path, file))
  try:
    tok = tokenizers.Tokenizer.from_file(file)
  except Exception as e:  # tokenizers raises a bare Exception on parse errors
    raise ValueError(f"{file} cannot be parsed by tokenizers {tokenizers.__version__} ({e}); it "
                     "is corrupt or from a newer tokenizers version.") from e

  tc_file = os.path.join(path, _TOKENIZER_CONFIG)
  tc = _read_json(tc_file)
  bare = not any(os.path.isfile(os.path.join(path, f)) for f in (_TOKENIZER_CONFIG, *_ID_FILES))
  found = {}
  for name, override in (("bos", bos_token), ("eos", eos_token), ("pad", pad_token)):
    if override is not None:
      found[name] = _given_id(tok, name, override)
    elif bare:
      found[name] = _guess_id(tok, name)
    else:
      found[name] = _token_id(tok, tc.get(f"{name}_token"), f"{tc_file} {name}_token")
  bos, pad = found["bos"], found["pad"]
  eos_ids = _ids(found["eos"])
  # tokenizer_config.json saying `"bos_token": null` means no bos (Qwen), even though Qwen's
  # generation_config.json names bos_token_id = <|endoftext|>: the other files only fill in
  # what tokenizer_config.json leaves out. Their eos ids all count (generate stops on them).
  settled_bos = bos_token is not None or "bos_token" in tc
  settled_pad = pad_token is not None or "pad_token" in tc
  for name in _ID_FILES:
    cfg = _read_json(os.path.join(path, name))
    if not settled_bos and bos is None:
      bos = cfg.get("bos_token_id")
    if not settled_pad and pad is None:
      pad = cfg.get("pad_token_id")
    if eos_token is None:
      eos_ids += [i for i in _ids(cfg.get("eos_token_id")) if i not in eos_ids]
  if not eos_ids:
    specials = special_tokens(tok)
    where = (f"{file!r}: no config files beside it and none of the usual eos_token names "
             f"{list(_CANDIDATES['eos'])} in it" if bare else
             f"{path!r}: tokenizer_config.json, generation_config.json and config.json define none")
    raise MissingEosError(where, specials, os.path.join(path, _TOKENIZER_CONFIG))
  vocab = tok.get_vocab_size(with_added_tokens=True)
  bad = [i for i in eos_ids + [bos, pad] if i is not None and not 0 <= int(i) < vocab]
  if bad:
    raise ValueError(f"Special-token ids {bad} in {path!r} are outside the {TOKENIZER_FILE} "
                     f"vocabulary of {vocab}; the config files do not belong to this tokenizer.")
  return Tokenizer(tok, eos_ids, bos_id=None if bos is None else int(bos),
                   pad_id=None if pad is None else int(pad))
