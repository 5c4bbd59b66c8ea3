"""The tasks' tokenizer interface (`Tokenizer`) and a character-level implementation.

`Tokenizer`: integer ids for pad / bos / eos, `encode` (text -> ids, no special tokens added)
and `decode` (ids -> text, stopping at the first eos). Special tokens are never produced by
`encode`: the text "<eos>" is five ordinary characters, so task text cannot inject control
tokens. A Hugging Face tokenizer.json is loaded with `lowrl.checkpoints.load_tokenizer`, whose
`lowrl.checkpoints.Tokenizer` implements the same interface.
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

  @property
  def eos_ids(self) -> tuple[int, ...]: ...  # every id that ends a sequence; eos_id first

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

  @property
  def eos_ids(self) -> tuple[int, ...]:
    return (self.eos_id,)

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
