"""Tokenizers for the tasks: a character-level one and a wrapper for Hugging Face tokenizer.json.

Both expose the same small interface (`Tokenizer`): integer ids for pad / bos / eos, `encode`
(text -> ids, no special tokens added) and `decode` (ids -> text, stopping at the first eos).
Special tokens are never produced by `encode`: the text "<eos>" is five ordinary characters,
so task text cannot inject control tokens.
"""
from __future__ import annotations

import string
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)  # ids 0, 1, 2 in CharTokenizer

# The fixed vocabulary every procedural task shares, so one model can be trained on a mix of
# tasks. Order matters (it fixes the ids): never reorder, only append.
DEFAULT_CHARS = (string.digits + string.ascii_lowercase + string.ascii_uppercase +
                 " +-*/=:>,.()[]{}<|?!_;'\"#%&^~@$\\`\n")


@runtime_checkable
class Tokenizer(Protocol):
  """What tasks, batching and samplers need from a tokenizer."""

  @property
  def vocab_size(self) -> int: ...

  @property
  def pad_id(self) -> int: ...

  @property
  def bos_id(self) -> int | None: ...

  @property
  def eos_id(self) -> int: ...

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Iterable[int]) -> str: ...


def _cut_at_eos(ids: Iterable[int], eos_id: int, drop: set[int]) -> list[int]:
  """Ids before the first eos, with the `drop` ids removed. `ids` is one 1-D sequence."""
  if not hasattr(ids, "__array__") and not isinstance(ids, (list, tuple)):
    ids = list(ids)  # generators and other one-shot iterables
  seq = np.asarray(ids)
  if seq.size == 0:
    return []
  if seq.ndim != 1 or not np.issubdtype(seq.dtype, np.integer):
    raise ValueError(f"decode takes one 1-D sequence of integer ids, got shape {seq.shape} dtype "
                     f"{seq.dtype}; decode the rows of a batch one at a time (see decode_batch).")
  out = []
  for i in seq.tolist():
    if i == eos_id:
      break
    if i not in drop:
      out.append(i)
  return out


class CharTokenizer:
  """One token per character; pad=0, bos=1, eos=2, then the characters of `chars` in order."""

  def __init__(self, chars: Sequence[str] | str = DEFAULT_CHARS):
    """Builds the vocabulary.

    Args:
      chars: the ordinary characters, in id order (id of chars[i] is 3 + i). Each must be a
        single character and appear once.
    """
    chars = list(chars)
    if not chars:
      raise ValueError("CharTokenizer needs at least one character; pass e.g. chars=DEFAULT_CHARS.")
    for c in chars:
      if not isinstance(c, str) or len(c) != 1:
        raise ValueError(f"CharTokenizer chars must be single characters, got {c!r}.")
    if len(set(chars)) != len(chars):
      dup = sorted({c for c in chars if chars.count(c) > 1})
      raise ValueError(f"CharTokenizer chars contain duplicates {dup!r}; pass each character once.")
    self._chars = tuple(chars)
    self._ids = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(chars)}

  @classmethod
  def from_texts(cls, texts: Iterable[str]) -> CharTokenizer:
    """A tokenizer whose vocabulary is exactly the characters of `texts`, sorted (deterministic)."""
    chars: set[str] = set()
    for t in texts:
      chars.update(t)
    return cls(sorted(chars))

  @property
  def chars(self) -> tuple[str, ...]:
    return self._chars

  @property
  def vocab_size(self) -> int:
    return len(SPECIAL_TOKENS) + len(self._chars)

  @property
  def pad_id(self) -> int:
    return 0

  @property
  def bos_id(self) -> int:
    return 1

  @property
  def eos_id(self) -> int:
    return 2

  def covers(self, text: str) -> bool:
    """Whether every character of `text` is in the vocabulary."""
    return all(c in self._ids for c in text)

  def encode(self, text: str) -> list[int]:
    """Character ids of `text` (no bos/eos added); unknown characters raise ValueError."""
    try:
      return [self._ids[c] for c in text]
    except KeyError:
      pos = next(i for i, c in enumerate(text) if c not in self._ids)
      raise ValueError(
          f"Character {text[pos]!r} at position {pos} of {text[:60]!r} is not in the tokenizer "
          "vocabulary; build the tokenizer with CharTokenizer.from_texts(...) over your data or "
          "add the character to `chars`.") from None

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids` up to (not including) the first eos; pad and bos are dropped."""
    out = []
    n = self.vocab_size
    for i in _cut_at_eos(ids, self.eos_id, {self.pad_id, self.bos_id}):
      if not 0 <= i < n:
        raise ValueError(f"Token id {i} is outside the vocabulary [0, {n}).")
      out.append(self._chars[i - len(SPECIAL_TOKENS)])
    return "".join(out)


# Names tried, in order, when the caller does not name a special token of a tokenizer.json.
_BOS_CANDIDATES = ("<bos>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "[BOS]")
_EOS_CANDIDATES = ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>",
                   "[EOS]")
_PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")


class HFTokenizer:
  """A Hugging Face `tokenizers` tokenizer.json behind the `Tokenizer` interface.

  bos may be absent (Qwen-style tokenizers have none): then `bos_id` is None and nothing is
  prepended. pad falls back to eos when the file has no pad token (as Qwen does); batching never
  infers lengths from pad, so the two may share an id.
  """

  def __init__(self, path: str, *, bos_token: str | None = None, eos_token: str | None = None,
               pad_token: str | None = None):
    """Loads `path` (a tokenizer.json).

    Args:
      path: tokenizer.json file.
      bos_token, eos_token, pad_token: special-token strings; None = try common names.
    """
    import tokenizers  # imported here so the char tokenizer does not need the package

    try:
      self._tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust error type is not importable; re-raise with the path
      raise ValueError(f"Could not load tokenizer.json from {str(path)!r}: {e}") from e
    self._bos = self._find("bos_token", bos_token, _BOS_CANDIDATES, required=False)
    eos = self._find("eos_token", eos_token, _EOS_CANDIDATES, required=True)
    assert eos is not None
    self._eos = eos
    pad = self._find("pad_token", pad_token, _PAD_CANDIDATES, required=False)
    self._pad = eos if pad is None else pad

  def _find(self, what: str, given: str | None, candidates: Sequence[str], required: bool) -> int | None:
    if given is not None:
      i = self._tok.token_to_id(given)
      if i is None:
        raise ValueError(f"{what}={given!r} is not in the tokenizer vocabulary; pass a token it has.")
      return i
    for name in candidates:
      i = self._tok.token_to_id(name)
      if i is not None:
        return i
    if required:
      raise ValueError(f"The tokenizer has none of the usual {what} names {list(candidates)}; "
                       f"pass {what}=... explicitly.")
    return None

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def pad_id(self) -> int:
    return self._pad

  @property
  def bos_id(self) -> int | None:
    return self._bos

  @property
  def eos_id(self) -> int:
    return self._eos

  def encode(self, text: str) -> list[int]:
    """Token ids of `text` without the tokenizer's own special-token template."""
    return list(self._tok.encode(text, add_special_tokens=False).ids)

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids` up to the first eos; pad and bos are dropped."""
    drop = {self._pad} | ({self._bos} if self._bos is not None else set())
    return self._tok.decode(_cut_at_eos(ids, self._eos, drop), skip_special_tokens=False)
